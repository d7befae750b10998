"""One optimiser step over megatron-core model chunks: DDP wrapping, the optimizer, and the pipeline schedule.

Example::

    chunks = wrap_model([gpt_model], ddp_config=DistributedDataParallelConfig())
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-3))
    stats = train_step(lm_forward_step, iter(batches), chunks, optimizer, num_microbatches=4,
                       seq_length=32, micro_batch_size=2)
    stats.loss        # mean per-token loss over the global batch (on the last pipeline stage; None elsewhere)

This follows Megatron-LM's ``training.train_step``: zero the grad buffers, run
``get_forward_backward_func()`` (no pipelining, 1F1B or interleaved 1F1B as the parallel state says), let
``finalize_model_grads`` reduce gradients over data-parallel and embedding groups, then step the optimizer.
A step whose gradients hold NaN/Inf is skipped (``StepStats.skipped``) and leaves the weights and the optimizer
state as they were: in fp16 megatron-core's loss scaler finds the overflow (and lowers the scale); in bf16/fp32
there is no scaler, so ``optimizer_step`` reads the global gradient norm the optimizer computes anyway.

Mixture-of-experts models add megatron-core's load-balancing loss in the backward pass (``MoEAuxLossAutoScaler``);
the schedules scale it by the loss scale / microbatches (the loss scale alone with ``calculate_per_token_loss``,
where the router multiplies it by its tokens instead) as in Megatron-LM, because ``build_optimizer`` hands them
the optimizer's ``scale_loss``. ``RoutingStatistics`` reads what each step routed: the load-balancing loss of
each MoE layer (megatron-core's tracker) and the tokens each expert received.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron_patch import compat
from megatron_patch.distributed import record_progress, sum_over_data_parallel


def broadcast_batch(keys: list[str], batch: dict | None, datatype: torch.dtype) -> dict[str, torch.Tensor]:
    """``batch[key]`` for ``keys`` of tensor-parallel rank 0, on every rank of its TP group, on this rank's device.

    Example::

        raw = next(data_iterator) if data_iterator is not None else None   # None on TP ranks > 0
        tokens = broadcast_batch(["tokens", "labels"], raw, torch.int64)["tokens"]

    megatron-core's ``broadcast_data`` at TP=1 still makes two collectives per call and a device-to-host copy of
    the sizes (``_build_key_size_numel_dictionaries``, tensor_parallel/data.py), a sync per microbatch on GPUs. At TP=1
    there is nobody to send to: the tensors only move to the device.
    """
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        return tensor_parallel.broadcast_data(keys, batch, datatype)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {key: batch[key].to(device=device, dtype=datatype, non_blocking=True) for key in keys}


def wrap_model(
    chunks: list[torch.nn.Module], ddp_config: DistributedDataParallelConfig
) -> list[DistributedDataParallel]:
    """Wrap each model chunk (one per virtual pipeline stage) in Float16Module when the config asks for
    fp16/bf16, then in megatron-core's DDP; the first chunk's buckets start gradient sync as in Megatron-LM."""
    wrapped = []
    for index, chunk in enumerate(chunks):
        config = get_model_config(chunk)
        if config.fp16 or config.bf16:
            chunk = Float16Module(config, chunk)
        wrapped.append(
            DistributedDataParallel(
                config=config,
                ddp_config=ddp_config,
                module=chunk,
                # Bucketing only the first chunk lets the others overlap their reduction with its backward.
                disable_bucketing=index > 0,
            )
        )
    return wrapped


def build_optimizer(chunks: list[DistributedDataParallel], optimizer_config: OptimizerConfig):
    """megatron-core's optimizer (distributed when ``optimizer_config.use_distributed_optimizer``), with the
    model config's hooks set the way the pipeline schedules expect them."""
    optimizer = get_megatron_optimizer(optimizer_config, chunks)
    compat.detach_main_param_views(optimizer)
    config = get_model_config(chunks[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = _finalize_model_grads
    ddp_config = chunks[0].ddp_config
    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
        # Each chunk starts reducing its last buckets as soon as its backward ends (Megatron-LM's
        # --align-grad-reduce, on by default: megatron/training/training.py, core_v0.16.1, setup of train()).
        config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
        if len(chunks) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    return optimizer


def _finalize_model_grads(*args, **kwargs):
    # This rank's backward is done; should the reduction below time out, the ranks that never got here are the
    # ones their peers waited for (megatron_patch.distributed.progress_report).
    record_progress()
    return finalize_model_grads(*args, **kwargs)


@dataclasses.dataclass
class RoutingStep:
    """One step's routing over the whole global batch, per MoE layer (global layer numbers from 1)."""

    aux_losses: dict[str, dict[int, float]]
    """Each auxiliary loss megatron-core's routers tracked, by its name there (``load_balancing_loss`` for
    ``--moe-router-load-balancing-type aux_loss``, ``seq_load_balancing_loss``, ``global_load_balancing_loss``),
    per layer, without its coefficient (the tracker holds the loss / ``moe_aux_loss_coeff``), averaged over the
    step's microbatches."""
    tokens_per_expert: dict[int, list[int]]
    """Tokens routed to each expert, summed over microbatches and ranks: each layer's sum is tokens x top-k
    (less what a capacity factor drops)."""


class RoutingStatistics:
    """Counts the tokens the routers of ``chunks`` send to each expert and reads megatron-core's per-layer
    load-balancing losses; ``take()`` after each step gives them (collectives: every rank calls it).

    Example::

        routing = RoutingStatistics(chunks)
        train_step(...)
        routing.take(num_microbatches).tokens_per_expert[1]    # [130, 120, 126, 136]: layer 1's four experts

    A router counts in training forwards only (grad enabled), the condition under which megatron-core tracks its
    aux loss: under full recompute the first forward runs without grad, so the recompute counts each token once.
    """

    def __init__(self, chunks: list[torch.nn.Module]):
        from megatron.core.transformer.moe.router import Router

        config = get_model_config(chunks[0])
        # Multi-token prediction modules are layers num_layers + 1, ... (each has a router in a MoE model).
        self.num_layers = config.num_layers + (getattr(config, "mtp_num_layers", None) or 0)
        self.num_experts = getattr(config, "num_moe_experts", None)
        self._counts: dict[int, torch.Tensor] = {}
        if self.num_experts is not None:
            from megatron_patch.compat import clear_moe_aux_losses

            # megatron-core's tracker is global: a model this process ran before (a forward outside train_step,
            # another run's last step) may have left values there, sized for its own number of layers.
            clear_moe_aux_losses()
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, Router):
                    module.register_forward_hook(self._count)

    def _count(self, router, inputs, outputs) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        counts = outputs[1].sum(dim=0)  # the routing map: tokens x experts, True where a token goes
        layer = router.layer_number
        self._counts[layer] = counts + self._counts[layer] if layer in self._counts else counts

    def take(self, num_microbatches: int) -> RoutingStep | None:
        """This step's routing over every rank, the counters cleared; None for a dense model."""
        from megatron_patch.compat import take_moe_aux_losses

        if self.num_experts is None:
            return None
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=device)
        for layer, found in self._counts.items():
            counts[layer - 1] = found
        self._counts.clear()
        # A MoE model trains with TP > 1 only under sequence parallelism (layout.check_layout), so each rank's
        # routers saw other tokens than its peers' (or, across pipeline stages, other layers): the sum over all
        # ranks is the step's.
        torch.distributed.all_reduce(counts)
        layers = [index + 1 for index in range(self.num_layers) if bool(counts[index].any())]
        # megatron-core's track_moe_metrics without its writers: summed over pipeline stages and TP x CP, averaged
        # over data-parallel ranks, scaled by 1 / microbatches as Megatron-LM's training_log does. Every rank
        # tracks the same names (each has MoE layers), so the reductions match up.
        losses = {}
        for name, tracked in take_moe_aux_losses().items():
            values = (tracked.float() / num_microbatches).tolist()
            losses[name] = {layer: values[layer - 1] for layer in layers}
        return RoutingStep(aux_losses=losses, tokens_per_expert={layer: counts[layer - 1].tolist() for layer in layers})


