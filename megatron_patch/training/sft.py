"""Supervised fine-tuning (SFT) data for megatron-core GPT: conversations prepared by ``megatron-patch
preprocess-data --sft`` (tokens and their loss mask in ``.bin/.idx``), packed into ``--seq-length`` sequences, and the
forward step and dev loss of examples/gpt/finetune_gpt.py.

Example::

    megatron-patch preprocess-data --sft --input chat.jsonl --output-prefix data/chat \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf/qwen2 --workers 8
    rapidformer --user-script examples/gpt/finetune_gpt.py --sft --data-path data/chat_sft_document \\
        --split 98,2,0 --load ckpt/qwen2-mcore --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 ...

    train, dev = sft_datasets(config, tokenizer, logger)     # in the Finetuner's dataset hook
    train[0]     # {"tokens", "labels", "loss_mask", "position_ids", "cu_seqlens"}: one pack of --seq-length tokens

A pack holds whole conversations, placed by best-fit decreasing (``pack_best_fit``), cached beside the data like
megatron-core's dataset indexes. In the model each conversation attends only to itself and its positions start at
0: the pack goes through megatron-core's ``thd`` format (``PackedSeqParams`` with the pack's ``cu_seqlens``), on
every pipeline stage, since every stage reads the batch. The loss is per trained token over the global batch
(``--sft`` turns on ``--calculate-per-token-loss``), so a token weighs the same packed or not. ``--no-sft-packing``
gives one conversation per sample, padded.

``--data-path`` (split by ``--split``, over conversations, as megatron-core splits documents) or
``--train-data-path``/``--valid-data-path`` name prepared prefixes (``PREFIX_sft_document``) or ``.jsonl`` files,
which the launcher prepares into ``--data-cache-path`` before any rank starts (``prepare_sft_inputs``); a directory
holding ``train.jsonl`` and ``dev.jsonl`` (``--data-name`` a folder under it) is the two files.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
import os

import numpy
import torch

from megatron_patch.data.conversations import SFT_FORMAT, SFT_VERSION
from megatron_patch.data.data_path import is_number, split_ranges
from megatron_patch.data.preferences import DPO_FORMAT, DPO_VERSION
from megatron_patch.errors import UserError
from megatron_patch.model.forward import forward_only_step
from megatron_patch.training.step import lm_loss_func



@dataclasses.dataclass(frozen=True)
class PreparedKind:
    """What ``preprocess-data --KEY`` writes and how a run reads it: each document of ``PREFIX_KEY_document.bin/.idx``
    holds one item (a conversation, a preference pair) as (token ids, 0/1 mask) sequences, one per name in
    ``sequences``; the sidecar's format and version are the writer's (data/conversations.py, data/preferences.py)."""

    key: str
    format: str
    version: int
    sequences: tuple[str, ...]
    items: str

    @property
    def flag(self) -> str:
        return f"--{self.key}"

    @property
    def suffix(self) -> str:
        return f"_{self.key}_document"

    @property
    def label(self) -> str:
        return self.key.upper()


SFT = PreparedKind("sft", SFT_FORMAT, SFT_VERSION, ("conversation",), "conversations")
DPO = PreparedKind("dpo", DPO_FORMAT, DPO_VERSION, ("chosen", "rejected"), "preference pairs")


def kind_of(data) -> PreparedKind:
    """The kind of post-training data a run's DataConfig asks for (``--dpo``, else ``--sft``)."""
    return DPO if data.dpo else SFT
# Bumped when the packing of the same lengths changes, so that no cache of an older packer is read.
_PACKER_VERSION = 1


def sidecar_path(prefix: str) -> str:
    """The JSON record ``preprocess-data --sft`` writes beside ``PREFIX.bin/.idx``."""
    return prefix + ".json"


