"""Megatron-LM's legacy ``torch`` format: one ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per TP x PP rank.

Example::

    save_legacy(model, "out/release", info)           # a TP=1, PP=1 model cut into info's TP x PP rank files
    full = merge_legacy("ckpt/iter_0000100", info, partition_dims(model))   # the rank files -> full tensors
    load_legacy(model, "ckpt/iter_0000100", info)     # the same, checked and copied into a TP=1, PP=1 model
    load_legacy_optimizer("ckpt/iter_0000100", info, optimizer, scheduler, fix="pass --finetune")  # each rank's own

Each rank file holds that rank's shards under the names of its own stage (layers numbered from 0 on every
stage) plus Megatron-LM's common state (:func:`format.megatron_lm_common_state`). TP shards are cut along the
dimension megatron-core splits each tensor on (:func:`format.partition_dims`); a swiglu ``linear_fc1`` holds
``[gate_shard; up_shard]`` on each rank. With tied embeddings and PP > 1 the last stage keeps its own copy of the
word embeddings as ``output_layer.weight``.

A Megatron-LM training run's rank file also holds its optimizer's ``state_dict`` and ``opt_param_scheduler``, and
with the distributed optimizer a ``distrib_optim.pt`` beside it; they resume at the saved TP x PP layout
(:func:`load_legacy_optimizer`).
"""

from __future__ import annotations

import os
import re

import torch

from megatron_patch.checkpoint.format import (
    ARGS_FILE, CheckpointInfo, CheckpointMismatch, full_state_dict, load_megatron_file, megatron_lm_common_state,
    partition_dims,
)
from megatron_patch.errors import first_problems
from megatron_patch.model.config import ModelConfig
from megatron_patch.model.names import FUSED_NORM_NAMES, LAYER


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_TT`` without pipeline parallelism, ``mp_rank_TT_PPP`` with it (Megatron-LM's naming)."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _stage_of(name: str, model_config: ModelConfig, pp: int) -> tuple[list[int], str]:
    """The pipeline stages that hold ``name`` and the name there (layers renumbered from 0 on each stage)."""
    per_stage = model_config.num_layers // pp
    match = LAYER.match(name)
    if match:
        layer = int(match.group(2))
        return [layer // per_stage], f"{match.group(1)}{layer % per_stage}.{name[match.end():]}"
    if name.startswith("embedding."):
        stages = [0]
        # Tied embeddings: the last stage keeps its own copy as output_layer.weight (kept equal by megatron-core).
        tied = not model_config.untie_embeddings_and_output_weights
        if name == "embedding.word_embeddings.weight" and pp > 1 and tied:
            return stages + [pp - 1], name
        return stages, name
    return [pp - 1], name


def _is_gated_fc1(name: str, model_config: ModelConfig) -> bool:
    return model_config.gated_mlp and re.search(r"\.mlp\.linear_fc1\.(weight|bias)$", name) is not None


def _tp_slice(tensor: torch.Tensor, dim: int | None, gated: bool, tp_rank: int, tp: int) -> torch.Tensor:
    if dim is None:
        return tensor.clone()
    if gated:  # each rank holds [gate_shard; up_shard], not a plain chunk of [gate; up]
        gate, up = tensor.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp, dim=dim)[tp_rank], up.chunk(tp, dim=dim)[tp_rank]], dim=dim)
    return tensor.chunk(tp, dim=dim)[tp_rank].clone()  # clone: torch.save of a view writes its whole storage


def _merge_tp(shards: list[torch.Tensor], dim: int | None, gated: bool) -> torch.Tensor:
    if dim is None:
        return shards[0]
    if gated:
        gates, ups = zip(*(s.chunk(2, dim=dim) for s in shards))
        return torch.cat([*gates, *ups], dim=dim)
    return torch.cat(shards, dim=dim)


def save_legacy(model, ckpt_dir: str, info: CheckpointInfo) -> None:
    """One ``model_optim_rng.pt`` per TP x PP rank, cut from the reference model's full tensors."""
    m, tp, pp = info.model_config, info.tensor_model_parallel_size, info.pipeline_model_parallel_size
    if m.num_layers % pp:
        raise ValueError(f"--target-pipeline-parallel-size {pp} must divide the {m.num_layers} layers")
    full, dims = model.state_dict(), partition_dims(model)
    common = megatron_lm_common_state(info, 0)
    for pp_rank in range(pp):
        placed = {}
        for name, value in full.items():
            stages, local = _stage_of(name, m, pp)
            if pp_rank in stages:
                placed[name] = local
        if pp > 1 and pp_rank == pp - 1 and not m.untie_embeddings_and_output_weights:
            placed["embedding.word_embeddings.weight"] = "output_layer.weight"
        for tp_rank in range(tp):
            state = {}
            for name, local in placed.items():
                value = full[name]
                dim = dims.get(LAYER.sub(r"\1{}.", name))
                state[local] = (value if not isinstance(value, torch.Tensor)
                                else _tp_slice(value, dim, _is_gated_fc1(name, m), tp_rank, tp))
            path = os.path.join(ckpt_dir, rank_dir_name(tp_rank, pp_rank, pp), "model_optim_rng.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": state, **common}, path)


