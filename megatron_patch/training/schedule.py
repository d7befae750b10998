"""Megatron-LM's training schedule counted in samples: the global batch of each iteration (a ramp-up through
megatron-core's ``num_microbatches_calculator``), where a resumed run's data continues, and the learning-rate
scheduler.

Example::

    rapidformer --task pretraining ... --micro-batch-size 2 --global-batch-size 16 --rampup-batch-size 4 4 48 \
        --train-samples 256 --lr-warmup-samples 32 --lr-decay-samples 224

    configure_batch_schedule(config.training, rank=0)   # megatron-core's calculator for this run
    consumed_samples(config.training, 3)                # 12: the first 3 iterations took 4 samples each

Iterations follow Megatron-LM's ``update_train_iters`` (training/config.py computes them) and the scheduler its
``get_optimizer_param_scheduler`` (megatron/training/training.py, core_v0.16.1): the scheduler counts samples, so a
ramp-up's small batches move the learning rate less than full ones.
"""

from __future__ import annotations

import logging
import math

from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_patch.compat import init_num_microbatches_calculator
from megatron_patch.errors import UserError
from megatron_patch.training.config import TrainingConfig, rampup_batch_sizes


def configure_batch_schedule(training: TrainingConfig, rank: int) -> None:
    """Set up megatron-core's microbatch calculator for this run (once per engine)."""
    # A second engine in the same process (tests, notebooks) configures its own run.
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(rank, training.rampup_batch_size, training.global_batch_size,
                                     training.micro_batch_size, training.data_parallel_size)


def consumed_samples(training: TrainingConfig, iteration: int) -> int:
    """Samples the first ``iteration`` iterations took (where a resumed run's data continues)."""
    ramp = rampup_batch_sizes(training.global_batch_size, training.micro_batch_size, training.data_parallel_size,
                              training.rampup_batch_size, math.inf)[:iteration]
    return sum(ramp) + (iteration - len(ramp)) * training.global_batch_size


# OptimizerParamScheduler._check_and_set's names (megatron/core/optimizer_param_scheduler.py, core_v0.16.1 and
# core_v0.19.0) of the values counted in steps, which a resume's message shows in iterations.
_STEP_COUNTS = ("warmup iterations", "total number of iterations", "total number of weight decay iterations")


class ResumableScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler, whose resume follows Megatron-LM's flags and says which schedule won.

    Example::

        scheduler = build_scheduler(config.training, optimizer, train_iters=20, unit=8)
        scheduler.load_state_dict(checkpoint["opt_param_scheduler"])
        # [rapidformer] learning-rate schedule on resume, from the flags (--override-opt_param-scheduler): ...

    With neither ``--override-opt_param-scheduler`` nor ``--use-checkpoint-opt_param-scheduler``, a checkpoint whose
    schedule differs from the flags' (a longer ``--train-iters``) is refused in one line naming both flags, where
    Megatron-LM's ``_check_and_set`` asserts; megatron-core's own default (``use_checkpoint=True``) would keep the
    checkpoint's schedule without a word.
    """

    def __init__(self, *args, unit: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.unit = unit
        self._differences: list[str] = []

    def _check_and_set(self, cls_value, sd_value, name: str):
        if cls_value != sd_value and not (self.override_opt_param_scheduler
                                          or self.use_checkpoint_opt_param_scheduler):
            self._differences.append(f"{name} {self._shown(sd_value, name)} in the checkpoint, "
                                     f"{self._shown(cls_value, name)} from the flags")
            return cls_value
        return super()._check_and_set(cls_value, sd_value, name)

    def _shown(self, value, name: str):
        return value / self.unit if name in _STEP_COUNTS and isinstance(value, (int, float)) else value

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume from ``state_dict``, refusing a changed schedule unless a flag says which one wins, and log the
        schedule in effect (the last rank)."""
        self._differences = []
        super().load_state_dict(state_dict)
        if self._differences:
            raise UserError(
                f"the checkpoint's learning-rate schedule differs from the flags' ({'; '.join(self._differences)}): "
                "give --override-opt_param-scheduler to use the flags' schedule or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's (Megatron-LM refuses it too)")
        source = ("from the flags (--override-opt_param-scheduler)" if self.override_opt_param_scheduler
                  else "from the checkpoint (--use-checkpoint-opt_param-scheduler)"
                  if self.use_checkpoint_opt_param_scheduler else "the checkpoint's and the flags' agree")
        # The engine's logger, which the last rank writes (as Megatron-LM's print_rank_last).
        logging.getLogger("rapidformer").info(
            f"learning-rate schedule on resume, {source}: lr {self.max_lr:g}, min lr {self.min_lr:g}, warmup "
            f"{self.lr_warmup_steps / self.unit:g} iterations, {self.lr_decay_style} decay over "
            f"{self.lr_decay_steps / self.unit:g} iterations")


def build_scheduler(training: TrainingConfig, optimizer, train_iters: int, unit: int = 1) -> ResumableScheduler:
    """megatron-core's OptimizerParamScheduler from the flags, stepped in ``unit``\\ s per iteration (megatron
    models: samples, ``unit`` = the global batch; plain models: iterations, ``unit`` = 1). With
    ``--train-samples`` every count is already in samples."""
    t = training
    if t.train_samples is not None:
        decay_steps = t.lr_decay_samples or t.train_samples
        wd_incr_steps = t.train_samples
        warmup = t.lr_warmup_samples
    else:
        decay_steps = (t.lr_decay_iters or train_iters) * unit
        wd_incr_steps = train_iters * unit
        warmup = t.lr_warmup_iters * unit
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay_steps
    return ResumableScheduler(
        optimizer, init_lr=t.lr_warmup_init if warmup else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(decay_steps, warmup + 1), lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=wd_incr_steps, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=t.override_opt_param_scheduler, unit=unit,
    )
