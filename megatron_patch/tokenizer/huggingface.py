"""A HuggingFace tokenizer from a local directory (`--tokenizer-model path/to/dir`), never the hub.

    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model="checkpoints/qwen2-tokenizer")

As in Megatron-LM's `_HuggingFaceTokenizer`, `tokenize` is `tokenizer(text).input_ids`: the
tokenizer's own special tokens (a BOS, say) are added, and eod is its eos token.
"""

import os

import numpy

from megatron_patch.tokenizer.base import Tokenizer
from megatron_patch.tokenizer.registry import TokenizerFileError, register_tokenizer


@register_tokenizer("HuggingFaceTokenizer")
class HuggingFaceTokenizer(Tokenizer):
    def __init__(self, tokenizer_model: str | None = None):
        if tokenizer_model is None:
            raise TokenizerFileError("HuggingFaceTokenizer needs --tokenizer-model (a local tokenizer directory)")
        if not os.path.isdir(tokenizer_model):
            raise TokenizerFileError(
                f"--tokenizer-model {tokenizer_model}: not a directory; HuggingFaceTokenizer loads a local "
                "directory holding tokenizer.json / tokenizer_config.json (hub names are not fetched)"
            )
        super().__init__(tokenizer_model)
        import transformers

        try:
            self._hf = transformers.AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True)
        except (OSError, ValueError) as error:
            raise TokenizerFileError(f"{tokenizer_model}: not a HuggingFace tokenizer directory ({error})") from None
        self._vocab = self._hf.get_vocab()
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._special_ids = {
            "eod": self._hf.eos_token_id, "eos": self._hf.eos_token_id,
            "bos": self._hf.bos_token_id, "pad": self._hf.pad_token_id,
        }
        # The Rust backend encodes a batch without building a BatchEncoding per call; it is the
        # same pipeline `__call__` runs (tests compare the two).
        self._backend = getattr(self._hf, "backend_tokenizer", None)

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    def tokenize(self, text: str) -> list[int]:
        return self._hf(text).input_ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._backend is None:
            return self._hf(texts).input_ids
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=True)]

    def detokenize(self, ids) -> str:
        return self._hf.decode(numpy.asarray(ids).tolist())
