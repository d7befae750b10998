"""The trainer's state in Megatron-LM's checkpoint layout: model, optimizer, scheduler and RNG of every rank.

Example::

    save_checkpoint("ckpt", 100, model, optimizer, scheduler, True, info)   # any TP/PP/DP layout
    iteration = load_checkpoint("ckpt", model, optimizer, scheduler, True)  # loads at another TP/PP too

The files and their description are :mod:`megatron_patch.checkpoint`'s: ``SAVE/iter_0000100/`` named by
``SAVE/latest_checkpointed_iteration.txt`` (``checkpoint.format``), written through a staging directory and
checksummed (``checkpoint.integrity``). This module decides what goes in them and loads it back.

A megatron model whose description is known (``info``) also gets ``SAVE/megatron_patch_args.json``, the file
``megatron-patch convert megatron-to-hf`` reads. A tracker holding ``release`` names a converted checkpoint
(``SAVE/release/``, Megatron-LM's convention): it has weights only, so loading it starts at iteration 0. A checkpoint
Megatron-LM's trainer saved loads too (its model described by the ``args`` it carries): torch_dist as ours, its
legacy per-rank files (``iter_N/mp_rank_*/model_optim_rng.pt``) for the model only, with --finetune or
--no-load-optim; both through ``checkpoint.load.load_into_chunks``.

megatron-core models go through ``dist_checkpointing`` (torch_dist), which reshards on load; the distributed
optimizer's state is saved ``fully_reshardable`` so it loads at another TP/PP/DP (the default format refuses
that). Plain/Hugging Face models are saved with ``save_pretrained`` (full weights gathered from FSDP shards) plus
the whole optimizer state keyed by parameter name (gathered from FSDP2 or ZeRO shards, so it loads under another
memory mode or data-parallel size) and the scheduler state.

A checkpoint with a missing, truncated or damaged file raises CorruptCheckpointError; ``load_fallback`` loads the
newest intact earlier ``iter_*`` instead.
"""

from __future__ import annotations

import functools
import logging
import os
import random

import numpy
import torch

from megatron_patch import compat
from megatron_patch.checkpoint.format import (
    RELEASE, TRACKER_FILE, CheckpointInfo, checkpoint_dir, checkpoint_format, complete_iterations,
    dtype_name, megatron_lm_common_state, read_info, read_tracker, rng_file, weights_dir, write_args_file,
    write_tracker,
)
from megatron_patch.checkpoint.integrity import (
    CorruptCheckpointError, fsync_tree, make_staging_dir, publish, remove_old, save_checksummed,
    verify_checkpoint, write_and_checksum, write_checksums, write_rank_checksums,
)
from megatron_patch.checkpoint.load import load_into_chunks
from megatron_patch.errors import UserError


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
        dtype=dtype_name(precision), tensor_model_parallel_size=parallel.tensor_model_parallel_size,
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
        compat.initialise_adam_state(optimizer, is_loading)
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading,
                                                          metadata=compat.DISTRIB_OPTIMIZER_METADATA)
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
    return state


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
    staging = make_staging_dir(path, rank)
    finalize = functools.partial(_publish_when_written, root, staging, path, iteration,
                                 info if megatron else None, keep_last_k)
    if megatron:
        from megatron.core import dist_checkpointing

        state = _megatron_state(model, optimizer, scheduler, is_loading=False, with_optimizer=True)
        # dist_checkpointing.save writes the state's non-sharded entries to common.pt (rank 0), which
        # write_checksums covers.
        state.update(megatron_lm_common_state(info, iteration, **(run_args or {})) if info is not None
                     else {"iteration": iteration})
        # Asynchronous in form even for a synchronous save (run at once by execute_sync, as megatron-core's own
        # synchronous save does: strategies/base.py:212), so that its write function can be wrapped.
        request = dist_checkpointing.save(state, staging, async_sharded_save=True)
        # After dist_checkpointing.save, which warns ("Overwriting old incomplete / corrupted checkpoint") when
        # its directory is not empty (serialization.py:383).
        checksums = _save_rng(staging, rank)
        if request.async_fn is None:  # this rank holds only replicas another rank writes: no .distcp of its own
            write_rank_checksums(staging, rank, checksums)
        else:
            request = request._replace(async_fn=functools.partial(
                write_and_checksum, request.async_fn, staging, rank, checksums))
        request.add_finalize_fn(finalize)
        if async_queue is None:
            request.execute_sync()
        else:
            async_queue.schedule_async_request(request)
        return path
    checksums = _save_rng(staging, rank)
    checksums.update(_save_plain(staging, model, optimizer, scheduler, iteration, rank))
    write_rank_checksums(staging, rank, checksums)
    finalize()
    return path


def _publish_when_written(root: str, staging: str, path: str, iteration: int, info: CheckpointInfo | None,
                          keep_last_k: int | None) -> None:
    torch.distributed.barrier()  # every rank's files are written: rank 0 may publish them
    if torch.distributed.get_rank() == 0:
        write_checksums(staging, torch.distributed.get_world_size())
        fsync_tree(staging)
        publish(staging, path)
        if info is not None:
            write_args_file(root, info)
        write_tracker(root, iteration)
        remove_old(root, iteration, keep_last_k)
    torch.distributed.barrier()


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
        checksums["model.pt"] = save_checksummed(state, os.path.join(path, "model.pt"))
    scaler = getattr(optimizer, "scaler", None)  # fp16's dynamic loss scale, which must resume where it was
    checksums["trainer_state.pt"] = save_checksummed(
        {"iteration": iteration, "scheduler": None if scheduler is None else scheduler.state_dict(),
         "optimizer": optimizer_state, "grad_scaler": None if scaler is None else scaler.state_dict()},
        os.path.join(path, "trainer_state.pt"))
    return checksums


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


def _save_rng(path: str, rank: int) -> dict:
    """Write this rank's RNG state; return its file's checksum, keyed by its name in the checkpoint."""
    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    state = {**_rng_state(), "world_size": torch.distributed.get_world_size()}
    return {rng_file(rank): save_checksummed(state, os.path.join(path, rng_file(rank)))}


def _load_rng(path: str, rank: int, logger) -> None:
    # verify_checkpoint found every rank's file of the world size the checkpoint was saved at; none for this
    # rank, or another world size in it, means a resume at another world size.
    file = os.path.join(path, rng_file(rank))
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
        raise FileNotFoundError(f"--load {root}: no {TRACKER_FILE}; nothing to resume from")
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
            compat.restore_adam_step(optimizer)
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
    # Reads both formats a conversion or Megatron-LM writes (torch_dist, the legacy per-rank files).
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
