"""The ``rapidformer`` command: check the flags once, then start one process per GPU with torch's elastic launcher.

Example::

    export CUDA_VISIBLE_DEVICES=0,1,2,3 MASTER_ADDR=localhost MASTER_PORT=6010 NNODES=1 NODE_RANK=0
    rapidformer --user-script my_trainer.py --micro-batch-size 16 --mixed-precision
    python -m megatron_patch.training.launcher --task pretraining --nproc-per-node 2 ...   # on CPUs

The flags and the parallel layout (``arguments.run_config``) are checked in the launcher's process, so a run that
cannot start ends in one ``rapidformer: error: ...`` line before any rank does. ``torchrun_command`` is the one
builder of torchrun command lines (``megatron-patch convert``'s verification uses it too). The elastic agent
(torchrun) runs inside the launcher (``run_torchrun``), so the launcher is the one process that a signal has to
reach. Each rank runs ``python -m megatron_patch.training.launcher --rank-entry ...``: the user script (as
``__main__``, with ``from megatron import mpu`` available; see ``run_user_script``) or the ``--task``. A rank ends
through ``megatron_patch.distributed.exit_rank`` (a normal interpreter exit after gloo sometimes aborts).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import sys
import traceback
import types
from typing import Callable

from megatron_patch.errors import UserError, debugging, describe, one_line_errors
from megatron_patch.training.arguments import parse_flags, parse_run, run_config

_RANK_ENTRY = "--rank-entry"
# The launcher's pid, in its ranks' environment: a rank whose launcher died while it started ends (_run_rank).
_LAUNCHER_PID = "MEGATRON_PATCH_LAUNCHER_PID"

# When a rank fails, the others get SIGTERM and, SHUTDOWN_SECONDS later, SIGKILL (torch's default, 30 s, was waited
# out by every hung or stopped rank with a SIGTERM handler); the failing ranks' report is written by then
# (distributed.report_failure). SIGTERM is the launcher's own (signals.RanksForward), not torchrun's: torchrun would
# answer it by stopping the ranks and exit 1 even after they saved.
SHUTDOWN_SECONDS = 5


def torchrun_settings() -> list[str]:
    """The flags every torchrun command of ours carries: the signals its agent handles, and SHUTDOWN_SECONDS where
    this torch's torchrun takes it as a flag (``compat.torchrun_shutdown_flags``)."""
    from megatron_patch.compat import torchrun_shutdown_flags
    from megatron_patch.startup import paused_collector

    with paused_collector():  # asking torchrun's parser can be the launcher's first import of torch (startup.py)
        shutdown = torchrun_shutdown_flags(SHUTDOWN_SECONDS)
    # SIGTERM and SIGINT are the launcher's (signals.RanksForward): torchrun's handler would stop the ranks at once.
    return ["--signals-to-handle=SIGHUP,SIGQUIT", *shutdown]


