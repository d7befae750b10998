"""JSONL -> Megatron `.bin/.idx`, a drop-in for Megatron-LM's `tools/preprocess_data.py`.

    python toolkits/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --workers 8

writes `data/corpus_text_document.bin/.idx` (`_sentence` with `--split-sentences`), byte for byte
what Megatron-LM writes for the same tokenizer, flags and input, documents without tokens included
(written as empty documents and counted; `--reject-empty` refuses them). Differences, all deliberate:
- Tokenizers run in Rust (HF `tokenizers`, `sentencepiece`; GPT-2 BPE behind a bounded cache of
  pre-tokens, see `tokenizer/gpt2.py`) over batches of lines; the main process only reads blocks
  of whole lines and writes token bytes, so memory is bounded by the batches in flight, not by
  the corpus.
- Bad input stops the run with `file:line: reason` (or is skipped and counted with
  `--skip-invalid`). A worker that dies (out of memory, `kill -9`) fails the run at once with one
  line saying how it died, instead of hanging; SIGTERM stops the run and its workers.
- Outputs are written under temporary names and renamed when complete: a failed or interrupted
  run leaves no `.bin/.idx` that look valid, and earlier outputs under the final names untouched.
  What a killed main process left (`*.tmp-HOST-PID.bin`) the next run to the same prefix removes.
- `--split-sentences` needs no nltk download (see `sentences.py`), works with one partition, and
  every `--json-keys` key gets its `.idx` (Megatron-LM finalizes only the last key's).
- `--input` may be a glob and `.gz` with any `--partitions`; partitions are handled in one pass
  and need no intermediate JSONL files, and `--workers` need not be a multiple of them.

`--sft` reads conversations instead (formats, chat templates and loss masks: `data/conversations.py`) through the
same workers, progress, errors and atomic publication, and writes `{output_prefix}_sft_document.bin/.idx`: each
conversation one document of two sequences of equal length, its token ids then its 0/1 loss mask (1: the token is
a trained target; the trainer shifts it), in the `.bin`'s dtype; and `{output_prefix}_sft_document.json`
(`"format": "megatron_patch.sft"`, its version, the input format, `--sft-loss`, the chat template's sha256, the
counts), published last. `--sft --show N` prints line N as the model sees it and writes nothing.

`--dpo` reads preference pairs the same way (formats and TRL's tokenization: `data/preferences.py`) and writes
`{output_prefix}_dpo_document.bin/.idx`: each pair one document of four sequences, the chosen sequence's ids and its
0/1 completion mask (1: a token whose log-probability the DPO loss sums), then the rejected sequence's ids and mask;
and `{output_prefix}_dpo_document.json` (`"format": "megatron_patch.dpo"`, its version, the input format, the chat
template's sha256, pairs, tokens, completion tokens, the largest token id). `--dpo --show N` prints line N's two
sequences.
"""

import argparse
import gc
import json
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections import Counter, deque
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy

from megatron_patch.data.conversations import (
    INPUT_FORMATS,
    LOSS_MODES,
    SFT_FORMAT,
    SFT_VERSION,
    ConversationEncoder,
    ConversationError,
    describe_formats,
    detect_format,
    load_chat_template,
    mark_trained,
    read_conversations,
)
from megatron_patch.data.data_path import record_largest_token_id
from megatron_patch.data.jsonl import InputError, expand_inputs, open_input
from megatron_patch.data.preferences import (
    DPO_FORMAT,
    DPO_VERSION,
    PREFERENCE_FORMATS,
    PreferenceEncoder,
    detect_preference_format,
    read_preference,
)
from megatron_patch.data.progress import Progress
from megatron_patch.data.sentences import SentenceSplitter
from megatron_patch.errors import FlagParser, UserError, one_line_errors, unwind_on_sigterm
from megatron_patch.staging import killed_leftovers, staging_tag, tag_pattern
from megatron_patch.tokenizer import (
    add_tokenizer_args,
    build_tokenizer,
    tokenizer_options,
)

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


SFT_KEY = "sft"
"""The outputs' key with `--sft`: `{output_prefix}_sft_document.bin/.idx/.json`."""
DPO_KEY = "dpo"
"""The outputs' key with `--dpo`: `{output_prefix}_dpo_document.bin/.idx/.json`."""


