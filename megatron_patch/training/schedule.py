"""Megatron-LM's training schedule counted in samples: the global batch of each iteration (a ramp-up through
megatron-core's ``num_microbatches_calculator``), the iterations ``--train-samples`` makes, and the learning-rate
scheduler.

Example::

    rapidformer --task pretraining ... --micro-batch-size 2 --global-batch-size 16 --rampup-batch-size 4 4 48 \
        --train-samples 256 --lr-warmup-samples 32 --lr-decay-samples 224

    configure_batch_schedule(args, rank=0, data_parallel_size=2)   # sets args.train_iters from --train-samples
    consumed_samples(args, 3)                                       # 12: the first 3 iterations took 4 samples each

Iterations follow Megatron-LM's ``update_train_iters`` and the scheduler its ``get_optimizer_param_scheduler``
(megatron/training/training.py, core_v0.16.1): the scheduler counts samples, so a ramp-up's small batches move
the learning rate less than full ones.
"""

from __future__ import annotations

import argparse
import math

from megatron.core.num_microbatches_calculator import (
    destroy_num_microbatches_calculator,
    get_current_global_batch_size,
    init_num_microbatches_calculator,
    update_num_microbatches,
)


def configure_batch_schedule(args: argparse.Namespace, rank: int, data_parallel_size: int) -> None:
    """Set up megatron-core's microbatch calculator for this run (once per engine) and, with
    ``--train-samples``, ``args.train_iters``."""
    step = args.micro_batch_size * data_parallel_size
    if args.rampup_batch_size is not None:
        start, increment, _ = args.rampup_batch_size
        if start % step or increment % step:
            raise SystemExit(
                f"rapidformer: error: --rampup-batch-size START {start} and INCR {increment} must be multiples of "
                f"--micro-batch-size {args.micro_batch_size} x data-parallel size {data_parallel_size}"
            )
    # A second engine in the same process (tests, notebooks) configures its own run.
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
                                     data_parallel_size)
    if args.train_samples is not None:
        ramp = _rampup_batch_sizes(args, args.train_samples)
        # The constant phase drops a partial last batch, as Megatron-LM does.
        args.train_iters = len(ramp) + max(0, args.train_samples - sum(ramp)) // args.global_batch_size


def _rampup_batch_sizes(args: argparse.Namespace, limit: float) -> list[int]:
    """Global batch sizes of the iterations that start within the ramp-up (at most ``limit`` samples consumed);
    every later iteration takes ``--global-batch-size``."""
    if args.rampup_batch_size is None:
        return []
    sizes, consumed = [], 0
    while consumed <= min(args.rampup_batch_size[2], limit):
        update_num_microbatches(consumed, consistency_check=False)
        sizes.append(get_current_global_batch_size())
        consumed += sizes[-1]
    update_num_microbatches(0, consistency_check=False)
    return sizes


def consumed_samples(args: argparse.Namespace, iteration: int) -> int:
    """Samples the first ``iteration`` iterations took (where a resumed run's data continues)."""
    ramp = _rampup_batch_sizes(args, math.inf)[:iteration]
    return sum(ramp) + (iteration - len(ramp)) * args.global_batch_size


def build_scheduler(args: argparse.Namespace, optimizer, train_iters: int, unit: int = 1):
    """megatron-core's OptimizerParamScheduler from the flags, stepped in ``unit``\\ s per iteration (megatron
    models: samples, ``unit`` = the global batch; plain models: iterations, ``unit`` = 1). With
    ``--train-samples`` every count is already in samples."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if args.train_samples is not None:
        decay_steps = args.lr_decay_samples or args.train_samples
        wd_incr_steps = args.train_samples
        warmup = args.lr_warmup_samples
    else:
        decay_steps = (args.lr_decay_iters or train_iters) * unit
        wd_incr_steps = train_iters * unit
        warmup = args.lr_warmup_iters * unit
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay_steps
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else args.lr, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(decay_steps, warmup + 1), lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=wd_incr_steps, wd_incr_style="constant",
    )
