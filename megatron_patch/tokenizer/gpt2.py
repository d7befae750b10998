"""GPT-2 byte-level BPE from `vocab.json` + `merges.txt`: GPT-2's regex splits the text into
pre-tokens, HF `tokenizers` (Rust) runs BPE on those not seen before, a cache answers the rest.

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    tok.tokenize_batch(["def f(x):", "    return x"])

Megatron-LM runs the same algorithm in pure Python (`gpt2_tokenization.py`, with the `regex`
package); the ids are the same, tests/test_tokenizer.py checks them against an independent Python
implementation.
"""

import json
import re
from itertools import chain

import numpy
import regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from megatron_patch.tokenizer.base import BackendTokenizer
from megatron_patch.tokenizer.registry import (
    TokenizerFileError,
    register_tokenizer,
    require_file,
)

EOD_TOKEN = "<|endoftext|>"

# GPT-2's pre-tokenizer, run by the `regex` package as GPT-2's and Megatron-LM's code run it. The
# `tokenizers` pipeline has its own copy, but spends most of its time there (the whole pipeline
# runs ~4 MB per CPU-second, `regex` splits ~12) and its Unicode tables miss the newest letters.
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
# The same pattern for ASCII-only text, which the stdlib `re` splits twice as fast again: on ASCII,
# \p{L} is [A-Za-z], \p{N} is [0-9] and `regex`'s \s is [\t\n\x0b\x0c\r ] (the tests check all 128).
ASCII_PATTERN = re.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\t\n\x0b\x0c\r A-Za-z0-9]+"""
    r"""|[\t\n\x0b\x0c\r ]+(?![^\t\n\x0b\x0c\r ])|[\t\n\x0b\x0c\r ]+"""
)
CACHE_SIZE = 1 << 17
"""Pre-tokens whose ids a tokenizer keeps, cleared when full: about 20 MB, whatever the corpus."""


def read_gpt2_vocab(path: str) -> dict[str, int]:
    """Read a GPT-2 `vocab.json` (token -> id), checking it is one, with the file and line at fault."""
    with open(path, encoding="utf-8") as f:
        try:
            vocab = json.load(f)
        except json.JSONDecodeError as error:
            raise TokenizerFileError(
                f"{path}:{error.lineno}: not a GPT-2 vocab.json (a JSON object of token -> id): {error.msg}"
            ) from None
        except UnicodeDecodeError as error:
            raise TokenizerFileError(f"{path}: not UTF-8 text ({error.reason}); is it a vocab.json?") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise TokenizerFileError(f"{path}:1: not a GPT-2 vocab.json (a JSON object of token -> id)")
    # A byte-level vocab holds all 256 byte symbols; without them some inputs have no encoding.
    missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab]
    if missing:
        raise TokenizerFileError(
            f"{path}: not a byte-level GPT-2 vocab.json: {len(missing)} of the 256 byte symbols are missing"
        )
    return vocab


def read_gpt2_merges(path: str, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Read `merges.txt`: an optional `#version` line, then one `left right` pair per line."""
    merges = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.read().split("\n")
        except UnicodeDecodeError as error:
            raise TokenizerFileError(f"{path}: not UTF-8 text ({error.reason}); is it a merges.txt?") from None
    for lineno, line in enumerate(lines, start=1):
        if (lineno == 1 and line.startswith("#")) or (lineno == len(lines) and not line):
            continue
        pair = line.split(" ")
        if len(pair) != 2 or not all(pair):
            raise TokenizerFileError(
                f"{path}:{lineno}: not a GPT-2 merges.txt line (two tokens separated by one space): {line[:60]!r}"
            )
        for token in (pair[0], pair[1], pair[0] + pair[1]):
            if token not in vocab:
                raise TokenizerFileError(f"{path}:{lineno}: {token!r} is not in the vocab.json")
        merges.append((pair[0], pair[1]))
    return merges


@register_tokenizer("GPT2BPETokenizer")
class GPT2BPETokenizer(BackendTokenizer):
    """GPT-2 BPE: `tokenize` equals Megatron-LM's `_GPT2BPETokenizer` (no special tokens in text,
    so a literal `<|endoftext|>` in a document is ordinary text); `eod` is `<|endoftext|>`.

    Like Megatron-LM's, it caches the ids of each pre-token: text is mostly pre-tokens seen
    before, so only the new ones go to the Rust BPE, one call per batch."""

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None):
        vocab_file = require_file(vocab_file, "--vocab-file", "GPT2BPETokenizer", "a GPT-2 vocab.json")
        merge_file = require_file(merge_file, "--merge-file", "GPT2BPETokenizer", "a GPT-2 merges.txt")
        super().__init__(vocab_file, merge_file)
        self._vocab = read_gpt2_vocab(vocab_file)
        if EOD_TOKEN not in self._vocab:
            raise TokenizerFileError(f"{vocab_file}: has no {EOD_TOKEN} token, which GPT-2 uses as eod")
        merges = read_gpt2_merges(merge_file, self._vocab)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._special_ids = {"eod": self._vocab[EOD_TOKEN], "eos": self._vocab[EOD_TOKEN]}
        # The backend gets one pre-token at a time, so its ByteLevel step only maps bytes to symbols.
        self._backend = HFTokenizer(models.BPE(vocab=self._vocab, merges=merges))
        self._backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._backend.decoder = decoders.ByteLevel()
        # Pre-token -> its ids as int32 bytes: a text's ids are then one C-level join, and bytes are
        # nothing the garbage collector tracks, so a full cache costs it nothing.
        self._cache: dict[str, bytes] = {}
        self._max_id = max(self._vocab.values())

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_batch([text])[0]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [numpy.frombuffer(ids, numpy.int32).tolist() for ids in self._encode(texts)]

    def tokenize_batch_flat(self, texts: list[str], dtype: type) -> tuple[numpy.ndarray, numpy.ndarray]:
        if numpy.iinfo(dtype).max < self._max_id:
            return super().tokenize_batch_flat(texts, dtype)  # which refuses ids the dtype cannot hold
        per_text = self._encode(texts)
        lengths = numpy.fromiter(map(len, per_text), dtype=numpy.int64, count=len(per_text)) // 4
        return numpy.frombuffer(b"".join(per_text), numpy.int32).astype(dtype, copy=False), lengths

    def _encode(self, texts: list[str]) -> list[bytes]:
        """Each text's ids as int32 bytes."""
        pieces = [(ASCII_PATTERN if text.isascii() else GPT2_PATTERN).findall(text) for text in texts]
        unique = set(chain.from_iterable(pieces))
        misses = unique.difference(self._cache)
        if len(self._cache) + len(misses) > CACHE_SIZE:
            self._cache.clear()
            misses = unique
        if misses:
            misses = list(misses)
            self._check_encodable(misses)
            encodings = self._backend.encode_batch_fast(misses, add_special_tokens=False)
            self._cache.update(zip(misses, (numpy.array(e.ids, numpy.int32).tobytes() for e in encodings)))
        ids = self._cache.__getitem__
        return [b"".join(map(ids, text_pieces)) for text_pieces in pieces]

    @staticmethod
    def _check_encodable(pieces: list[str]) -> None:
        """Lone surrogates (from an unpaired `\\ud800`-style JSON escape) have no UTF-8 bytes to encode."""
        try:
            "".join(pieces).encode("utf-8")
        except UnicodeEncodeError as error:
            bad = error.object[error.start]
            raise ValueError(f"text holds the lone surrogate {bad!r}, which has no UTF-8 encoding") from None
