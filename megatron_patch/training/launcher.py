"""The ``rapidformer`` command: check the flags once, then start one process per GPU with torch's elastic launcher.

Example::

    export CUDA_VISIBLE_DEVICES=0,1,2,3 MASTER_ADDR=localhost MASTER_PORT=6010 NNODES=1 NODE_RANK=0
    rapidformer --user-script my_trainer.py --micro-batch-size 16 --mixed-precision
    python -m megatron_patch.training.launcher --task pretraining --nproc-per-node 2 ...   # on CPUs

Each process runs ``python -m megatron_patch.training.launcher --rank-entry ...``: the user script (as
``__main__``, with ``from megatron import mpu`` available; see ``run_user_script``) or the ``--task``. A rank ends
through ``megatron_patch.distributed.exit_rank`` (a normal interpreter exit after gloo sometimes aborts).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import traceback
import types

from megatron_patch.distributed import exit_rank, free_port
from megatron_patch.training.arguments import parse_args

_RANK_ENTRY = "--rank-entry"


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


def launch_command(argv: list[str]) -> list[str]:
    """The torch.distributed.run command line for ``argv`` (validated first: errors name the flag)."""
    args = parse_args(argv)
    if not args.task and not args.user_script:
        raise SystemExit("rapidformer: error: give --task (black-box) or --user-script FILE (white-box)")
    if args.user_script and not os.path.isfile(args.user_script):
        raise SystemExit(f"rapidformer: error: --user-script {args.user_script}: no such file")
    env = os.environ
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={processes_per_node(args.nproc_per_node)}",
        f"--nnodes={env.get('NNODES', '1')}", f"--node-rank={env.get('NODE_RANK', '0')}",
        f"--master-addr={env.get('MASTER_ADDR', '127.0.0.1')}",
        f"--master-port={env.get('MASTER_PORT') or free_port()}",
        "-m", "megatron_patch.training.launcher", _RANK_ENTRY, *_without(argv, "--nproc-per-node"),
    ]


def _run_rank(argv: list[str]) -> int:
    """One rank's work: the user script or the task. Returns the exit status."""
    from megatron_patch import compat

    compat.apply()
    from megatron_patch.training import mpu

    mpu.install()
    args = parse_args(argv)
    if args.user_script:
        run_user_script(args.user_script, argv)
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


def _print_progress() -> None:
    """After a failure (a collective that timed out names no culprit), say which rank fell behind."""
    import torch

    from megatron_patch.distributed import progress_report

    if torch.distributed.is_initialized():
        try:
            print(f"rapidformer: {progress_report()}", file=sys.stderr)
        except RuntimeError:  # the store went away with the launcher: nothing to add
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [_RANK_ENTRY]:
        try:
            status = _run_rank(argv[1:])
        except SystemExit as error:  # argument errors and the like: the message is the report
            print(error, file=sys.stderr)
            status = error.code if isinstance(error.code, int) else 1
        except BaseException as error:  # noqa: BLE001  (report every failure of a rank before the hard exit)
            traceback.print_exc()
            print(f"rapidformer: rank {os.environ.get('RANK', 0)} failed: {error!r}", file=sys.stderr)
            _print_progress()
            status = 1
        exit_rank(status)
    command = launch_command(argv)
    print("+ " + " ".join(command), flush=True)
    return subprocess.run(command).returncode


if __name__ == "__main__":
    raise SystemExit(main())