@dataclass
class PreprocessConfig:
    """What to preprocess and how; the fields are Megatron-LM's flags (see `build_parser`)."""

    input: str
    output_prefix: str
    tokenizer_type: str
    tokenizer_options: dict[str, Any] = field(default_factory=dict)
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    workers: int = 1
    partitions: int = 1
    keep_sequential_samples: bool = False
    log_interval: int = 1000
    skip_invalid: bool = False
    reject_empty: bool = False
    """Treat a document without tokens as bad input (stop, or skip it with `skip_invalid`) instead of
    writing it as an empty document, as Megatron-LM does."""
    batch_bytes: int = 1 << 20
    """Lines are sent to workers in batches of about this many bytes (or `batch_lines` lines); the
    last part of the input is cut finer, so that the workers finish together (see `_batch_bytes`).
    GPT-2 BPE spent 10-20% less CPU per byte on 1 MB batches than on 256 KB ones (bench/preprocess.py's
    corpus, a cold tokenizer, 2-core machine), and the main process handles a quarter as many messages."""
    batch_lines: int = 2048
    sft: bool = False
    """Read conversations (see `data/conversations.py`) instead of documents and write each as one document of two
    sequences, its token ids and its loss mask, to `{output_prefix}_sft_document.bin/.idx` with a `.json` beside."""
    chat_template: str | None = None
    """With `sft`: a jinja chat template file that replaces the tokenizer's own (`--chat-template FILE`)."""
    sft_loss: str = "assistant"
    """With `sft`: the trained tokens, `assistant` (every assistant turn), `last-turn` or `all`."""
    dpo: bool = False
    """Read preference pairs (see `data/preferences.py`) and write each as one document of four sequences, the
    chosen and the rejected ids each followed by its completion mask, to `{output_prefix}_dpo_document.bin/.idx` with a
    `.json` beside."""

    def __post_init__(self) -> None:
        for name in ("workers", "partitions", "log_interval", "batch_bytes", "batch_lines"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.json_keys:
            raise ValueError("--json-keys needs at least one key")
        if self.sft and self.dpo:
            raise ValueError("--sft and --dpo: choose one (conversations or preference pairs)")
        if self.record_kind:
            if self.split_sentences or self.append_eod or self.json_keys != ["text"]:
                raise ValueError(
                    f"--{self.record_kind} takes whole records, and the chat template or the tokenizer's eos decides "
                    "their end: drop --split-sentences, --append-eod and --json-keys"
                )
            if self.sft_loss not in LOSS_MODES:
                raise ValueError(f"--sft-loss {self.sft_loss}: choose one of {', '.join(LOSS_MODES)}")
        elif self.chat_template is not None:
            raise ValueError("--chat-template renders conversations: add --sft or --dpo")

    @property
    def record_kind(self) -> str | None:
        """"sft" or "dpo", the kind of record read instead of documents (a key of RECORD_KINDS), None for documents."""
        return SFT_KEY if self.sft else DPO_KEY if self.dpo else None

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_prefixes(self) -> dict[str, str]:
        """`{key: "{output_prefix}_{key}_{level}"}`, the names Megatron-LM gives its outputs
        (`{"sft": "{output_prefix}_sft_document"}` with `sft`, "dpo" likewise)."""
        if self.record_kind:
            return {self.record_kind: f"{self.output_prefix}_{self.record_kind}_document"}
        return {key: f"{self.output_prefix}_{key}_{self.level}" for key in self.json_keys}


@dataclass
class PreprocessReport:
    """What a run wrote and skipped."""

    outputs: list[str]
    documents: int = 0
    empty_documents: int = 0  # of `documents`, those written without tokens
    sequences: int = 0
    tokens: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    skipped: Counter = field(default_factory=Counter)
    sft: dict[str, Any] | None = None
    """With `--sft`: what `{output_prefix}_sft_document.json` says (conversations, tokens, trained_tokens, ...)."""
    dpo: dict[str, Any] | None = None
    """With `--dpo`: what `{output_prefix}_dpo_document.json` says (pairs, tokens, completion_tokens, ...)."""

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items()))
        rate = self.input_bytes / max(self.seconds, 1e-9) / 1e6
        for kind, sidecar in ((RECORD_KINDS[SFT_KEY], self.sft), (RECORD_KINDS[DPO_KEY], self.dpo)):
            if sidecar is not None:
                return (
                    f"Done: {sidecar[kind.documents]} {kind.documents} ({sidecar['input_format']}), "
                    f"{sidecar['tokens']} tokens, {sidecar[kind.trained]} {kind.trained.replace('_', ' ')} "
                    f"from {self.input_bytes / 1e6:.1f} MB in {self.seconds:.1f} s ({rate:.1f} MB/s); skipped "
                    f"{skipped} lines" + (f" ({reasons})" if reasons else "")
                    + f"; wrote {', '.join(p + '.bin/.idx/.json' for p in self.outputs)}"
                )
        return (
            f"Done: {self.documents} documents, {self.sequences} sequences, {self.tokens} tokens "
            f"from {self.input_bytes / 1e6:.1f} MB in {self.seconds:.1f} s ({rate:.1f} MB/s); "
            f"{self.empty_documents} empty documents; skipped {skipped} lines"
            + (f" ({reasons})" if reasons else "") + f"; wrote {', '.join(p + '.bin/.idx' for p in self.outputs)}"
        )


# ---------------------------------------------------------------------------------------------
# Worker side: raw lines in, token arrays out.



def _parse_line(raw: bytes, config: PreprocessConfig, splitter) -> tuple[list[list[str]] | None, str | None]:
    """The sentences of each json key of one line, or the reason the line is unusable."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"invalid UTF-8: undecodable byte at offset {error.start} of the line"
    if not text.strip():
        return None, "malformed JSON: blank line"
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        return None, f"malformed JSON: {error.msg} (column {error.colno})"
    if not isinstance(record, dict):
        return None, f"malformed JSON: expected an object, got {type(record).__name__}"
    per_key = []
    for key in config.json_keys:
        if key not in record:
            return None, f"missing key: no {key!r} (keys: {', '.join(map(repr, list(record)[:8]))})"
        value = record[key]
        # A list of strings is a document already split into sentences, as Megatron-LM reads it.
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            per_key.append(value)
        elif isinstance(value, str):
            per_key.append(splitter.split(value) if splitter else [value])
        else:
            return None, f"not a string: {key!r} holds {type(value).__name__}"
    return per_key, None


def _tokenize_all(tokenizer, texts: list[str], dtype: type):
    """`tokenizer.tokenize_batch_flat(texts, dtype)`, None and None; if the tokenizer rejects some
    text: None, that text's index and why."""
    try:
        return tokenizer.tokenize_batch_flat(texts, dtype), None, None
    except (ValueError, TypeError) as batch_error:
        for index, text in enumerate(texts):
            try:
                tokenizer.tokenize(text)
            except (ValueError, TypeError) as error:
                return None, index, str(error)
        raise batch_error


def _gather(ids: numpy.ndarray, starts: numpy.ndarray, lengths: numpy.ndarray) -> numpy.ndarray:
    """`ids[starts[0]:starts[0] + lengths[0]]`, then the next range, ..., in one array."""
    ends = numpy.cumsum(lengths)
    return ids[numpy.repeat(starts - (ends - lengths), lengths) + numpy.arange(ends[-1] if len(ends) else 0)]


