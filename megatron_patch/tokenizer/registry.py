"""Tokenizers registered by Megatron-LM's `--tokenizer-type` names, and the padded vocab rule.

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    tok.tokenize("Hello world")          # [15496, 995] with GPT-2's own files
    padded_vocab_size(tok.vocab_size, 128, tensor_model_parallel_size=2)   # 50257 -> 50432

This module imports no tokenizer: the names are known from `BUILTIN_TOKENIZERS`, and a tokenizer's module (with
the library it encodes with) is imported when one of its type is built.
"""

import argparse
import importlib
import inspect
import os
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from megatron_patch.tokenizer.base import Tokenizer


class TokenizerFileError(ValueError):
    """A tokenizer file is missing or not in the format its tokenizer type reads.

    The message names the file and, where one is at fault, the line:
    `vocab.json:1: not a GPT-2 vocab.json (a JSON object of token -> id): ...`.
    """


# name -> (class, fixed keyword arguments), filled by `register_tokenizer` as the tokenizers' modules are imported.
TOKENIZERS: dict[str, tuple[type, dict[str, Any]]] = {}

# Our tokenizer types -> the module that defines and registers each (tests/test_tokenizer.py checks the two agree).
# Listing the names (`--tokenizer-type`'s choices, shown by every `--help`) needs none of those modules, nor the
# libraries they encode with (tokenizers, sentencepiece, transformers).
BUILTIN_TOKENIZERS = {
    "BertWordPieceCase": "megatron_patch.tokenizer.bert",
    "BertWordPieceLowerCase": "megatron_patch.tokenizer.bert",
    "GPT2BPETokenizer": "megatron_patch.tokenizer.gpt2",
    "GPTSentencePieceTokenizer": "megatron_patch.tokenizer.sentencepiece",
    "HuggingFaceTokenizer": "megatron_patch.tokenizer.huggingface",
    "Llama2Tokenizer": "megatron_patch.tokenizer.sentencepiece",
    "NullTokenizer": "megatron_patch.tokenizer.null",
    "SentencePieceTokenizer": "megatron_patch.tokenizer.sentencepiece",
}


def tokenizer_names() -> list[str]:
    """Every `--tokenizer-type` name, sorted: ours and any registered since; imports no tokenizer."""
    return sorted(BUILTIN_TOKENIZERS.keys() | TOKENIZERS.keys())


def load_tokenizers() -> dict[str, tuple[type, dict[str, Any]]]:
    """`TOKENIZERS` with all of ours registered (their modules imported)."""
    for module in sorted(set(BUILTIN_TOKENIZERS.values())):
        importlib.import_module(module)
    return TOKENIZERS


def register_tokenizer(name: str, **fixed_options: Any) -> Callable[[type], type]:
    """Class decorator: `@register_tokenizer("GPT2BPETokenizer")` makes the class buildable by name.

    `fixed_options` lets one class serve several names, e.g. `lower_case=True` for
    `BertWordPieceLowerCase`.
    """

    def register(cls: type) -> type:
        if name in TOKENIZERS:
            raise ValueError(f"tokenizer type {name!r} is registered twice")
        TOKENIZERS[name] = (cls, fixed_options)
        return cls

    return register


def build_tokenizer(tokenizer_type: str, **options: Any) -> "Tokenizer":
    """Build a tokenizer by its Megatron name.

        build_tokenizer("BertWordPieceLowerCase", vocab_file="vocab.txt")
        build_tokenizer("NullTokenizer", vocab_size=1000)

    `options` are `vocab_file, merge_file, tokenizer_model, vocab_size, vocab_extra_ids`; each
    tokenizer takes the ones it needs and, like Megatron-LM, ignores the rest, so one launch
    script can switch `--tokenizer-type` without editing its other flags. `None` means unset.
    """
    if tokenizer_type not in TOKENIZERS and tokenizer_type in BUILTIN_TOKENIZERS:
        importlib.import_module(BUILTIN_TOKENIZERS[tokenizer_type])
    if tokenizer_type not in TOKENIZERS:
        raise ValueError(
            f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(tokenizer_names())}"
        )
    cls, fixed = TOKENIZERS[tokenizer_type]
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in options.items() if k in accepted and v is not None}
    return cls(**kwargs, **fixed)


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Round the vocab up so each tensor-parallel shard of the embedding is a multiple of the divisor.

        padded_vocab_size(50257, 128, 1)  # 50304: 47 dummy rows make GEMMs tile evenly
        padded_vocab_size(50257, 128, 8)  # 51200: each of 8 shards holds 6400 rows

    This is Megatron-LM's `_vocab_size_with_padding` rule, so checkpoints agree in shape.
    """
    if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(
            "--make-vocab-size-divisible-by and --tensor-model-parallel-size must be >= 1, got "
            f"{make_vocab_size_divisible_by} and {tensor_model_parallel_size}"
        )
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple  # integer ceiling: exact for any size


def require_file(path: str | None, flag: str, tokenizer_type: str, what: str) -> str:
    """Return `path` if it names an existing file, else a TokenizerFileError naming the flag."""
    if path is None:
        raise TokenizerFileError(f"{tokenizer_type} needs {flag} ({what})")
    if not os.path.isfile(path):
        raise TokenizerFileError(f"{flag} {path}: no such file ({tokenizer_type} reads {what})")
    return path


def add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron-LM's tokenizer flags; read them back with `tokenizer_options(args)`."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=tokenizer_names())
    group.add_argument(
        "--vocab-file", "--vocab", dest="vocab_file",
        help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*); --vocab is the old name",
    )
    group.add_argument("--merge-file", help="merges.txt (GPT2BPETokenizer)")
    group.add_argument(
        "--tokenizer-model",
        help="a SentencePiece .model, or a local HuggingFace tokenizer directory",
    )
    group.add_argument("--vocab-size", type=int, help="vocab size (NullTokenizer)")
    group.add_argument(
        "--vocab-extra-ids", type=int, default=0,
        help="number of <extra_id_N> sentinel tokens to add (T5-style), as Megatron-LM does",
    )
    return parser


def tokenizer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `build_tokenizer` taken from parsed `add_tokenizer_args` flags."""
    return {
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
        "tokenizer_model": args.tokenizer_model,
        "vocab_size": args.vocab_size,
        "vocab_extra_ids": args.vocab_extra_ids,
    }
