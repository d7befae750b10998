"""Every docstring's example runs and prints what it shows (STYLE: docstrings open with an example)."""

import os
import subprocess
import sys
from pathlib import Path

from megatron_patch.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_the_examples_in_the_docstrings_run_as_shown():
    # A process of its own: the examples start a process group (distributed.initialize_distributed) and apply the
    # CPU shim, neither of which the test session's own process should keep.
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--doctest-modules", "-o",
         "doctest_optionflags=ELLIPSIS", "megatron_patch"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
