"""preprocess-data through the command line when the run cannot finish: a worker killed, SIGTERM,
a full disk. Each must end promptly with one line, leave no file, and keep earlier outputs.

    python -m pytest -q tests/test_preprocess_failures.py
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
ENV.pop("MEGATRON_PATCH_DEBUG", None)
PROG = "megatron-patch preprocess-data: error: "
# Earlier outputs under the final names: a failed run must leave them as they are.
PREVIOUS = {"out_text_document.bin": b"previous bin", "out_text_document.idx": b"previous idx"}


def _command(corpus, prefix, *flags):
    return [sys.executable, "-m", "megatron_patch.cli", *flags, "preprocess-data", "--input", str(corpus),
            "--output-prefix", str(prefix), "--tokenizer-type", "NullTokenizer", "--vocab-size", "100000",
            "--workers", "2", "--log-interval", "100000000"]


@pytest.fixture
def started(tmp_path):
    """A run on 30 MB of token ids (seconds of work for 2 workers) in `tmp_path/run`, which holds
    earlier outputs; yields (process, its 2 workers, the run directory) once both workers exist."""
    corpus = tmp_path / "ids.jsonl"
    line = b'{"text": "' + b" ".join(b"%d" % i for i in range(0, 4000, 37)) + b'"}\n'
    corpus.write_bytes(line * (30_000_000 // len(line)))
    run = tmp_path / "run"
    run.mkdir()
    for name, data in PREVIOUS.items():
        (run / name).write_bytes(data)
    process = subprocess.Popen(_command(corpus, run / "out"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=ENV)
    try:
        deadline = time.monotonic() + 180  # start-up imports torch and megatron-core: slow on a busy machine
        while len(psutil.Process(process.pid).children()) < 2:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.01)
        workers = psutil.Process(process.pid).children()
        time.sleep(0.3)  # into the work: batches in flight on both workers
        yield process, workers, run
    finally:
        for child in psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []:
            child.kill()
        process.kill()
        process.communicate()


def _ends_within(process, seconds):
    """(exit status, stderr) if `process` ends within `seconds`, else fail."""
    try:
        _, err = process.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {seconds} s later (hung)")
    return process.returncode, err


def _assert_nothing_left(run, workers):
    assert {name: (run / name).read_bytes() for name in os.listdir(run)} == PREVIOUS
    assert not [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


def test_a_killed_worker_fails_the_run_at_once_naming_its_fate(started):
    process, workers, run = started
    victim = workers[0].pid
    os.kill(victim, signal.SIGKILL)
    status, err = _ends_within(process, 30)
    assert status == 1, err[-3000:]
    assert err.rstrip().splitlines()[-1] == (
        f"{PROG}worker process {victim} was killed by signal 9 (SIGKILL; the kernel's out-of-memory killer sends "
        "it, see dmesg); nothing was written: re-run, with fewer --workers if memory ran out"
    )
    assert "Traceback" not in err
    _assert_nothing_left(run, workers)


def test_sigterm_stops_the_run_and_its_workers_even_a_stuck_one(started):
    process, workers, run = started
    # A worker that never finishes its batch (stopped here; a pathological document would do) must
    # not keep a scheduler's SIGTERM from ending the run.
    workers[0].suspend()
    process.send_signal(signal.SIGTERM)
    status, err = _ends_within(process, 30)
    assert status == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    _assert_nothing_left(run, workers)


def _mount_tmpfs(directory, size):
    """The shell words that mount a `size` tmpfs on `directory` in a private mount namespace (gone
    with the command), or skip the test where this machine does not allow it."""
    words = ["unshare", "--mount", "sh", "-c", f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$@"', directory]
    try:
        probe = subprocess.run([*words, "true"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no unshare command to mount a tmpfs with")
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    return words


@pytest.mark.parametrize("debug", [False, True])
def test_a_full_disk_is_one_line_naming_the_output(tmp_path, debug):
    corpus = tmp_path / "ids.jsonl"
    # 3000 documents of 40 int32 ids: 480 KB of tokens for a 64 KB disk.
    corpus.write_text("".join('{"text": "%s"}\n' % " ".join(str(i + j) for j in range(40)) for i in range(3000)))
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = _mount_tmpfs(str(disk), "64k")
    flags = ["--debug"] if debug else []
    # The listing is taken inside the namespace, where the tmpfs is mounted.
    command = [*mount, "sh", "-c", '"$@"; status=$?; echo "left: $(ls -A "$0")"; exit $status', str(disk),
               *_command(corpus, disk / "out", *flags), "--partitions", "2"]
    done = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.rstrip().splitlines()
    assert lines[-1] == (f"{PROG}{disk}/out_text_document.bin: no space left on the device; free some space or "
                         "write to another disk, then re-run")
    if debug:
        assert "Traceback (most recent call last):" in done.stderr and "[Errno 28]" in lines[-2]
    else:
        assert "Traceback" not in done.stderr
    assert done.stdout.splitlines()[-1] == "left: "


def test_what_a_killed_run_left_the_next_run_removes(started, tmp_path):
    """Failed before: a SIGKILL of the main process (the out-of-memory killer) left its `*.tmp-PID.bin`, as large
    as the data written so far, and later runs to the same prefix never removed it."""
    process, workers, run = started
    deadline = time.monotonic() + 60
    while not [name for name in os.listdir(run) if ".tmp-" in name]:
        assert time.monotonic() < deadline and process.poll() is None, "no temporary output appeared"
        time.sleep(0.01)
    process.kill()
    process.communicate()
    left = sorted(name for name in os.listdir(run) if ".tmp-" in name)
    assert left, "a SIGKILL runs no cleanup: its temporary files should still be there"
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "1 2 3"}\n')
    done = subprocess.run(_command(small, run / "out"), capture_output=True, text=True, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(run)) == sorted([*PREVIOUS, "out_text_document.tokens.json"]), os.listdir(run)
    for name in left:
        assert f"note: removed {run / name}, left by process {process.pid}" in done.stderr, done.stderr[-3000:]
