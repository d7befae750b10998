"""Preemption and hangs seen from outside, as a scheduler sees a job: a SIGTERM to the recipe's whole process group
must end in a published checkpoint and status 0, with nothing left running; a rank that stops must end the job
within --distributed-timeout-minutes, with a report naming that rank.

    python -m pytest -q -p no:cacheprovider tests/test_preemption.py

The jobs spend most of their time starting up or waiting for a stopped rank, so they run side by side
(tests/side_by_side.py), and each test checks its own job's result.
"""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from seed_scripts.assets import rapidformer_assets
from side_by_side import side_by_side
from test_reliability import FAULTY_SCRIPT, _last_iteration, _records, _start, _tracker
from test_trainer_megatron import _gpt_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = os.path.join(ROOT, "examples", "gpt", "run_pretrain_gpt.sh")
ITERS = 16


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def recipe_flags(assets, out, nproc_per_node=2) -> list[str]:
    """examples/gpt/run_pretrain_gpt.sh's flags for a tiny GPT at TP=2 over ``nproc_per_node`` CPU processes on each
    node, ITERS iterations, its output under ``out`` (tests/test_multinode.py runs the same job on two nodes)."""
    return ["--cpu", "--nproc-per-node", str(nproc_per_node), "--tp", "2", "--seq-length", "32", "--data-path",
            assets.gpt_prefix, "--vocab-file", assets.gpt_options["vocab_file"], "--merge-file",
            assets.gpt_options["merge_file"], "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters",
            str(ITERS), "--lr", "3e-3", "--output-dir", str(out), "--", "--log-interval", "1", "--split", "98,2,0"]


def _start_recipe(assets, out):
    """examples/gpt/run_pretrain_gpt.sh with TP=2 on 2 CPU processes, in a process group of its own (a container's,
    a scheduler job's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")}
    return subprocess.Popen(["bash", GPT, *recipe_flags(assets, out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})


def _wait_for_iteration(process, logs, iteration, timeout=300):
    deadline = time.monotonic() + timeout
    while _last_iteration(logs) < iteration:
        assert process.poll() is None, process.communicate()[0][-5000:]
        assert time.monotonic() < deadline, "training did not reach the iteration"
        time.sleep(0.05)


def _descendants(process) -> list[psutil.Process]:
    return psutil.Process(process.pid).children(recursive=True)


def _ranks(process) -> dict[int, psutil.Process]:
    """The job's rank processes by RANK (torchrun sets it for them alone)."""
    ranks = {}
    for child in _descendants(process):
        environment = child.environ()
        if "--rank-entry" in child.cmdline() and "RANK" in environment:
            ranks[int(environment["RANK"])] = child
    return ranks


def _kill_all(processes) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def _still_running(processes, wait=5.0) -> list[psutil.Process]:
    """Those of ``processes`` still running after up to ``wait`` seconds."""
    _, alive = psutil.wait_procs(processes, timeout=wait)
    running = []
    for process in alive:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def _preempt_and_resume(assets, root):
    """An unbroken run of the recipe; then the same command SIGTERMed to its process group at iteration 3 or later,
    and run again."""
    reference = _start_recipe(assets, root / "unbroken")
    output, _ = reference.communicate(timeout=300)
    result = {"unbroken_status": reference.returncode, "unbroken_output": output,
              "unbroken": _records(root / "unbroken" / "logs")}

    out = root / "preempted"
    logs, save = out / "logs", out / "checkpoints"
    process = _start_recipe(assets, out)
    job = []
    try:
        _wait_for_iteration(process, logs, 3)
        job = _descendants(process)  # the launcher (torchrun) and its ranks among them
        os.killpg(process.pid, signal.SIGTERM)  # the scheduler's notice, to every process of the group
        sent = time.monotonic()
        output, _ = process.communicate(timeout=120)
        result["grace"] = time.monotonic() - sent
        os.killpg(process.pid, signal.SIGKILL)  # the container's teardown: whatever is left in the group
    except ProcessLookupError:  # nothing was left
        pass
    finally:
        result["left"] = [p.cmdline()[:6] for p in _still_running(job)]
        _kill_all(job)
    result.update(status=process.returncode, output=output, stopped=_last_iteration(logs),
                  tracked=_tracker(save) if (save / "latest_checkpointed_iteration.txt").exists() else None)

    resumed = _start_recipe(assets, out)  # the same command again: it resumes from OUTPUT/checkpoints
    output, _ = resumed.communicate(timeout=300)
    result.update(resumed_status=resumed.returncode, resumed_output=output, records=_records(logs))
    return result


