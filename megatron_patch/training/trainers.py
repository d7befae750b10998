"""Rapidformer's trainer templates: subclass, fill in the hooks, call ``train()``.

Example::

    class MyPretrainer(Pretrainer):
        def train_valid_test_datasets_provider(self, train_val_test_num_samples):
            return build_train_valid_test_datasets(...)
        def model_optimizer_lr_scheduler_provider(self):
            return build_model_chunks(...), None, None          # None: optimizer and scheduler from the flags
        def run_forward_step(self, data_iterator, model):
            ...; return loss

    MyPretrainer(engine=RapidformerEngine()).train()

The trainers hold the loop (iterations, evaluation, saves, exits) and the hooks; how a model is composed, stepped,
evaluated, saved and loaded is its backend's (training/backends/): megatron-core models train through
megatron-core's pipeline schedules, so the same hooks run under TP, PP and virtual PP (``run_forward_step``
returns the loss, or Megatron-LM's ``(output, loss_func)``; backends/megatron.py says how a non-last stage runs
it); plain torch and Hugging Face models train data-parallel under the memory mode of the flags. The loop reads
the typed run configuration (``self.config``); ``self.args`` is the user hooks' view of the same flags.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import os
import time
from collections.abc import Mapping

import torch
from torch.utils.data import default_collate

from megatron_patch.distributed import record_progress, sum_over_data_parallel
from megatron_patch.checkpoint.format import (
    checkpoint_dir, no_checkpoint_notice, read_tracker, recorded_train_samples,
)
from megatron_patch.training.engine import Engine
from megatron_patch.training.metrics import RoutingLog, TrainingLog
from megatron_patch.training.schedule import consumed_samples


class MissingHook(TypeError):
    """A trainer subclass lacks a hook its template needs."""


class TrainingStopped(SystemExit):
    """Training gave up on purpose (NaN/Inf gradients for ``--max-bad-steps`` steps in a row); the message says
    why and which checkpoint is the last good one. The launcher prints it and exits non-zero."""


def _all_reduce_mean(values: list[float], device) -> float:
    """The mean of ``values`` over all data-parallel ranks' values."""
    total, count = sum_over_data_parallel([sum(values), len(values)], device)
    return total / count


def count_input_tokens(batch) -> int:
    """Token positions in a batch, padding included: what the model computes on, counted as Megatron-LM
    (``seq_length`` x batch) and Hugging Face's Trainer (``num_input_tokens_seen``: ``input_ids.numel()``) do.

    Example::

        >>> count_input_tokens({"input_ids": torch.zeros(4, 128, dtype=torch.long), "labels": torch.zeros(4)})
        512

    A dict-like batch's ``input_ids`` (Hugging Face) or ``tokens`` (Megatron); otherwise the first integer
    tensor of two or more dimensions (batch x sequence) in the batch; 0 when there is none.
    """
    if isinstance(batch, Mapping):
        for key in ("input_ids", "tokens"):
            if key in batch:
                return batch[key].numel()
        values = list(batch.values())
    else:
        values = list(batch) if isinstance(batch, (list, tuple)) else [batch]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point():
            return value.numel()
    return 0


class _TokenCounter:
    """The input tokens of the batches a Finetuner's forward steps took since the last ``take()``."""

    def __init__(self):
        self.tokens = 0

    def take(self) -> int:
        tokens, self.tokens = self.tokens, 0
        return tokens


def _hook(method):
    """Mark a template's placeholder hook, so ``check_hooks`` can tell it from the user's."""
    method.template_default = True
    return method