def _split_lines(data: bytes) -> list[bytes]:
    """The lines of a batch's bytes, without their newlines (the last line may have none)."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


@dataclass
class _KeyResult:
    """One json key's output for a batch: all tokens, each sequence's length, each document's
    number of sequences and number of tokens."""

    tokens: numpy.ndarray
    sequence_lengths: numpy.ndarray
    document_sequences: numpy.ndarray
    document_tokens: numpy.ndarray


@dataclass
class _BatchResult:
    keys: dict[str, _KeyResult]
    document_lines: numpy.ndarray  # line offset within the batch of each document written
    empty_documents: int  # of those, how many have no tokens (in some json key)
    errors: list[tuple[int, str]]  # (line offset, reason), in line order
    records: "_RecordCounts | None" = None  # with --sft or --dpo


class _DocumentEncoder:
    """The pool's encode function for documents: parse, split and tokenize a batch of JSONL lines.

        _DocumentEncoder(config, tokenizer, numpy.uint16)([b'{"text": "a b"}'])   # a _BatchResult

    Built in the main process; the workers inherit it, tokenizer included, through the fork: building one per
    worker read the tokenizer's files again (for GPT-2, ~30 ms of each worker's time before its first batch).
    """

    def __init__(self, config: PreprocessConfig, tokenizer, dtype: type):
        self.config, self.tokenizer, self.dtype = config, tokenizer, dtype
        self.splitter = SentenceSplitter(config.lang, config.keep_newlines) if config.split_sentences else None

    def __call__(self, lines: list[bytes]) -> "_BatchResult":
        return _encode_lines(self.config, self.tokenizer, self.dtype, self.splitter, lines)


def _encode_lines(config: PreprocessConfig, tokenizer, dtype: type, splitter, lines: list[bytes]) -> "_BatchResult":
    """Parse, split and tokenize a batch of JSONL lines."""
    errors: dict[int, str] = {}
    parsed: list[tuple[int, list[list[str]]]] = []
    for offset, raw in enumerate(lines):
        per_key, reason = _parse_line(raw, config, splitter)
        if reason:
            errors[offset] = reason
        else:
            parsed.append((offset, per_key))

    # One tokenizer call for every sentence of every key of every line: batches are fastest.
    texts = [s for _, per_key in parsed for sentences in per_key for s in sentences]
    owner = [offset for offset, per_key in parsed for sentences in per_key for _ in sentences]
    while True:
        flat, bad_index, reason = _tokenize_all(tokenizer, texts, dtype)
        if flat is not None:
            break
        # Drop the offending line and try again; other lines of the batch are still good.
        bad_line = owner[bad_index]
        errors[bad_line] = f"tokenizer error: {reason}"
        keep = [i for i, o in enumerate(owner) if o != bad_line]
        texts, owner = [texts[i] for i in keep], [owner[i] for i in keep]
        parsed = [(o, k) for o, k in parsed if o != bad_line]
    ids, text_lengths = flat

    # Each text's document (index into `parsed`) and json key, for the array arithmetic below.
    text_document = numpy.fromiter(
        (d for d, (_, per_key) in enumerate(parsed) for sentences in per_key for _ in sentences),
        dtype=numpy.int64, count=len(texts),
    )
    text_key = numpy.fromiter(
        (k for _, per_key in parsed for k, sentences in enumerate(per_key) for _ in sentences),
        dtype=numpy.int64, count=len(texts),
    )
    text_start = numpy.cumsum(text_lengths) - text_lengths
    # As Megatron-LM: sentences with no tokens are dropped; a document without tokens in some key is
    # written empty (or refused with --reject-empty).
    sequences_per_key = [
        numpy.bincount(text_document[(text_key == k) & (text_lengths > 0)], minlength=len(parsed))
        for k in range(len(config.json_keys))
    ]
    empty = numpy.logical_or.reduce([n == 0 for n in sequences_per_key])
    written = numpy.ones(len(parsed), bool)
    if config.reject_empty:
        for d in numpy.flatnonzero(empty):
            key = config.json_keys[next(k for k, n in enumerate(sequences_per_key) if n[d] == 0)]
            errors[parsed[d][0]] = (
                f"empty document: no tokens in {key!r} (refused by --reject-empty; without it the "
                "line is written as an empty document, as Megatron-LM does)"
            )
        written &= ~empty

    eod = tokenizer.eod if config.append_eod else None
    keys = {}
    for k, key in enumerate(config.json_keys):
        selected = (text_key == k) & written[text_document]
        if selected.all():
            tokens = ids
        else:
            tokens = _gather(ids, text_start[selected], text_lengths[selected])
        lengths, documents = text_lengths[selected], text_document[selected]
        sequence_lengths = lengths[lengths > 0].astype(numpy.int32)
        document_sequences = sequences_per_key[k][written]
        document_tokens = numpy.bincount(documents, weights=lengths, minlength=len(parsed)).astype(numpy.int64)[written]
        if eod is not None:
            # eod joins each document's last sentence, in documents that have tokens.
            has_tokens = document_tokens > 0
            tokens = numpy.insert(tokens, numpy.cumsum(document_tokens)[has_tokens], eod)
            sequence_lengths[numpy.cumsum(document_sequences)[has_tokens] - 1] += 1
            document_tokens += has_tokens
        keys[key] = _KeyResult(tokens, sequence_lengths, document_sequences.astype(numpy.int64), document_tokens)
    return _BatchResult(
        keys=keys,
        document_lines=numpy.array([offset for offset, _ in parsed], dtype=numpy.int64)[written],
        empty_documents=int(empty[written].sum()),
        errors=sorted(errors.items()),
    )


@dataclass
class _RecordCounts:
    """What a batch of records (`--sft`, `--dpo`) holds beyond its tokens: each line's input format (an index into
    its kind's formats, -1 for none) and each document's trained tokens and largest token id."""

    line_formats: numpy.ndarray
    trained_tokens: numpy.ndarray
    max_token_id: numpy.ndarray


def _parse_record(raw: bytes) -> tuple[Any, str | None]:
    """The JSON object of one line, or the reason it has none."""
    try:
        record = json.loads(raw)
    except UnicodeDecodeError as error:
        return None, f"invalid UTF-8: undecodable byte at offset {error.start} of the line"
    except json.JSONDecodeError as error:
        reason = "blank line" if not raw.strip() else f"{error.msg} (column {error.colno})"
        return None, f"malformed JSON: {reason}"
    if not isinstance(record, dict):
        return None, f"malformed JSON: expected an object, got {type(record).__name__}"
    return record, None


def _detect_conversation_format(record: dict) -> str:
    input_format = detect_format(record)
    if input_format is None:
        raise ConversationError(
            f"unknown format: expected {describe_formats()} (keys: {', '.join(map(repr, list(record)[:8]))})")
    return input_format


@dataclass(frozen=True)
class RecordKind:
    """What `--sft` and `--dpo` each read and write; the batch encoder, the file formats, the sidecar, the summary
    and `--show` are the same code for both.

        RECORD_KINDS["dpo"].read(record, RECORD_KINDS["dpo"].detect(record))   # [Preference(...)]
    """

    key: str
    """The outputs' key: `{output_prefix}_{key}_document.bin/.idx/.json`; the flag is `--{key}`."""
    format: str
    """The sidecar's "format", which the trainer checks with its "version"."""
    version: int
    input_formats: tuple[str, ...]
    detect: Callable[[dict], str]
    """A record's input format; a ConversationError says why it has none."""
    read: Callable[[dict, str], list]
    """A record's items (conversations, one pair), each one document; a ConversationError refuses the line."""
    build_encoder: Callable[["PreprocessConfig", Any], Any]
    """(config, tokenizer) -> the encoder whose `encode(items)` gives, per item, what has `sequences`,
    `trained_tokens`, or the ConversationError that refuses it."""
    documents: str
    """The sidecar's name of the count of documents ("conversations", "pairs")."""
    trained: str
    """The sidecar's name of the count of tokens whose mask is 1 ("trained_tokens", "completion_tokens")."""
    settings: Callable[["PreprocessConfig"], dict[str, Any]]
    """The flags the sidecar records besides the chat template."""
    show: Callable[["PreprocessConfig", Any, list], tuple[str, list[str]]]
    """(config, encoder, items) -> what `--show` says of the line in its header, and the lines that show the items."""
    show_header: str


