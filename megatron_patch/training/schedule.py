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

import math

from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

from megatron_patch.compat import init_num_microbatches_calculator
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


def build_scheduler(training: TrainingConfig, optimizer, train_iters: int, unit: int = 1):
    """megatron-core's OptimizerParamScheduler from the flags, stepped in ``unit``\\ s per iteration (megatron
    models: samples, ``unit`` = the global batch; plain models: iterations, ``unit`` = 1). With
    ``--train-samples`` every count is already in samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(decay_steps, warmup + 1), lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=wd_incr_steps, wd_incr_style="constant",
    )
