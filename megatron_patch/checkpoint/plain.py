"""Plain torch / Hugging Face models' checkpoints: the model with ``save_pretrained`` (or as ``model.pt``) and
``trainer_state.pt``, the whole optimizer state keyed by parameter name, in the trainer's layout
(``checkpoint.trainer``), and back under any memory mode and data-parallel size.

Example::

    save_plain_checkpoint("ckpt", 100, model, optimizer, scheduler, keep_last_k=2)
    iteration = load_plain_checkpoint("ckpt", model, optimizer, scheduler)

The training backend (``training/backends/plain.py``) calls these two; nothing else here is public.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from megatron_patch.checkpoint import trainer
from megatron_patch.checkpoint.integrity import save_checksummed, write_rank_checksums
from megatron_patch.unpickle import load_plain_values


def save_plain_checkpoint(root: str, iteration: int, model: torch.nn.Module, optimizer, scheduler, *,
                          keep_last_k: int | None = None) -> str:
    """Save a plain/Hugging Face model with ``save_pretrained`` (full weights gathered from FSDP shards) or as
    ``model.pt``, plus ``trainer_state.pt``: the whole optimizer state keyed by parameter name (gathered from FSDP2
    or ZeRO shards, so it loads under another memory mode or data-parallel size), the scheduler's and the fp16 loss
    scaler's; in the trainer's layout (``trainer.save_checkpoint``).

    Example::

        save_plain_checkpoint("ckpt", 100, model, optimizer, scheduler)
    """

    def write_state(staging: str, rank: int, write_rng: Callable[[], dict], finalize: Callable[[], None]) -> None:
        checksums = {**write_rng(), **_save_plain(staging, model, optimizer, scheduler, iteration, rank)}
        write_rank_checksums(staging, rank, checksums)
        finalize()

    return trainer.save_checkpoint(root, iteration, write_state, keep_last_k=keep_last_k)


def load_plain_checkpoint(root: str, model: torch.nn.Module, optimizer, scheduler, **options) -> int:
    """Load what ``save_plain_checkpoint`` wrote (``options``: ``trainer.load_checkpoint``'s)."""

    def read_state(path: str, with_optimizer: bool, finetune: bool) -> None:
        _load_plain(path, model, optimizer, scheduler, with_optimizer)

    return trainer.load_checkpoint(root, read_state, megatron=False, **options)


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


def _load_plain(path: str, model, optimizer, scheduler, with_optimizer: bool) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    module = _plain_module(model)
    if hasattr(module, "from_pretrained"):
        state = type(module).from_pretrained(path).state_dict()
    else:
        state = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    trainer = load_plain_values(os.path.join(path, "trainer_state.pt"))
    if with_optimizer:
        _load_plain_optimizer_state(model, optimizer, trainer["optimizer"])
        if getattr(optimizer, "scaler", None) is not None and trainer.get("grad_scaler"):
            optimizer.scaler.load_state_dict(trainer["grad_scaler"])
        if scheduler is not None and trainer["scheduler"] is not None:
            scheduler.load_state_dict(trainer["scheduler"])