class _Trainer:
    HOOKS: tuple[str, ...] = ()
    LOSS_NAME: str | None = None
    """The loss's name in the log, TensorBoard and W&B, where it is not the model's (a DPO trainer's "dpo loss")."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.args = engine.args  # the flags under Megatron-LM's names, for the user's hooks
        self.config = engine.config
        self.model = self.optimizer = self.lr_scheduler = None
        self.backend = None  # set by _compose: backends.MegatronBackend or backends.PlainBackend
        self.iteration = 0
        self.consumed_samples = 0  # samples of the iterations done (Megatron-LM's consumed_train_samples)
        self.skipped_samples = 0  # Megatron-LM's skipped_train_samples of the run resumed; this one skips none
        self._last_saved = None  # the iteration of the last save (so nothing is saved twice)
        self._bad_steps = 0  # consecutive steps skipped for NaN/Inf gradients (bf16/fp32)
        self._exit_signal = None  # signals.ExitSignal with --exit-signal-handler
        self._async_saves = None  # megatron-core's AsyncCallsQueue (run in threads) with --async-save
        # The megatron model's description, written next to each save (so megatron-to-hf can export it); set by
        # a model provider that knows its ModelConfig (checkpoint.trainer.trained_model_info).
        self.checkpoint_info = None

    # -- the user's side --------------------------------------------------------------------------------
    @_hook
    def train_valid_test_datasets_provider(self, *args):
        raise MissingHook("train_valid_test_datasets_provider")

    @_hook
    def model_optimizer_lr_scheduler_provider(self):
        raise MissingHook("model_optimizer_lr_scheduler_provider")

    @_hook
    def run_forward_step(self, batch_or_iterator, model):
        raise MissingHook("run_forward_step")

    def after_load(self) -> None:
        """Optional: runs once the model is built and its checkpoint loaded, before the first step (a DPO trainer
        computes its reference log-probabilities here)."""

    # -- helpers user scripts call ----------------------------------------------------------------------
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.engine.gather(tensor)

    def build_data_loader(self, dataset, batch_size: int | None = None, collate_fn=None, shuffle: bool = True):
        return self.engine.build_data_loader(dataset, batch_size=batch_size, collate_fn=collate_fn, shuffle=shuffle)

    # -- the engine room --------------------------------------------------------------------------------
    def check_hooks(self) -> None:
        """Refuse a subclass that lacks a hook, naming it (before any work starts)."""
        missing = [h for h in self.HOOKS if getattr(getattr(type(self), h), "template_default", False)]
        if missing:
            raise MissingHook(
                f"{type(self).__name__} must define {', '.join(missing)} (the {type(self).__bases__[0].__name__} "
                "template calls it); see the Rapidformer API"
            )

    @property
    def megatron(self) -> bool:
        """Whether the model is megatron-core's (known once the model provider ran)."""
        return self.backend is not None and self.backend.megatron

    def _compose(self, train_iters: int) -> None:
        model, optimizer, scheduler = self.model_optimizer_lr_scheduler_provider()
        self.model, self.optimizer, self.lr_scheduler = self.engine.compose(
            model, optimizer, scheduler, train_iters=train_iters)
        self.backend = self.engine.backend
        checkpoints = self.config.checkpointing
        if checkpoints.async_save:
            from megatron_patch.checkpoint.async_save import async_save_queue

            self._async_saves = async_save_queue()
        if self.config.training.exit_signal_handler:
            from megatron_patch.training.signals import ExitSignal

            self._exit_signal = ExitSignal()
        if checkpoints.load and (read_tracker(checkpoints.load) is not None
                                 or checkpoints.exit_on_missing_checkpoint):
            self.iteration = self.backend.load(
                checkpoints.load, load_optim=not checkpoints.no_load_optim, load_rng=not checkpoints.no_load_rng,
                finetune=checkpoints.finetune, load_fallback=checkpoints.load_fallback,
                verify_checksums=not checkpoints.no_verify_checksums, logger=self.engine.logger)
        elif os.path.isfile(os.path.join(checkpoints.load or "", "config.json")):
            # A user script's Hugging Face model (the launcher refuses one for --task): the script loads it.
            self.engine.logger.info(f" --load {checkpoints.load} holds a Hugging Face model (config.json): left to "
                                    "the script (get_args().load), not loaded as a checkpoint")
        elif checkpoints.load:
            self.engine.logger.warning(no_checkpoint_notice(checkpoints.load))
        if self.iteration:
            # The loaded checkpoint holds this state: a run that trains no further saves nothing (it wrote the
            # loaded iteration again, into a new --save directory too).
            self._last_saved = self.iteration
        if self.iteration >= train_iters:
            self.engine.logger.info(f" nothing left to train: --load {checkpoints.load} is at iteration "
                                    f"{self.iteration} and --train-iters is {train_iters}; give a larger "
                                    "--train-iters to train on")
        self.consumed_samples, self.skipped_samples = self._resumed_samples()
        self.after_load()

    def _resumed_samples(self) -> tuple[int, int]:
        """Megatron-LM's ``consumed_train_samples`` and ``skipped_train_samples`` at the loaded iteration: as the
        checkpoint's args record them (a ramp-up or a change of --global-batch-size makes them differ from the
        iteration times this run's batch), else the samples this run's schedule takes in as many iterations."""
        recorded = (recorded_train_samples(checkpoint_dir(self.config.checkpointing.load, self.iteration))
                    if self.iteration else None)
        return recorded or (consumed_samples(self.config.training, self.iteration), 0)

    def _chunks(self) -> list:
        return self.backend.chunks()

    def _run(self, forward, data_iterator, train_iters: int, log: TrainingLog, after_step=None,
             counter: _TokenCounter | None = None) -> bool:
        """Train up to ``train_iters``; returns True when an exit signal, ``--exit-interval`` or
        ``--exit-duration-in-mins`` stopped it (after saving: ``_exit_reason``). Without a token ``counter`` every
        sample counts ``--seq-length`` tokens (Megatron-LM's pretraining count). Each iteration takes the global
        batch megatron-core's microbatch calculator gives for the samples consumed so far (``--rampup-batch-size``);
        after it come the interval's save, the manual collection and the exit rules, each its own method."""
        from megatron.core.num_microbatches_calculator import (
            get_current_global_batch_size, get_num_microbatches, update_num_microbatches,
        )

        training = self.config.training
        for chunk in self._chunks():
            chunk.train()
        if training.manual_gc:
            # Collect at the same points on every rank, not when each rank's allocation count says (Megatron-LM's
            # --manual-gc: stragglers from unaligned collections slow every collective).
            gc.disable()
            gc.collect()
        update_num_microbatches(self.consumed_samples, consistency_check=False)
        routing = RoutingLog(log)
        while self.iteration < train_iters:
            self._follow_batch_rampup()
            num_microbatches, batch_size = get_num_microbatches(), get_current_global_batch_size()
            self._profile(start=True)
            start = time.perf_counter()
            result = self.backend.step(forward, data_iterator, num_microbatches,
                                       None if counter is None else counter.take)
            self.iteration += 1
            self.consumed_samples += batch_size
            elapsed = time.perf_counter() - start
            record_progress(self.iteration)
            self._profile(start=False)
            tokens = batch_size * (self.config.data.seq_length or 0) if counter is None else result.input_tokens
            log.step(self.iteration, self.consumed_samples, self._lr(), result.loss, result.grad_norm,
                     result.loss_scale, result.skipped, elapsed, tokens or 0, batch_size, result.other_losses)
            routing.step(self.iteration, result.routing)
            self._count_bad_step(result.skipped)
            if after_step is not None:
                after_step(self.iteration)
            self._save_on_interval()
            self._collect_garbage()
            reason = self._exit_reason()
            if reason is not None:
                self._finish_saves()
                self.engine.logger.info(f" exiting {reason}")
                return True
        return False

    def _follow_batch_rampup(self) -> None:
        """megatron-core's microbatch calculator to the samples consumed (``--rampup-batch-size``); Megatron-LM saves
        where the ramp-up changes the batch."""
        from megatron.core.num_microbatches_calculator import get_num_microbatches, update_num_microbatches

        before = get_num_microbatches()
        update_num_microbatches(self.consumed_samples, consistency_check=True)
        if get_num_microbatches() != before and self.config.checkpointing.save:
            self.save()

    def _save_on_interval(self) -> None:
        """``--save-interval``'s save; an asynchronous save finished meanwhile is finalized (without waiting)."""
        save, interval = self.config.checkpointing.save, self.config.checkpointing.save_interval
        if save and interval and self.iteration % interval == 0:
            self.save()
        if self._async_saves is not None:
            self._async_saves.maybe_finalize_async_calls(blocking=False)

    def _collect_garbage(self) -> None:
        """``--manual-gc-interval``: a collection on every rank at the same iterations."""
        training = self.config.training
        if training.manual_gc and training.manual_gc_interval and self.iteration % training.manual_gc_interval == 0:
            gc.collect()

    def _exit_reason(self) -> str | None:
        """Why the run stops after this iteration (the end of the log line ``exiting ...``), or None: an exit signal
        on any rank (``--exit-signal-handler``), ``--exit-interval`` (Megatron-LM's: save if --save, then stop;
        training.py's train, core_v0.16.1) or ``--exit-duration-in-mins``. The signal and the duration are agreed by
        a collective, which every rank runs in this order."""
        training, save = self.config.training, self.config.checkpointing.save
        saved = f", saved to {save}" if save else ""
        if self._exit_signal is not None and self._exit_signal.any_rank_received(self.engine.device):
            return f"on signal {self._exit_signal.signum}: saved iteration {self.iteration} to {save}"
        if training.exit_interval and self.iteration % training.exit_interval == 0:
            return f"at iteration {self.iteration} (--exit-interval {training.exit_interval}){saved}"
        if training.exit_duration_in_mins and self._out_of_time():
            minutes = training.exit_duration_in_mins
            return f"after --exit-duration-in-mins {minutes} at iteration {self.iteration}{saved}"
        return None

    def _out_of_time(self) -> bool:
        """Whether any rank has run longer than ``--exit-duration-in-mins`` (all ranks agree, so all stop)."""
        minutes = (time.time() - self.engine.start_time) / 60.0
        done = torch.tensor([int(minutes > self.config.training.exit_duration_in_mins)], device=self.engine.device)
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)
        return bool(done.item())

    def _profile(self, start: bool) -> None:
        """``--profile`` (GPUs; ignored_flags.flag_notices turns it off elsewhere): CUDA's profiler runs from the
        start of iteration ``--profile-step-start`` to the end of ``--profile-step-end``, on ``--profile-ranks``."""
        training = self.config.training
        if not training.profile or torch.distributed.get_rank() not in training.profile_ranks:
            return
        if start and self.iteration == training.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        elif not start and self.iteration == training.profile_step_end:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())

    def _count_bad_step(self, skipped: bool) -> None:
        """fp16 skips overflowing steps as a matter of course (the loss scaler adapts); in bf16/fp32 a skipped
        step had NaN/Inf gradients, and ``--max-bad-steps`` of them in a row stop the run."""
        training, save = self.config.training, self.config.checkpointing.save
        self._bad_steps = self._bad_steps + 1 if skipped and self.config.precision != "fp16" else 0
        if self._bad_steps < training.max_bad_steps:
            return
        self._wait_for_saves()
        first = self.iteration - self._bad_steps + 1
        latest = read_tracker(save) if save else None
        kept = (f"the last checkpoint, iteration {latest} under --save {save}, is intact: resume from it "
                "with --load" if latest is not None else "no checkpoint was saved")
        raise TrainingStopped(
            f"rapidformer: error: iterations {first}-{self.iteration} had NaN/Inf gradients ({self._bad_steps} "
            f"consecutive steps, --max-bad-steps {training.max_bad_steps}); none of them changed the weights (a save "
            f"after one holds the weights from before it); {kept}; lower --lr or check the data around consumed sample "
            f"{consumed_samples(training, first - 1)}"
        )

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def save(self) -> str:
        self._last_saved = self.iteration
        checkpoints = self.config.checkpointing
        with self.backend.parameters_in_sync():
            return self.backend.save(checkpoints.save, self.iteration, self.checkpoint_info, checkpoints.keep_last_k,
                                     self._async_saves, self._megatron_lm_run_args())

    def _megatron_lm_run_args(self) -> dict:
        """What Megatron-LM's ``args`` in a save need from the run, not the model (its resume reads
        ``consumed_train_samples``). Validation restarts at its first sample on our resume, so 0 valid samples."""
        training = self.config.training
        return dict(consumed_train_samples=self.consumed_samples, skipped_train_samples=self.skipped_samples,
                    consumed_valid_samples=0,
                    tokenizer_type=self.config.tokenizer_type, global_batch_size=training.global_batch_size,
                    micro_batch_size=training.micro_batch_size,
                    virtual_pipeline_model_parallel_size=self.config.parallel.virtual_pipeline_model_parallel_size,
                    expert_model_parallel_size=self.config.parallel.expert_model_parallel_size,
                    expert_tensor_parallel_size=self.config.parallel.expert_tensor_parallel_size,
                    train_iters=training.train_iters, data_parallel_size=training.data_parallel_size,
                    # What lays out the distributed optimizer's buckets, which its default checkpoint format keeps
                    # (`megatron-patch checkpoint reshard` builds them again from these).
                    use_distributed_optimizer=training.use_distributed_optimizer,
                    overlap_grad_reduce=training.overlap_grad_reduce,
                    accumulate_allreduce_grads_in_fp32=self.backend.grad_reduce_in_fp32,
                    decoupled_lr=training.decoupled_lr, decoupled_min_lr=training.decoupled_min_lr)

    def _wait_for_saves(self) -> None:
        """Publish every asynchronous save still being written (a no-op without --async-save)."""
        if self._async_saves is not None:
            self._async_saves.maybe_finalize_async_calls(blocking=True)

    def _finish_saves(self) -> None:
        """Save the current iteration unless that is done, and wait until every save is published."""
        if self.config.checkpointing.save and self._last_saved != self.iteration:
            self.save()
        self._wait_for_saves()

    def _finish(self, log: TrainingLog) -> None:
        logging = self.config.logging
        self._finish_saves()
        if self._exit_signal is not None:
            self._exit_signal.restore()
        if self.config.training.manual_gc:
            gc.enable()
        directory = logging.log_dir or logging.tensorboard_dir or self.config.checkpointing.save
        if directory and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            log.plot(os.path.join(directory, "loss_curves.png"))
        log.close()

    def _log(self, train_iters: int, flops_per_sample: float | None = None) -> TrainingLog:
        logging = self.config.logging
        # The last rank holds the last pipeline stage, so the loss: it keeps the per-iteration record and writes
        # the TensorBoard scalars (Megatron-LM's get_tensorboard_writer: rank world_size - 1).
        world_size = torch.distributed.get_world_size()
        last = torch.distributed.get_rank() == world_size - 1
        record = os.path.join(logging.log_dir, "iterations.jsonl") if logging.log_dir and last else None
        return TrainingLog(self.engine.logger, logging.log_interval, train_iters, flops_per_sample,
                           logging.tensorboard_dir if last else None, record_path=record, world_size=world_size,
                           loss_name=self.LOSS_NAME or self.backend.loss_name,
                           wandb_options=self._wandb_options() if last else None)

    def _wandb_options(self) -> dict | None:
        """``wandb.init``'s arguments for ``--wandb-project`` (Megatron-LM's _set_wandb_writer: the run under
        ``--wandb-save-dir``, by default ``--save``'s wandb/, with the run's settings as its config)."""
        logging = self.config.logging
        if logging.wandb_project is None:
            return None
        settings = {name: value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
                    for name, value in vars(self.engine.args).items()}
        options = dict(project=logging.wandb_project, name=logging.wandb_exp_name, config=settings,
                       dir=logging.wandb_save_dir or os.path.join(self.config.checkpointing.save, "wandb"))
        return {**options, "entity": logging.wandb_entity} if logging.wandb_entity else options


