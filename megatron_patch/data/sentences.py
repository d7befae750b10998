"""Offline sentence splitting for BERT's sentence-level data (`--split-sentences`).

    split_sentences("Dr. Smith arrived. He sat down!  Then he left.")
    # ['Dr. Smith arrived.', 'He sat down!', 'Then he left.']

Megatron-LM uses nltk's punkt, which downloads a model at run time (and, offline, its workers
respawn forever). This is a rule-based splitter with no data files: a sentence ends at `.`, `!`,
`?` or `...` (with any closing quotes or brackets) followed by whitespace and a capital letter,
digit, quote or bracket, unless the word ending in `.` is a known abbreviation or a single
initial; a blank line always ends a sentence. Its boundaries are not punkt's, so
`--split-sentences` output differs from Megatron-LM's where the two splitters disagree.
"""

import re

# Lower-cased, without the final period. Only English is built in (see `--lang`).
ABBREVIATIONS = {
    "english": frozenset(
        "mr mrs ms dr prof sr jr st vs etc e.g i.e cf al fig figs eq eqs no nos vol vols ed eds "
        "approx dept est inc ltd co corp jan feb mar apr jun jul aug sep sept oct nov dec "
        "mt ft ave blvd rd gen gov sen rep u.s u.k ph.d".split()
    )
}

_BOUNDARY = re.compile(
    r"""(?:\.\.\.|[.!?])["')\]’”]*   # the sentence end and any closing marks
        (?P<gap>\s+)                  # the whitespace between sentences
        (?=["'(\[‘“]*[A-Z0-9À-ÖØ-Þ])  # the next sentence starts with a capital or digit
      | (?P<para>\n[ \t]*\n\s*)       # or a blank line
    """,
    re.VERBOSE,
)


def last_word(text: str, end: int) -> str:
    """The run of non-whitespace characters that ends at `end` ("" after whitespace).

        last_word("see Dr. Smith", 7)  # 'Dr.'

    Scanning back from `end` costs the word's length; a regex search for `\\S+$` in
    `text[:end]` tries every position from the start, which made splitting quadratic in the
    document's length (a 20 kB document took 0.1 s).
    """
    start = end
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return text[start:end]


class SentenceSplitter:
    """Split text into sentences; `keep_newlines` keeps the whitespace that follows each
    sentence on it (Megatron-LM's `--keep-newlines`), otherwise sentences are stripped."""

    def __init__(self, lang: str = "english", keep_newlines: bool = False):
        self.abbreviations = ABBREVIATIONS.get(lang, frozenset())
        self.keep_newlines = keep_newlines

    def _is_abbreviation(self, text: str, end: int) -> bool:
        """Whether the `.` just before `end` closes an abbreviation or an initial (`J.`)."""
        word = last_word(text, end)
        if not word.endswith("."):
            return False
        word = word.rstrip(".").lstrip("\"'([‘“").lower()
        return word in self.abbreviations or (len(word) == 1 and word.isalpha())

    def split(self, text: str) -> list[str]:
        """The sentences of `text`, in order; empty pieces are dropped."""
        starts = [0]
        for match in _BOUNDARY.finditer(text):
            if match.group("para") is None:
                end_of_mark = match.start("gap")
                if text[match.start()] == "." and self._is_abbreviation(text, end_of_mark):
                    continue
            starts.append(match.end())
        starts.append(len(text))
        pieces = [text[a:b] for a, b in zip(starts, starts[1:])]
        if not self.keep_newlines:
            pieces = [p.strip() for p in pieces]
        return [p for p in pieces if p.strip()]


def split_sentences(text: str, lang: str = "english", keep_newlines: bool = False) -> list[str]:
    """`SentenceSplitter(lang, keep_newlines).split(text)`."""
    return SentenceSplitter(lang, keep_newlines).split(text)
