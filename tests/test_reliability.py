"""Long runs die; a resumed run must continue as if nothing happened. These tests start real training jobs with
the ``megatron-patch train`` launcher, kill or poison them, and compare every iteration's record (loss, learning
rate, consumed samples, grad norm, loss scale: ``--log-dir``'s ``iterations.jsonl``, full precision) with an
uninterrupted run of the same flags.

    python -m pytest -q -p no:cacheprovider tests/test_reliability.py

Most of these jobs run one rank, which keeps one of CI's two cores busy, or wait for a distributed timeout, so they
run side by side (tests/side_by_side.py), and each test checks its own job's result."""

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from seed_scripts.assets import rapidformer_assets
from side_by_side import After, side_by_side
from test_trainer_megatron import _gpt_flags

TRACKER = "latest_checkpointed_iteration.txt"
ITERS = 16
FAULTY_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "faulty_gpt.py")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def _flags(assets, *extra):
    """Dropout on (so the RNG state matters), warm-up then cosine decay (so the scheduler's state matters) and
    two microbatches per step."""
    return _gpt_flags(assets, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--micro-batch-size", "2",
                      "--global-batch-size", "4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3",
                      "--min-lr", "1e-4", "--train-iters", str(ITERS), *extra)


def _start(argv, nproc=1, script=None, env=None):
    program = ["--user-script", script] if script else ["--task", "pretraining"]
    command = [sys.executable, "-m", "megatron_patch.cli", "train", *program, "--nproc-per-node", str(nproc),
               *argv]
    # A session of its own, so a kill reaches torchrun and its ranks together (as a node failure would).
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})


def _run(argv, nproc=1, script=None, env=None, timeout=300):
    process = _start(argv, nproc, script, env)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return process.returncode, output


def _records(log_dir) -> list[dict]:
    """Every line of the record; a line cut short by a kill is dropped."""
    records = []
    with open(os.path.join(log_dir, "iterations.jsonl")) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


def _last_iteration(log_dir) -> int:
    path = os.path.join(log_dir, "iterations.jsonl")
    return max((r["iteration"] for r in _records(log_dir)), default=0) if os.path.exists(path) else 0


def _tracker(save):
    with open(os.path.join(save, TRACKER)) as f:
        return int(f.read())


def _assert_same_as(reference: list[dict], records: list[dict]):
    """Each record (repeated iterations included) equals the uninterrupted run's for its iteration, bitwise."""
    expected = {r["iteration"]: r for r in reference}
    assert sorted(expected) == list(range(1, ITERS + 1))
    assert {r["iteration"] for r in records} == set(expected)
    # Every differing record at once, field by field: the first mismatch alone does not tell a deviation from the
    # resumed iteration on (the resume's) from one iteration's report.
    differing = []
    for record in records:
        want = expected[record["iteration"]]
        fields = [f"{key} {record.get(key)!r} != {want.get(key)!r}"
                  for key in sorted(set(record) | set(want)) if record.get(key) != want.get(key)]
        if fields:
            differing.append(f"iteration {record['iteration']}: " + ", ".join(fields))
    assert not differing, "records differ from the uninterrupted run's:\n" + "\n".join(differing)


def _reference(assets, root):
    """An uninterrupted run: its records, and its checkpoints (every 4 iterations)."""
    save, logs = str(root / "ckpt"), str(root / "logs")
    status, output = _run(_flags(assets, "--save", save, "--save-interval", "4", "--log-dir", logs))
    assert status == 0, output
    return {"records": _records(logs), "save": save}


def _kill_when(process, condition, poll=0.002, timeout=300) -> bool:
    """SIGKILL the job as soon as ``condition()`` holds; False when the job ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if condition():
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return True
        time.sleep(poll)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError("the job neither reached the kill point nor ended")


def _saving(save, iteration):
    """True while iteration's checkpoint is being written (its staging directory exists) or once it is done."""
    name = os.path.join(save, f"iter_{iteration:07d}")
    return lambda: bool(glob.glob(name + ".tmp-*")) or os.path.isdir(name)


