"""Tokenizers by Megatron-LM's `--tokenizer-type` names; see `registry.build_tokenizer`.

    from megatron_patch.tokenizer import build_tokenizer, padded_vocab_size
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model="tokenizer.model")

Importing the package imports no tokenizer (each one's module is imported when one of its type is built, see
`registry.py`); `Tokenizer` and `TOKENIZERS`, which need them, are loaded on first use.
"""

from megatron_patch.tokenizer.registry import (
    TokenizerFileError,
    add_tokenizer_args,
    build_tokenizer,
    load_tokenizers,
    padded_vocab_size,
    register_tokenizer,
    tokenizer_names,
    tokenizer_options,
)

__all__ = [
    "TOKENIZERS",
    "Tokenizer",
    "TokenizerFileError",
    "add_tokenizer_args",
    "build_tokenizer",
    "load_tokenizers",
    "padded_vocab_size",
    "register_tokenizer",
    "tokenizer_names",
    "tokenizer_options",
]


def __getattr__(name: str):
    # PEP 562: these two import megatron-core (the tokenizers' base class), so only a caller that uses them pays.
    if name == "TOKENIZERS":
        return load_tokenizers()
    if name == "Tokenizer":
        from megatron_patch.tokenizer.base import Tokenizer

        return Tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