class Conversations:
    """One prepared prefix: item ``i`` (a conversation; for ``DPO`` a preference pair) is document ``i`` of its
    ``.bin/.idx``, whose sequences are token ids and the 0/1 mask of the tokens trained on, in turn.

    Example::

        data = Conversations("data/chat_sft_document")
        len(data), data.lengths[:3]          # (1000, array([312, 85, 1024]))
        ids, mask = data[0]
        chosen_ids, chosen_mask, rejected_ids, rejected_mask = Conversations("data/prefs_dpo_document", DPO)[0]
    """

    def __init__(self, prefix: str, kind: PreparedKind = SFT):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.prefix, self.kind = prefix, kind
        flag, tool = kind.flag, f"`megatron-patch preprocess-data {kind.flag}`"
        record = sidecar_path(prefix)
        if not os.path.isfile(prefix + ".idx") or not os.path.isfile(prefix + ".bin"):
            stem, suffix = os.path.splitext(prefix)
            if suffix in (".bin", ".idx") and os.path.isfile(stem + ".idx"):
                raise UserError(f"{flag} --data-path {prefix} names a data file; give its prefix, without {suffix}: "
                                f"--data-path {stem}")
            if os.path.isfile(prefix + kind.suffix + ".idx"):
                raise UserError(f"{flag} --data-path {prefix}: no {prefix}.bin/.idx, but {prefix}{kind.suffix}.idx "
                                f"exists: give --data-path {prefix}{kind.suffix}")
            raise UserError(f"{flag} --data-path {prefix}: no {prefix}.bin/.idx; prepare the {kind.items} with "
                            f"`megatron-patch preprocess-data {flag} --input FILE.jsonl --output-prefix P` and give "
                            f"P{kind.suffix}, or give the .jsonl itself")
        try:
            with open(record) as f:
                self.info = json.load(f)
        except FileNotFoundError:
            raise UserError(f"{flag} --data-path {prefix}: {record} is missing, so these are not {kind.items} "
                            f"prepared by {tool} (plain documents train with examples/gpt/pretrain_gpt.py); prepare "
                            f"them with {tool}") from None
        other = next((k for k in (SFT, DPO) if k is not kind and self.info.get("format") == k.format), None)
        if other is not None:
            raise UserError(f"{flag} --data-path {prefix}: these are {other.items} (preprocess-data {other.flag}), "
                            f"not {kind.items}; give {flag} the output of {tool}, or train these with {other.flag}")
        if self.info.get("format") != kind.format or self.info.get("version") != kind.version:
            raise UserError(f"{record}: format {self.info.get('format')!r} version {self.info.get('version')!r}, not "
                            f"{kind.format!r} version {kind.version}; prepare the data again with this release's "
                            f"{tool}")
        self.dataset = IndexedDataset(prefix, mmap=True)
        lengths = self.dataset.sequence_lengths.astype(numpy.int64)
        width = 2 * len(kind.sequences)  # (ids, mask) per sequence
        documents = self.dataset.document_indices
        if len(lengths) % width or not numpy.array_equal(documents, numpy.arange(0, len(lengths) + 1, width)) \
                or not numpy.array_equal(lengths[0::2], lengths[1::2]):
            raise UserError(f"{prefix}.idx: its documents are not {len(kind.sequences)} (tokens, loss mask) pair(s) "
                            f"of equal length; prepare the data again with {tool}")
        self.sequence_lengths = lengths[0::2].reshape(-1, len(kind.sequences))
        """Each item's sequences' numbers of tokens."""
        self.lengths = self.sequence_lengths.sum(axis=1)
        """Each item's number of tokens."""
        self.predictions = self.lengths - len(kind.sequences)
        """The positions each item fills in a sample: a sequence of n tokens predicts n - 1 of them."""

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> tuple[numpy.ndarray, ...]:
        width = 2 * len(self.kind.sequences)
        return tuple(self.dataset[width * index + k] for k in range(width))


