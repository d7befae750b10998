"""Tokenizers by Megatron-LM's `--tokenizer-type` names; see `registry.build_tokenizer`.

    from megatron_patch.tokenizer import build_tokenizer, padded_vocab_size
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model="tokenizer.model")
"""

# Importing each module registers its tokenizer types.
from megatron_patch.tokenizer import bert, gpt2, huggingface, null, sentencepiece  # noqa: F401
from megatron_patch.tokenizer.registry import (
    TOKENIZERS,
    Tokenizer,
    TokenizerFileError,
    add_tokenizer_args,
    build_tokenizer,
    padded_vocab_size,
    register_tokenizer,
    tokenizer_options,
)

__all__ = [
    "TOKENIZERS",
    "Tokenizer",
    "TokenizerFileError",
    "add_tokenizer_args",
    "build_tokenizer",
    "padded_vocab_size",
    "register_tokenizer",
    "tokenizer_options",
]
