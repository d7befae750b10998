"""The plain-torch / Hugging Face backend: any ``torch.nn.Module`` trained data-parallel under the memory mode of the
flags, with AdamW, loss scaling and the learning-rate schedule of the flags.

Example::

    backend = PlainBackend(config, device, logger)
    model, optimizer, scheduler = backend.compose(hf_model, None, None, train_iters=100)
    stats = backend.step(forward, batches, num_microbatches=4)       # one optimiser step
    backend.save("ckpt", 100, info=None, keep_last_k=None, async_queue=None, run_args={})

The memory modes (``MEMORY_WRAPPERS``): DDP, ZeRO-1 through torch's ZeroRedundancyOptimizer, ZeRO-2/3 and FSDP
through FSDP2's ``fully_shard``. ``--mixed-precision`` runs the forward under ``torch.autocast`` with fp32 weights
and a ``GradScaler`` for fp16, also on CPUs. The megatron-core backend (backends/megatron.py) has the same methods.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable

import torch

from megatron_patch.checkpoint.plain import load_plain_checkpoint, save_plain_checkpoint
from megatron_patch.distributed import sum_over_data_parallel
from megatron_patch.training.backends.common import Backend, StepResult, compile_forward, user_scheduler
from megatron_patch.training.config import RunConfig
from megatron_patch.training.metrics import CLASSIFICATION_LOSS, LM_LOSS
from megatron_patch.training.schedule import build_scheduler


class PlainOptimizer:
    """A torch optimizer with loss scaling and gradient clipping, stepping like megatron-core's optimizers.

    ``step()`` returns ``(update_successful, grad_norm, None)``. The loss is unscaled only when it went through
    ``engine.backward`` (a user script calling ``loss.backward()`` itself is not scaled, so nothing is undone).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: list, clip_grad: float,
                 scaler: torch.amp.GradScaler | None):
        self.optimizer = optimizer
        self.parameters = parameters
        self.clip_grad = clip_grad
        self.scaler = scaler
        self.scaled = False

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss
        self.scaled = True
        return self.scaler.scale(loss)

    def get_loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaled else 1.0

    def step(self):
        if self.scaled:
            self.scaler.unscale_(self.optimizer)
        grads = [p for p in self.parameters if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(grads, self.clip_grad if self.clip_grad > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor holding the global norm
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if not self.scaled:
            if not math.isfinite(grad_norm):  # bf16/fp32 have no scaler to skip a NaN/Inf step; skip it here
                return False, grad_norm, None
            self.optimizer.step()
            return True, grad_norm, None
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scaled = False
        # GradScaler skips the step and lowers the scale when gradients overflowed.
        return self.scaler.get_scale() >= scale, grad_norm, None

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)


class IterationScheduler:
    """megatron-core's ``OptimizerParamScheduler`` stepped once per optimiser step (``step()`` takes no count,
    as torch schedulers do, so user scripts can call it the usual way)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self, increment: int = 1):
        self.scheduler.step(increment)

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.scheduler.optimizer.param_groups]

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)


def _layer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a model (elements of every ModuleList): FSDP2's units of sharding."""
    return [layer for module in model.modules() if isinstance(module, torch.nn.ModuleList) for layer in module]


def _wrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    if torch.distributed.get_world_size() == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(model)


def _wrap_fsdp(model: torch.nn.Module, reshard_after_forward: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in _layer_modules(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


# memory mode -> how a plain/HF model is wrapped (see arguments.MEMORY_HELP for what each mode promises).
MEMORY_WRAPPERS: dict[str | None, Callable[[torch.nn.Module], torch.nn.Module]] = {
    None: _wrap_ddp,
    "zero-1": _wrap_ddp,
    "zero-2": functools.partial(_wrap_fsdp, reshard_after_forward=False),
    "zero-3": functools.partial(_wrap_fsdp, reshard_after_forward=True),
    "fsdp": functools.partial(_wrap_fsdp, reshard_after_forward=True),
}



def _plain_autocast_dtype(config: RunConfig) -> torch.dtype | None:
    return None if config.precision == "fp32" else config.parallel.params_dtype


# Flags that act on megatron-core's DDP, optimizer, scheduler or pipeline schedules: (flag, whether it is given).
_MEGATRON_ONLY_FLAGS = [
    ("--train-samples", lambda t: t.train_samples is not None),
    ("--rampup-batch-size", lambda t: t.rampup_batch_size is not None),
    ("--decoupled-lr", lambda t: t.decoupled_lr is not None),
    ("--calculate-per-token-loss", lambda t: t.calculate_per_token_loss),
    ("--overlap-grad-reduce", lambda t: t.overlap_grad_reduce),
    ("--cross-entropy-loss-fusion", lambda t: t.cross_entropy_loss_fusion),
]


def _is_sequence_classifier(model: torch.nn.Module) -> bool:
    """Whether ``model`` is (a subclass of) one of transformers' ``...ForSequenceClassification`` classes, as
    its auto-class registry lists them; a plain torch model is not."""
    classes = [c for c in type(model).__mro__ if c.__module__.startswith("transformers.")]
    if not classes:
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    return any(c.__name__ in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values() for c in classes)


def _ddp_no_sync(model, last: bool):
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


class PlainBackend(Backend):
    """Compose, step, evaluate, save and load a plain torch / Hugging Face model (see the module docstring)."""

    megatron = False

    def compose(self, model: torch.nn.Module, optimizer, lr_scheduler_fn, train_iters: int):
        config, training = self.config, self.config.training
        if config.parallel.tensor_model_parallel_size > 1 or config.parallel.pipeline_model_parallel_size > 1:
            raise SystemExit("rapidformer: error: --tensor-model-parallel-size/--pipeline-model-parallel-size need a "
                             "megatron-core model; plain torch/Hugging Face models train data-parallel only")
        for flag, given in _MEGATRON_ONLY_FLAGS:
            if given(training):
                raise SystemExit(f"rapidformer: error: {flag} acts on megatron-core models (their DDP, optimizer and "
                                 "sample-counted scheduler); drop it for plain torch/Hugging Face models")
        if config.lora.lora_rank is not None:
            raise SystemExit("rapidformer: error: --lora-rank adapts megatron-core models (convert a Hugging Face "
                             "model with megatron-patch convert hf-to-megatron and train it with --load DIR "
                             "--finetune); for plain torch/Hugging Face models use peft itself")
        if config.checkpointing.async_save:
            raise SystemExit("rapidformer: error: --async-save applies to megatron-core models (dist_checkpointing)"
                             "; drop it for plain torch/Hugging Face models")
        self.loss_name = CLASSIFICATION_LOSS if _is_sequence_classifier(model) else LM_LOSS
        model.to(self.device)
        if training.onnx_runtime_training:
            compile_forward(model, training.compile_backend, self.logger)
        model = MEMORY_WRAPPERS[training.memory_optimization](model)
        parameters = [p for p in model.parameters() if p.requires_grad]
        if optimizer is None:
            options = dict(lr=training.lr, betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_eps,
                           weight_decay=training.weight_decay)
            # The fused kernel exists on GPUs; foreach is the fast multi-tensor path on CPUs.
            options["fused" if self.device.type == "cuda" else "foreach"] = True
            if training.memory_optimization == "zero-1" and torch.distributed.get_world_size() > 1:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                optimizer = ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.AdamW, **options)
            else:
                optimizer = torch.optim.AdamW(parameters, **options)
        scaler = torch.amp.GradScaler(self.device.type, init_scale=min(training.initial_loss_scale, 2.0 ** 16)) \
            if self.config.precision == "fp16" else None
        wrapped = PlainOptimizer(optimizer, parameters, training.clip_grad, scaler)
        autocast = _plain_autocast_dtype(config)
        if autocast is not None:
            model.forward = torch.autocast(self.device.type, dtype=autocast)(model.forward)
        scheduler = user_scheduler(lr_scheduler_fn, optimizer,
                                   lambda: IterationScheduler(build_scheduler(training, optimizer, train_iters)))
        self.model, self.optimizer, self.scheduler = model, wrapped, scheduler
        return model, wrapped, scheduler

    def chunks(self) -> list:
        return [self.model]

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the loss scaled for fp16 (the optimizer unscales before stepping)."""
        self.optimizer.scale_loss(loss).backward()

    def step(self, forward: Callable, data_iterator, num_microbatches: int, count_tokens: Callable[[], int] | None
             ) -> StepResult:
        """One optimiser step over ``num_microbatches`` calls of ``forward(data_iterator, model) -> loss``, the
        gradients reduced once, after the last microbatch."""
        losses = []
        for index in range(num_microbatches):
            with _ddp_no_sync(self.model, last=index == num_microbatches - 1):
                loss = forward(data_iterator, self.model)
                self.backward(loss / num_microbatches)
            losses.append(loss.detach().float())  # kept on the device: one host sync per step, not per microbatch
        loss_scale = self.optimizer.get_loss_scale()
        success, grad_norm, _ = self.optimizer.step()
        if success:
            self.scheduler.step()
        self.optimizer.zero_grad()
        loss_sum, count, tokens = sum_over_data_parallel(
            [torch.stack(losses).sum(), len(losses), 0 if count_tokens is None else count_tokens()], self.device)
        return StepResult(loss_sum / count, grad_norm, not success, float(loss_scale),
                          None if count_tokens is None else int(tokens), {})

    def evaluation_losses(self, forward: Callable, data_iterator, eval_iters: int, num_microbatches: int
                          ) -> list[float] | None:
        """This rank's loss of each microbatch of ``eval_iters`` global batches, without gradients."""
        with torch.no_grad():
            return [forward(data_iterator, self.model).float().item()
                    for _ in range(eval_iters) for _ in range(num_microbatches)]

    def save(self, root: str, iteration: int, info, keep_last_k: int | None, async_queue, run_args: dict) -> str:
        return save_plain_checkpoint(root, iteration, self.model, self.optimizer, self.scheduler,
                                     keep_last_k=keep_last_k)

    def load(self, root: str, **options) -> int:
        return load_plain_checkpoint(root, self.model, self.optimizer, self.scheduler, **options)