def processes_per_node(requested: int | None) -> int:
    if requested:
        return requested
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return len([d for d in visible.split(",") if d.strip()])
    import torch

    return max(1, torch.cuda.device_count())


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (either ``--flag V`` or ``--flag=V``)."""
    result, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        elif not item.startswith(flag + "="):
            result.append(item)
    return result


def torchrun_command(module: str, module_args: list[str], nproc_per_node: int,
                     this_host_only: bool = False) -> list[str]:
    """The ``python -m torch.distributed.run`` command line (for ``run_torchrun``) that runs ``python -m module
    module_args`` in ``nproc_per_node`` processes on each node.

    Example::

        torchrun_command("megatron_patch.convert.cli", ["verify", "--hf-dir", "hf", ...], 2, this_host_only=True)

    The nodes meet as the seed's scripts say: NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT (default one node,
    127.0.0.1 and a free port). ``this_host_only`` keeps a job that is one step of a local command (a conversion's
    verification) on this host whatever NNODES says; MASTER_PORT still applies.
    """
    from megatron_patch.distributed import free_port  # here: distributed.py imports torch, which --help needs not

    nodes = {} if this_host_only else os.environ
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nodes.get('NNODES', '1')}", f"--node-rank={nodes.get('NODE_RANK', '0')}",
        f"--master-addr={nodes.get('MASTER_ADDR', '127.0.0.1')}",
        f"--master-port={os.environ.get('MASTER_PORT') or free_port()}",
        *torchrun_settings(), "-m", module, *module_args,
    ]


def launch_command(argv: list[str]) -> list[str]:
    """The torch.distributed.run command line for ``argv``, validated first: errors name the flag, and a layout the
    processes cannot hold is refused here, before any starts."""
    flags = parse_flags(argv)
    if not flags.task and not flags.user_script:
        raise SystemExit("rapidformer: error: give --task (black-box) or --user-script FILE (white-box)")
    if flags.user_script and not os.path.isfile(flags.user_script):
        raise SystemExit(f"rapidformer: error: --user-script {flags.user_script}: no such file")
    nproc_per_node = processes_per_node(flags.nproc_per_node)
    nnodes = os.environ.get("NNODES", "1")
    # torchrun also takes an elastic MIN:MAX, which leaves the world size open until the nodes meet.
    run_config(flags, nproc_per_node * int(nnodes) if nnodes.isdigit() else None, launcher=True)
    return torchrun_command("megatron_patch.training.launcher", [_RANK_ENTRY, *_without(argv, "--nproc-per-node")],
                            nproc_per_node)


def prepare_nodes():
    """For a job of several nodes (NNODES > 1): the ranks' network interface chosen and said, node 0's rendezvous
    probed, and the ``nodes.JobFate`` watching the other nodes; None on one node.

    Example::

        fate = prepare_nodes()    # NNODES=2 NODE_RANK=1 MASTER_ADDR=10.201.0.1 MASTER_PORT=6010
        # rapidformer: node 1 of 2 reaches MASTER_ADDR=10.201.0.1 through veth1 (10.201.0.2): GLOO_SOCKET_IFNAME=...
    """
    from megatron_patch.startup import paused_collector
    from megatron_patch.training import nodes

    nnodes = os.environ.get("NNODES", "1")
    if not nnodes.isdigit() or int(nnodes) < 2:
        return None
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port or not port.isdigit():
        raise UserError(f"NNODES={nnodes} needs MASTER_ADDR (node 0's address) and MASTER_PORT (one free port, the "
                        f"same on every node)")
    node_rank = os.environ.get("NODE_RANK", "0")
    if not node_rank.isdigit() or int(node_rank) >= int(nnodes):
        raise UserError(f"NODE_RANK must be an integer from 0 to NNODES-1 ({int(nnodes) - 1}), got {node_rank!r}: set "
                        f"it to this node's place, 0 on the node at MASTER_ADDR")
    node_rank = int(node_rank)
    print(f"rapidformer: node {node_rank} of {nnodes} {nodes.choose_socket_interfaces(address)}", flush=True)
    if node_rank:
        waiting = nodes.probe_master(address, int(port))
        if waiting:
            print(f"rapidformer: {waiting}", flush=True)
    with paused_collector():
        import torch.distributed
    try:
        return nodes.JobFate(node_rank, int(nnodes), address, int(port))
    except torch.distributed.DistNetworkError as error:
        raise UserError(f"MASTER_PORT={port} cannot be served on node 0 ({describe(error)}): choose a free port "
                        f"and set it on every node") from None


def run_torchrun(command: list[str], fate=None, left: Callable[[], str] | None = None,
                 ctrl_c_saves: bool = False) -> int:
    """Run a ``python -m torch.distributed.run ...`` command line in this process; returns the job's exit status.

    Example::

        run_torchrun(torchrun_command("my_module", ["--flag", "1"], nproc_per_node=2))

    The first SIGTERM goes on to the ranks and the job ends as they do (0 after their save with
    ``--exit-signal-handler``, 143 if they stopped on it); a second one stops them (status 143). A Ctrl-C does the
    same, as SIGTERM to the ranks, when they save on it (``ctrl_c_saves``), and ends in 130 with the checkpoint to
    resume from; otherwise it stops them where they are. A failed job is
    summed up in one line; torchrun's own table names the first rank to exit as the "root cause", which after a hang
    is a rank that waited for it. With a ``nodes.JobFate`` (a job of several nodes) the line names the node that
    failed first, on every node. A job stopped by a signal says which, and ``left()`` what it left to resume
    from (the launcher's: the latest checkpoint under --save).
    """
    from megatron_patch.startup import paused_collector

    with paused_collector():
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from megatron_patch.compat import shorten_elastic_shutdown
    from megatron_patch.training.signals import RanksForward

    shorten_elastic_shutdown(SHUTDOWN_SECONDS)
    assert command[1:3] == ["-m", "torch.distributed.run"], command
    args = torchrun.parse_args(command[3:])
    # For the ranks only (torchrun hands them this environment): a process that runs this function and goes on (a
    # rank relaunching convert verify, the test suite's rank pools) must not leave its pid there for ranks it does
    # not start, which would take it for a launcher that died and end themselves.
    outer = os.environ.get(_LAUNCHER_PID)
    os.environ[_LAUNCHER_PID] = str(os.getpid())
    # torchrun's own default for several processes a node, set here so that it need not print a 4-line banner
    # about it (torch/distributed/run.py, ``config_from_args``); a value of the user's is kept.
    threads_given = "OMP_NUM_THREADS" in os.environ
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    forward = RanksForward(ctrl_c_saves)
    failed = False
    try:
        torchrun.run(args)
        if forward.signum == signal.SIGINT:
            # The ranks saved on a Ctrl-C and ended together: the run did not finish, and its resume is said.
            failed = True
            print(f"rapidformer: stopped by Ctrl-C (SIGINT){_left(left)}", file=sys.stderr, flush=True)
            return 128 + signal.SIGINT
    except ChildFailedError as error:
        failed = True
        if forward.forwarded:
            # The ranks ended on the SIGTERM passed on to them (no --exit-signal-handler, or a command with nothing
            # to save, such as convert verify): the job was stopped, as a scheduler asked, not broken.
            stopped = (f"stopped by signal {forward.signum} ({signal.Signals(forward.signum).name}): "
                       f"{_describe_failures(error.failures)}{_left(left)}")
            if fate:
                fate.failed(stopped)
            print(f"rapidformer: {stopped}", file=sys.stderr, flush=True)
            return 128 + forward.signum
        failure = _describe_failures(error.failures)
        print(f"rapidformer: the job failed: {fate.failed(failure) if fate else failure}", file=sys.stderr,
              flush=True)
        return 1
    except SignalException as error:
        failed = True
        # A Ctrl-C the ranks do not save on, a second Ctrl-C or SIGTERM (or SIGHUP, SIGQUIT): torchrun's agent
        # stopped the ranks where they were.
        stopped = f"stopped by signal {int(error.sigval)} ({signal.Signals(error.sigval).name}){_left(left)}"
        if fate:
            fate.failed(stopped)
        print(f"rapidformer: {stopped}", file=sys.stderr, flush=True)
        return 128 + int(error.sigval)
    finally:
        if not threads_given:
            os.environ.pop("OMP_NUM_THREADS", None)
        if outer is None:
            os.environ.pop(_LAUNCHER_PID, None)
        else:
            os.environ[_LAUNCHER_PID] = outer
        forward.restore()
        if fate:
            fate.stop(failed)
    return 0


def _left(left: Callable[[], str] | None) -> str:
    return f"; {left()}" if left is not None else ""


def latest_checkpoint(save: str | None) -> str:
    """What a stopped run leaves to resume from: the latest checkpoint under ``save`` (``--save``), if any.

    Example::

        latest_checkpoint("ckpt")    # 'the latest checkpoint is iteration 20 in ckpt: resume with --load ckpt'
    """
    from megatron_patch.checkpoint.format import read_tracker

    if save is None:
        return "nothing was saved (no --save)"
    latest = read_tracker(save)
    if latest is None:
        return f"no checkpoint was saved to {save}"
    return f"the latest checkpoint is iteration {latest} in {save}: resume with --load {save}"


def _describe_failures(failures: dict) -> str:
    """``{rank: ProcessFailure}`` as ``rank 0 exited with status 1; rank 1 was killed by SIGKILL``."""
    parts = []
    for rank, failure in sorted(failures.items()):
        if failure.exitcode < 0:
            parts.append(f"rank {rank} was killed by {signal.Signals(-failure.exitcode).name}")
        else:
            parts.append(f"rank {rank} exited with status {failure.exitcode}")
    return "; ".join(parts)


def _run_rank(argv: list[str]) -> int:
    """One rank's work: the user script or the task. Returns the exit status."""
    from megatron_patch import compat
    from megatron_patch.startup import import_libraries

    # torch's elastic agent starts each rank in a session of its own (elastic/multiprocessing/subprocess_handler/
    # subprocess_handler.py, ``start_new_session``), so a SIGKILL of the launcher's process group (a container's
    # teardown, a scheduler's end of the grace period) would leave the ranks running, holding their devices. A
    # launcher that died before this call is noticed by its pid: on a node other than node 0 the rendezvous store
    # lives on, and such a rank joined node 0's and trained on without its node (issue 42).
    compat.die_with_parent(int(os.environ.get(_LAUNCHER_PID, os.getppid())))
    import_libraries()
    from megatron_patch.training import mpu

    mpu.install()
    # Parsed once here; the engine the task or the user script creates takes this parse (arguments.parse_run).
    config, _ = parse_run(argv, hand_over=True)
    if config.user_script:
        run_user_script(config.user_script, argv)
    else:
        from megatron_patch.training.engine import Engine
        from megatron_patch.training.tasks import run_task

        run_task(Engine(argv))
    return 0


def run_user_script(path: str, argv: list[str]) -> None:
    """Run ``path`` as this rank's ``__main__``: its top level and its ``if __name__ == "__main__":`` block run.

    Example::

        run_user_script("my_trainer.py", ["--lr", "1e-3"])     # sys.argv is ["my_trainer.py", "--lr", "1e-3"]

    The module's spec names this launcher, not the script. Processes started with multiprocessing's spawn
    method (dist_checkpointing's writer uses a spawn Manager: strategies/filesystem_async.py) re-import
    ``__main__`` from ``__main__.__spec__.name``, or else from ``__main__.__file__``; from the file, the seed's
    scripts, which call ``trainer.train()`` at top level, would train again inside the helper, and ``from megatron
    import mpu`` fails there, so the helper died and ``--save`` ended in EOFError. The launcher imports harmlessly.
    """
    path = os.path.abspath(path)
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__spec__ = importlib.util.find_spec("megatron_patch.training.launcher")
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    sys.modules["__main__"] = module
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    exec(code, module.__dict__)


@one_line_errors("rapidformer")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [_RANK_ENTRY]:
        from megatron_patch.startup import paused_collector

        # The rank's first import of torch (startup.py); here, as the launcher's --help needs none.
        with paused_collector():
            from megatron_patch.distributed import exit_rank, report_failure

        try:
            status = _run_rank(argv[1:])
        except SystemExit as error:  # argument errors and the like: the message is the report
            print(error, file=sys.stderr)
            status = error.code if isinstance(error.code, int) else 1
        except KeyboardInterrupt:  # Ctrl-C, passed on by torchrun's agent: a stop the launcher reports in one line
            status = 128 + signal.SIGINT
        except BaseException as error:  # noqa: BLE001  (report every failure of a rank before the hard exit)
            # A user's error (bad data, a damaged checkpoint) says what to fix in its one line; a bug needs the trace.
            rank = int(os.environ.get("RANK", 0))
            if not isinstance(error, UserError) or debugging():
                traceback.print_exc()
            # An error every rank meets alike (the data's) is said by rank 0 alone, not once per rank.
            if rank == 0 or not getattr(error, "same_on_every_rank", False):
                print(f"rapidformer: rank {rank} failed: {type(error).__name__}: {describe(error)}", file=sys.stderr)
            report = report_failure(error)
            if report:
                print(f"rapidformer: {report}", file=sys.stderr)
            status = 1
        exit_rank(status)
    # The recipes start the launcher with SIGTERM ignored (run_scripts/common.sh); until run_torchrun handles it,
    # SIGTERM ends the launcher at once, as it would any program: no rank runs yet.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from megatron_patch.training.nodes import slurm_launch

    slurm = slurm_launch()  # before the layout check: NNODES counts in the world size
    command = launch_command(argv)
    if slurm:
        print(f"rapidformer: {slurm}", flush=True)
    fate = prepare_nodes()
    print("+ " + " ".join(command), flush=True)
    flags = parse_flags(argv)
    return run_torchrun(command, fate, left=functools.partial(latest_checkpoint, flags.save),
                        ctrl_c_saves=bool(flags.exit_signal_handler and flags.save))


if __name__ == "__main__":
    raise SystemExit(main())