def merge_legacy(ckpt_dir: str, info: CheckpointInfo, dims: dict[str, int | None]) -> dict[str, torch.Tensor]:
    """Full tensors from the per-rank files: TP shards concatenated along ``dims`` (from
    :func:`format.partition_dims`), layers renumbered from their stage, the tied copy on the last stage checked."""
    m, tp, pp = info.model_config, info.tensor_model_parallel_size, info.pipeline_model_parallel_size
    per_stage = m.num_layers // pp
    full, tied_copy = {}, None
    for pp_rank in range(pp):
        shards = []
        for tp_rank in range(tp):
            path = os.path.join(ckpt_dir, rank_dir_name(tp_rank, pp_rank, pp), "model_optim_rng.pt")
            if not os.path.isfile(path):
                raise CheckpointMismatch(f"{path} is missing (the checkpoint records TP={tp}, PP={pp})")
            shards.append(load_megatron_file(path)["model"])
        for local, value in shards[0].items():
            # Transformer Engine's FP8 metadata (saved as a tensor by newer TE): no weight of the model.
            if not isinstance(value, torch.Tensor) or local.endswith("._extra_state"):
                continue
            match = LAYER.match(local)
            name = (f"{match.group(1)}{int(match.group(2)) + pp_rank * per_stage}.{local[match.end():]}"
                    if match else local)
            name = _fused_norm_alias(name, dims)
            template = LAYER.sub(r"\1{}.", name)
            if template not in dims and template != "output_layer.weight":
                raise CheckpointMismatch(f"{local} (rank files of stage {pp_rank}) is not a tensor of the model")
            merged = _merge_tp([s[local] for s in shards], dims.get(template, 0), _is_gated_fc1(name, m))
            if name == "output_layer.weight" and template not in dims:
                tied_copy = merged  # the last stage's copy of tied embeddings, checked below
                continue
            full[name] = merged
    # With tied embeddings and PP > 1 the export takes the first stage's copy; both must agree.
    if tied_copy is not None and not torch.equal(tied_copy, full.get("embedding.word_embeddings.weight")):
        raise CheckpointMismatch("the last pipeline stage's output_layer.weight differs from the tied word "
                                 "embeddings of the first stage; the checkpoint is inconsistent")
    return full


def _fused_norm_alias(name: str, dims: dict[str, int | None]) -> str:
    """``name`` as the model calls it: a rank file written with Transformer Engine's layers (Megatron-LM's default
    ``--transformer-impl``, and Pai-Megatron-Patch's converters) holds a pre-norm inside the linear layer it fuses
    into, where megatron-core's local layers have a norm module, and the other way round.

    Example::

        _fused_norm_alias("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", dims)
        # 'decoder.layers.3.input_layernorm.weight' for a model of local layers
    """
    if LAYER.sub(r"\1{}.", name) in dims:
        return name
    for local, fused in FUSED_NORM_NAMES.items():
        for theirs, ours in ((fused, local), (local, fused)):
            alias = name.replace(theirs, ours)
            if theirs in name and LAYER.sub(r"\1{}.", alias) in dims:
                return alias
    return name


def load_legacy(model, ckpt_dir: str, info: CheckpointInfo) -> None:
    """Merge the per-rank files into the reference (TP=1, PP=1) model, checking names and shapes."""
    full = merge_legacy(ckpt_dir, info, partition_dims(model))
    _copy_full_tensors(model, full, ckpt_dir)


def _copy_full_tensors(model, full: dict[str, torch.Tensor], source: str) -> None:
    target = full_state_dict(model)
    problems = [f"{n}: missing from the checkpoint (model expects {tuple(t.shape)})"
                for n, t in target.items() if n not in full]
    problems += [f"{n}: checkpoint has shape {tuple(full[n].shape)}, model expects {tuple(t.shape)}"
                 for n, t in target.items() if n in full and full[n].shape != t.shape]
    problems += [f"{n}: in the checkpoint but not a tensor of the model" for n in full if n not in target]
    if problems:
        raise CheckpointMismatch(f"{source} does not fit the model its description ({ARGS_FILE} or Megatron-LM "
                                 f"args) records: {first_problems(problems)}")
    with torch.no_grad():
        for name, tensor in target.items():
            tensor.copy_(full[name])