class _RecordBatchEncoder:
    """The pool's encode function with `--sft` and `--dpo`: each line's items (`kind.read`), encoded by `encoder`,
    one document each of the item's sequences (ids, mask, ...). A line is written whole or not at all.

        _RecordBatchEncoder(RECORD_KINDS["sft"], ConversationEncoder(tokenizer), numpy.uint16)(
            [b'{"prompt": "a", "response": "b"}'])
    """

    def __init__(self, kind: RecordKind, encoder, dtype: type):
        self.kind, self.encoder, self.dtype = kind, encoder, dtype

    def __call__(self, lines: list[bytes]) -> _BatchResult:
        errors: dict[int, str] = {}
        line_formats = numpy.full(len(lines), -1, numpy.int8)
        items, owners = [], []
        for offset, raw in enumerate(lines):
            record, reason = _parse_record(raw)
            if reason is None:
                try:
                    input_format = self.kind.detect(record)
                    line_formats[offset] = self.kind.input_formats.index(input_format)
                    parts = self.kind.read(record, input_format)
                except ConversationError as error:
                    reason = str(error)
                else:
                    items += parts
                    owners += [offset] * len(parts)
            if reason is not None:
                errors[offset] = reason
        encoded = self.encoder.encode(items)
        for offset, result in zip(owners, encoded):
            if isinstance(result, ConversationError):
                errors.setdefault(offset, str(result))
        kept = [(offset, result) for offset, result in zip(owners, encoded) if offset not in errors]
        sequences = [r.sequences for _, r in kept]
        flat = [s for per_document in sequences for s in per_document]
        return _BatchResult(
            keys={self.kind.key: _KeyResult(
                tokens=numpy.concatenate(flat or [numpy.zeros(0, numpy.int64)]).astype(self.dtype),
                sequence_lengths=numpy.fromiter(map(len, flat), numpy.int32, len(flat)),
                document_sequences=numpy.fromiter(map(len, sequences), numpy.int64, len(kept)),
                document_tokens=numpy.fromiter((sum(map(len, d)) for d in sequences), numpy.int64, len(kept)),
            )},
            document_lines=numpy.fromiter((offset for offset, _ in kept), numpy.int64, len(kept)),
            empty_documents=0,
            errors=sorted(errors.items()),
            records=_RecordCounts(
                line_formats=line_formats,
                trained_tokens=numpy.fromiter((r.trained_tokens for _, r in kept), numpy.int64, len(kept)),
                # The ids are every other sequence (ids, mask, ids, mask, ...).
                max_token_id=numpy.fromiter((max(s.max(initial=-1) for s in r.sequences[::2]) for _, r in kept),
                                            numpy.int64, len(kept)),
            ),
        )


def _drop_documents(result: _BatchResult, drop: numpy.ndarray) -> None:
    """Remove the documents where `drop` is True from a result of `_RecordBatchEncoder`."""
    keep = ~drop
    for key, key_result in result.keys.items():
        starts = numpy.cumsum(key_result.document_tokens) - key_result.document_tokens
        sequences = numpy.repeat(keep, key_result.document_sequences)
        result.keys[key] = _KeyResult(
            tokens=_gather(key_result.tokens, starts[keep], key_result.document_tokens[keep]),
            sequence_lengths=key_result.sequence_lengths[sequences],
            document_sequences=key_result.document_sequences[keep],
            document_tokens=key_result.document_tokens[keep],
        )
    result.document_lines = result.document_lines[keep]
    result.records.trained_tokens = result.records.trained_tokens[keep]
    result.records.max_token_id = result.records.max_token_id[keep]


class _FileFormats:
    """Each input file's format, that of its first record; a line of another format is an error."""

    def __init__(self, input_formats: tuple[str, ...]) -> None:
        self.input_formats = input_formats
        self.formats: dict[str, tuple[int, int]] = {}  # path -> (index into input_formats, its line)

    def check(self, batch: "_Batch", result: _BatchResult) -> None:
        """Add a `format mismatch` error for each line of `batch` in another format than its file's, and drop
        its documents; name a file's format in the log when its first record shows it."""
        formats = result.records.line_formats
        known = numpy.flatnonzero(formats >= 0)
        if not len(known):
            return
        if batch.path not in self.formats:
            self.formats[batch.path] = (int(formats[known[0]]), batch.first_line + int(known[0]))
            print(f"note: {batch.path}: {self.input_formats[formats[known[0]]]} records (from line "
                  f"{self.formats[batch.path][1]})", file=sys.stderr, flush=True)
        expected, line = self.formats[batch.path]
        wrong = numpy.flatnonzero((formats >= 0) & (formats != expected))
        if not len(wrong):
            return
        errors = dict(result.errors)
        for offset in wrong.tolist():
            errors.setdefault(offset, (
                f"format mismatch: a {self.input_formats[formats[offset]]} record in a file of "
                f"{self.input_formats[expected]} records (line {line} sets the file's format)"
            ))
        result.errors = sorted(errors.items())
        _drop_documents(result, numpy.isin(result.document_lines, wrong))

    def names(self) -> str | None:
        """The formats seen, `messages` or `alpaca+messages` for several files of different ones."""
        names = sorted({self.input_formats[index] for index, _ in self.formats.values()})
        return "+".join(names) or None


@dataclass
class _WorkerFailure:
    """An exception a worker raised: a bug, since the encode functions report bad input line by line."""

    summary: str
    traceback: str


class _WorkerTraceback(Exception):
    """A worker's traceback, shown as the cause of the error it raised in the main process."""

    def __str__(self) -> str:
        return self.args[0]