@dataclasses.dataclass
class StepStats:
    """What one optimiser step reports; ``loss`` (and ``input_tokens``) is None off the last pipeline stage;
    ``loss_scale`` is the scale after this step's update (1.0 without a loss scaler)."""

    loss: float | None
    grad_norm: float | None
    skipped: bool
    num_tokens: int
    loss_scale: float = 1.0
    input_tokens: int | None = None
    other_losses: dict[str, float] = dataclasses.field(default_factory=dict)
    """Losses the loss function reports beside "lm loss" (BERT's "sop loss"), averaged the same way, and a
    mixture-of-experts model's auxiliary losses, e.g. "load_balancing_loss" (Megatron-LM's names: the mean over its
    MoE layers)."""
    routing: RoutingStep | None = None
    """What a mixture-of-experts model's routers did in this step (None for a dense model)."""


def _reduce_loss_reports(reports: list[dict], input_tokens: int | None
                         ) -> tuple[float | None, int, int | None, dict[str, float]]:
    """Sum each ``{"lm loss": tensor([loss_sum, count]), ...}`` report of all microbatches and DP ranks, and this
    rank's ``input_tokens`` with them (one all-reduce, none at DP=1); returns (lm loss, its token count,
    input_tokens, the other reported losses), each loss its sum over its count."""
    if not reports:
        return None, 0, input_tokens, {}
    names = list(reports[0])
    sums = [torch.stack([report[name].detach().float() for report in reports]).sum(dim=0) for name in names]
    totals = sum_over_data_parallel([value for pair in sums for value in pair] + [input_tokens or 0],
                                    sums[0].device)
    losses = {name: totals[2 * i] / max(totals[2 * i + 1], 1.0) for i, name in enumerate(names)}
    num_tokens = int(totals[2 * names.index("lm loss") + 1])
    tokens = None if input_tokens is None else int(totals[-1])
    return losses.pop("lm loss"), num_tokens, tokens, losses


