"""What both training backends share: the result of one step, the user's scheduler argument, ``torch.compile``.

Example::

    result = backend.step(forward, batches, num_microbatches=4, count_tokens=None)
    result.loss, result.grad_norm, result.skipped
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One optimiser step as the trainer logs it."""

    loss: float | None
    """Mean loss of the global batch (None off the last pipeline stage)."""
    grad_norm: float | None
    skipped: bool
    """The step had NaN/Inf gradients (or an fp16 overflow) and changed nothing."""
    loss_scale: float
    input_tokens: int | None
    """Input tokens of the global batch as counted by the trainer's counter (None: not counted)."""
    other_losses: dict[str, float]
    """Further losses the forward step reported (BERT's ``sop loss``)."""


def user_scheduler(lr_scheduler_fn, optimizer, default: Callable[[], object]):
    """``compose``'s ``lr_scheduler_fn``: None -> ``default()``; a factory such as
    ``partial(get_linear_schedule_with_warmup, ...)`` -> called with the optimizer; a scheduler -> itself."""
    if lr_scheduler_fn is None:
        return default()
    if callable(lr_scheduler_fn) and not hasattr(lr_scheduler_fn, "step"):
        return lr_scheduler_fn(optimizer=optimizer)
    return lr_scheduler_fn


def compile_forward(model: torch.nn.Module, backend: str, logger: logging.Logger) -> None:
    """``--onnx-runtime-training``: ONNX Runtime training is unmaintained upstream; compile instead."""
    logger.info(f"--onnx-runtime-training: ONNX Runtime training is unmaintained upstream, so the model's "
                f"forward is compiled with torch.compile(backend={backend!r}) instead")
    model.compile(backend=backend)
