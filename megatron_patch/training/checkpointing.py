"""Checkpoints in Megatron-LM's layout: ``SAVE/iter_0000100/`` plus ``SAVE/latest_checkpointed_iteration.txt``.

Example::

    save_checkpoint("ckpt", 100, model, optimizer, scheduler, True, info)   # any TP/PP/DP layout
    iteration = load_checkpoint("ckpt", model, optimizer, scheduler, True)  # loads at another TP/PP too

A megatron model whose description is known (``info``) also gets ``SAVE/megatron_patch_args.json``, the file
``megatron-patch convert megatron-to-hf`` reads. A tracker holding ``release`` names a converted checkpoint
(``SAVE/release/``, Megatron-LM's convention): it has weights only, so loading it starts at iteration 0. A checkpoint
Megatron-LM's trainer saved loads too (its model described by the ``args`` it carries): torch_dist as ours, its
legacy per-rank files (``iter_N/mp_rank_*/model_optim_rng.pt``) for the model only, with --finetune or
--no-load-optim.

megatron-core models go through ``dist_checkpointing`` (torch_dist), which reshards on load; the distributed
optimizer's state is saved ``fully_reshardable`` so it loads at another TP/PP/DP (the default format refuses
that). Plain/Hugging Face models are saved with ``save_pretrained`` (full weights gathered from FSDP shards) plus
the whole optimizer state keyed by parameter name (gathered from FSDP2 or ZeRO shards, so it loads under another
memory mode or data-parallel size) and the scheduler state.

Crash safety: a save goes to ``SAVE/iter_0000100.tmp-<id>/``, is fsynced, renamed to ``iter_0000100`` and only
then named by the tracker (replaced atomically), so a process killed mid-save leaves the previous checkpoint
current; loading ignores ``*.tmp-*`` leftovers and the next successful save removes them.

Integrity: every save records each file's length and CRC-32 in ``iter_*/checksums.json``, written before the rename
that publishes the checkpoint. A checkpoint with a missing, truncated or damaged file (one whose CRC-32 differs,
e.g. flipped bytes) raises CorruptCheckpointError naming both; ``load_fallback`` loads the newest intact earlier
``iter_*`` instead. A checkpoint saved before checksums were recorded (no ``checksums.json``) still loads, its files
checked for presence and length only.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import mmap
import os
import random
import re
import shutil
import uuid
import zipfile
import zlib

import numpy
import torch

from megatron_patch.convert.mcore_io import (
    RELEASE, TRACKER_FILE as TRACKER, CheckpointInfo, checkpoint_format, megatron_lm_common_state, read_info,
    read_tracker, weights_dir, write_args_file,
)
from megatron_patch.errors import UserError

# Reshardable across TP/PP/DP at load time (docs/megatron-core-on-cpu.md, item 9).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


_COMPLETE = re.compile(r"iter_(\d{7})")
_STAGING = re.compile(r"iter_(\d{7})\.tmp-")

CHECKSUMS = "checksums.json"
_CHECKSUMS_FORMAT = {"format": "megatron_patch checkpoint checksums", "version": 1, "algorithm": "crc32"}
# Each rank's checksums of the files it wrote, merged into CHECKSUMS by rank 0 before the checkpoint is published.
_RANK_CHECKSUMS = "checksums.rank_{:05d}.json"


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint directory with a missing, truncated or damaged file (a save that died half-way, a damaged disk
    or copy)."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete_iterations(root: str) -> list[int]:
    """The iterations of ``root``'s ``iter_*`` directories, oldest first; ``*.tmp-*`` saves in progress (or
    killed) are not among them.

    Example::

        complete_iterations("ckpt")   # [100, 200] for ckpt/iter_0000100, ckpt/iter_0000200, ckpt/iter_0000300.tmp-1f
    """
    if not os.path.isdir(root):
        return []
    found = (_COMPLETE.fullmatch(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def trained_model_info(model_config, padded_vocab_size: int, precision: str, parallel,
                       loaded: CheckpointInfo | None) -> CheckpointInfo:
    """What ``megatron_patch_args.json`` records for the trainer's own checkpoints: the model, the stored weights'
    dtype (``precision``: bf16, fp16 or fp32) and ``parallel`` layout, and the Hugging Face description of the
    checkpoint it was ``loaded`` from (for export).

    Example::

        info = trained_model_info(model, 128, "bf16", config.parallel, config.checkpoint_info)
        save_checkpoint("ckpt", 10, model, optimizer, scheduler, True, info)
    """
    return CheckpointInfo(
        format="torch_dist", model_config=model_config, padded_vocab_size=padded_vocab_size,
        dtype=_DTYPES[precision], tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        hf_config=loaded.hf_config if loaded else None, hf_architecture=loaded.hf_architecture if loaded else None,
        initialized_tensors=loaded.initialized_tensors if loaded else [],
    )


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model under megatron-core's DDP (Float16Module keeps the same sharded keys as its module)."""
    return chunk.module if hasattr(chunk, "ddp_config") else chunk


