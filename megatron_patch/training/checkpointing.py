"""Checkpoints in Megatron-LM's layout: ``SAVE/iter_0000100/`` plus ``SAVE/latest_checkpointed_iteration.txt``.

Example::

    save_checkpoint("ckpt", 100, model, optimizer, scheduler, True, info)   # any TP/PP/DP layout
    iteration = load_checkpoint("ckpt", model, optimizer, scheduler, True)  # loads at another TP/PP too

A megatron model whose description is known (``info``) also gets ``SAVE/megatron_patch_args.json``, the file
``megatron-patch convert megatron-to-hf`` reads. A tracker holding ``release`` names a converted checkpoint
(``SAVE/release/``, Megatron-LM's convention): it has weights only, so loading it starts at iteration 0.

megatron-core models go through ``dist_checkpointing`` (torch_dist), which reshards on load; the distributed
optimizer's state is saved ``fully_reshardable`` so it loads at another TP/PP/DP (the default format refuses
that). Plain/Hugging Face models are saved with ``save_pretrained`` (full weights gathered from FSDP shards) plus
the whole optimizer state keyed by parameter name (gathered from FSDP2 or ZeRO shards, so it loads under another
memory mode or data-parallel size) and the scheduler state.

Crash safety: a save goes to ``SAVE/iter_0000100.tmp-<id>/``, is fsynced, renamed to ``iter_0000100`` and only
then named by the tracker (replaced atomically), so a process killed mid-save leaves the previous checkpoint
current; loading ignores ``*.tmp-*`` leftovers and the next successful save removes them. A checkpoint with a
missing or truncated file raises CorruptCheckpointError naming both; ``load_fallback`` loads the newest complete
earlier ``iter_*`` instead.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
import shutil
import uuid
import zipfile

import numpy
import torch

from megatron_patch.convert.mcore_io import (
    RELEASE, TRACKER_FILE as TRACKER, CheckpointInfo, read_info, weights_dir, write_args_file,
)

# Reshardable across TP/PP/DP at load time (shared/notes/megatron-core-on-cpu.md, item 9).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


_COMPLETE = re.compile(r"iter_(\d{7})")
_STAGING = re.compile(r"iter_(\d{7})\.tmp-")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint directory with a missing or truncated file (a save that died half-way, a damaged disk)."""


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


def read_tracker(root: str) -> int | str | None:
    """The iteration in ``latest_checkpointed_iteration.txt``, ``"release"`` for a converted checkpoint, or
    None when there is no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise ValueError(f"{path} holds {text!r}; expected an iteration number or {RELEASE!r}")
    return int(text)


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def trained_model_info(model_config, padded_vocab_size: int, args, loaded: CheckpointInfo | None) -> CheckpointInfo:
    """What ``megatron_patch_args.json`` records for the trainer's own checkpoints: the model, the stored weights'
    dtype and layout, and the Hugging Face description of the checkpoint it was ``loaded`` from (for export).

    Example::

        info = trained_model_info(config, 128, args, args.checkpoint_info)   # args: the parsed flags
        save_checkpoint("ckpt", 10, model, optimizer, scheduler, True, info)
    """
    return CheckpointInfo(
        format="torch_dist", model_config=model_config, padded_vocab_size=padded_vocab_size,
        dtype=_DTYPES[args.params_dtype], tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
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
    optimizer's ``state_dict`` reads ``step``; shared/notes/megatron-core-on-cpu.md item 9)."""
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
                    info: CheckpointInfo | None = None, *, keep_last_k: int | None = None, async_queue=None) -> str:
    """Write ``iter_{iteration}`` (through a ``.tmp-`` directory, renamed once every rank's files are on disk),
    ``info`` as ``megatron_patch_args.json`` (megatron models), then the tracker; with ``keep_last_k`` delete all
    but the newest K ``iter_*`` (never the tracker's).

    Example::

        save_checkpoint("ckpt", 300, model, optimizer, scheduler, True, info, keep_last_k=2)
        # ckpt/iter_0000200, ckpt/iter_0000300; the tracker holds 300

    With ``async_queue`` (megatron-core's ``AsyncCallsQueue``) the tensors are written by a background process
    and the publishing (rename, tracker) happens when the queue finalizes the save on every rank
    (``maybe_finalize_async_calls``), so an unfinished save is never the latest.
    """
    path = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    staging = _make_staging_dir(path, rank)
    publish = functools.partial(_publish_when_written, root, staging, path, iteration,
                                info if megatron else None, keep_last_k)
    if megatron:
        from megatron.core import dist_checkpointing

        state = _megatron_state(model, optimizer, scheduler, is_loading=False, with_optimizer=True)
        state["iteration"] = iteration
        request = dist_checkpointing.save(state, staging, async_sharded_save=async_queue is not None)
        # After dist_checkpointing.save, which warns ("Overwriting old incomplete / corrupted checkpoint") when
        # its directory is not empty (serialization.py:383).
        _save_rng(staging, rank)
        if request is not None:
            request.add_finalize_fn(publish)
            async_queue.schedule_async_request(request)
            return path
    else:
        _save_rng(staging, rank)
        _save_plain(staging, model, optimizer, scheduler, iteration, rank)
    publish()
    return path


def _publish_when_written(root: str, staging: str, path: str, iteration: int, info: CheckpointInfo | None,
                          keep_last_k: int | None) -> None:
    torch.distributed.barrier()  # every rank's files are written: rank 0 may publish them
    if torch.distributed.get_rank() == 0:
        _fsync_tree(staging)
        _publish(staging, path)
        if info is not None:
            write_args_file(root, info)
        _write_tracker(root, iteration)
        _remove_old(root, iteration, keep_last_k)
    torch.distributed.barrier()


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
    """Remove killed saves' ``*.tmp-*`` directories (up to ``iteration``) and, with ``keep_last_k``, all but the newest K checkpoints
    (``iteration``, the one the tracker now names, always stays)."""
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


