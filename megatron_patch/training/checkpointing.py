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
the optimizer and scheduler state of rank 0's view when not sharded.
"""

from __future__ import annotations

import os

import torch

from megatron_patch.convert.mcore_io import (
    RELEASE, TRACKER_FILE as TRACKER, CheckpointInfo, read_info, weights_dir, write_args_file,
)

# Reshardable across TP/PP/DP at load time (shared/notes/megatron-core-on-cpu.md, item 9).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


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


def _has_adam_state(optimizer) -> bool:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return all(getattr(part, "optimizer", None) is None or part.optimizer.state for part in parts)


def _initialise_adam_state(optimizer) -> None:
    """A fresh torch Adam has no state; megatron-core's loader needs it, with a ``step`` (without TE/apex the
    optimizer's ``state_dict`` reads ``step``; shared/notes/megatron-core-on-cpu.md item 9)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None or getattr(part, "init_state_fn", None) is None:
            continue
        part.init_state_fn(inner, part.config)
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def _restore_adam_step(optimizer) -> None:
    """Without TE/apex megatron-core saves torch Adam's step per param group (``distrib_optimizer.py:672``) but
    torch Adam reads it per parameter; put it back there, or bias correction restarts after a resume."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            if group.get("step") is not None:
                for param in group["params"]:
                    inner.state[param]["step"] = torch.tensor(float(group["step"]))


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, megatron: bool,
                    info: CheckpointInfo | None = None) -> str:
    """Write ``iter_{iteration}``, ``info`` as ``megatron_patch_args.json`` (megatron models), and then the tracker
    (so a crash mid-save leaves the previous one current)."""
    path = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    if megatron:
        from megatron.core import dist_checkpointing

        if rank == 0:
            os.makedirs(path, exist_ok=True)
        torch.distributed.barrier()
        state = _megatron_state(model, optimizer, scheduler, is_loading=False, with_optimizer=True)
        state["iteration"] = iteration
        dist_checkpointing.save(state, path)
    else:
        _save_plain(path, model, optimizer, scheduler, iteration, rank)
    torch.distributed.barrier()
    _save_rng(path, rank)
    if rank == 0:
        if megatron and info is not None:
            write_args_file(root, info)
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()
    return path


def _full_model_state(model: torch.nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _plain_module(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _save_plain(path: str, model, optimizer, scheduler, iteration: int, rank: int) -> None:
    state = _full_model_state(model)  # a collective under FSDP2: every rank takes part
    if rank != 0:
        return
    module = _plain_module(model)
    os.makedirs(path, exist_ok=True)
    if hasattr(module, "save_pretrained"):
        module.save_pretrained(path, state_dict=state)
    else:
        torch.save(state, os.path.join(path, "model.pt"))
    sharded = not isinstance(getattr(optimizer, "optimizer", optimizer), torch.optim.AdamW)
    torch.save({"iteration": iteration, "scheduler": None if scheduler is None else scheduler.state_dict(),
                "optimizer": None if sharded else optimizer.state_dict()}, os.path.join(path, "trainer_state.pt"))


def _save_rng(path: str, rank: int) -> None:
    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    torch.save({"torch": torch.get_rng_state(), "world_size": torch.distributed.get_world_size()},
               os.path.join(path, "rng", f"rank_{rank:05d}.pt"))


def _load_rng(path: str, rank: int, logger) -> None:
    file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    state = torch.load(file, weights_only=False) if os.path.isfile(file) else None
    if state is None or state["world_size"] != torch.distributed.get_world_size():
        logger.warning(f"{path}: no RNG state for this world size; keeping the seeded RNG (as --no-load-rng)")
        return
    torch.set_rng_state(state["torch"])


def load_checkpoint(root: str, model, optimizer, scheduler, megatron: bool, *, load_optim: bool = True,
                    load_rng: bool = True, finetune: bool = False, logger=None) -> int:
    """Load the tracker's iteration into ``model`` (and optimizer/scheduler); return the iteration to resume
    from (0 with ``finetune``). Raises FileNotFoundError when ``root`` has no tracker.

    A converted checkpoint (tracker ``release``) loads the model only and returns 0, as Megatron-LM does.
    """
    iteration = read_tracker(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER}; nothing to resume from")
    if iteration == RELEASE:
        return _load_release(root, model, megatron, logger)
    path = checkpoint_dir(root, iteration)
    with_optimizer = load_optim and not finetune
    if megatron:
        from megatron.core import dist_checkpointing

        state = _megatron_state(model, optimizer, scheduler, is_loading=True, with_optimizer=with_optimizer)
        loaded = dist_checkpointing.load(state, path)
        chunks = [_unwrap(c) for c in model]
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"])
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
    if with_optimizer and trainer["optimizer"] is not None:
        optimizer.load_state_dict(trainer["optimizer"])
    if with_optimizer and scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