def _megatron_state(model, optimizer, scheduler, is_loading: bool, with_optimizer: bool) -> dict:
    chunks = [_unwrap(c) for c in model]
    if len(chunks) == 1:
        state = {"model": chunks[0].sharded_state_dict()}
    else:
        state = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    if with_optimizer:
        model_state = {k: v for k, v in state.items() if k.startswith("model")}
        if is_loading or not _has_adam_state(optimizer):
            # Also when saving before any step was taken (e.g. fp16 skipped every step so far): megatron-core's
            # distributed optimizer asserts on an empty state (distrib_optimizer.py:642).
            _initialise_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading, metadata=_OPTIMIZER_METADATA)
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def _optimizer_parts(optimizer):
    """(megatron optimizer, its torch optimizer or None) for each part of a possibly chained optimizer."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield part, getattr(part, "optimizer", None)


def _has_adam_state(optimizer) -> bool:
    return all(inner is None or inner.state for _, inner in _optimizer_parts(optimizer))


def _initialise_adam_state(optimizer) -> None:
    """A fresh torch Adam has no state; megatron-core's loader needs it, with a ``step`` (without TE/apex the
    optimizer's ``state_dict`` reads ``step``; docs/megatron-core-on-cpu.md, item 9)."""
    for part, inner in _optimizer_parts(optimizer):
        if inner is None or getattr(part, "init_state_fn", None) is None:
            continue
        part.init_state_fn(inner, part.config)
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def _restore_adam_step(optimizer) -> None:
    """Without TE/apex megatron-core saves torch Adam's step per param group (``distrib_optimizer.py:672``) but
    torch Adam reads it per parameter; put it back there, or bias correction restarts after a resume."""
    for _, inner in _optimizer_parts(optimizer):
        for group in getattr(inner, "param_groups", []):
            if group.get("step") is not None:
                for param in group["params"]:
                    inner.state[param]["step"] = torch.tensor(float(group["step"]))


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, megatron: bool,
                    info: CheckpointInfo | None = None, *, keep_last_k: int | None = None, async_queue=None,
                    run_args: dict | None = None) -> str:
    """Write ``iter_{iteration}`` (through a ``.tmp-`` directory, renamed once every rank's files are on disk and
    their checksums in ``checksums.json``), ``info`` as ``megatron_patch_args.json`` (megatron models), then the
    tracker; with ``keep_last_k`` delete all but the newest K ``iter_*`` (never the tracker's).

    Example::

        save_checkpoint("ckpt", 300, model, optimizer, scheduler, True, info, keep_last_k=2)
        # ckpt/iter_0000200, ckpt/iter_0000300; the tracker holds 300

    With ``async_queue`` (megatron-core's ``AsyncCallsQueue``) the tensors are written and checksummed by a
    background process and the publishing (rename, tracker) happens when the queue finalizes the save on every
    rank (``maybe_finalize_async_calls``), so an unfinished save is never the latest.

    With ``info``, ``common.pt`` carries Megatron-LM's ``args`` (``run_args``, e.g. ``consumed_train_samples``,
    override what ``info`` cannot know), so Megatron-LM resumes it with ``--use-checkpoint-args``.
    """
    path = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    staging = _make_staging_dir(path, rank)
    publish = functools.partial(_publish_when_written, root, staging, path, iteration,
                                info if megatron else None, keep_last_k)
    if megatron:
        from megatron.core import dist_checkpointing

        state = _megatron_state(model, optimizer, scheduler, is_loading=False, with_optimizer=True)
        # dist_checkpointing.save writes the state's non-sharded entries to common.pt (rank 0), which
        # _write_checksums covers.
        state.update(megatron_lm_common_state(info, iteration, **(run_args or {})) if info is not None
                     else {"iteration": iteration})
        # Asynchronous in form even for a synchronous save (run at once by execute_sync, as megatron-core's own
        # synchronous save does: strategies/base.py:212), so that its write function can be wrapped.
        request = dist_checkpointing.save(state, staging, async_sharded_save=True)
        # After dist_checkpointing.save, which warns ("Overwriting old incomplete / corrupted checkpoint") when
        # its directory is not empty (serialization.py:383).
        checksums = _save_rng(staging, rank)
        if request.async_fn is None:  # this rank holds only replicas another rank writes: no .distcp of its own
            _write_rank_checksums(staging, rank, checksums)
        else:
            request = request._replace(async_fn=functools.partial(
                _write_and_checksum, request.async_fn, staging, rank, checksums))
        request.add_finalize_fn(publish)
        if async_queue is None:
            request.execute_sync()
        else:
            async_queue.schedule_async_request(request)
        return path
    checksums = _save_rng(staging, rank)
    checksums.update(_save_plain(staging, model, optimizer, scheduler, iteration, rank))
    _write_rank_checksums(staging, rank, checksums)
    publish()
    return path


