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
A step whose gradients hold NaN/Inf is skipped (``StepStats.skipped``): in fp16 megatron-core's loss scaler finds
the overflow (and lowers the scale); in bf16/fp32 there is no scaler, so ``train_step`` looks itself.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron_patch.distributed import record_progress


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
    config = get_model_config(chunks[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = _finalize_model_grads
    ddp_config = chunks[0].ddp_config
    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
        if len(chunks) == 1:
            config.no_sync_func = config.no_sync_func[0]
    return optimizer


def _finalize_model_grads(*args, **kwargs):
    # This rank's backward is done; should the reduction below time out, the ranks that never got here are the
    # ones their peers waited for (megatron_patch.distributed.progress_report).
    record_progress()
    return finalize_model_grads(*args, **kwargs)


@dataclasses.dataclass
class StepStats:
    """What one optimiser step reports; ``loss`` is None off the last pipeline stage."""

    loss: float | None
    grad_norm: float | None
    skipped: bool
    num_tokens: int


def _reduce_loss_reports(reports: list[dict]) -> tuple[float | None, int]:
    """Sum the ``{"lm loss": tensor([loss_sum, num_tokens])}`` reports of all microbatches and DP ranks."""
    if not reports:
        return None, 0
    total = torch.stack([report["lm loss"].detach().float() for report in reports]).sum(dim=0)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    loss_sum, num_tokens = total.tolist()
    return loss_sum / max(num_tokens, 1.0), int(num_tokens)


def gradients_are_finite(chunks: list[DistributedDataParallel]) -> bool:
    """True when no rank holds a NaN/Inf gradient (every rank gets the same answer: one all-reduce over the
    world, since tensor- and pipeline-parallel ranks hold different parameters)."""
    bad = torch.zeros(1, device=chunks[0].buffers[0].grad_data.device)
    for chunk in chunks:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            bad += (~torch.isfinite(buffer.grad_data)).any()
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    return not bad.item()


def train_step(
    forward_step_func: Callable,
    data_iterator: Iterator | list[Iterator],
    chunks: list[DistributedDataParallel],
    optimizer,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    scheduler=None,
) -> StepStats:
    """Forward and backward over ``num_microbatches`` microbatches, then one optimiser (and scheduler) step.

    ``forward_step_func(data_iterator, model)`` returns ``(output, loss_func)`` as in Megatron-LM, where
    ``loss_func(output)`` returns ``(loss_sum, num_tokens, {"lm loss": tensor([loss_sum, num_tokens])})``.
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
    if get_model_config(chunks[0]).fp16 or gradients_are_finite(chunks):
        update_successful, grad_norm, _ = optimizer.step()
    else:  # an update with NaN/Inf gradients would poison every weight (and Adam's moments)
        update_successful, grad_norm = False, None
    if update_successful and scheduler is not None:
        data_parallel_size = parallel_state.get_data_parallel_world_size()
        scheduler.step(increment=num_microbatches * micro_batch_size * data_parallel_size)
    loss, num_tokens = (
        _reduce_loss_reports(reports)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        else (None, 0)
    )
    return StepStats(
        loss=loss,
        grad_norm=None if grad_norm is None else float(grad_norm),
        skipped=not update_successful,
        num_tokens=num_tokens,
    )


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
    per_token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return per_token_loss, lambda output: lm_loss_func(batch["loss_mask"], output)