def _sigkill_then_resume(assets, root, saving):
    save, logs = str(root / "ckpt"), str(root / "logs")
    argv = _flags(assets, "--save", save, "--load", save, "--save-interval", "2", "--log-dir", logs,
                  *(["--async-save"] if saving == "async" else []))
    rng = random.Random(os.environ.get("FAULT_SEED", "1"))
    # Kill points: after a random iteration, or while a random checkpoint is being written; each later than
    # the one before (a resumed run repeats the iterations since its checkpoint).
    iterations = sorted(rng.sample(range(2, ITERS), 5))
    plan = [("during save", i + i % 2) if rng.random() < 0.5 else ("after iteration", i) for i in iterations]
    kills = 0
    for kind, iteration in plan:
        if _last_iteration(logs) >= iteration:
            continue
        process = _start(argv)
        ok = _saving(save, iteration) if kind == "during save" else lambda it=iteration: _last_iteration(logs) >= it
        kills += _kill_when(process, ok)
    status, output = _run(argv)
    return {"plan": plan, "kills": kills, "status": status, "output": output, "save": save, "logs": logs}


def _sigterm_then_resume(assets, root):
    save, logs = str(root / "ckpt"), str(root / "logs")
    argv = _flags(assets, "--save", save, "--load", save, "--save-interval", "100", "--log-dir", logs,
                  "--exit-signal-handler")
    # Iterations 6 on wait 0.2 s each, so the SIGTERM lands between iterations even when this process is slow to see
    # iteration 5 (a loaded machine: at full speed the 11 iterations left took ~0.4 s, and a late SIGTERM found the run
    # finished). The waits change no number: the records are still compared with the reference run's.
    process = _start(argv, script=FAULTY_SCRIPT, env={"FAULT": "slow", "FAULT_RANK": "0",
                                                      "FAULT_ITERATIONS": ",".join(map(str, range(6, ITERS + 1)))})
    deadline = time.monotonic() + 300
    while _last_iteration(logs) < 5 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(process.pid, signal.SIGTERM)  # a scheduler's preemption notice reaches the whole job
    output, _ = process.communicate(timeout=120)
    stopped = _last_iteration(logs)
    tracked = _tracker(save) if os.path.exists(os.path.join(save, TRACKER)) else None
    status, resumed_output = _run(argv)
    return {"output": output, "stopped": stopped, "tracked": tracked, "status": status,
            "resumed_output": resumed_output, "logs": logs}