def _write_and_checksum(write, staging: str, rank: int, checksums: dict, *args, **kwargs) -> None:
    """megatron-core's write function (``write(rank, write_buckets, results_queue)``, strategies/
    filesystem_async.py:235), then the CRC-32 of each ``.distcp`` it wrote. megatron-core opens these files itself
    (filesystem_async.py:380), so they are read back, from the page cache they were just written through, in the
    same (with --async-save background) process."""
    write(*args, **kwargs)
    files = [file for file, _, _ in args[1]]
    for file, checksum in zip(files, _checksum_files(files)):
        checksums[os.path.relpath(file, staging)] = checksum
    _write_rank_checksums(staging, rank, checksums)


def _publish_when_written(root: str, staging: str, path: str, iteration: int, info: CheckpointInfo | None,
                          keep_last_k: int | None) -> None:
    torch.distributed.barrier()  # every rank's files are written: rank 0 may publish them
    if torch.distributed.get_rank() == 0:
        _write_checksums(staging, torch.distributed.get_world_size())
        _fsync_tree(staging)
        _publish(staging, path)
        if info is not None:
            write_args_file(root, info)
        _write_tracker(root, iteration)
        _remove_old(root, iteration, keep_last_k)
    torch.distributed.barrier()


class _ChecksummedFile:
    """A file opened for writing that keeps the length and CRC-32 of what is written to it (``torch.save`` takes
    it as its file), so the file is checksummed as it is written, not read back.

    Example::

        with _ChecksummedFile("ckpt/trainer_state.pt") as f:
            torch.save(state, f)
        f.checksum()   # {"bytes": 1234, "crc32": "9a3c11f0"}
    """

    def __init__(self, path: str):
        self._file = open(path, "wb")
        self._crc = self._bytes = 0

    def write(self, data) -> int:
        self._crc = zlib.crc32(data, self._crc)
        self._bytes += memoryview(data).nbytes
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def checksum(self) -> dict:
        return _checksum_entry(self._bytes, self._crc)

    def __enter__(self) -> "_ChecksummedFile":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._file.flush()
            # Each rank flushes its own files: on a shared filesystem rank 0's fsync does not reach another node's.
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


def _checksum_entry(size: int, crc: int) -> dict:
    return {"bytes": size, "crc32": f"{crc:08x}"}