def optimizer_step(optimizer) -> tuple[bool, float | None, float]:
    """megatron-core's ``optimizer.step()``, except that a step whose gradients hold NaN/Inf is skipped in
    bf16/fp32 too; returns (updated, grad norm, loss scale), the norm None when skipped.

    Example::

        updated, grad_norm, loss_scale = optimizer_step(optimizer)   # (False, None, 1.0): NaN/Inf gradients

    The order is ``ChainedOptimizer.step``'s (megatron/core/optimizer/optimizer.py, 0.16.1): prepare the
    gradients (fp16: unscale them, find overflows, update the loss scale), take the global gradient norm, clip,
    step. A NaN/Inf in any gradient makes that norm NaN/Inf, and every rank gets the same norm: the gradients are
    already reduced over data-parallel ranks and the norm over the optimizer's gradient-statistics group (model-
    parallel ranks; all ranks with the distributed optimizer). So the check costs nothing beyond the norm that
    clipping needs anyway. A finite gradient whose norm overflows fp32 is skipped too (clipping by an infinite
    norm would zero it). The loss scale is read before the step as well: with every host sync ahead of the
    optimizer's kernels, GPUs run them while the host starts the next step.
    """
    found_inf = optimizer.prepare_grads()  # fp16: the loss scaler's verdict (the scale is updated already)
    loss_scale = float(optimizer.get_loss_scale())
    if found_inf:
        return False, None, loss_scale
    grad_norm = optimizer.get_grad_norm()
    if not math.isfinite(grad_norm):  # bf16/fp32: stepping would poison every weight and Adam's moments
        return False, None, loss_scale
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        parameters = [] if getattr(part, "is_stub_optimizer", False) else part.get_parameters()
        if parameters and part.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(parameters, part.config.clip_grad, grad_norm,
                                         part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return optimizer.step_with_ready_grads(), grad_norm, loss_scale


def train_step(
    forward_step_func: Callable,
    data_iterator: Iterator | list[Iterator],
    chunks: list[DistributedDataParallel],
    optimizer,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    scheduler=None,
    count_input_tokens: Callable[[], int] | None = None,
    empty_cache_level: int = 0,
    routing: RoutingStatistics | None = None,
) -> StepStats:
    """Forward and backward over ``num_microbatches`` microbatches, then one optimiser (and scheduler) step.

    ``forward_step_func(data_iterator, model)`` returns ``(output, loss_func)`` as in Megatron-LM, where
    ``loss_func(output)`` returns ``(loss_sum, num_tokens, {"lm loss": tensor([loss_sum, num_tokens])})``.
    ``count_input_tokens()``, called after the backward passes, gives this rank's input tokens of the step;
    ``StepStats.input_tokens`` is their sum over data-parallel ranks. ``empty_cache_level`` is Megatron-LM's
    ``--empty-unused-memory-level`` (GPUs): 1 empties the CUDA cache after the backward passes, 2 also after the
    optimizer step. ``routing`` (a mixture-of-experts model's) adds the step's ``RoutingStep`` and each auxiliary
    loss's mean over the MoE layers ("load_balancing_loss").
    """
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    reports = forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    # Read the loss before the optimizer step: on GPUs the host then waits for the backward it must wait for
    # anyway (the norm's .item() follows), and the optimizer's kernels overlap the next step's launch.
    input_tokens = None if count_input_tokens is None else count_input_tokens()
    loss, num_tokens, input_tokens, other_losses = (
        _reduce_loss_reports(reports, input_tokens)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        else (None, 0, None, {})
    )
    if getattr(get_model_config(chunks[0]), "mtp_num_layers", None) and parallel_state.is_pipeline_last_stage(
            ignore_virtual=True):
        other_losses = {**other_losses, **_take_mtp_losses(num_microbatches)}
    routed = None if routing is None else routing.take(num_microbatches)
    if routed is not None:
        # Megatron-LM logs each auxiliary loss as its mean over the MoE layers, under its tracker name.
        other_losses = {**other_losses, **{name: sum(per_layer.values()) / len(per_layer)
                                           for name, per_layer in routed.aux_losses.items() if per_layer}}
    if empty_cache_level >= 1:
        torch.cuda.empty_cache()
    update_successful, grad_norm, loss_scale = optimizer_step(optimizer)
    if empty_cache_level >= 2:
        torch.cuda.empty_cache()
    if update_successful and scheduler is not None:
        data_parallel_size = parallel_state.get_data_parallel_world_size()
        scheduler.step(increment=num_microbatches * micro_batch_size * data_parallel_size)
    return StepStats(
        loss=loss,
        grad_norm=None if grad_norm is None else float(grad_norm),
        skipped=not update_successful,
        num_tokens=num_tokens,
        loss_scale=loss_scale,
        input_tokens=input_tokens,
        other_losses=other_losses,
        routing=routed,
    )


def _take_mtp_losses(num_microbatches: int) -> dict[str, float]:
    """This step's multi-token prediction losses under Megatron-LM's names ("mtp_1 loss", ...): each module's loss
    (GPTModel's forward tracks the sum over microbatches of their means) averaged over microbatches and
    data-parallel ranks, as Megatron-LM's training_log does with ``track_mtp_metrics``; then cleared."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    if "values" not in MTPLossLoggingHelper.tracker:
        return {}
    MTPLossLoggingHelper.reduce_loss_in_tracker()
    values = (MTPLossLoggingHelper.tracker["values"] / num_microbatches).tolist()
    MTPLossLoggingHelper.clean_loss_in_tracker()
    return {f"mtp_{k + 1} loss": value for k, value in enumerate(values)}


def lm_loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Masked language-model loss in the three-value form megatron-core's schedules average per token."""
    loss_mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(per_token_loss.reshape(-1).float() * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}


def lm_forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """Forward step for causal LM batches ``{"tokens", "labels", "loss_mask", "position_ids"}``.

    The attention mask is left to the model's causal mask type (``AttnMaskType.causal``).
    """
    batch = next(data_iterator)
    # The loss mask also masks the multi-token prediction losses, which the model computes itself.
    per_token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                           loss_mask=batch["loss_mask"])
    return per_token_loss, lambda output: lm_loss_func(batch["loss_mask"], output)