def pack_best_fit(lengths: numpy.ndarray, capacity: int) -> list[numpy.ndarray]:
    """Items of ``lengths`` (each at most ``capacity``) in bins of ``capacity``, best-fit decreasing: the longest
    item first, each into the fullest bin it fits (TRL's "bfd"; as good as first-fit decreasing, 11/9 of optimal
    at worst, and deterministic: ties go by index).

    Example::

        >>> [b.tolist() for b in pack_best_fit(numpy.array([5, 3, 4, 2, 6]), 8)]
        [[4, 3], [0, 1], [2]]
    """
    order = numpy.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    free: list[int] = []  # the distinct room left in some bin, sorted
    by_room: dict[int, list[int]] = {}  # room left -> the bins with that much, last opened last
    for item in order.tolist():
        length = int(lengths[item])
        at = bisect.bisect_left(free, length)
        if at == len(free):
            bins.append([])
            target, room = len(bins) - 1, capacity
        else:
            room = free[at]
            target = by_room[room].pop()
            if not by_room[room]:
                del by_room[room], free[at]
        bins[target].append(item)
        left = room - length
        if left not in by_room:
            by_room[left] = []
            bisect.insort(free, left)
        by_room[left].append(target)
    return [numpy.array(b, dtype=numpy.int64) for b in bins]


def _cached(path: str, compute) -> list[numpy.ndarray]:
    """``compute()``'s packs, saved at ``path`` (an ``.npz``, written under a temporary name and renamed, so that
    ranks packing at once never read half a file) or read from it."""
    if os.path.isfile(path):
        with numpy.load(path) as stored:
            ends = stored["ends"]
            return numpy.split(stored["items"], ends[:-1]) if len(ends) else []
    packs = compute()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}.npz"
    numpy.savez(temporary, items=numpy.concatenate(packs) if packs else numpy.zeros(0, numpy.int64),
                ends=numpy.cumsum([len(p) for p in packs], dtype=numpy.int64))
    os.replace(temporary, path)
    return packs


@dataclasses.dataclass
class SFTStats:
    """What building a split did to its items (conversations, preference pairs), for the log."""

    kind: PreparedKind = SFT
    conversations: int = 0
    skipped: int = 0
    truncated: int = 0
    samples: int = 0
    tokens: int = 0
    """Positions the items fill (a sequence of n tokens fills n - 1: each predicts the next)."""

    def summary(self, name: str, seq_length: int, packed: bool) -> str:
        efficiency = self.tokens / max(self.samples * seq_length, 1)
        cut = (f", {self.skipped} skipped" if self.skipped else "") + \
              (f", {self.truncated} truncated" if self.truncated else "")
        one = self.kind.items[:-1]  # "conversation", "preference pair"
        kind = "packs" if packed else f"samples, one {one} each"
        return (f" {self.kind.label} {name}: {self.conversations} {self.kind.items}{cut} in {self.samples} {kind} of "
                f"{seq_length} tokens; packing efficiency {100 * efficiency:.1f}%")


class SFTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length`` tokens from conversations (``parts``: each a ``Conversations`` and the indices of
    those taken), packed or one per sample; padded with empty samples to a multiple of ``multiple_of`` (so that
    data-parallel ranks split a dev set without repeating a conversation).

    Example::

        dev = SFTDataset([(Conversations("data/chat_sft_document"), numpy.arange(980, 1000))], seq_length=4096,
                         pad=0, packed=True, overlong="skip", cache_dir="data/cache", multiple_of=2)
        dev.stats.summary("dev", 4096, True)

    A conversation of n tokens gives n - 1 predictions (position i predicts token i + 1), so it fits when
    n - 1 <= seq_length; a longer one stops the build (``overlong`` None), is cut to seq_length + 1 tokens
    ("truncate") or is left out ("skip"). A preference pair (``DPO`` data) fills the predictions of its chosen and
    its rejected sequence, which attend to themselves only (``cu_seqlens``, packed or not); a sample names its
    items (``"items"``: their indices in ``items``), whose sequences come in that order.
    """

    def __init__(self, parts: list[tuple[Conversations, numpy.ndarray]], seq_length: int, pad: int, packed: bool,
                 overlong: str | None, cache_dir: str | None, multiple_of: int = 1):
        self.parts, self.seq_length, self.pad, self.packed = [p for p, _ in parts], seq_length, pad, packed
        kind = parts[0][0].kind if parts else SFT
        # A pair's two sequences must not see each other, one pair to a sample too.
        self.bounded = packed or len(kind.sequences) > 1
        owners = numpy.concatenate([numpy.full(len(indices), k, numpy.int64) for k, (_, indices) in enumerate(parts)]
                                   or [numpy.zeros(0, numpy.int64)])
        indices = numpy.concatenate([numpy.asarray(i, numpy.int64) for _, i in parts] or [numpy.zeros(0, numpy.int64)])
        predictions = numpy.concatenate([p.predictions[i] for p, i in parts] or [numpy.zeros(0, numpy.int64)])
        over = predictions > seq_length
        self.stats = SFTStats(kind=kind, conversations=len(indices))
        if over.any() and overlong is None:
            longest, one = int(numpy.argmax(predictions)), kind.items[:-1]
            raise UserError(
                f"{int(over.sum())} {kind.items} are longer than --seq-length {seq_length} (the longest, {one} "
                f"{indices[longest]} of {parts[owners[longest]][0].prefix}, has {predictions[longest]} positions to "
                f"predict): give --{kind.key}-overlong {'skip' if kind is DPO else 'truncate or skip'}, or a "
                "longer --seq-length")
        if overlong == "skip":
            owners, indices, predictions = owners[~over], indices[~over], predictions[~over]
            self.stats.skipped = int(over.sum())
        else:
            self.stats.truncated = int(over.sum())
        predictions = numpy.minimum(predictions, seq_length)
        self.items = numpy.stack([owners, indices], axis=1)
        if packed:
            key = hashlib.sha256(json.dumps([_PACKER_VERSION, seq_length, [
                (os.path.abspath(p.prefix), os.path.getsize(p.prefix + ".idx"), os.stat(p.prefix + ".bin").st_mtime_ns,
                 hashlib.sha256(numpy.asarray(i).tobytes()).hexdigest()) for p, i in parts]]).encode()).hexdigest()
            compute = lambda: pack_best_fit(predictions, seq_length)  # noqa: E731
            self.samples = compute() if cache_dir is None else _cached(
                os.path.join(cache_dir, "sft_packs", f"{key[:24]}.npz"), compute)
        else:
            self.samples = [numpy.array([i], numpy.int64) for i in range(len(indices))]
        empty = -len(self.samples) % multiple_of
        self.samples += [numpy.zeros(0, numpy.int64)] * empty
        self.stats.samples = len(self.samples) - empty
        self.stats.tokens = int(predictions.sum())

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        length = self.seq_length
        tokens = numpy.full(length, self.pad, numpy.int64)
        labels = numpy.full(length, self.pad, numpy.int64)
        loss_mask = numpy.zeros(length, numpy.float32)
        position_ids = numpy.arange(length, dtype=numpy.int64)
        bounds, at = [0], 0
        members = self.samples[index]
        for item in members.tolist():
            owner, conversation = self.items[item]
            arrays = self.parts[owner][conversation]
            for ids, mask in zip(arrays[0::2], arrays[1::2]):
                ids, mask = ids[: length + 1], mask[: length + 1]
                n = len(ids) - 1
                tokens[at:at + n], labels[at:at + n] = ids[:-1], ids[1:]
                loss_mask[at:at + n] = mask[1:]  # position i trains on predicting token i + 1
                position_ids[at:at + n] = numpy.arange(n)
                at += n
                bounds.append(at)
        sample = {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                  "loss_mask": torch.from_numpy(loss_mask)}
        if not self.bounded:
            return {**sample, "position_ids": torch.from_numpy(position_ids)}
        if at < length:  # the padding is a sequence of its own, attending to itself, positions from 0
            position_ids[at:] = numpy.arange(length - at)
            bounds.append(length)
        return {**sample, "position_ids": torch.from_numpy(position_ids),
                "cu_seqlens": torch.tensor(bounds, dtype=torch.int64), "items": torch.from_numpy(members)}


# ----------------------------------------------------------------------------------------------------------
# Where the conversations come from
# ----------------------------------------------------------------------------------------------------------

def _file_stamp(path: str) -> list:
    """What identifies a file or a directory's files as they are now (names, sizes, modification times)."""
    if os.path.isdir(path):
        return sorted([name, *_file_stamp(os.path.join(path, name))] for name in os.listdir(path)
                      if os.path.isfile(os.path.join(path, name)))
    status = os.stat(path)
    return [os.path.abspath(path), status.st_size, status.st_mtime_ns]


