"""Preemption: SIGTERM asks every rank to finish its iteration, save, and exit together.

Example::

    rapidformer --task pretraining ... --save ckpt --exit-signal-handler
    kill -TERM <pid of the launcher>      # or the scheduler's SIGTERM to the whole process group
    # -> " exiting on signal 15: saved iteration 37 to ckpt", status 0; rerun with --load ckpt to continue exactly

The launcher passes the signal on to its ranks once (``RanksForward``): torch's elastic agent starts each rank in a
session of its own, so a signal to the launcher's process group never reaches them. A rank's handler
(``ExitSignal``) only records the signal; the trainer asks ``any_rank_received()`` after each iteration, an
all-reduce, so the ranks that got the signal and those that did not agree on the same last iteration (Megatron-LM's
``--exit-signal-handler`` works the same way).
"""

from __future__ import annotations

import os
import signal
import sys

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


class RanksForward:
    """The launcher's SIGTERM and Ctrl-C (SIGINT). The first SIGTERM goes to every rank (this process's children),
    which finish their iteration, save and exit 0 with ``--exit-signal-handler``. A first Ctrl-C does the same, as
    SIGTERM, when the ranks save on it (``ctrl_c_saves``: the recipes set ``--exit-signal-handler``); otherwise, or
    for a second signal, or one before any rank started, it raises torch's ``SignalException``, on which the elastic
    agent stops the ranks where they are (that signal, then SIGKILL after its shutdown timeout:
    elastic/agent/server/api.py, ``run``).

    Example::

        forward = RanksForward(ctrl_c_saves=True)
        try:
            torch.distributed.run.run(args)     # the elastic agent, in this process
        finally:
            forward.restore()

    Ctrl-C reaches only the launcher (and the shell around it): torch's agent starts each rank in a session of its
    own, away from the terminal's process group.
    """

    def __init__(self, ctrl_c_saves: bool = False):
        self.ctrl_c_saves = ctrl_c_saves
        self.signum: int | None = None  # the first one passed on
        self.forwarded = False
        self._previous = {signum: signal.signal(signum, self._forward) for signum in (signal.SIGTERM, signal.SIGINT)}

    def _forward(self, signum, frame) -> None:
        import psutil
        from torch.distributed.elastic.multiprocessing.api import SignalException

        ranks = psutil.Process().children()
        if self.forwarded or not ranks or (signum == signal.SIGINT and not self.ctrl_c_saves):
            raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))
        self.forwarded, self.signum = True, signum
        if signum == signal.SIGINT:
            print("\nrapidformer: Ctrl-C: the ranks stop after this iteration and save it; Ctrl-C again stops "
                  "them at once", file=sys.stderr, flush=True)
        for rank in ranks:
            # The rank alone, not its process group: dist_checkpointing's writer processes share that group and
            # must live on to write the save this signal asks for.
            try:
                os.kill(rank.pid, signal.SIGTERM)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