def _save_plain(path: str, model, optimizer, scheduler, iteration: int, rank: int) -> None:
    # Collectives under FSDP2 and ZeRO: every rank takes part before rank 0 writes.
    state = _full_model_state(model)
    optimizer_state = _plain_optimizer_state(model, optimizer)
    if rank != 0:
        return
    module = _plain_module(model)
    os.makedirs(path, exist_ok=True)
    if hasattr(module, "save_pretrained"):
        module.save_pretrained(path, state_dict=state)
    else:
        torch.save(state, os.path.join(path, "model.pt"))
    scaler = getattr(optimizer, "scaler", None)  # fp16's dynamic loss scale, which must resume where it was
    torch.save({"iteration": iteration, "scheduler": None if scheduler is None else scheduler.state_dict(),
                "optimizer": optimizer_state, "grad_scaler": None if scaler is None else scaler.state_dict()},
               os.path.join(path, "trainer_state.pt"))


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


def _save_rng(path: str, rank: int) -> None:
    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    with open(file, "wb") as f:
        torch.save({**_rng_state(), "world_size": torch.distributed.get_world_size()}, f)
        f.flush()
        # Each rank flushes its own file: on a shared filesystem rank 0's fsync does not reach another node's.
        os.fsync(f.fileno())


def _load_rng(path: str, rank: int, logger) -> None:
    file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    state = torch.load(file, weights_only=False) if os.path.isfile(file) else None
    if state is None or state["world_size"] != torch.distributed.get_world_size():
        logger.warning(f"{path}: no RNG state for this world size; keeping the seeded RNG (as --no-load-rng)")
        return
    _set_rng_state(state)


def load_checkpoint(root: str, model, optimizer, scheduler, megatron: bool, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, load_fallback: bool = False, logger=None) -> int:
    """Load the tracker's iteration into ``model`` (and optimizer/scheduler); return the iteration to resume
    from (0 with ``finetune``). Raises FileNotFoundError when ``root`` has no tracker, CorruptCheckpointError when
    that checkpoint has a missing or truncated file (with ``load_fallback``: loads the newest complete earlier one).

    Example::

        iteration = load_checkpoint("ckpt", model, optimizer, scheduler, True, load_fallback=True)

    A converted checkpoint (tracker ``release``) loads the model only and returns 0, as Megatron-LM does.
    """
    iteration = read_tracker(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER}; nothing to resume from")
    if iteration == RELEASE:
        return _load_release(root, model, megatron, logger)
    iteration = _complete_iteration(root, iteration, megatron, load_fallback, logger or logging.getLogger(__name__))
    path = checkpoint_dir(root, iteration)
    with_optimizer = load_optim and not finetune
    if megatron:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

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
    if absent and logger is not None:
        logger.info(f"--finetune: {path} has no {', '.join(sorted(absent))}; initialised, not loaded")


def _complete_iteration(root: str, iteration: int, megatron: bool, load_fallback: bool, logger) -> int:
    """``iteration`` when its checkpoint is complete; else, with ``load_fallback``, the newest complete earlier
    one. Every rank checks the same files, so all ranks pick the same checkpoint."""
    try:
        verify_checkpoint(checkpoint_dir(root, iteration), megatron)
        return iteration
    except CorruptCheckpointError as error:
        if not load_fallback:
            raise CorruptCheckpointError(f"--load {root}: {error}; pass --load-fallback to load the newest "
                                         "complete earlier checkpoint instead") from None
        problem = error
    for earlier in reversed([i for i in complete_iterations(root) if i < iteration]):
        try:
            verify_checkpoint(checkpoint_dir(root, earlier), megatron)
        except CorruptCheckpointError as error:
            logger.warning(f"--load-fallback: skipping {error}")
            continue
        logger.warning(f"--load {root}: {problem}; --load-fallback: loading iteration {earlier} instead")
        return earlier
    raise CorruptCheckpointError(f"--load {root}: {problem}; --load-fallback found no complete earlier checkpoint")


def verify_checkpoint(path: str, megatron: bool) -> None:
    """Raise CorruptCheckpointError naming ``path`` and the file when a file is missing or shorter than what the
    checkpoint's own metadata records; reads metadata only, not the weights.

    Example::

        verify_checkpoint("ckpt/iter_0000100", megatron=True)   # a truncated __0_0.distcp raises
    """
    if not os.path.isdir(path):
        raise CorruptCheckpointError(f"checkpoint {path} does not exist")
    if not megatron:
        _require(path, "trainer_state.pt", zipped=True)
        if not any(os.path.isfile(os.path.join(path, name)) for name in ("model.pt", "config.json")):
            raise CorruptCheckpointError(f"checkpoint {path} is incomplete: neither model.pt nor config.json")
        return
    _require(path, "common.pt", zipped=True)
    try:
        with open(_require(path, "metadata.json")) as f:
            json.load(f)
    except ValueError as error:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupted: metadata.json is not JSON ({error})") from None
    _verify_distcp_sizes(path)


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
    from megatron_patch.convert.verify import load_into_chunks

    # verify's loader reads both formats a conversion writes (torch_dist and the legacy per-rank files).
    load_into_chunks([_unwrap(chunk) for chunk in model], root, read_info(root))
    if logger is not None:
        logger.info(f"--load {root}: converted checkpoint ({weights_dir(root)}) has no optimizer, scheduler or "
                    "RNG state; loaded the model only, starting at iteration 0 (as --finetune)")
    torch.distributed.barrier()
    return 0


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