def _pretraining_batches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                         device):
    """Megatron-LM's pretraining sampler: each global step takes the next micro x DP samples in order, this
    rank its slice; resuming at ``consumed_samples`` continues exactly where a run stopped."""
    index = consumed_samples
    while True:
        start = index + dp_rank * micro_batch_size
        batch = default_collate([dataset[i % len(dataset)] for i in range(start, start + micro_batch_size)])
        yield {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(device)
        index += micro_batch_size * dp_size


class Pretrainer(_Trainer):
    """Pretraining for ``train_iters`` steps from datasets sized by the template (Megatron-LM's loop).

    Hooks: ``train_valid_test_datasets_provider(train_val_test_num_samples)``,
    ``model_optimizer_lr_scheduler_provider()``, ``run_forward_step(data_iterator, model)``.
    """

    HOOKS = ("train_valid_test_datasets_provider", "model_optimizer_lr_scheduler_provider", "run_forward_step")

    def _iterators(self, dataset, consumed: int):
        from megatron.core import parallel_state

        if dataset is None:
            return None
        # Only TP rank 0 reads data; the hook broadcasts it (mpu.broadcast_data), as in Megatron-LM.
        if self.megatron and parallel_state.get_tensor_model_parallel_rank() != 0:
            return None if len(self._chunks()) == 1 else [None] * len(self._chunks())
        make = lambda: _pretraining_batches(  # noqa: E731
            dataset, consumed, self.config.training.micro_batch_size, parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(), self.engine.device)
        # Each virtual pipeline chunk reads its own copy of the stream, in step with the others.
        return make() if len(self._chunks()) == 1 else [make() for _ in self._chunks()]

    def _flops_per_sample(self) -> float | None:
        seq_length = self.config.data.seq_length
        if not (self.megatron and seq_length and self.config.model.described):
            return None
        from megatron_patch.model import num_floating_point_operations
        from megatron_patch.training.models import model_config_and_vocab

        # The formula counts the logit layer over the padded vocabulary (Megatron-LM: args.padded_vocab_size): the
        # model provider's record of what it built, else the model the flags describe, padded by the rule that
        # builds it (model_config_and_vocab).
        if self.checkpoint_info is not None:
            info = self.checkpoint_info
            return num_floating_point_operations(info.model_config, 1, seq_length, info.padded_vocab_size)
        loaded, tokenizer = self.config.checkpoint_info, self.engine.tokenizer if self.config.tokenizer_type else None
        if loaded is None and tokenizer is None:
            return None  # no vocabulary to count the logit layer over
        family = loaded.model_config.family if loaded is not None else self.config.model.family or "gpt"
        try:
            config, vocab = model_config_and_vocab(self.config, tokenizer, family)
        except (ValueError, TypeError):  # the flags describe no model (the user's provider built its own)
            return None
        return num_floating_point_operations(config, 1, seq_length, vocab)

    def evaluate(self, data_iterator) -> float | None:
        """Mean validation loss over ``--eval-iters`` global batches (None off the last pipeline stage)."""
        training = self.config.training
        with self.backend.parameters_in_sync(), self._collected_around(training.manual_gc and training.manual_gc_eval):
            return self._evaluate(data_iterator)

    @staticmethod
    @contextlib.contextmanager
    def _collected_around(collect: bool):
        # --manual-gc: evaluation allocates its own tensors; collect before and after it (Megatron-LM's
        # --manual-gc-eval, on by default).
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect()

    def _evaluate(self, data_iterator) -> float | None:
        for chunk in self._chunks():
            chunk.eval()
        with torch.no_grad():
            losses = self.backend.evaluation_losses(self.run_forward_step, data_iterator,
                                                    self.config.logging.eval_iters,
                                                    self.config.training.num_microbatches)
        for chunk in self._chunks():
            chunk.train()
        return None if losses is None else _all_reduce_mean(losses, self.engine.device)

    def train(self) -> TrainingLog:
        self.check_hooks()
        training, logging = self.config.training, self.config.logging
        train_iters = training.train_iters
        if not train_iters:
            raise SystemExit("rapidformer: error: a Pretrainer needs --train-iters")
        self._compose(train_iters)
        gbs = training.global_batch_size
        evals = (train_iters // logging.eval_interval + 1) if logging.eval_interval else 0
        train_ds, valid_ds, _ = self.train_valid_test_datasets_provider(
            [training.train_samples or train_iters * gbs, evals * logging.eval_iters * gbs, logging.eval_iters * gbs])
        if evals:
            # Only the ranks that build datasets know whether the split left validation documents; all must agree,
            # since every rank takes part in each evaluation.
            has_valid = torch.tensor([float(valid_ds is not None)], device=self.engine.device)
            torch.distributed.all_reduce(has_valid, op=torch.distributed.ReduceOp.MAX)
            evals = evals if has_valid.item() else 0
        train_iterator = self._iterators(train_ds, self.consumed_samples)
        valid_iterator = self._iterators(valid_ds, 0) if evals else None
        log = self._log(train_iters, self._flops_per_sample())

        def after_step(iteration: int):
            # Not `valid_iterator is not None`: TP ranks other than 0 have no iterator (rank 0 broadcasts each
            # batch) but must evaluate with it, or rank 0 waits in the broadcast for ever.
            if evals and iteration % logging.eval_interval == 0:
                loss = self.evaluate(valid_iterator)
                if loss is not None:
                    log.validation(iteration, loss)

        self._run(self.run_forward_step, train_iterator, train_iters, log, after_step)
        self._finish(log)
        return log


class Finetuner(_Trainer):
    """Fine-tuning over epochs with an evaluation after each (and every ``--eval-interval`` iterations); a run
    resumed with ``--load`` goes on in the epoch, and at the batch, where the checkpoint was taken.

    Hooks: ``train_valid_test_datasets_provider()`` returning ``(train, valid, test, collate_fn)``,
    ``model_optimizer_lr_scheduler_provider()``, ``run_forward_step(batch, model)`` and
    ``run_compute_metrics(model, eval_dataloader)`` (``model`` is a list of model chunks, as in Rapidformer).
    """

    HOOKS = ("train_valid_test_datasets_provider", "model_optimizer_lr_scheduler_provider", "run_forward_step",
             "run_compute_metrics")

    @_hook
    def run_compute_metrics(self, model, eval_dataloader):
        raise MissingHook("run_compute_metrics")

    def train(self) -> TrainingLog:
        self.check_hooks()
        training = self.config.training
        if training.train_samples is not None or training.rampup_batch_size is not None:
            raise SystemExit("rapidformer: error: --train-samples/--rampup-batch-size schedule pretraining (a "
                             "Pretrainer); fine-tuning counts --epochs or --train-iters")
        train_ds, valid_ds, _, collate_fn = self.train_valid_test_datasets_provider()
        train_loader = self.build_data_loader(train_ds, collate_fn=collate_fn)
        eval_loader = self.build_data_loader(valid_ds, collate_fn=collate_fn, shuffle=False) if valid_ds else None
        steps_per_epoch = max(1, len(train_loader) // training.num_microbatches)
        epochs = training.epochs or math.ceil((training.train_iters or steps_per_epoch) / steps_per_epoch)
        train_iters = training.train_iters or epochs * steps_per_epoch
        self._compose(train_iters)
        log = self._log(train_iters)
        self.metrics: list[dict] = []
        counter = _TokenCounter()

        def counted(batches):
            for batch in batches:
                counter.tokens += count_input_tokens(batch)
                yield batch

        def forward(batches, model):
            return self.run_forward_step(next(batches), model)

        interval = self.config.logging.eval_interval

        def after_step(iteration: int):
            if eval_loader is not None and interval and iteration % interval == 0:
                log.evaluation(iteration, self._compute_metrics(eval_loader))

        # A resumed run goes on in the epoch it stopped in, after the batches it took there (Megatron-LM's
        # tasks/finetune_utils.py: start_epoch, start_iteration); each epoch's shuffle depends on its number only.
        for epoch in range(self.iteration // steps_per_epoch, epochs):
            if self.iteration >= train_iters:  # a run resumed from its last iteration has nothing left to do
                break
            train_loader.set_epoch(epoch)
            done = self.iteration - epoch * steps_per_epoch
            # Under virtual pipelining each model chunk reads the same batches from a stream of its own.
            streams = [itertools.islice(train_loader, done * training.num_microbatches, None)
                       for _ in self._chunks()]
            streams[0] = counted(streams[0])
            batches = streams[0] if len(streams) == 1 else streams
            if self._run(forward, batches, min(train_iters, (epoch + 1) * steps_per_epoch), log, after_step,
                         counter=counter):
                break
            if eval_loader is not None:
                values = self._compute_metrics(eval_loader)
                self.metrics.append(values)
                log.metrics(epoch, values)
        self._finish(log)
        return log

    def _compute_metrics(self, eval_loader) -> dict:
        """``run_compute_metrics`` on the model in eval mode, its parameters up to date; back to training after."""
        for chunk in self._chunks():
            chunk.eval()
        with self.backend.parameters_in_sync():
            values = self.run_compute_metrics(self._chunks(), eval_loader)
        for chunk in self._chunks():
            chunk.train()
        return values


PreTrainer = Pretrainer