def prepared_prefix(jsonl: str, data, tokenizer_type: str | None, tokenizer_options: dict) -> str:
    """Where the launcher prepares ``jsonl`` for ``--sft`` or ``--dpo`` (in ``--data-cache-path``, else a ``cache/``
    folder beside the file): a name that changes with the file, the tokenizer, the chat template and ``--sft-loss``,
    so that a rank finds the data its flags describe, never stale data."""
    kind = kind_of(data)
    stamp = [kind.format, kind.version, _file_stamp(jsonl), tokenizer_type, data.sft_loss,
             {k: _file_stamp(v) if isinstance(v, str) and os.path.exists(v) else v
              for k, v in sorted(tokenizer_options.items())},
             _file_stamp(data.chat_template) if data.chat_template else None]
    digest = hashlib.sha256(json.dumps(stamp, default=str).encode()).hexdigest()[:16]
    cache = data.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(jsonl)), "cache")
    stem = os.path.splitext(os.path.basename(jsonl))[0]
    return os.path.join(cache, kind.key, f"{stem}-{digest}")


@dataclasses.dataclass(frozen=True)
class SFTInputs:
    """The prepared prefixes of a run: split by ``split`` (``--data-path``), or train and valid apart."""

    split: tuple[str, ...] = ()
    train: tuple[str, ...] = ()
    valid: tuple[str, ...] = ()


def _words(values, kind: PreparedKind) -> list[str]:
    words = [word for value in values or () for word in value.split()]
    if any(is_number(word) for word in words):
        raise UserError(f"{kind.flag} data takes prefixes or .jsonl files without weights, got {' '.join(words)}: "
                        f"give the files alone (their {kind.items} are concatenated)")
    return words


def sft_inputs(data) -> tuple[SFTInputs, list[str]]:
    """The run's SFT inputs as given (``.jsonl`` files not yet replaced by their prepared prefixes) and the
    ``.jsonl`` files among them; a directory stands for its ``train.jsonl`` and ``dev.jsonl``."""
    kind = kind_of(data)
    if data.train_data_path or data.valid_data_path:
        inputs = SFTInputs(train=tuple(_words(data.train_data_path, kind)),
                           valid=tuple(_words(data.valid_data_path, kind)))
    else:
        words = _words(data.data_path, kind)
        if not words:
            raise UserError(f"{kind.flag} needs --data-path (split by --split) or --train-data-path/--valid-data-path")
        directories = [w for w in words if os.path.isdir(w)]
        if directories:
            if len(words) > 1:
                raise UserError(f"--data-path {' '.join(words)}: give one directory (train.jsonl, dev.jsonl) or "
                                "prefixes and .jsonl files")
            root = os.path.join(words[0], data.data_name) if data.data_name else words[0]
            train, dev = os.path.join(root, "train.jsonl"), os.path.join(root, "dev.jsonl")
            if not os.path.isfile(train):
                raise UserError(f"--data-path {words[0]}{' --data-name ' + data.data_name if data.data_name else ''}: "
                                f"no {train}")
            inputs = SFTInputs(train=(train,), valid=(dev,) if os.path.isfile(dev) else ())
        else:
            inputs = SFTInputs(split=tuple(words))
    jsonl = [w for w in inputs.split + inputs.train + inputs.valid if w.endswith((".jsonl", ".jsonl.gz"))]
    for word in jsonl:
        if not os.path.isfile(word):
            raise UserError(f"{kind.flag}: {word}: no such file")
    return inputs, jsonl