def _checksum_file(path: str) -> dict:
    """The length and CRC-32 of the file at ``path``. Mapped, not read: the CRC runs over the page cache itself
    (a read's copy into a buffer made it about 1.5x slower here)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # mmap refuses an empty file
            return _checksum_entry(0, 0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            return _checksum_entry(size, zlib.crc32(mapped))


def _checksum_files(paths: list[str]) -> list[dict]:
    """``_checksum_file`` of each path, the files in parallel (zlib.crc32 releases the GIL)."""
    if len(paths) < 2:
        return [_checksum_file(path) for path in paths]
    with concurrent.futures.ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(_checksum_file, paths))


def _write_rank_checksums(staging: str, rank: int, checksums: dict) -> None:
    with open(os.path.join(staging, _RANK_CHECKSUMS.format(rank)), "w") as f:
        json.dump(checksums, f)


def _write_checksums(staging: str, world_size: int) -> None:
    """Merge the ranks' checksums into ``checksums.json``, adding those of the files no rank checksummed while
    writing (rank 0's ``common.pt``, ``metadata.json`` and ``.metadata``; ``save_pretrained``'s files)."""
    files = {}
    for rank in range(world_size):
        part = os.path.join(staging, _RANK_CHECKSUMS.format(rank))
        with open(part) as f:
            files.update(json.load(f))
        os.remove(part)
    rest = [os.path.relpath(os.path.join(directory, name), staging)
            for directory, _, names in os.walk(staging) for name in names]
    rest = [name for name in rest if name not in files]
    files.update(zip(rest, _checksum_files([os.path.join(staging, name) for name in rest])))
    with open(os.path.join(staging, CHECKSUMS), "w") as f:
        json.dump({**_CHECKSUMS_FORMAT, "files": dict(sorted(files.items()))}, f, indent=1)


def _make_staging_dir(path: str, rank: int) -> str:
    """A fresh ``iter_*.tmp-<id>`` every rank writes into; the id (made by rank 0) keeps a killed save's
    leftovers from mixing with this one's files."""
    name = [f"{path}.tmp-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    if rank == 0:
        os.makedirs(name[0])
    torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


def _fsync_path(path: str) -> None:
    """fsync a file or a directory (both can be opened read-only for it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """Flush every file and directory under ``path`` before the rename publishes it: a rename can reach the disk
    before the data it names (ext4/xfs delayed allocation), leaving a complete-looking checkpoint of empty files."""
    for directory, _, files in os.walk(path):
        for name in files:
            _fsync_path(os.path.join(directory, name))
        _fsync_path(directory)


def _publish(staging: str, path: str) -> None:
    """Rename ``staging`` to ``path``; an existing ``path`` (the same iteration saved again) is moved aside
    first, since a directory cannot be renamed onto a non-empty one."""
    replaced = None
    if os.path.exists(path):
        replaced = f"{staging}-replaced"
        os.rename(path, replaced)
    os.rename(staging, path)
    _fsync_path(os.path.dirname(path))
    if replaced is not None:
        shutil.rmtree(replaced)


def _write_tracker(root: str, iteration: int) -> None:
    """Replace the tracker atomically: a reader (or a restart after a crash) sees the old or the new iteration,
    never an empty file."""
    path = os.path.join(root, TRACKER)
    with open(path + ".tmp", "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    _fsync_path(root)


def _remove_old(root: str, iteration: int, keep_last_k: int | None) -> None:
    """Remove killed saves' ``*.tmp-*`` directories (up to ``iteration``) and, with ``keep_last_k``, all but the
    newest K checkpoints (``iteration``, the one the tracker now names, always stays)."""
    for name in os.listdir(root):
        staging = _STAGING.match(name)
        # Later iterations' staging directories may be asynchronous saves still being written.
        if staging and int(staging.group(1)) <= iteration:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if keep_last_k is None:
        return
    complete = complete_iterations(root)
    keep = set(complete[-keep_last_k:]) | {iteration}
    for old in complete:
        if old not in keep:
            shutil.rmtree(checkpoint_dir(root, old))


def _full_model_state(model: torch.nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _plain_module(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in its order (the indices of its ``state_dict``), as torch's
    ``get_optimizer_state_dict`` names them (without DDP's ``module.`` prefix)."""
    names = {param: name for name, param in _plain_module(model).named_parameters()}
    return [names[param] for group in optimizer.param_groups for param in group["params"]]


def _rekey(state: dict, keys) -> dict:
    """An optimizer ``state_dict`` with its parameter keys mapped through ``keys`` (index -> name or back)."""
    return {"state": {keys[key]: value for key, value in state["state"].items()},
            "param_groups": [{**group, "params": [keys[key] for key in group["params"]]}
                             for group in state["param_groups"]]}


def _plain_optimizer_state(model: torch.nn.Module, optimizer) -> dict | None:
    """The whole optimizer state keyed by parameter name on rank 0 (None on the others); every rank takes part.

    Example::

        _plain_optimizer_state(model, optimizer)["state"]["bert.pooler.dense.weight"]["exp_avg"]   # on rank 0

    FSDP2's shards are gathered by torch's ``get_optimizer_state_dict``, ZeroRedundancyOptimizer's are
    consolidated on rank 0; keyed by name, as the former returns it, the state loads under any memory mode and
    data-parallel size (``_load_plain_optimizer_state``).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = getattr(optimizer, "optimizer", optimizer)
    rank = torch.distributed.get_rank()
    if isinstance(inner, ZeroRedundancyOptimizer):
        inner.consolidate_state_dict(to=0)
        return _rekey(inner.state_dict(), _parameter_names(model, inner)) if rank == 0 else None
    state = get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if rank == 0 else None


def _load_plain_optimizer_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Load ``_plain_optimizer_state``'s whole state; each rank keeps its own shard of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = getattr(optimizer, "optimizer", optimizer)
    if isinstance(inner, ZeroRedundancyOptimizer):
        names = _parameter_names(model, inner)
        inner.load_state_dict(_rekey(state, {name: index for index, name in enumerate(names)}))
    else:
        set_optimizer_state_dict(model, inner, state, options=StateDictOptions(full_state_dict=True))


def _save_plain(path: str, model, optimizer, scheduler, iteration: int, rank: int) -> dict:
    """Write the model and ``trainer_state.pt`` (rank 0); return the checksums of the files written through
    ``_ChecksummedFile`` (``save_pretrained`` writes its own)."""
    # Collectives under FSDP2 and ZeRO: every rank takes part before rank 0 writes.
    state = _full_model_state(model)
    optimizer_state = _plain_optimizer_state(model, optimizer)
    if rank != 0:
        return {}
    module = _plain_module(model)
    os.makedirs(path, exist_ok=True)
    checksums = {}
    if hasattr(module, "save_pretrained"):
        module.save_pretrained(path, state_dict=state)
    else:
        checksums["model.pt"] = _save_checksummed(state, os.path.join(path, "model.pt"))
    scaler = getattr(optimizer, "scaler", None)  # fp16's dynamic loss scale, which must resume where it was
    checksums["trainer_state.pt"] = _save_checksummed(
        {"iteration": iteration, "scheduler": None if scheduler is None else scheduler.state_dict(),
         "optimizer": optimizer_state, "grad_scaler": None if scaler is None else scaler.state_dict()},
        os.path.join(path, "trainer_state.pt"))
    return checksums


def _save_checksummed(obj, path: str) -> dict:
    """``torch.save(obj, path)``, flushed to disk; returns the file's checksum."""
    with _ChecksummedFile(path) as f:
        torch.save(obj, f)
    return f.checksum()


def _rng_state() -> dict:
    """Every generator a step draws from, as Megatron-LM saves them: Python's and NumPy's (data code), torch's
    (dropout outside tensor-parallel regions), the GPU's, and megatron-core's tensor-parallel tracker (dropout
    inside them, different per TP rank)."""
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(), "numpy": numpy.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_file(rank: int) -> str:
    return os.path.join("rng", f"rank_{rank:05d}.pt")


def _save_rng(path: str, rank: int) -> dict:
    """Write this rank's RNG state; return its file's checksum, keyed by its name in the checkpoint."""
    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    state = {**_rng_state(), "world_size": torch.distributed.get_world_size()}
    return {_rng_file(rank): _save_checksummed(state, os.path.join(path, _rng_file(rank)))}


def _load_rng(path: str, rank: int, logger) -> None:
    # verify_checkpoint found every rank's file of the world size the checkpoint was saved at; none for this
    # rank, or another world size in it, means a resume at another world size.
    file = os.path.join(path, _rng_file(rank))
    state = torch.load(file, weights_only=False) if os.path.isfile(file) else None
    if state is None or state["world_size"] != torch.distributed.get_world_size():
        logger.warning(f"{path}: no RNG state for this world size; keeping the seeded RNG (as --no-load-rng)")
        return
    _set_rng_state(state)


def load_checkpoint(root: str, model, optimizer, scheduler, megatron: bool, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, load_fallback: bool = False,
                    verify_checksums: bool = True, logger=None) -> int:
    """Load the tracker's iteration into ``model`` (and optimizer/scheduler); return the iteration to resume
    from (0 with ``finetune``). Raises FileNotFoundError when ``root`` has no tracker, CorruptCheckpointError when
    that checkpoint has a missing, truncated or damaged file (with ``load_fallback``: loads the newest intact
    earlier one); ``verify_checksums=False`` skips comparing the files' CRC-32s with ``checksums.json``.

    Example::

        iteration = load_checkpoint("ckpt", model, optimizer, scheduler, True, load_fallback=True)

    A converted checkpoint (tracker ``release``) loads the model only and returns 0, as Megatron-LM does.
    """
    logger = logger or logging.getLogger(__name__)
    iteration = _load(root, model, optimizer, scheduler, megatron, load_optim, load_rng, finetune, load_fallback,
                      verify_checksums, logger)
    # Megatron-LM's wording (training/checkpointing.py load_checkpoint), which log scrapers look for.
    logger.info(f"successfully loaded checkpoint from {root} at iteration {iteration}")
    return iteration


def _load(root: str, model, optimizer, scheduler, megatron: bool, load_optim: bool, load_rng: bool, finetune: bool,
          load_fallback: bool, verify_checksums: bool, logger) -> int:
    iteration = read_tracker(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER}; nothing to resume from")
    if iteration == RELEASE:
        return _load_release(root, model, megatron, logger)
    with_optimizer = load_optim and not finetune
    if megatron and checkpoint_format(checkpoint_dir(root, iteration)) == "torch":
        return _load_legacy(root, iteration, model, with_optimizer, finetune, logger)
    iteration = _complete_iteration(root, iteration, megatron, load_fallback, verify_checksums, logger)
    path = checkpoint_dir(root, iteration)
    if megatron:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        if with_optimizer:
            _require_optimizer_state(root, path)
        state = _megatron_state(model, optimizer, scheduler, is_loading=True, with_optimizer=with_optimizer)
        if finetune:
            # --finetune may put a new head on the loaded weights (a classifier on a pretrained BERT): tensors the
            # checkpoint lacks keep their initialisation, as Megatron-LM's tasks/finetune_utils.py loads its
            # pretrained checkpoint with strict=False.
            loaded, _, absent = dist_checkpointing.load(state, path, strict=StrictHandling.RETURN_UNEXPECTED)
            _check_finetune_coverage(path, state, absent, logger)
        else:
            loaded = dist_checkpointing.load(state, path)
        chunks = [_unwrap(c) for c in model]
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"], strict=not finetune)
        if with_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_step(optimizer)
            if scheduler is not None and "opt_param_scheduler" in loaded:
                scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        _load_plain(path, model, optimizer, scheduler, with_optimizer)
    if load_rng and not finetune:
        _load_rng(path, torch.distributed.get_rank(), logger)
    torch.distributed.barrier()
    return 0 if finetune else iteration


def _require_optimizer_state(root: str, path: str) -> None:
    """Refuse, in one line, resuming the optimizer from a torch_dist checkpoint that has none (a model-only save,
    e.g. Megatron-LM's with --no-save-optim), before megatron-core's loader fails on the missing keys."""
    from megatron.core import dist_checkpointing

    if not any(key.startswith("optimizer.") for key in dist_checkpointing.load_tensors_metadata(path)):
        raise UserError(f"--load {root}: {path} has no optimizer state; pass --finetune or --no-load-optim to load "
                        "its model")


def _check_finetune_coverage(path: str, state: dict, absent: set, logger) -> None:
    """Log the model tensors ``path`` does not have (they keep their initialisation); refuse a checkpoint that
    has none of them (another model altogether)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    keys = {v.key for v in nested_values(state) if isinstance(v, ShardedTensor)}
    absent = set(absent) & keys
    if absent == keys:
        raise ValueError(f"--load {path} --finetune: the checkpoint has none of this model's tensors; it holds "
                         "another model")
    if absent:
        logger.info(f"--finetune: {path} has no {', '.join(sorted(absent))}; initialised, not loaded")


def _complete_iteration(root: str, iteration: int, megatron: bool, load_fallback: bool, checksums: bool,
                        logger) -> int:
    """``iteration`` when its checkpoint is intact; else, with ``load_fallback``, the newest intact earlier
    one. Every rank checks the same files, so all ranks pick the same checkpoint."""
    verify = functools.partial(verify_checkpoint, megatron=megatron, checksums=checksums, logger=logger)
    try:
        verify(checkpoint_dir(root, iteration))
        return iteration
    except CorruptCheckpointError as error:
        if not load_fallback:
            raise CorruptCheckpointError(f"--load {root}: {error}; pass --load-fallback to load the newest "
                                         "complete earlier checkpoint instead") from None
        problem = error
    for earlier in reversed([i for i in complete_iterations(root) if i < iteration]):
        try:
            verify(checkpoint_dir(root, earlier))
        except CorruptCheckpointError as error:
            logger.warning(f"--load-fallback: skipping {error}")
            continue
        logger.warning(f"--load {root}: {problem}; --load-fallback: loading iteration {earlier} instead")
        return earlier
    raise CorruptCheckpointError(f"--load {root}: {problem}; --load-fallback found no intact earlier checkpoint")


def verify_checkpoint(path: str, megatron: bool, *, checksums: bool = True, logger=None) -> None:
    """Raise CorruptCheckpointError naming ``path`` and the file when a file is missing, shorter than what the
    checkpoint's own metadata records, or (``checksums``) its CRC-32 differs from ``checksums.json``'s. Under
    torch.distributed every rank must call it: the ranks share the reading, each file is read once.

    Example::

        verify_checkpoint("ckpt/iter_0000100", megatron=True)   # a truncated or bit-flipped __0_0.distcp raises

    A checkpoint without ``checksums.json`` (saved before checksums were recorded) is checked from its own
    metadata and its RNG files, and ``logger`` says so.
    """
    if not os.path.isdir(path):
        raise CorruptCheckpointError(f"checkpoint {path} does not exist")
    if not megatron:
        _require(path, "trainer_state.pt", zipped=True)
        if not any(os.path.isfile(os.path.join(path, name)) for name in ("model.pt", "config.json")):
            raise CorruptCheckpointError(f"checkpoint {path} is incomplete: neither model.pt nor config.json")
    else:
        _require(path, "common.pt", zipped=True)
        try:
            with open(_require(path, "metadata.json")) as f:
                json.load(f)
        except ValueError as error:
            raise CorruptCheckpointError(f"checkpoint {path} is corrupted: metadata.json is not JSON ({error})"
                                         ) from None
        _verify_distcp_sizes(path)
    if not os.path.isfile(os.path.join(path, CHECKSUMS)):
        (logger or logging.getLogger(__name__)).info(
            f"{path} has no {CHECKSUMS} (saved before checksums were recorded): its files are checked for presence "
            "and length, not content")
        _verify_rng_files(path)
        return
    _verify_checksums(path, checksums)


def _verify_checksums(path: str, checksums: bool) -> None:
    """Every file ``checksums.json`` lists is there with its length and (``checksums``) its CRC-32."""
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError) as error:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupted: {CHECKSUMS} does not load ({error!r})"
                                     ) from None
    for name, recorded in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        size = os.path.getsize(file)
        if size != recorded["bytes"]:
            damage = "truncated" if size < recorded["bytes"] else "longer than written"
            raise CorruptCheckpointError(f"checkpoint {path} is corrupted: {name} is {damage} ({size} bytes; "
                                         f"{CHECKSUMS} records {recorded['bytes']})")
    if not checksums:
        return
    rank, world_size = ((torch.distributed.get_rank(), torch.distributed.get_world_size())
                        if torch.distributed.is_initialized() else (0, 1))
    # Largest first, dealt out in turn: the ranks read about as many bytes each.
    mine = sorted(files, key=lambda name: (-files[name]["bytes"], name))[rank::world_size]
    found = _checksum_files([os.path.join(path, name) for name in mine])
    here = next((name for name, checksum in zip(mine, found) if checksum != files[name]), None)
    damaged = [here]
    if world_size > 1:
        damaged = [None] * world_size
        torch.distributed.all_gather_object(damaged, here)
    name = next((name for name in damaged if name is not None), None)
    if name is not None:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupted: {name} does not match its CRC-32 in {CHECKSUMS} (damaged on disk or "
            "in a copy); --no-verify-checksums loads it as it is")


def _verify_rng_files(path: str) -> None:
    """Every rank's RNG file of the world size the checkpoint was saved at (recorded in each file), each a whole
    ``torch.save`` file. A missing one would leave that rank on its seeded RNG unnoticed: ``_load_rng`` takes a
    missing file for a resume at another world size."""
    directory = os.path.join(path, "rng")
    if not os.path.isdir(directory):  # not saved by this trainer (it always writes rng/): loaded as --no-load-rng
        return
    names = sorted(os.listdir(directory))
    for name in names:
        _require(path, os.path.join("rng", name), zipped=True)
    first = _require(path, os.path.join("rng", names[0]) if names else _rng_file(0))
    for rank in range(torch.load(first, weights_only=False)["world_size"]):
        _require(path, _rng_file(rank))


def _require(path: str, name: str, zipped: bool = False) -> str:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise CorruptCheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    # torch.save writes a zip whose directory sits at the end, so a truncated file is not a zip any more.
    if zipped and not zipfile.is_zipfile(file):
        raise CorruptCheckpointError(f"checkpoint {path} is corrupted: {name} is truncated or not a torch.save file")
    return file


def _verify_distcp_sizes(path: str) -> None:
    """torch_dist's ``.metadata`` records each tensor's file, offset and length; a ``.distcp`` shorter than its
    last record was cut off."""
    from torch.distributed.checkpoint import FileSystemReader

    _require(path, ".metadata")
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as error:  # any unpickling failure means the same thing: a damaged .metadata
        raise CorruptCheckpointError(f"checkpoint {path} is corrupted: .metadata does not load ({error!r})") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if os.path.getsize(file) < size:
            raise CorruptCheckpointError(f"checkpoint {path} is corrupted: {name} is truncated "
                                         f"({os.path.getsize(file)} bytes; .metadata records {size})")


def _load_release(root: str, model, megatron: bool, logger) -> int:
    if not megatron:
        raise ValueError(f"--load {root}: a converted ({RELEASE}) checkpoint holds a megatron-core model; this "
                         "trainer's model is a plain torch/Hugging Face one")
    _load_model_only(root, model)
    logger.info(f"--load {root}: converted checkpoint ({weights_dir(root)}) has no optimizer, scheduler or "
                "RNG state; loaded the model only, starting at iteration 0 (as --finetune)")
    return 0


def _load_legacy(root: str, iteration: int, model, with_optimizer: bool, finetune: bool, logger) -> int:
    """The model of a Megatron-LM ``--ckpt-format torch`` save (``iter_N/mp_rank_*/model_optim_rng.pt``); its
    optimizer state, kept per rank in Megatron-LM's own layout, is not read, so only --finetune or --no-load-optim
    (as Megatron-LM's own flags, which skip the optimizer and scheduler alike) load it."""
    path = checkpoint_dir(root, iteration)
    if with_optimizer:
        raise UserError(f"--load {root}: {path} holds Megatron-LM per-rank (--ckpt-format torch) files, whose "
                        "optimizer state is not read; pass --finetune or --no-load-optim to load its model")
    _load_model_only(root, model)
    start = 0 if finetune else iteration
    logger.info(f"--load {root}: loaded the model of {path} (Megatron-LM per-rank files) without optimizer, "
                f"scheduler or RNG state, starting at iteration {start}")
    return start


def _load_model_only(root: str, model) -> None:
    from megatron_patch.convert.verify import load_into_chunks

    # verify's loader reads both formats a conversion or Megatron-LM writes (torch_dist, the legacy per-rank files).
    load_into_chunks([_unwrap(chunk) for chunk in model], root, read_info(root))
    torch.distributed.barrier()


def _load_plain(path: str, model, optimizer, scheduler, with_optimizer: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    module = _plain_module(model)
    if hasattr(module, "from_pretrained"):
        state = type(module).from_pretrained(path).state_dict()
    else:
        state = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    trainer = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    if with_optimizer:
        _load_plain_optimizer_state(model, optimizer, trainer["optimizer"])
        if getattr(optimizer, "scaler", None) is not None and trainer.get("grad_scaler"):
            optimizer.scaler.load_state_dict(trainer["grad_scaler"])
        if scheduler is not None and trainer["scheduler"] is not None:
            scheduler.load_state_dict(trainer["scheduler"])