DISTRIBUTED_OPTIMIZER_FILE = "distrib_optim.pt"
"""Beside each rank file: the distributed optimizer's parameter state, gathered to data-parallel rank 0
(megatron-core's ``save_parameter_state``; Megatron-LM's get_distributed_optimizer_checkpoint_name)."""


def load_legacy_optimizer(weights: str, info: CheckpointInfo, optimizer, scheduler, fix: str) -> None:
    """This rank's optimizer and scheduler from Megatron-LM's per-rank files in ``weights`` (described by
    ``info``), as its ``load_checkpoint`` reads them for ``--ckpt-format torch`` (megatron/training/checkpointing.py
    at core_v0.16.1): ``optimizer.load_state_dict`` of the rank file's ``optimizer`` (the whole state of a
    non-distributed optimizer, the distributed one's groups and grad scaler), its ``load_parameter_state`` of
    ``distrib_optim.pt`` (the distributed optimizer's moments and main parameters), and the scheduler's
    ``opt_param_scheduler``. Every rank of the world calls it.

    Example::

        load_legacy_optimizer("ckpt/iter_0000100", read_info("ckpt"), optimizer, scheduler, fix="pass --finetune")

    The state is indexed by the optimizer's parameter order at the saved tensor/pipeline layout, so it loads only
    at that layout and into the same kind of optimizer at the same precision; any other is refused here, naming
    what differs (``fix``: how to load the model alone). A non-distributed optimizer's state is the same on every
    data-parallel rank and megatron-core scatters the distributed one's over the ranks present, so the
    data-parallel size may change.
    """
    from megatron.core import parallel_state
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_patch import compat

    saved = (info.tensor_model_parallel_size, info.pipeline_model_parallel_size)
    requested = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size())
    if saved != requested:
        raise CheckpointMismatch(
            f"{weights} holds Megatron-LM per-rank (--ckpt-format torch) optimizer state of TP={saved[0]} "
            f"PP={saved[1]}, indexed by that layout's parameters; requested TP={requested[0]} PP={requested[1]}: "
            f"resume at TP={saved[0]} PP={saved[1]}, or {fix}")
    here = os.path.join(weights, rank_dir_name(parallel_state.get_tensor_model_parallel_rank(),
                                               parallel_state.get_pipeline_model_parallel_rank(), saved[1]))
    path = os.path.join(here, "model_optim_rng.pt")
    state = load_megatron_file(path)
    if "optimizer" not in state or "opt_param_scheduler" not in state:
        raise CheckpointMismatch(f"{path} has no optimizer or scheduler state (saved with --no-save-optim?); {fix}")
    distributed = all(isinstance(part, DistributedOptimizer)
                      for part in getattr(optimizer, "chained_optimizers", [optimizer]))
    saved_flags = _optimizer_flags(getattr(state.get("args"), "use_distributed_optimizer", False), state.get("args"))
    requested_flags = _optimizer_flags(distributed, optimizer.config)
    if saved_flags != requested_flags:
        raise CheckpointMismatch(f"{path} holds the state of an optimizer run with {saved_flags}, which does not "
                                 f"load into one run with {requested_flags}: resume with the saving run's flags, "
                                 f"or {fix}")
    parameter_state = os.path.join(here, DISTRIBUTED_OPTIMIZER_FILE)
    if distributed and not os.path.isfile(parameter_state):
        raise CheckpointMismatch(f"{parameter_state} is missing: the distributed optimizer's state is not all "
                                 f"there; {fix}")
    optimizer.load_state_dict(state["optimizer"])
    if distributed:
        optimizer.load_parameter_state(parameter_state)
    compat.restore_adam_step(optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(state["opt_param_scheduler"])


def _optimizer_flags(distributed: bool, config) -> str:
    """The flags that shape an optimizer's state, from Megatron-LM's args or a megatron-core OptimizerConfig."""
    flags = ["--use-distributed-optimizer"] if distributed else []
    flags += [f"--{precision}" for precision in ("bf16", "fp16") if getattr(config, precision, False)]
    return " ".join(flags) or "neither --use-distributed-optimizer nor --bf16/--fp16"