def _resolved(inputs: SFTInputs, data, tokenizer_type, tokenizer_options) -> SFTInputs:
    def prefix(word: str) -> str:
        if word.endswith((".jsonl", ".jsonl.gz")):
            return prepared_prefix(word, data, tokenizer_type, tokenizer_options) + kind_of(data).suffix
        return word

    return SFTInputs(*(tuple(prefix(w) for w in words) for words in (inputs.split, inputs.train, inputs.valid)))


def prepare_sft_inputs(config, workers: int | None = None, log=print) -> SFTInputs:
    """The launcher's step before any rank starts: each ``.jsonl`` of the run prepared (once: the cache keeps it),
    then every split built as the ranks will build it, so that wrong input stops here, in one line."""
    data = config.data
    kind = kind_of(data)
    options = dict(config.tokenizer_options)
    inputs, jsonl = sft_inputs(data)
    resolved = _resolved(inputs, data, config.tokenizer_type, options)
    for word in jsonl:
        prefix = prepared_prefix(word, data, config.tokenizer_type, options)
        if os.path.isfile(sidecar_path(prefix + kind.suffix)):
            continue
        from megatron_patch.data.preprocess import PreprocessConfig, preprocess

        log(f"rapidformer: preparing {word} for {kind.flag} into {prefix}{kind.suffix} (once; the cache keeps it)")
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        preprocess(PreprocessConfig(
            input=word, output_prefix=prefix, tokenizer_type=config.tokenizer_type, tokenizer_options=options,
            sft=kind is SFT, dpo=kind is DPO, sft_loss=data.sft_loss, chat_template=data.chat_template,
            workers=workers or max(1, min(os.cpu_count() or 1, 8))))
    return resolved


def sft_splits(data, inputs: SFTInputs) -> tuple[list, list]:
    """(train parts, valid parts): each a list of (Conversations, indices) for ``SFTDataset``."""
    kind = kind_of(data)
    if inputs.split:
        train, valid = [], []
        for prefix in inputs.split:
            conversations = Conversations(prefix, kind)
            ranges = split_ranges(len(conversations), data.split)
            for parts, bounds in ((train, ranges[0]), (valid, ranges[1])):
                if bounds is not None and bounds[1] > bounds[0]:
                    parts.append((conversations, numpy.arange(*bounds)))
        return train, valid
    def every(prefixes):
        return [(c, numpy.arange(len(c))) for c in (Conversations(p, kind) for p in prefixes)]

    return every(inputs.train), every(inputs.valid)


def check_sft_run(config, log=print) -> dict[str, int | None]:
    """The launcher's check of an ``--sft`` run, before any rank starts: its ``.jsonl`` prepared, then its splits
    built and packed as the ranks will build them (the packs cached, so the ranks read them), so that wrong input
    (a conversation longer than ``--seq-length``, an empty split, data of no known kind) stops it in one line.
    Returns each prepared prefix's largest token id (as its record says), for the tokenizer's check."""
    inputs = prepare_sft_inputs(config, log=log)
    for line in _built(config, pad=0):
        log("rapidformer:" + line)
    return {prefix: Conversations(prefix, kind_of(config.data)).info.get("max_token_id")
            for prefix in inputs.split + inputs.train + inputs.valid}


