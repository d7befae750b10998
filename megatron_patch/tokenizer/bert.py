"""BERT WordPiece from a `vocab.txt`, run by HF `tokenizers`.

    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file="vocab.txt")
    tok.tokenize("Hello, World")   # ids of ["hello", ",", "world"]

The pipeline mirrors the original BERT `FullTokenizer` that Megatron-LM uses: clean text, space
around CJK characters, lower-case and strip accents (LowerCase only), split on whitespace and
punctuation, greedy longest-match WordPiece with `##` continuations and words over 200
characters mapped to `[UNK]`. `[CLS]`/`[SEP]` written in a document are ordinary text.
"""

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from megatron_patch.tokenizer.base import BackendTokenizer
from megatron_patch.tokenizer.registry import (
    TokenizerFileError,
    register_tokenizer,
    require_file,
)

REQUIRED_TOKENS = ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]")
# Megatron's special-token properties -> the token each returns; [BOS] and [EOS] are appended to the vocab
# when absent, and [EOS] also ends documents, as in Megatron-LM.
SPECIAL_TOKENS = {
    "cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]", "bos": "[BOS]", "eos": "[EOS]", "eod": "[EOS]",
}
# The original BERT WordpieceTokenizer's `max_input_chars_per_word` (HF's default is 100).
MAX_INPUT_CHARS_PER_WORD = 200


def read_wordpiece_vocab(path: str) -> dict[str, int]:
    """Read a BERT `vocab.txt` (one token per line, id = line number - 1)."""
    vocab: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.read().split("\n")
        except UnicodeDecodeError as error:
            raise TokenizerFileError(f"{path}: not UTF-8 text ({error.reason}); is it a vocab.txt?") from None
    if lines and lines[-1] == "":
        lines.pop()
    for lineno, line in enumerate(lines, start=1):
        token = line.strip()
        if not token:
            raise TokenizerFileError(f"{path}:{lineno}: empty token; a BERT vocab.txt has one token per line")
        if token in vocab:
            raise TokenizerFileError(
                f"{path}:{lineno}: token {token!r} repeats line {vocab[token] + 1}; is this a BERT vocab.txt?"
            )
        vocab[token] = lineno - 1
    missing = [t for t in REQUIRED_TOKENS if t not in vocab]
    if missing:
        raise TokenizerFileError(
            f"{path}: not a BERT WordPiece vocab.txt: it lacks {', '.join(missing)}"
            f" (line 1 reads {lines[0][:60]!r})" if lines else f"{path}: empty vocab file"
        )
    return vocab


class BertWordPieceTokenizer(BackendTokenizer):
    """Megatron-LM's `_BertWordPieceTokenizer`: like it, appends `[BOS]`, `[EOS]` and
    `vocab_extra_ids` `<extra_id_N>` tokens to the vocab when absent, and uses `[EOS]` as eod."""

    def __init__(self, vocab_file: str | None = None, lower_case: bool = True, vocab_extra_ids: int = 0):
        vocab_file = require_file(vocab_file, "--vocab-file", type(self).__name__, "a BERT vocab.txt")
        super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
        self._vocab = read_wordpiece_vocab(vocab_file)
        in_file = len(self._vocab)
        for token in ["[BOS]", "[EOS]"] + [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]:
            self._vocab.setdefault(token, len(self._vocab))
        # The tokens appended after the vocab file's, which a Hugging Face BERT of that file has no rows for.
        self.appended_ids = frozenset(range(in_file, len(self._vocab)))
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._special_ids = {name: self._vocab[token] for name, token in SPECIAL_TOKENS.items()}
        self.additional_special_tokens_ids = [
            self._vocab[f"<extra_id_{i}>"] for i in range(vocab_extra_ids)
        ]
        self._backend = HFTokenizer(
            models.WordPiece(
                vocab=self._vocab, unk_token="[UNK]", max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD
            )
        )
        self._backend.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case, lowercase=lower_case
        )
        self._backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._backend.decoder = decoders.WordPiece(prefix="##")


register_tokenizer("BertWordPieceLowerCase", lower_case=True)(BertWordPieceTokenizer)
register_tokenizer("BertWordPieceCase", lower_case=False)(BertWordPieceTokenizer)
