"""The megatron-core backend: model chunks under megatron-core's DDP (``Float16Module`` for fp16/bf16), its
optimizer (distributed with ``--use-distributed-optimizer`` or ``--zero-1/2-memory-optimization``), the
``OptimizerParamScheduler`` counted in samples and its pipeline schedules, as in Megatron-LM.

Example::

    backend = MegatronBackend(config, device, logger)
    chunks, optimizer, scheduler = backend.compose(gpt_model, None, None, train_iters=100)
    result = backend.step(run_forward_step, data_iterator, num_microbatches=4, count_tokens=None)

A trainer's ``run_forward_step(data_iterator, model)`` runs under megatron-core's schedules on every pipeline
stage (``forward_step``). On the last stage it returns the loss, or Megatron-LM's ``(output, loss_func)``. A
non-last stage computes no loss: there the hook is given a ``StageModel``, whose call hands the stage's output to
the schedule and ends the hook (``StageOutput``), so the same hook serves every stage; a hook that returns
``(output, loss_func)`` ends the same way.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from megatron_patch.checkpoint.megatron import load_megatron_checkpoint, save_megatron_checkpoint
from megatron_patch.model.forward import forward_only_step
from megatron_patch.training.backends.common import Backend, StepResult, compile_forward, user_scheduler
from megatron_patch.training.metrics import CLASSIFICATION_LOSS, LM_LOSS
from megatron_patch.training.schedule import build_scheduler


def is_megatron_model(model_obj) -> bool:
    from megatron.core.transformer.module import MegatronModule

    chunks = model_obj if isinstance(model_obj, (list, tuple)) else [model_obj]
    return all(isinstance(chunk, MegatronModule) for chunk in chunks)


class StageOutput(BaseException):
    """Ends a forward-step hook on a non-last pipeline stage, carrying the stage's output to the schedule. A
    ``BaseException``, as ``GeneratorExit`` is: a hook's ``except Exception`` must not swallow it (the stage's
    output would be lost and the schedule told the hook never called the model)."""

    def __init__(self, output):
        super().__init__("pipeline stage output")
        self.output = output


class StageModel:
    """The model as a non-last pipeline stage's hook sees it: calling it ends the hook with ``StageOutput``."""

    def __init__(self, model):
        self._model = model

    def __call__(self, *args, **kwargs):
        raise StageOutput(self._model(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._model, name)


def _mean_loss_func(loss: torch.Tensor):
    # megatron-core's legacy two-value form: the schedule divides by the number of microbatches. "lm loss" is the
    # key of the step's main loss in the schedule's reports (step.train_step reduces it; Megatron-LM's
    # tasks/finetune_utils.py reports classifiers under it too); the log names it by the model (loss_name).
    return loss, {"lm loss": torch.stack([loss.detach().float(), torch.ones((), device=loss.device)])}


def _is_sequence_classifier(chunk) -> bool:
    """Whether ``chunk`` is the megatron-core sequence classifier here (model/bert.py, built on BERT)."""
    from megatron_patch.model.bert import BertForSequenceClassification

    return isinstance(chunk, BertForSequenceClassification)


def holds_last_stage(chunk) -> bool:
    """Whether ``chunk`` holds the last pipeline stage (where the loss is computed)."""
    from megatron.core.utils import unwrap_model

    module = unwrap_model(chunk)
    # A sequence classifier keeps post_process off (no LM head) and marks its last stage with ``classify``.
    return getattr(module, "classify", getattr(module, "post_process", True))


class MegatronBackend(Backend):
    """Compose, step, evaluate, save and load megatron-core model chunks (see the module docstring)."""

    megatron = True
    lora_base: str | None = None
    """With --lora-rank: the base checkpoint directory the adapters are trained on (known once loaded)."""

    def compose(self, model_obj, optimizer, lr_scheduler_fn, train_iters: int):
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.utils import get_model_config

        from megatron_patch.training.step import RoutingStatistics, build_optimizer, wrap_model

        training = self.config.training
        if training.memory_optimization in ("zero-3", "fsdp"):
            raise SystemExit(
                f"rapidformer: error: --{training.memory_optimization}-memory-optimization shards parameters of "
                "plain/HF models only; for megatron models use --zero-2-memory-optimization (distributed optimizer) "
                "with --tensor-model-parallel-size/--pipeline-model-parallel-size"
            )
        chunks = list(model_obj) if isinstance(model_obj, (list, tuple)) else [model_obj]
        self.loss_name = CLASSIFICATION_LOSS if _is_sequence_classifier(chunks[0]) else LM_LOSS
        model_config = get_model_config(chunks[0])
        # The flags decide the precision even when the user's model was configured without it.
        fp16, bf16 = self.config.precision == "fp16", self.config.precision == "bf16"
        model_config.fp16, model_config.bf16 = fp16, bf16
        model_config.calculate_per_token_loss = training.calculate_per_token_loss
        model_config.cross_entropy_loss_fusion = training.cross_entropy_loss_fusion  # read by each forward's loss
        if training.fp8_format is not None:  # only where Transformer Engine and CUDA exist (ignored_flags.flag_notices)
            model_config.fp8, model_config.fp8_amax_history_len = training.fp8_format, training.fp8_amax_history_len
            model_config.fp8_amax_compute_algo = training.fp8_amax_compute_algo
        if fp16 or bf16:
            model_config.pipeline_dtype = self.config.parallel.params_dtype
        if training.onnx_runtime_training:
            for chunk in chunks:
                compile_forward(chunk, training.compile_backend, self.logger)
        self.grad_reduce_in_fp32 = fp16 or (bf16 and not training.grad_reduce_in_bf16)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=training.use_distributed_optimizer,
            grad_reduce_in_fp32=self.grad_reduce_in_fp32,
            overlap_grad_reduce=training.overlap_grad_reduce,
            overlap_param_gather=training.overlap_param_gather,
        )
        lora = self.config.lora.settings
        if lora is not None:
            from megatron_patch.model.lora import apply_lora

            # Before DDP and the optimizer: they take only the parameters that need gradients, the adapters.
            apply_lora(chunks, lora, seed=training.seed)
        model = wrap_model(chunks, ddp_config)
        self.routing = RoutingStatistics(model)
        if optimizer is None:
            optimizer = build_optimizer(model, OptimizerConfig(
                optimizer="adam", lr=training.lr, min_lr=training.min_lr, weight_decay=training.weight_decay,
                adam_beta1=training.adam_beta1, adam_beta2=training.adam_beta2, adam_eps=training.adam_eps,
                clip_grad=training.clip_grad, fp16=fp16, bf16=bf16,
                params_dtype=model_config.params_dtype, loss_scale=training.loss_scale,
                initial_loss_scale=training.initial_loss_scale,
                use_distributed_optimizer=training.use_distributed_optimizer,
                decoupled_lr=training.decoupled_lr, decoupled_min_lr=training.decoupled_min_lr,
            ))
        scheduler = user_scheduler(lr_scheduler_fn, optimizer, lambda: build_scheduler(
            training, optimizer, train_iters, unit=training.global_batch_size))
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        return model, optimizer, scheduler

    def chunks(self) -> list:
        return self.model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def forward_step(self, forward: Callable) -> Callable:
        """``forward(data_iterator, model) -> loss`` (or ``(output, loss_func)``) as a megatron-core schedule's
        forward step on every pipeline stage (see the module docstring)."""

        def forward_step(data_iterator, model):
            if holds_last_stage(model):
                result = forward(data_iterator, model)
                if isinstance(result, tuple):
                    return result
                if self.config.training.calculate_per_token_loss:
                    raise SystemExit("rapidformer: error: --calculate-per-token-loss sums the loss over the global "
                                     "batch's tokens: run_forward_step must return (output, loss_func) with "
                                     "loss_func giving (loss_sum, num_tokens, report), not a mean loss")
                return result, _mean_loss_func
            try:
                forward(data_iterator, StageModel(model))
            except StageOutput as stage:
                return stage.output, _mean_loss_func
            raise RuntimeError("run_forward_step returned without calling the model on a non-last pipeline stage")

        return forward_step

    def step(self, forward: Callable, data_iterator, num_microbatches: int, count_tokens: Callable[[], int] | None
             ) -> StepResult:
        """One optimiser step over ``num_microbatches`` through megatron-core's pipeline schedule."""
        from megatron_patch.training.step import train_step

        training = self.config.training
        stats = train_step(self.forward_step(forward), data_iterator, self.model, self.optimizer, num_microbatches,
                           self.config.data.seq_length or 1, training.micro_batch_size, scheduler=self.scheduler,
                           count_input_tokens=count_tokens, empty_cache_level=training.empty_unused_memory_level,
                           routing=self.routing)
        return StepResult(stats.loss, stats.grad_norm, stats.skipped, stats.loss_scale, stats.input_tokens,
                          stats.other_losses, stats.routing)

    def evaluation_losses(self, forward: Callable, data_iterator, eval_iters: int, num_microbatches: int
                          ) -> list[float] | None:
        """The loss of each microbatch of ``eval_iters`` global batches on the last pipeline stage; None on the
        other stages."""
        from megatron.core import parallel_state

        losses = []
        for _ in range(eval_iters):
            reports = forward_only_step(self.model, data_iterator, self.forward_step(forward), num_microbatches,
                                        self.config.data.seq_length, self.config.training.micro_batch_size)
            # [loss_sum, count] per microbatch: token sums from (output, loss_func) hooks, a mean and 1 from hooks
            # that return the loss.
            losses += [r["lm loss"][0].item() / max(r["lm loss"][1].item(), 1.0) for r in reports]
        return losses if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None

    @contextlib.contextmanager
    def parameters_in_sync(self):
        """With ``--overlap-param-gather`` the updated parameters arrive during the next forward pass; saving or
        evaluating needs them now (Megatron-LM's disable_forward_pre_hook around both). "In sync" means per group:
        a mixture of experts' routed experts differ across expert-parallel ranks by design and agree within their
        expert-data-parallel group, whose buffers megatron-core's DDP keeps apart and gathers over that group."""
        overlapped = self.config.training.overlap_param_gather
        if overlapped:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=True)
        try:
            yield
        finally:
            if overlapped:
                for chunk in self.model:
                    chunk.enable_forward_pre_hook()

    def save(self, root: str, iteration: int, info, keep_last_k: int | None, async_queue, run_args: dict) -> str:
        lora = self.config.lora.settings
        options = dict(keep_last_k=keep_last_k, async_queue=async_queue, run_args=run_args,
                       fully_reshardable=self.config.checkpointing.dist_ckpt_optim_fully_reshardable)
        if lora is not None:
            from megatron_patch.checkpoint.lora import save_lora_checkpoint

            return save_lora_checkpoint(root, iteration, self.model, self.optimizer, self.scheduler, info, lora,
                                        self.lora_base, **options)
        return save_megatron_checkpoint(root, iteration, self.model, self.optimizer, self.scheduler, info, **options)

    def load(self, root: str, **options) -> int:
        options["fully_parallel"] = self.config.checkpointing.ckpt_fully_parallel_load
        lora = self.config.lora.settings
        if lora is not None:
            from megatron_patch.checkpoint.lora import load_lora_checkpoint

            iteration, self.lora_base = load_lora_checkpoint(root, self.model, self.optimizer, self.scheduler, lora,
                                                             **options)
            return iteration
        return load_megatron_checkpoint(root, self.model, self.optimizer, self.scheduler, **options)
