"""Preemption: SIGTERM asks every rank to finish its iteration, save, and exit together.

Example::

    rapidformer --task pretraining ... --save ckpt --exit-signal-handler
    kill -TERM <pid of any rank>      # or the scheduler's SIGTERM to the whole job
    # -> " exiting on SIGTERM: saved iteration 37 to ckpt"; rerun with --load ckpt to continue exactly

The handler only records the signal; the trainer asks ``any_rank_received()`` after each iteration, an
all-reduce, so the ranks that got the signal and those that did not agree on the same last iteration (Megatron-LM's
``--exit-signal-handler`` works the same way).
"""

from __future__ import annotations

import signal

import torch


class ExitSignal:
    """Records ``signum`` (SIGTERM by default) instead of dying on it, until ``restore()``."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.received = False
        self._previous = signal.signal(signum, self._record)

    def _record(self, signum, frame) -> None:
        self.received = True

    def any_rank_received(self, device: torch.device) -> bool:
        flag = torch.tensor([int(self.received)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(self.signum, self._previous)