def _stuck_save(assets, root, ending):
    """Rank 1 hangs in iteration 2, so the first SIGTERM's save never comes; then ``ending``."""
    save = str(root / "ckpt")
    argv = _gpt_flags(assets, "--train-iters", "6", "--micro-batch-size", "1", "--tensor-model-parallel-size", "2",
                      "--save", save, "--exit-signal-handler", "--log-dir", str(root / "logs"))
    process = _start(argv, nproc=2, script=FAULTY_SCRIPT, env={"FAULT": "hang", "FAULT_RANK": "1",
                                                               "FAULT_ITERATIONS": "2"})
    ranks = {}
    try:
        _wait_for_iteration(process, root / "logs", 1)
        ranks = _ranks(process)
        os.killpg(process.pid, signal.SIGTERM)
        time.sleep(3)
        waiting = process.poll() is None
        os.killpg(process.pid, signal.SIGTERM if ending == "second SIGTERM" else signal.SIGKILL)
        output, _ = process.communicate(timeout=30)
    finally:
        left = [p.environ()["RANK"] for p in _still_running(list(ranks.values()))]
        _kill_all(ranks.values())
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return {"ranks": sorted(ranks), "waiting": waiting, "left": left, "status": process.returncode, "output": output,
            "tracked": os.path.exists(os.path.join(save, "latest_checkpointed_iteration.txt"))}


TIMEOUT_MINUTES = 0.25


def _stopped_rank(assets, root, stopped):
    """SIGSTOP rank ``stopped`` at iteration 3 or later; (exit status, output, seconds from the stop to the exit)."""
    logs = root / "logs"
    # --exit-signal-handler as the recipes pass it: a stopped rank with a SIGTERM handler ignores the launcher's
    # SIGTERM (the signal stays pending), so only SIGKILL ends it.
    argv = _gpt_flags(assets, "--train-iters", "1000", "--micro-batch-size", "1", "--tensor-model-parallel-size",
                      "2", "--save", str(root / "ckpt"), "--save-interval", "1000", "--exit-signal-handler",
                      "--log-dir", str(logs), "--distributed-timeout-minutes", str(TIMEOUT_MINUTES))
    process = _start(argv, nproc=2)
    ranks = {}
    try:
        _wait_for_iteration(process, logs, 3)
        ranks = _ranks(process)
        ranks[stopped].suspend()  # SIGSTOP
        start = time.monotonic()
        output, _ = process.communicate(timeout=TIMEOUT_MINUTES * 60 + 120)
        elapsed = time.monotonic() - start
    finally:
        _kill_all(ranks.values())
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output, elapsed


# The tests below by pytest name, and the job each one checks.
JOBS = {
    "test_sigterm_to_the_recipes_process_group_saves_exits_0_and_resumes_exactly": (_preempt_and_resume,),
    "test_a_stuck_save_still_ends_on_a_second_sigterm_or_a_sigkill[second SIGTERM]": (_stuck_save, "second SIGTERM"),
    "test_a_stuck_save_still_ends_on_a_second_sigterm_or_a_sigkill[SIGKILL]": (_stuck_save, "SIGKILL"),
    "test_a_stopped_rank_ends_the_job_within_the_timeout_and_is_named[0]": (_stopped_rank, 0),
    "test_a_stopped_rank_ends_the_job_within_the_timeout_and_is_named[1]": (_stopped_rank, 1),
}


@pytest.fixture(scope="module")
def jobs(assets, tmp_path_factory, request):
    yield from side_by_side(request, tmp_path_factory, JOBS, assets)


def test_sigterm_to_the_recipes_process_group_saves_exits_0_and_resumes_exactly(job):
    assert job["unbroken_status"] == 0, job["unbroken_output"][-5000:]
    unbroken = {r["iteration"]: r for r in job["unbroken"]}
    assert sorted(unbroken) == list(range(1, ITERS + 1))

    output, stopped = job["output"], job["stopped"]
    assert job["status"] == 0, output[-5000:]
    assert 3 <= stopped < ITERS and job["tracked"] == stopped, output[-5000:]
    assert f"exiting on signal {int(signal.SIGTERM)}: saved iteration {stopped}" in output
    assert not job["left"], f"still running after the recipe exited: {job['left']}"
    print(f"SIGTERM to exit: {job['grace']:.1f} s (saved iteration {stopped})")

    assert job["resumed_status"] == 0, job["resumed_output"][-5000:]
    records = job["records"]
    assert {r["iteration"] for r in records} == set(unbroken)
    for record in records:
        assert record == unbroken[record["iteration"]]


@pytest.mark.parametrize("ending", ["second SIGTERM", "SIGKILL"])
def test_a_stuck_save_still_ends_on_a_second_sigterm_or_a_sigkill(job, ending):
    """Rank 1 hangs in iteration 2, so the first SIGTERM's save never comes; a second SIGTERM, or the SIGKILL at the
    end of a scheduler's grace period, must still end the job and every rank."""
    assert job["ranks"] == [0, 1]
    assert job["waiting"]  # for a save that cannot come
    assert not job["left"], f"ranks {job['left']} outlived the launcher"
    expected = 128 + signal.SIGTERM if ending == "second SIGTERM" else -signal.SIGKILL
    assert job["status"] == expected, job["output"]
    assert not job["tracked"]


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_stopped_rank_ends_the_job_within_the_timeout_and_is_named(job, stopped):
    status, output, elapsed = job
    assert status != 0, output[-5000:]
    behind = re.findall(r"ranks? ([\d, ]+) fell behind", output)
    assert behind == [str(stopped)], output[-5000:]
    print(f"rank {stopped} stopped: the job exited after {elapsed:.1f} s (timeout {TIMEOUT_MINUTES * 60:.0f} s)")
    assert elapsed < TIMEOUT_MINUTES * 60 + 20, output[-5000:]
