"""Tokenizers registered by Megatron-LM's `--tokenizer-type` names, and the padded vocab rule.

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    tok.tokenize("Hello world")          # [15496, 995] with GPT-2's own files
    padded_vocab_size(tok.vocab_size, 128, tensor_model_parallel_size=2)   # 50257 -> 50432
"""

import argparse
import inspect
import os
from typing import Any, Callable

import numpy
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer


class TokenizerFileError(ValueError):
    """A tokenizer file is missing or not in the format its tokenizer type reads.

    The message names the file and, where one is at fault, the line:
    `vocab.json:1: not a GPT-2 vocab.json (a JSON object of token -> id): ...`.
    """


def special_token_property(name: str) -> property:
    """megatron-core's `name` property (`cls`, `eod`, ...) answered from the tokenizer's `_special_ids` table.

        eod = special_token_property("eod")   # tok.eod == tok._special_ids["eod"]

    A name the table lacks runs megatron-core's own property, which raises its NotImplementedError
    (`GPT2BPETokenizer has no attribute 'cls'`), the error Megatron-LM's tokenizers give.
    """
    upstream = getattr(MegatronLegacyTokenizer, name)

    def special_id(self: "Tokenizer") -> int | None:
        if name in self._special_ids:
            return self._special_ids[name]
        return upstream.fget(self)

    return property(special_id, doc=upstream.__doc__)


class Tokenizer(MegatronLegacyTokenizer):
    """Base of our tokenizers: megatron-core's tokenizer interface plus a batch encoder.

        ids_per_text = tok.tokenize_batch(["first document", "second one"])

    Subclassing megatron-core's base gives `unique_identifiers`, which its datasets hash into
    their cache names. Subclasses fill `_vocab` (token -> id), `_inv_vocab` and `_special_ids`,
    the one table behind the special-token properties below.
    """

    _vocab: dict[str, int]
    _inv_vocab: dict[int, str]
    _special_ids: dict[str, int | None] = {}
    """Megatron's special-token property name -> id, e.g. `{"eod": 50256, "eos": 50256}` for GPT-2. None: the
    tokenizer's model has no such token; a name missing: the property raises."""

    # The ids megatron-core's datasets, Megatron-LM's scripts and ours read (`tok.eod`, `tok.pad`, ...).
    cls = special_token_property("cls")
    sep = special_token_property("sep")
    pad = special_token_property("pad")
    eod = special_token_property("eod")
    bos = special_token_property("bos")
    eos = special_token_property("eos")
    mask = special_token_property("mask")

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """`[tok.tokenize(t) for t in texts]`, computed by the fastest path the backend has."""
        return [self.tokenize(text) for text in texts]


class BackendTokenizer(Tokenizer):
    """A tokenizer whose encoding is one HF `tokenizers` pipeline, `self._backend`, adding no
    special tokens (GPT-2 BPE, BERT WordPiece)."""

    def tokenize(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self._backend.decode(numpy.asarray(ids).tolist(), skip_special_tokens=False)


# name -> (class, fixed keyword arguments)
TOKENIZERS: dict[str, tuple[type[Tokenizer], dict[str, Any]]] = {}


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


def build_tokenizer(tokenizer_type: str, **options: Any) -> Tokenizer:
    """Build a tokenizer by its Megatron name.

        build_tokenizer("BertWordPieceLowerCase", vocab_file="vocab.txt")
        build_tokenizer("NullTokenizer", vocab_size=1000)

    `options` are `vocab_file, merge_file, tokenizer_model, vocab_size, vocab_extra_ids`; each
    tokenizer takes the ones it needs and, like Megatron-LM, ignores the rest, so one launch
    script can switch `--tokenizer-type` without editing its other flags. `None` means unset.
    """
    if tokenizer_type not in TOKENIZERS:
        raise ValueError(
            f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(sorted(TOKENIZERS))}"
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
    group.add_argument("--tokenizer-type", required=True, choices=sorted(TOKENIZERS))
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
