"""No worker of the multi-process harness outlives the pytest run that started it, however that run ends.

    python -m pytest -q -p no:cacheprovider tests/test_harness_cleanup.py

Each test runs an inner pytest session and ends it one way. The sessions spend their time starting workers and
waiting (for a timeout, for the workers' end), so they run side by side (tests/side_by_side.py), and each test
checks its own.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from side_by_side import side_by_side

# The inner session: one test whose rank body starts a child (as dist_checkpointing's writers do), records both
# pids, and then returns or hangs.
INNER_TEST = textwrap.dedent('''
    import os
    import subprocess
    import sys
    import time

    import pytest

    from megatron_patch.testing import run_on_ranks

    def record_pids(rank, world_size, pid_file, hang):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(pid_file, "a") as f:
            f.write(f"{os.getpid()} {child.pid}\\n")
        if hang:
            time.sleep(600)
        return rank

    @pytest.fixture
    def started_workers():
        run_on_ranks(int.__add__, 2)  # the workers' start-up is not the test body's time

    # func_only: the timeout starts after the fixture, so a slow start-up on a loaded machine does not fire it
    @pytest.mark.timeout(int(os.environ["INNER_TIMEOUT"]), method=os.environ["INNER_TIMEOUT_METHOD"], func_only=True)
    def test_body(started_workers):
        assert run_on_ranks(record_pids, 2, args=(os.environ["PID_FILE"], os.environ["HANG"] == "1")) == [0, 1]
''')


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _recorded_pids(pid_file) -> list[int]:
    try:
        return [int(pid) for pid in pid_file.read_text().split()]
    except FileNotFoundError:
        return []


# (how the run ends, whether the rank body hangs, the inner test's timeout in seconds and pytest-timeout's method)
ENDINGS = {
    "passes": (None, False, 600, "signal"),
    "ctrl-c": (signal.SIGINT, True, 600, "signal"),
    "sigterm": (signal.SIGTERM, True, 600, "signal"),
    "timeout": (None, True, 5, "signal"),  # pytest-timeout fails the test, the session goes on
    "timeout-thread": (None, True, 5, "thread"),  # pytest-timeout ends the process with os._exit
}


def _end_session(root, ending):
    """Run the inner session, end it as ``ending`` says; (its exit status, its output, the pids it recorded and those of
    them still running 5 s after it ended, which are then killed, and the workers' log directories left in its
    temporary directory)."""
    sig, hang, timeout, method = ENDINGS[ending]
    (root / "test_inner.py").write_text(INNER_TEST)
    pid_file = root / "pids"
    temp = root / "tmp"  # the inner session's temporary files, pytest's and the workers' logs
    temp.mkdir()
    env = dict(os.environ, PID_FILE=str(pid_file), HANG=str(int(hang)), INNER_TIMEOUT=str(timeout),
               INNER_TIMEOUT_METHOD=method, TMPDIR=str(temp))
    # Its own session, as a terminal's foreground job: Ctrl-C reaches the whole process group.
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"], cwd=root, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while len(_recorded_pids(pid_file)) < 4 and time.monotonic() < deadline and inner.poll() is None:
            time.sleep(0.2)
        assert len(_recorded_pids(pid_file)) == 4, inner.communicate(timeout=60)[0].decode()
        if sig == signal.SIGINT:
            os.killpg(inner.pid, sig)
        elif sig is not None:
            inner.send_signal(sig)
        output = inner.communicate(timeout=180)[0].decode()
    finally:
        if inner.poll() is None:
            os.killpg(inner.pid, signal.SIGKILL)
    pids = _recorded_pids(pid_file)
    deadline = time.monotonic() + 5
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    return inner.returncode, output, pids, survivors, sorted(path.name for path in temp.glob("megatron_patch_ranks_*"))


JOBS = {f"test_no_worker_survives_the_session[{ending}]": (_end_session, ending) for ending in ENDINGS}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, request):
    yield from side_by_side(request, tmp_path_factory, JOBS, workers=len(ENDINGS))


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_no_worker_survives_the_session(job, ending):
    returncode, output, _, survivors, log_dirs = job
    if ending == "passes":
        assert returncode == 0, output
        assert not log_dirs, f"the session left its workers' logs behind: {log_dirs}"
    assert not survivors, f"{len(survivors)} of the workers and their children outlived pytest ({ending}):\n{output}"
