"""What both training backends share: their interface (``Backend``), the result of one step, the user's scheduler
argument, ``torch.compile``.

Example::

    result = backend.step(forward, batches, num_microbatches=4, count_tokens=None)
    result.loss, result.grad_norm, result.skipped
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Callable

import torch

from megatron_patch.training.config import RunConfig

if TYPE_CHECKING:
    from megatron_patch.training.step import RoutingStep


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
    """Further losses the forward step reported (BERT's ``sop loss``; a mixture-of-experts model's
    ``load_balancing_loss``)."""
    routing: RoutingStep | None = None
    """A mixture-of-experts model's routing of the step (training/step.py ``RoutingStep``)."""


class Backend:
    """How the trainers drive a model: ``compose`` it with its optimizer and scheduler, take a ``step``, compute
    ``evaluation_losses``, ``save`` and ``load`` checkpoints. One subclass per kind of model
    (backends/megatron.py, backends/plain.py); the trainers hold the loop and the hooks, never the kind.
    """

    megatron: bool
    """Whether the models are megatron-core's (their checkpoints are torch_dist, their flags megatron-core's)."""
    loss_name: str
    """What the log calls the training loss: "classification loss" for a sequence classifier, else "lm loss" (set
    by ``compose``, which sees the model)."""
    grad_reduce_in_fp32: bool = False
    """Whether 16-bit gradients are reduced in fp32 (megatron-core's DDP buffers; set by the megatron backend's
    ``compose``), which checkpoints record as Megatron-LM's ``accumulate_allreduce_grads_in_fp32``."""

    def __init__(self, config: RunConfig, device: torch.device, logger: logging.Logger):
        self.config = config
        self.device = device
        self.logger = logger
        self.model = self.optimizer = self.scheduler = None

    def compose(self, model, optimizer, lr_scheduler_fn, train_iters: int) -> tuple:
        """``(model, optimizer, scheduler)`` ready to train under the run's precision, memory mode and layout."""
        raise NotImplementedError

    def chunks(self) -> list:
        """The composed model as a list of modules (one per virtual pipeline stage)."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self, forward: Callable, data_iterator, num_microbatches: int, count_tokens: Callable[[], int] | None
             ) -> "StepResult":
        raise NotImplementedError

    def evaluation_losses(self, forward: Callable, data_iterator, eval_iters: int, num_microbatches: int
                          ) -> list[float] | None:
        raise NotImplementedError

    @contextlib.contextmanager
    def parameters_in_sync(self):
        """A block in which every parameter holds its updated value (saving, evaluating)."""
        yield

    def save(self, root: str, iteration: int, info, keep_last_k: int | None, async_queue, run_args: dict) -> str:
        raise NotImplementedError

    def load(self, root: str, **options) -> int:
        raise NotImplementedError


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
