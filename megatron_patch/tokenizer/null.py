"""The tokenizer for text that already is token ids: `"5 17 3"` -> `[5, 17, 3]`.

    tok = build_tokenizer("NullTokenizer", vocab_size=1000)   # ids 0..999, eod = 1000

As in Megatron-LM, eod is `vocab_size` and the reported vocab size is one more.
"""

import numpy

from megatron_patch.tokenizer.base import Tokenizer
from megatron_patch.tokenizer.registry import register_tokenizer


@register_tokenizer("NullTokenizer")
class NullTokenizer(Tokenizer):
    def __init__(self, vocab_size: int | None = None):
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        super().__init__(None, vocab_size=vocab_size)
        self._vocab_size_without_eod = int(vocab_size)
        self._special_ids = {"eod": self._vocab_size_without_eod, "eos": self._vocab_size_without_eod}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size_without_eod + 1

    @property
    def vocab(self):
        raise NotImplementedError("NullTokenizer has no vocab")

    @property
    def inv_vocab(self):
        raise NotImplementedError("NullTokenizer has no vocab")

    def tokenize(self, text: str) -> list[int]:
        # Megatron-LM splits on single spaces and fails on "" or double spaces; any whitespace
        # gives the same ids wherever it succeeds.
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer reads space-separated integers, got {text[:40]!r}") from None
        # Megatron-LM does not check; an id past the vocab would wrap silently in a uint16 file.
        bad = [i for i in ids if not 0 <= i < self._vocab_size_without_eod]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} is outside [0, {self._vocab_size_without_eod})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(i) for i in numpy.asarray(ids).tolist())