def _built(config, pad: int, datasets: list | None = None) -> list[str]:
    """The summary lines of the run's (train, dev) datasets, which land in ``datasets``."""
    data, training = config.data, config.training
    inputs, _ = sft_inputs(data)
    train_parts, valid_parts = sft_splits(data, _resolved(inputs, data, config.tokenizer_type,
                                                          dict(config.tokenizer_options)))
    kind = kind_of(data)
    if not train_parts:
        raise UserError(f"{kind.flag}: no training {kind.items} (--split {data.split} leaves none)")
    cache = data.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(train_parts[0][0].prefix)), "cache")
    overlong = data.dpo_overlong if kind is DPO else data.sft_overlong
    build = lambda parts, multiple: SFTDataset(  # noqa: E731
        parts, data.seq_length, pad, data.sft_packing, overlong, cache, multiple)
    train = build(train_parts, 1)
    # Whole microbatches on every data-parallel rank, and under virtual pipelining a multiple of the pipeline's
    # stages of them (megatron-core's interleaved schedule takes no fewer): sft_metrics runs them in one schedule.
    parallel = config.parallel
    groups = parallel.pipeline_model_parallel_size if parallel.virtual_pipeline_model_parallel_size else 1
    dev = build(valid_parts, (training.data_parallel_size or 1) * training.micro_batch_size * groups) \
        if valid_parts else None
    if datasets is not None:
        datasets += [train, dev]
    return [dataset.stats.summary(name, data.seq_length, data.sft_packing)
            for name, dataset in (("train", train), ("dev", dev)) if dataset is not None]


def sft_datasets(config, tokenizer, logger=None) -> tuple[SFTDataset, SFTDataset | None]:
    """(train, dev) of the run's ``--sft`` flags, on any rank (the launcher prepared the ``.jsonl`` inputs); the
    dev set padded with empty samples to whole microbatches on each data-parallel rank, so each trained token of it
    counts once.

    Example::

        train, dev = sft_datasets(self.config, self.engine.tokenizer, self.engine.logger)
    """
    datasets: list = []
    lines = _built(config, tokenizer.eod if tokenizer.eod is not None else 0, datasets)
    if logger is not None:
        for line in lines:
            logger.info(line)
    return datasets[0], datasets[1]


# ----------------------------------------------------------------------------------------------------------
# The model's side
# ----------------------------------------------------------------------------------------------------------

def packed_seq_params(cu_seqlens: torch.Tensor):
    """megatron-core's ``PackedSeqParams`` (``thd``) of one pack's sequence bounds ``[0, ..., seq_length]``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = cu_seqlens.reshape(-1).to(torch.int32)
    # The longest sequence, not the pack's length: megatron-core's thd RoPE (_apply_rotary_pos_emb_thd, 0.16.1 and
    # 0.19) counts positions from each sequence's start only when its table is shorter than the pack.
    longest = int((bounds[1:] - bounds[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def per_token_loss(batch: dict, model) -> torch.Tensor:
    """The model's loss at each position of ``batch`` (the negative log-probability of its label); the sequences a
    sample's ``cu_seqlens`` bound attend to themselves only."""
    packed = packed_seq_params(batch["cu_seqlens"]) if "cu_seqlens" in batch else None
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"],
                 packed_seq_params=packed)


def sft_forward_step(batch: dict, model):
    """Per-token loss of ``batch``'s trained tokens (the three-value loss form); a pack's conversations attend to
    themselves only (``cu_seqlens``)."""
    return per_token_loss(batch, model), lambda output: lm_loss_func(batch["loss_mask"], output)


def sft_metrics(chunks: list, loader, seq_length: int, micro_batch_size: int) -> dict[str, float]:
    """The dev loss over every trained token of ``loader`` (all data-parallel ranks; its batches whole, as
    ``sft_datasets`` pads the dev set), and its perplexity; ``{}`` off the last pipeline stage."""
    from megatron.core import parallel_state

    iterators = [iter(loader) for _ in chunks]  # one per virtual pipeline chunk, each the same batches
    reports = forward_only_step(chunks, iterators if len(chunks) > 1 else iterators[0],
                                lambda it, model: sft_forward_step(next(it), model), len(loader), seq_length,
                                micro_batch_size)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    total = torch.stack([r["lm loss"].float() for r in reports]).sum(dim=0)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    loss = (total[0] / total[1].clamp(min=1.0)).item()
    return {"loss": loss, "ppl": math.exp(min(loss, 20.0))}