def _work(conn: Connection, inherited: list[Connection], encode: Callable[[list[bytes]], "_BatchResult"]) -> None:
    """A worker's loop: batches of lines in through `conn`, results out, until the main process
    closes its end or dies (both read as EOF)."""
    # The main process's ends of this worker's pipe and of those forked before: held open here,
    # they would hide the main process's death from the workers.
    for other in inherited:
        other.close()
    # Ctrl-C reaches the whole process group and SIGTERM may too; the main process alone decides,
    # and stops its workers. Forked, a worker would otherwise run the main process's SIGTERM handler.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # The ~400k objects forked from the parent (torch, megatron-core) live as long as the worker:
    # frozen, the garbage collector skips them instead of writing to, and so copying, their pages,
    # which cost a GPT-2 worker a quarter of its CPU time.
    gc.freeze()
    # The pool's processes are the parallelism; a Rust thread pool in each would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        while True:
            conn.send(encode(_split_lines(conn.recv_bytes())))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return
    except BaseException as error:
        with suppress(OSError):
            conn.send(_WorkerFailure(f"{type(error).__name__}: {error}", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------
# Main side: read, dispatch, write in order.


@dataclass
class _Batch:
    path: str
    first_line: int  # 1-based line number in `path`
    global_line: int  # 0-based index of the first line over all inputs
    data: bytes  # whole lines, as read; the workers split them (`_split_lines`)
    position: int  # input bytes (compressed for .gz) consumed up to the end of this batch

    @property
    def nbytes(self) -> int:
        return len(self.data)


_MIN_BATCH_BYTES = 1 << 16
"""Below this the main process's cost per batch starts to show."""


def _batch_bytes(config: PreprocessConfig, remaining: int) -> int:
    """The size of the next batch when `remaining` input bytes are left: `config.batch_bytes`, less
    towards the end. A batch takes at most a quarter of a worker's share of what is left, so the
    last batches are small and the workers finish within a small batch of each other, instead of
    one worker still encoding a full batch while the others wait."""
    return min(config.batch_bytes, max(remaining // (4 * config.workers), _MIN_BATCH_BYTES))


def _line_end(data: bytes, lines: int) -> int:
    """The offset just after the `lines`-th newline of `data`, or `len(data)` if it has no more lines."""
    if data.count(b"\n") <= lines:
        return len(data)
    end = -1
    for _ in range(lines):
        end = data.find(b"\n", end + 1)
    return end + 1


def _read_batches(paths: list[str], config: PreprocessConfig) -> Iterator[_Batch]:
    """Batches of whole lines, read as blocks: the lines are found in C (`bytes.count`, and
    `_split_lines` in the workers), not by a Python loop over them in the main process."""
    sizes = [os.path.getsize(p) for p in paths]
    done_bytes, global_line, total = 0, 0, sum(sizes)
    for path, file_size in zip(paths, sizes):
        with open_input(path) as f:
            # For .gz the progress position is the offset in the compressed file underneath.
            raw = getattr(f, "fileobj", None) or f
            line_number, pending = 1, b""
            while True:
                wanted = _batch_bytes(config, total - done_bytes - raw.tell())
                data = pending + f.read(max(wanted - len(pending), 0))
                if data and not data.endswith(b"\n"):
                    data += f.readline()  # the rest of the last line
                if not data:
                    break
                cut = _line_end(data, config.batch_lines)
                data, pending = data[:cut], data[cut:]
                yield _Batch(path, line_number, global_line, data, done_bytes + raw.tell())
                lines = data.count(b"\n") + (not data.endswith(b"\n"))
                line_number += lines
                global_line += lines
        done_bytes += file_size


@dataclass
class _InFlight:
    batch: _Batch
    result: _BatchResult | None = None


def _enlarge_send_buffer(conn: Connection, nbytes: int) -> None:
    """Let the kernel hold `nbytes` sent through `conn` and not yet read. A message larger than the
    socket's buffer (208 KB by default) goes in pieces, each waiting for the other process to read
    the one before, which on a busy machine costs a scheduling delay each; a batch that fits is
    waiting whole when its worker comes for it. The kernel caps the size (net.core.wmem_max)."""
    with suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)


class _Worker:
    """One forked worker process, the main process's end of its pipe, and a thread sending it batches.

    Batches go through a thread because a send blocks while the worker is busy and the batch is
    larger than the pipe's buffer: blocked there, the main process would not read the result the
    worker is sending back, and each would wait for the other.
    """

    def __init__(self, context, config: PreprocessConfig, encode: Callable, earlier: list["_Worker"]):
        self.conn, child = context.Pipe()
        for end in (self.conn, child):
            _enlarge_send_buffer(end, 2 * config.batch_bytes + (1 << 16))
        self.process = context.Process(
            target=_work, args=(child, [self.conn] + [w.conn for w in earlier], encode), daemon=True
        )
        self.process.start()
        # The worker now holds the only other end: its death reads as EOF here, and a send to it fails.
        child.close()
        self.outbox: SimpleQueue = SimpleQueue()
        self.sender = threading.Thread(target=self._send_all, daemon=True)
        self.awaiting: deque[_InFlight] = deque()  # sent, result not yet received, in order

    def _send_all(self) -> None:
        while (data := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:
                return  # the worker is gone; `receive` says how

    def submit(self, entry: _InFlight) -> None:
        self.awaiting.append(entry)
        self.outbox.put(entry.batch.data)

    def receive(self) -> None:
        """Receive the oldest awaited result; a dead worker is a UserError saying how it died."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            raise UserError(
                f"{self.fate()}; nothing was written: re-run, with fewer --workers if memory ran out"
            ) from None
        if isinstance(message, _WorkerFailure):
            raise RuntimeError(f"worker process {self.process.pid}: {message.summary}") from _WorkerTraceback(
                message.traceback
            )
        self.awaiting.popleft().result = message

    def fate(self) -> str:
        """How the worker ended, e.g. `worker process 12345 was killed by signal 9 (SIGKILL ...)`."""
        self.process.join(timeout=10)  # it closed its pipe by exiting: reaped at once
        code, name = self.process.exitcode, f"worker process {self.process.pid}"
        if code is None:
            return f"{name} closed its pipe but is still running"
        if code >= 0:
            return f"{name} exited with status {code}"
        fate = f"{name} was killed by signal {-code} ({signal.Signals(-code).name}"
        return fate + ("; the kernel's out-of-memory killer sends it, see dmesg)" if -code == signal.SIGKILL else ")")


class _Workers:
    """`config.workers` forked processes that run `encode` (a `_DocumentEncoder`, a `_RecordBatchEncoder`)
    on `batches`; leaving the `with` block stops them, at once (SIGKILL) when it is left by an exception.

        with _Workers(config, _DocumentEncoder(config, tokenizer, dtype), _read_batches(paths, config)) as workers:
            for batch, result in workers.results():
                ...
    """

    def __init__(self, config: PreprocessConfig, encode: Callable, batches: Iterator[_Batch]):
        # fork: workers start in milliseconds instead of re-importing torch and megatron-core.
        context = multiprocessing.get_context("fork")
        self.batches = batches
        self.in_flight: deque[_InFlight] = deque()
        self.workers: list[_Worker] = []
        try:
            for _ in range(config.workers):
                worker = _Worker(context, config, encode, self.workers)
                self.workers.append(worker)
                # Its first batch goes now, from this thread, so that it works while the next one is
                # forked (tens of ms each, for a process that has imported torch). The send waits at
                # most for the worker to read it: the worker sends nothing before it has this batch.
                batch = next(batches, None)
                if batch is not None:
                    self.in_flight.append(_InFlight(batch))
                    worker.awaiting.append(self.in_flight[-1])
                    with suppress(OSError):  # the worker is gone; `receive` says how
                        worker.conn.send_bytes(batch.data)
        except BaseException as error:
            self.__exit__(type(error))
            raise
        # Threads start after the last fork: a fork copies the locks other threads hold, never released.
        for worker in self.workers:
            worker.sender.start()

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, error_type, *_) -> None:
        for worker in self.workers:
            worker.outbox.put(None)
            if error_type is not None:
                worker.process.kill()
        for worker in self.workers:
            if worker.sender.ident is not None:  # not started when a fork failed
                worker.sender.join()
            worker.conn.close()  # an idle worker reads EOF and exits
        for worker in self.workers:
            worker.process.join()

    def results(self) -> Iterator[tuple[_Batch, _BatchResult]]:
        """Yield each batch with its result, in input order, keeping about 2 per worker in flight,
        each sent to the worker with the fewest waiting."""
        in_flight = self.in_flight
        for batch in self.batches:
            in_flight.append(_InFlight(batch))
            min(self.workers, key=lambda w: len(w.awaiting)).submit(in_flight[-1])
            if len(in_flight) > 2 * len(self.workers):
                yield self._oldest(in_flight)
        while in_flight:
            yield self._oldest(in_flight)

    def _oldest(self, in_flight: deque[_InFlight]) -> tuple[_Batch, _BatchResult]:
        """Receive results as they come until the oldest batch's is in; pop it."""
        while in_flight[0].result is None:
            busy = {worker.conn: worker for worker in self.workers if worker.awaiting}
            for conn in wait(list(busy)):
                busy[conn].receive()
        done = in_flight.popleft()
        return done.batch, done.result


def _count_lines(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open_input(path) as f:
            total += sum(1 for _ in f)
    return total


def _append(builder: "IndexedDatasetBuilder", tokens, sequence_lengths, document_sequences) -> None:
    """Append whole documents to a megatron-core builder in one write; the `.idx` it finalizes is
    the same as after one `add_document` per document."""
    builder.data_file.write(tokens.tobytes(order="C"))
    start = len(builder.sequence_lengths)
    builder.sequence_lengths.extend(sequence_lengths.tolist())
    builder.document_indices.extend((start + numpy.cumsum(document_sequences)).tolist())


def _write(builders: list["IndexedDatasetBuilder"], result: _KeyResult, partition_of_doc) -> None:
    if len(builders) == 1:
        _append(builders[0], result.tokens, result.sequence_lengths, result.document_sequences)
        return
    token_end = numpy.cumsum(result.document_tokens)
    sequence_end = numpy.cumsum(result.document_sequences)
    for partition, builder in enumerate(builders):
        docs = numpy.flatnonzero(partition_of_doc == partition)
        if len(docs) == 0:
            continue
        tokens = [result.tokens[token_end[d] - result.document_tokens[d] : token_end[d]] for d in docs]
        lengths = [
            result.sequence_lengths[sequence_end[d] - result.document_sequences[d] : sequence_end[d]]
            for d in docs
        ]
        _append(builder, numpy.concatenate(tokens), numpy.concatenate(lengths), result.document_sequences[docs])


@contextmanager
def _naming(path: str) -> Iterator[None]:
    """Name `path` in an OSError that names no file, as a failed write's (a full disk) does not."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            error.filename = path
        raise


def _remove(*paths: str) -> None:
    for path in paths:
        if os.path.exists(path):
            os.remove(path)


def _remove_killed_leftovers(final: str) -> None:
    """Remove the temporary `.bin/.idx` files that killed runs into `final` left (`megatron_patch.staging`)."""
    directory, base = os.path.split(os.path.abspath(final))
    pattern = re.escape(base) + r"(?:\.part\d+)?" + tag_pattern("tmp") + r"\.(?:bin|idx|json)"
    for path, pid, _ in killed_leftovers(directory, pattern):
        os.remove(path)
        print(f"note: removed {path}, left by process {pid}, a preprocess-data run that was killed",
              file=sys.stderr, flush=True)


def _publish(temporary: str, final: str, sidecar: bool = False) -> None:
    """Move `temporary.bin/.idx` to `final.bin/.idx` so that no moment shows a mismatched pair:
    the old `.idx` goes first and the new one arrives last. With `sidecar`, the `.json` goes before them
    and arrives after them: its presence says that the three are one set."""
    _remove(*([final + ".json"] if sidecar else []), final + ".idx")
    os.replace(temporary + ".bin", final + ".bin")
    os.replace(temporary + ".idx", final + ".idx")
    if sidecar:
        os.replace(temporary + ".json", final + ".json")


def _sidecar(config: PreprocessConfig, kind: RecordKind, encoder, formats: _FileFormats,
             totals: Counter) -> dict[str, Any]:
    """What `{output_prefix}_{sft,dpo}_document.json` says; the trainer checks "format" and "version" before reading."""
    return {
        "format": kind.format,
        "version": kind.version,
        "input_format": formats.names(),
        **kind.settings(config),
        "chat_template_sha256": encoder.chat_template_sha256,
        "tokenizer_type": config.tokenizer_type,
        kind.documents: totals["documents"],
        "tokens": totals["tokens"],
        kind.trained: totals["trained_tokens"],
        "max_token_id": totals["max_token_id"] if totals["documents"] else None,
    }


def build_conversation_encoder(config: PreprocessConfig, tokenizer) -> ConversationEncoder:
    """The encoder `--sft` runs: the tokenizer's chat template or `--chat-template FILE`, `--sft-loss`.

        encoder = build_conversation_encoder(config, build_tokenizer(config.tokenizer_type, **config.tokenizer_options))
    """
    template = load_chat_template(config.chat_template) if config.chat_template is not None else None
    return ConversationEncoder(tokenizer, chat_template=template, loss=config.sft_loss)


def build_preference_encoder(config: PreprocessConfig, tokenizer) -> PreferenceEncoder:
    """The encoder `--dpo` runs: TRL's tokenization with the tokenizer's chat template or `--chat-template FILE`.

        encoder = build_preference_encoder(config, build_tokenizer(config.tokenizer_type, **config.tokenizer_options))
    """
    return PreferenceEncoder(build_conversation_encoder(config, tokenizer))


def preprocess(config: PreprocessConfig) -> PreprocessReport:
    """Tokenize `config.input` into `.bin/.idx` files; see the module docstring.

        report = preprocess(PreprocessConfig(input="a.jsonl", output_prefix="out/a",
                                             tokenizer_type="NullTokenizer",
                                             tokenizer_options={"vocab_size": 1000}))
        report.outputs  # ['out/a_text_document']
    """
    from megatron_patch.compat import collect_only_new_objects
    from megatron_patch.startup import paused_collector

    # Here, not at the top: megatron-core (and torch with it) costs seconds that `--help` and a
    # flag error need not wait for.
    with paused_collector():
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    start = time.perf_counter()
    paths = expand_inputs(config.input)
    tokenizer = build_tokenizer(config.tokenizer_type, **config.tokenizer_options)
    if config.append_eod and tokenizer.eod is None:
        raise ValueError(f"--append-eod: the {config.tokenizer_type} tokenizer has no eod/eos token")
    # The same rule as Megatron-LM: uint16 below 65500 tokens, else int32.
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    kind = RECORD_KINDS[config.record_kind] if config.record_kind else None
    if kind is not None:
        record_encoder = kind.build_encoder(config, tokenizer)
        encode = _RecordBatchEncoder(kind, record_encoder, dtype)
    else:
        encode = _DocumentEncoder(config, tokenizer, dtype)
    file_formats, record_totals = _FileFormats(kind.input_formats if kind else ()), Counter()
    finals = config.output_prefixes()
    os.makedirs(os.path.dirname(os.path.abspath(config.output_prefix)), exist_ok=True)
    for final in finals.values():
        _remove_killed_leftovers(final)
    tmp = staging_tag("tmp")
    part_prefixes = {
        key: [final + tmp] if config.partitions == 1 else [f"{final}.part{p}{tmp}" for p in range(config.partitions)]
        for key, final in finals.items()
    }
    sequential_size = None
    if config.partitions > 1 and config.keep_sequential_samples:
        sequential_size = -(-_count_lines(paths) // config.partitions)

    report = PreprocessReport(outputs=list(finals.values()))
    progress = Progress(sum(os.path.getsize(p) for p in paths), config.log_interval)
    builders: dict[str, list["IndexedDatasetBuilder"]] = {}
    try:
        with _Workers(config, encode, _read_batches(paths, config)) as workers:
            # Opened after the fork, so that no worker holds the outputs open.
            for key, prefixes in part_prefixes.items():
                builders[key] = [IndexedDatasetBuilder(p + ".bin", dtype=dtype) for p in prefixes]
            for batch, result in workers.results():
                report.input_bytes += batch.nbytes
                if result.records is not None:
                    file_formats.check(batch, result)
                for offset, reason in result.errors:
                    if not config.skip_invalid:
                        raise InputError(f"{batch.path}:{batch.first_line + offset}: {reason}")
                    report.skipped[reason.split(":")[0]] += 1
                global_lines = batch.global_line + result.document_lines
                partition_of_doc = (
                    global_lines // sequential_size if sequential_size else global_lines % config.partitions
                )
                for key, key_result in result.keys.items():
                    with _naming(finals[key] + ".bin"):
                        _write(builders[key], key_result, partition_of_doc)
                first = result.keys[next(iter(finals))]
                report.documents += len(result.document_lines)
                report.empty_documents += result.empty_documents
                report.sequences += len(first.sequence_lengths)
                # A record's tokens are stored twice: each sequence's ids, then its mask.
                report.tokens += len(first.tokens) // (2 if result.records is not None else 1)
                if result.records is not None:
                    record_totals["documents"] += len(result.document_lines)
                    record_totals["tokens"] += int(first.document_tokens.sum()) // 2
                    record_totals["trained_tokens"] += int(result.records.trained_tokens.sum())
                    batch_max = int(result.records.max_token_id.max(initial=0))
                    record_totals["max_token_id"] = max(record_totals["max_token_id"], batch_max)
                progress.update(report.documents, report.input_bytes, report.tokens, batch.position)
        for key, prefixes in part_prefixes.items():
            with _naming(f"{finals[key]}.bin/.idx"):
                for builder, prefix in zip(builders[key], prefixes):
                    builder.finalize(prefix + ".idx")
                if config.partitions > 1:
                    # Merged in partition order, exactly as Megatron-LM merges its partition files.
                    merged = IndexedDatasetBuilder(finals[key] + tmp + ".bin", dtype=dtype)
                    builders[key].append(merged)
                    for prefix in prefixes:
                        with collect_only_new_objects():  # add_index ends in a full gc.collect()
                            merged.add_index(prefix)
                    merged.finalize(finals[key] + tmp + ".idx")
        if kind is not None:
            sidecar = _sidecar(config, kind, record_encoder, file_formats, record_totals)
            setattr(report, kind.key, sidecar)
            with _naming(finals[kind.key] + ".json"), open(finals[kind.key] + tmp + ".json", "w") as f:
                json.dump(sidecar, f, indent=2)
                f.write("\n")
        for final in finals.values():
            _publish(final + tmp, final, sidecar=kind is not None)
            if kind is None:  # an SFT or DPO prefix's sidecar records its max_token_id
                record_largest_token_id(final)  # so that a run checks its token ids without reading the .bin
    finally:
        for key, prefixes in part_prefixes.items():
            for builder in builders.get(key, []):
                # On a full disk closing flushes, and fails, again; the file goes anyway.
                with suppress(OSError):
                    builder.data_file.close()
            for prefix in prefixes + [finals[key] + tmp]:
                _remove(prefix + ".bin", prefix + ".idx", prefix + ".json")
    report.seconds = time.perf_counter() - start
    progress.close(report.summary())
    return report


SHOW_HEADER = (
    "# Trained tokens (loss mask 1: the model learns to predict them) are between [[ and ]]; the rest is context."
)
DPO_SHOW_HEADER = (
    "# Completion tokens (mask 1: the DPO loss sums their log-probabilities) are between [[ and ]]; the rest is the "
    "prompt."
)


def show_line(config: PreprocessConfig, line_number: int) -> str:
    """Line `line_number` (1-based, over the `--input` files in order) as the model sees it, with `--sft` each of
    its conversations, with `--dpo` its chosen and its rejected sequence, the trained tokens between `[[` and `]]`,
    with token counts. Writes nothing.

        print(show_line(PreprocessConfig(input="chat.jsonl", output_prefix="-", sft=True,
                                         tokenizer_type="HuggingFaceTokenizer",
                                         tokenizer_options={"tokenizer_model": "tok"}), 3))
    """
    seen = 0
    for path in expand_inputs(config.input):
        with open_input(path) as f:
            for number, raw in enumerate(f, start=1):
                seen += 1
                if seen == line_number:
                    return _show_record(config, path, number, raw)
    raise InputError(f"--show {line_number}: --input {config.input} has {seen} lines")


def _show_record(config: PreprocessConfig, path: str, number: int, raw: bytes) -> str:
    kind = RECORD_KINDS[config.record_kind]
    tokenizer = build_tokenizer(config.tokenizer_type, **config.tokenizer_options)
    encoder = kind.build_encoder(config, tokenizer)
    record, reason = _parse_record(raw.rstrip(b"\n"))
    try:
        if reason is not None:
            raise ConversationError(reason)
        input_format = kind.detect(record)
        what, lines = kind.show(config, encoder, kind.read(record, input_format))
    except ConversationError as error:
        raise InputError(f"{path}:{number}: {error}") from None
    template = "plain text (no chat template)" if encoder.chat_template_sha256 is None else (
        f"chat template sha256 {encoder.chat_template_sha256[:12]}")
    return "\n".join([kind.show_header, f"# {path}:{number}: {input_format} record, {what}, {template}", *lines])


def _show_conversations(config: PreprocessConfig, encoder: ConversationEncoder, conversations: list) -> tuple:
    lines = []
    for index, conversation in enumerate(conversations, start=1):
        encoded = encoder.encode_one(conversation)
        lines.append(f"# conversation {index}: {len(encoded.ids)} tokens, {encoded.trained_tokens} trained")
        lines.append(mark_trained(encoder.tokenizer, encoded.ids, encoded.mask))
    return f"{len(conversations)} conversation(s), --sft-loss {config.sft_loss}", lines


def _show_pair(config: PreprocessConfig, encoder: PreferenceEncoder, pairs: list) -> tuple:
    [pair] = pairs
    encoded = encoder.encode_one(pair)
    lines = []
    for name, sequence in (("chosen", encoded.chosen), ("rejected", encoded.rejected)):
        lines.append(f"# {name}: {len(sequence.ids)} tokens, {sequence.trained_tokens} completion")
        lines.append(mark_trained(encoder.tokenizer, sequence.ids, sequence.mask))
    return "one pair", lines


RECORD_KINDS = {
    SFT_KEY: RecordKind(
        key=SFT_KEY, format=SFT_FORMAT, version=SFT_VERSION, input_formats=INPUT_FORMATS,
        detect=_detect_conversation_format, read=read_conversations, build_encoder=build_conversation_encoder,
        documents="conversations", trained="trained_tokens", settings=lambda config: {"sft_loss": config.sft_loss},
        show=_show_conversations, show_header=SHOW_HEADER,
    ),
    DPO_KEY: RecordKind(
        key=DPO_KEY, format=DPO_FORMAT, version=DPO_VERSION, input_formats=PREFERENCE_FORMATS,
        detect=detect_preference_format, read=lambda record, input_format: [read_preference(record, input_format)],
        build_encoder=build_preference_encoder, documents="pairs", trained="completion_tokens",
        settings=lambda config: {}, show=_show_pair, show_header=DPO_SHOW_HEADER,
    ),
}
"""What `--sft` and `--dpo` read and write, by the outputs' key (`PreprocessConfig.record_kind`)."""


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        description="Tokenize JSONL into Megatron .bin/.idx files (Megatron-LM's preprocess_data flags).",
    )
    add_tokenizer_args(parser)
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", required=True, help="a JSONL file or a glob of them; .gz is read as gzip")
    group.add_argument("--json-keys", nargs="+", help="keys to extract (default: text)")
    group.add_argument("--split-sentences", action="store_true", help="write one sequence per sentence")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between split sentences")
    group.add_argument(
        "--lang", default="english",
        help="language of the abbreviation list of the built-in sentence splitter; only 'english' "
        "has one, other values split without it (no nltk data is used or downloaded)",
    )
    group = parser.add_argument_group(title="tokenization")
    group.add_argument("--append-eod", action="store_true", help="append the eod token to each document")
    group.add_argument(
        "--skip-invalid", action="store_true",
        help="skip (and count) malformed lines, lines without a json key, non-string values, invalid "
        "UTF-8 and, with --reject-empty, empty documents instead of stopping at the first with file:line",
    )
    empty = group.add_mutually_exclusive_group()
    empty.add_argument(
        "--reject-empty", action="store_true",
        help="stop at the first document with no tokens, naming its file:line (or skip it with "
        "--skip-invalid); by default it is written as an empty document, as Megatron-LM does",
    )
    empty.add_argument(
        "--keep-empty", action="store_true",
        help="accepted for old scripts: empty documents are written by default",
    )
    group = parser.add_argument_group(title="conversations (supervised fine-tuning) and preference pairs (DPO)")
    records = group.add_mutually_exclusive_group()
    records.add_argument(
        "--sft", action="store_true",
        help="read conversations (messages, ShareGPT conversations, prompt/completion|response, alpaca), render "
        "them with the chat template and write ids and loss masks to PREFIX_sft_document.bin/.idx/.json",
    )
    records.add_argument(
        "--dpo", action="store_true",
        help="read preference pairs (prompt/chosen/rejected as strings or messages, or chosen/rejected alone), "
        "tokenize them as TRL's DPOTrainer does and write the chosen and rejected ids and completion masks to "
        "PREFIX_dpo_document.bin/.idx/.json",
    )
    group.add_argument("--chat-template", metavar="FILE", help="a jinja chat template replacing the tokenizer's")
    group.add_argument(
        "--sft-loss", choices=LOSS_MODES,
        help="with --sft, trained tokens: every assistant turn (default), the last assistant turn, or all tokens",
    )
    group.add_argument(
        "--show", type=int, metavar="N",
        help="with --sft or --dpo: print line N of --input as the model sees it, trained spans marked, and write "
        "nothing",
    )
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", help="path prefix of the outputs, without suffix (required but with --show)")
    group.add_argument(
        "--dataset-impl", choices=["mmap"], default="mmap",
        help="accepted for old scripts; mmap is the only format megatron-core reads",
    )
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    group.add_argument(
        "--partitions", type=int, default=1,
        help="split the input round-robin into this many parts and merge them in part order, "
        "which gives Megatron-LM's document order for the same value",
    )
    group.add_argument(
        "--keep-sequential-samples", action="store_true",
        help="with --partitions, cut the input into contiguous parts, keeping input order",
    )
    group.add_argument("--log-interval", type=int, default=1000, help="documents between log lines")
    return parser


@one_line_errors("megatron-patch preprocess-data", expected=(UserError, OSError, ValueError))
def main(argv: list[str] | None = None) -> int:
    """The `preprocess_data` command; exit status 1 with one `error:` line on bad input, a dead
    worker or a full disk (the traceback too with MEGATRON_PATCH_DEBUG=1)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sft or args.dpo:
        flag, what = ("--sft", "conversations") if args.sft else ("--dpo", "pairs")
        document_flags = (("--split-sentences", args.split_sentences), ("--append-eod", args.append_eod),
                          ("--json-keys", args.json_keys is not None))
        given = [name for name, value in document_flags if value]
        if given:
            parser.error(f"{', '.join(given)}: not with {flag}, which takes whole {what} and ends them as the chat "
                         "template (or, for plain text, the tokenizer's eos) does; drop them")
        if args.dpo and args.sft_loss is not None:
            parser.error("--sft-loss: not with --dpo, which marks each answer's completion as TRL's DPOTrainer does")
    elif args.show is not None or args.chat_template is not None or args.sft_loss is not None:
        parser.error("--show, --chat-template and --sft-loss work on conversations or pairs: add --sft or --dpo")
    if args.output_prefix is None and args.show is None:
        parser.error("the following arguments are required: --output-prefix")
    config = PreprocessConfig(
        input=args.input,
        output_prefix=args.output_prefix or "",
        tokenizer_type=args.tokenizer_type,
        tokenizer_options=tokenizer_options(args),
        json_keys=args.json_keys or ["text"],
        append_eod=args.append_eod,
        split_sentences=args.split_sentences,
        keep_newlines=args.keep_newlines,
        lang=args.lang,
        workers=args.workers,
        partitions=args.partitions,
        keep_sequential_samples=args.keep_sequential_samples,
        log_interval=args.log_interval,
        skip_invalid=args.skip_invalid,
        reject_empty=args.reject_empty,
        sft=args.sft,
        chat_template=args.chat_template,
        sft_loss=args.sft_loss or "assistant",
        dpo=args.dpo,
    )
    if args.show is not None:
        print(show_line(config, args.show))
        return 0
    # The workers are stopped and the temporary files removed on a SIGTERM as on Ctrl-C.
    unwind_on_sigterm()
    preprocess(config)
    return 0