def _failing_rank(assets, root, fault, world_size):
    """Rank 1 raises or hangs in iteration 2; (exit status, output, seconds the job took)."""
    argv = _gpt_flags(assets, "--train-iters", "6", "--micro-batch-size", "1",
                      "--tensor-model-parallel-size", str(world_size // 2), "--distributed-timeout-minutes", "0.25")
    start = time.monotonic()
    status, output = _run(argv, nproc=world_size, script=FAULTY_SCRIPT, timeout=240,
                          env={"FAULT": fault, "FAULT_RANK": "1", "FAULT_ITERATIONS": "2"})
    return status, output, time.monotonic() - start


def _fp16_poisoned(assets, root):
    logs = str(root / "logs")
    # Megatron's hysteresis (2): the scale drops at the second overflow in a row, so two steps are poisoned.
    argv = _gpt_flags(assets, "--train-iters", "8", "--micro-batch-size", "2", "--fp16", "--initial-loss-scale",
                      "4096", "--log-dir", logs)
    status, output = _run(argv, script=FAULTY_SCRIPT, env={"FAULT": "nan", "FAULT_ITERATIONS": "4,5"})
    return {"status": status, "output": output, "logs": logs}


def _bf16_max_bad_steps(assets, root):
    save, logs = str(root / "ckpt"), str(root / "logs")
    argv = _gpt_flags(assets, "--train-iters", "8", "--micro-batch-size", "2", "--bf16", "--save", save,
                      "--save-interval", "1", "--log-dir", logs, "--max-bad-steps", "2")
    # One poisoned step is skipped and training goes on; two in a row stop the run.
    status, output = _run(argv, script=FAULTY_SCRIPT, env={"FAULT": "nan", "FAULT_ITERATIONS": "2,5,6"})
    records = _records(logs) if os.path.exists(os.path.join(logs, "iterations.jsonl")) else []
    tracked = _tracker(save) if os.path.exists(os.path.join(save, TRACKER)) else None
    resumed_status, resumed_output = _run(argv + ["--load", save], script=FAULTY_SCRIPT,
                                          env={"FAULT": "nan", "FAULT_ITERATIONS": "0"})
    return {"status": status, "output": output, "records": records, "tracked": tracked,
            "resumed_status": resumed_status, "resumed_output": resumed_output, "logs": logs}


def _late_configuration_errors(assets, root, reference):
    """(exit status, output) of a run on a missing corpus, and of runs loading the reference's checkpoint with
    another tokenizer and with another model shape."""
    missing = str(root / "no_such_corpus_text_document")
    argv = _gpt_flags(assets, "--train-iters", "2")
    no_data = _run([*argv, "--data-path", missing])
    save = reference.result()["save"]
    # The flags' schedule, which the launcher would refuse first as another than the checkpoint's.
    tokenizer = _run([*argv, "--load", save, "--tokenizer-type", "NullTokenizer", "--vocab-size", "2000",
                      "--override-opt_param-scheduler"])
    shape = list(argv)
    shape[shape.index("--hidden-size") + 1] = "64"  # another model's shape than the checkpoint's
    model = _run([*shape, "--load", save])
    return {"missing": missing, "no_data": no_data, "tokenizer": tokenizer, "shape": model, "save": save}


# The tests below by pytest name, and the job each one checks; the reference run, which several compare with, first.
JOBS = {
    "reference": (_reference,),
    "test_sigkill_at_random_points_then_resume_gives_the_uninterrupted_records[sync]": (_sigkill_then_resume, "sync"),
    "test_sigkill_at_random_points_then_resume_gives_the_uninterrupted_records[async]":
        (_sigkill_then_resume, "async"),
    "test_sigterm_saves_at_the_end_of_the_iteration_and_resumes_exactly": (_sigterm_then_resume,),
    **{f"test_a_failing_or_hanging_rank_ends_the_job_within_the_timeout[{fault}-{world_size}]":
       (_failing_rank, fault, world_size) for fault in ("raise", "hang") for world_size in (2, 4)},
    "test_fp16_skips_a_poisoned_step_and_lowers_the_loss_scale": (_fp16_poisoned,),
    "test_bf16_stops_after_max_bad_steps_with_the_last_checkpoint_intact": (_bf16_max_bad_steps,),
    "test_late_configuration_errors_stop_before_the_first_step": (_late_configuration_errors, After("reference")),
}


@pytest.fixture(scope="module")
def jobs(assets, tmp_path_factory, request):
    yield from side_by_side(request, tmp_path_factory, JOBS, assets)


@pytest.fixture(scope="module")
def reference(jobs):
    """An uninterrupted run: its records, and its checkpoints (every 4 iterations)."""
    return jobs["reference"].result()


@pytest.mark.parametrize("saving", ["sync", "async"])
def test_sigkill_at_random_points_then_resume_gives_the_uninterrupted_records(job, reference, saving):
    print(f"kill plan: {job['plan']}")
    assert job["status"] == 0, job["output"]
    assert job["kills"] >= 5, f"only {job['kills']} of the planned kills happened: {job['plan']}"
    _assert_same_as(reference["records"], _records(job["logs"]))
    assert _tracker(job["save"]) == ITERS


def test_sigterm_saves_at_the_end_of_the_iteration_and_resumes_exactly(job, reference):
    output, stopped = job["output"], job["stopped"]
    assert 5 <= stopped < ITERS, output
    assert f"exiting on signal {int(signal.SIGTERM)}: saved iteration {stopped}" in output
    assert job["tracked"] == stopped  # a checkpoint of the last finished iteration, not an earlier one
    assert job["status"] == 0, job["resumed_output"]
    _assert_same_as(reference["records"], _records(job["logs"]))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_a_failing_or_hanging_rank_ends_the_job_within_the_timeout(job, world_size, fault):
    status, output, elapsed = job
    assert status != 0, output
    assert " iteration 1/6" in output  # it failed during training, not at start-up
    if fault == "raise":
        assert "rank 1 failed" in output and "injected fault on rank 1" in output, output
    else:
        # The hung rank is among those named (with TP its tensor-parallel peer, stuck waiting in the forward).
        behind = re.search(r"ranks? ([\d, ]+) fell behind", output)
        assert "timed out" in output.lower() and behind and "1" in behind.group(1).split(", "), output
    print(f"{world_size} ranks, {fault}: exit {status} after {elapsed:.0f} s")


def test_fp16_skips_a_poisoned_step_and_lowers_the_loss_scale(job):
    status, output = job["status"], job["output"]
    assert status == 0, output
    records = {r["iteration"]: r for r in _records(job["logs"])}
    assert [i for i, r in records.items() if r["skipped"]] == [4, 5]
    assert records[5]["loss_scale"] < records[3]["loss_scale"]
    assert all(r["loss"] == r["loss"] for i, r in records.items() if i > 5)  # not NaN: the weights were spared
    assert "number of skipped iterations: 2" in output


def test_bf16_stops_after_max_bad_steps_with_the_last_checkpoint_intact(job):
    status, output = job["status"], job["output"]
    assert status != 0
    assert "iterations 5-6 had NaN/Inf gradients" in output and "--max-bad-steps 2" in output, output
    records = {r["iteration"]: r for r in job["records"]}
    assert max(records) == 6 and [i for i, r in records.items() if r["skipped"]] == [2, 5, 6]
    assert job["tracked"] == 5  # the save after the first bad step of the run of two: its weights are unchanged
    assert job["resumed_status"] == 0, job["resumed_output"]
    resumed = [r for r in _records(job["logs"])[len(records):]]
    assert [r["iteration"] for r in resumed] == [6, 7, 8]
    assert all(r["loss"] == r["loss"] and not r["skipped"] for r in resumed)


def test_late_configuration_errors_stop_before_the_first_step(job):
    missing = job["missing"]
    status, output = job["no_data"]
    assert status != 0 and f"{missing}.bin" in output and " iteration " not in output, output

    args_file = os.path.join(job["save"], "megatron_patch_args.json")
    status, output = job["tokenizer"]
    assert status != 0 and args_file in output and "NullTokenizer has 2001 tokens" in output, output
    assert " iteration " not in output

    status, output = job["shape"]
    assert status != 0 and args_file in output and "--hidden-size 64" in output, output
    assert " iteration " not in output


def _async_save_published(rank, world_size, argv):
    """Whether an asynchronous save's directory was published right after ``save()`` returned, and after the
    queue finalized it; and the tracker then."""
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import MegatronGPTPretrainer

    trainer = MegatronGPTPretrainer(engine=Engine(argv))
    trainer.train()
    trainer.iteration += 1
    path = trainer.save()
    before = os.path.isdir(path)
    trainer._wait_for_saves()
    return before, os.path.isdir(path), _tracker(trainer.args.save)


def test_an_async_save_becomes_the_latest_only_once_written(assets, tmp_path):
    from megatron_patch.testing import run_on_ranks

    save = str(tmp_path / "ckpt")
    argv = _gpt_flags(assets, "--train-iters", "1", "--save", save, "--async-save")
    assert run_on_ranks(_async_save_published, 2, args=(argv,), timeout=300) == [(False, True, 2)] * 2


@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
def test_mixed_precision_resume_restores_the_loss_scaler(assets, tmp_path, precision):
    """fp16 from 2**32 overflows and skips its first steps, halving the scale every second time; a resume that
    forgot the scaler would start over at 2**32 and skip again. bf16 has no scaler; its resume must be exact
    too."""
    from test_trainer_megatron import train_gpt

    from megatron_patch.testing import run_on_ranks
    from megatron_patch.checkpoint.format import write_tracker

    save = str(tmp_path / "ckpt")
    argv = _flags(assets, precision, "--initial-loss-scale", str(2.0 ** 32), "--train-iters", "8")
    run_on_ranks(train_gpt, 1, args=(argv + ["--save", save, "--save-interval", "4", "--log-dir",
                                             str(tmp_path / "unbroken")],), timeout=300)
    write_tracker(save, 4)  # resume from the middle: iteration 4, not the last save
    run_on_ranks(train_gpt, 1, args=(argv + ["--load", save, "--log-dir", str(tmp_path / "resumed")],),
                 timeout=300)
    unbroken, resumed = _records(tmp_path / "unbroken"), _records(tmp_path / "resumed")
    if precision == "--fp16":
        assert unbroken[0]["skipped"] and unbroken[3]["loss_scale"] < 2.0 ** 32
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8]
    assert resumed == unbroken[4:]
