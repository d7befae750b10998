"""The distributed optimizer's checkpoint in Megatron-LM's default format (issue 39), through ``megatron-patch train``
and ``megatron-patch checkpoint reshard`` as a user runs them.

Saved ``dp_reshardable`` by default (``--dist-ckpt-optim-fully-reshardable`` writes the gathered per-parameter
format, as our saves did before), a checkpoint resumes exactly at its own layout and at another data-parallel size; at
another TP/PP the launcher refuses it in one line before any rank starts; ``checkpoint reshard`` rewrites it, and a
resume from the result trains as a resume from a fully reshardable save of the same run (TP 2 -> 1, PP 1 -> 2, and
fully reshardable at the saved layout). The reference is always another run of the trainer, never a copied number.

Failed before: the default save was ``fully_reshardable``, ``--dist-ckpt-optim-fully-reshardable`` was an unknown
flag and there was no ``checkpoint`` command.

Each run is a launcher, torchrun's agent and two or four ranks, whose start-up keeps one core busy and the other idle,
so the runs go side by side (tests/side_by_side.py; one that needs a checkpoint waits for the run that saves it), and
each test checks its own run's output.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from side_by_side import After, side_by_side

# No dropout: a resume at another layout draws other masks (each rank's RNG is its own).
TINY = ["--task", "pretraining", "--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
        "2", "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--lr", "1e-3",
        "--min-lr", "1e-4", "--log-interval", "1", "--use-distributed-optimizer", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--train-iters", "8"]
TP2 = ["--tensor-model-parallel-size", "2"]


def command(*args, nproc=None) -> tuple[int, str]:
    nproc = [] if nproc is None else ["--nproc-per-node", str(nproc)]
    result = subprocess.run([sys.executable, "-m", "megatron_patch.cli", *args[:1], *nproc, *args[1:]],
                            capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def train(*flags, nproc=2) -> dict[int, str]:
    """The lm loss logged at each iteration, as printed (so equal means bitwise equal to the printed digits)."""
    status, log = command("train", *TINY, *flags, nproc=nproc)
    assert status == 0, log[-3000:]
    return {int(i): loss for i, loss in re.findall(r"iteration (\d+)/\d+ .*?lm loss: ([0-9.E+-]+)", log)}


def sharding(checkpoint) -> str:
    import torch

    common = torch.load(os.path.join(checkpoint, "iter_0000004", "common.pt"), weights_only=False)
    return common["content_metadata"]["distrib_optim_sharding_type"]


def _saved(root, *flags) -> tuple[str, dict[int, str]]:
    """A checkpoint at iteration 4 of the TP=2 run (flags: its format), and the losses up to there."""
    save = str(root / "checkpoint")
    return save, train(*TP2, "--exit-interval", "4", "--save", save, *flags)


def _unbroken(root) -> dict[int, str]:
    return train(*TP2)


def _resumed(root, saved, *flags, nproc=2) -> dict[int, str]:
    checkpoint, _ = saved.result()
    return train("--load", checkpoint, *flags, nproc=nproc)


def _resumed_at_another_data_parallel_size(root, default) -> tuple[dict[int, str], dict[int, str]]:
    return (_resumed(root, default, *TP2, nproc=4),
            _resumed(root, default, *TP2, "--ckpt-fully-parallel-load", nproc=4))


def _refused_then_the_model_alone(root, default, layout) -> tuple[int, str, dict[int, str]]:
    checkpoint, _ = default.result()
    status, log = command("train", *TINY, "--load", checkpoint, *layout, nproc=2)
    return status, log, _resumed(root, default, *layout, "--no-load-optim")


def _resharded_then_resumed(root, default, target, layout, reference) -> tuple[str, int, str, dict, dict]:
    """``checkpoint reshard`` of the default save to ``target``, and the result resumed at ``layout``; the reference,
    the fully reshardable save resumed at ``layout``."""
    checkpoint, _ = default.result()
    resharded = str(root / ("resharded-" + "-".join(target[1::2] or ["any"])))
    status, log = command("checkpoint", "reshard", "--load-dir", checkpoint, "--save-dir", resharded, *target)
    return resharded, status, log, train("--load", resharded, *layout) if status == 0 else {}, reference.result()


@pytest.fixture(scope="module")
def unbroken(jobs):
    """The TP=2 run's losses, unbroken."""
    return jobs["unbroken"].result()


@pytest.fixture(scope="module")
def default(jobs):
    """A checkpoint at iteration 4 of the TP=2 run in the default format (its directory, the losses up to there)."""
    return jobs["default"].result()


@pytest.fixture(scope="module")
def fully(jobs):
    """The same with --dist-ckpt-optim-fully-reshardable."""
    return jobs["fully"].result()


def test_the_default_format_is_megatron_lms_and_the_flag_writes_the_fully_reshardable_one(unbroken, default, fully):
    assert (sharding(default[0]), sharding(fully[0])) == ("dp_reshardable", "fully_reshardable")
    assert default[1] == fully[1] == {i: unbroken[i] for i in range(1, 5)}  # the same run up to the save


def test_the_default_format_resumes_exactly_at_its_layout(job, unbroken):
    assert job == {i: unbroken[i] for i in range(5, 9)}


def test_the_default_format_resumes_at_another_data_parallel_size(job, unbroken):
    """TP=2 DP=1 saved, TP=2 DP=2 resumed: the same global batch over two ranks, equal to float rounding (the
    reduction order) as the layout oracles; read by both data-parallel ranks, or shared between them
    (--ckpt-fully-parallel-load, megatron-core's parallel load), the same state."""
    resumed, resumed_in_parallel = job
    assert list(resumed) == [5, 6, 7, 8]
    assert [float(loss) for loss in resumed.values()] == pytest.approx([float(unbroken[i]) for i in range(5, 9)],
                                                                       rel=1e-5)
    assert resumed_in_parallel == resumed


@pytest.mark.parametrize("layout", [[], ["--pipeline-model-parallel-size", "2"]], ids=["tp1", "tp1-pp2"])
def test_another_tensor_or_pipeline_layout_is_refused_before_launch_naming_the_ways_on(job, default, layout):
    status, log, model_alone = job
    default, _ = default
    assert status != 0
    [line] = log.strip().splitlines()  # no rank started: the launcher's one line
    pipeline = layout[1] if layout else "1"
    assert line.startswith(f"rapidformer: error: --load {default}: ") and (
        f"saved at TP=2 PP=1 VPP=1 DP=1, requested TP=1 PP={pipeline} VPP=1 DP={2 // int(pipeline)}; resume at TP=2 "
        "PP=1 VPP=1, pass --no-load-optim to load the model alone with a new optimizer state, or reshard it first: "
        f"megatron-patch checkpoint reshard --load-dir {default} --save-dir RESHARDED --target-tensor-parallel-size 1 "
        f"--target-pipeline-parallel-size {pipeline}, then --load RESHARDED") in line, line
    assert model_alone  # the first way on: the model alone


@pytest.mark.parametrize("target, layout", [
    (["--target-tensor-parallel-size", "1"], []),
    (["--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "2"],
     ["--pipeline-model-parallel-size", "2"]),
    ([], []),
], ids=["tp2-to-tp1", "pp1-to-pp2", "fully-reshardable"])
def test_a_resharded_checkpoint_resumes_as_a_fully_reshardable_save_of_the_run(job, target, layout):
    resharded, status, log, resumed, reference = job
    assert status == 0, log[-3000:]
    assert f"written to {resharded} at " in log
    assert sharding(resharded) == ("dp_reshardable" if target else "fully_reshardable")
    root = os.path.dirname(resharded)
    assert not [name for name in os.listdir(root) if ".reshard-" in name]  # the intermediate one is gone
    assert resumed == reference


def test_what_a_killed_reshard_left_beside_save_dir_the_next_one_removes(default, tmp_path):
    """A SIGKILL (the out-of-memory killer, a scheduler's hard limit) runs no cleanup: the intermediate fully
    reshardable checkpoint stays beside --save-dir until the next reshard into it."""
    default, _ = default
    out = str(tmp_path / "out")
    argv = [sys.executable, "-m", "megatron_patch.cli", "checkpoint", "reshard", "--load-dir", default, "--save-dir",
            out, "--target-tensor-parallel-size", "1"]
    killed = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not [name for name in os.listdir(tmp_path) if name.startswith("out.reshard-")]:
        assert time.monotonic() < deadline and killed.poll() is None, "no staging directory appeared"
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)  # the command and its ranks
    killed.wait()
    [left] = [name for name in os.listdir(tmp_path) if name.startswith("out.reshard-")]
    status, log = command("checkpoint", "reshard", "--load-dir", default, "--save-dir", out,
                          "--target-tensor-parallel-size", "1")
    assert status == 0, log[-3000:]
    assert f"note: removed {tmp_path / left}, left by process {killed.pid}, a reshard that was killed" in log
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("args, message", [
    (["--load-dir", "{root}/none", "--save-dir", "{root}/x"],
     "--load-dir {root}/none: no latest_checkpointed_iteration"),
    (["--load-dir", "{default}", "--save-dir", "{default}"],
     "--save-dir {default} is --load-dir; give a new directory"),
    (["--load-dir", "{default}", "--save-dir", "{fully}"], "--save-dir {fully} holds a checkpoint already"),
    (["--load-dir", "{fully}", "--save-dir", "{root}/y"], "optimizer state is fully reshardable already"),
    (["--load-dir", "{default}", "--save-dir", "{root}/z", "--target-tensor-parallel-size", "3"],
     "--num-attention-heads 2 is not divisible by --tensor-model-parallel-size 3"),
], ids=["no-checkpoint", "same-directory", "save-dir-taken", "already-fully-reshardable", "impossible-target"])
def test_reshard_refuses_wrong_input_in_one_line(default, fully, tmp_path, args, message):
    names = dict(root=tmp_path, default=default[0], fully=fully[0])
    status, log = command("checkpoint", "reshard", *(arg.format(**names) for arg in args))
    assert status == 1
    [line] = log.strip().splitlines()
    assert line.startswith("megatron-patch checkpoint: error: ") and message.format(**names) in line, line


def test_reshard_names_a_damaged_checkpoint_in_one_line(default, tmp_path):
    from megatron_patch.compat import common_state_source

    default, _ = default
    damaged = shutil.copytree(default, str(tmp_path / "damaged"))
    common = common_state_source(os.path.join(damaged, "iter_0000004"))
    os.remove(common)
    status, log = command("checkpoint", "reshard", "--load-dir", damaged, "--save-dir", str(tmp_path / "out"))
    assert status == 1
    [line] = log.strip().splitlines()
    assert line == (f"megatron-patch checkpoint: error: checkpoint {damaged}/iter_0000004 is incomplete: "
                    f"{os.path.basename(common)} is missing"), line


# ----------------------------------------------------------------------------------------------------------
# The runs, side by side
# ----------------------------------------------------------------------------------------------------------

REFUSED = "test_another_tensor_or_pipeline_layout_is_refused_before_launch_naming_the_ways_on"
RESHARDED = "test_a_resharded_checkpoint_resumes_as_a_fully_reshardable_save_of_the_run"
PP2 = ["--pipeline-model-parallel-size", "2"]
# Each run by the pytest name of the test that checks it, or by a name of its own; a run comes after those it needs.
JOBS = {
    "default": (_saved,),
    "fully": (_saved, "--dist-ckpt-optim-fully-reshardable"),
    "unbroken": (_unbroken,),
    "test_the_default_format_resumes_exactly_at_its_layout": (_resumed, After("default"), *TP2),
    "test_the_default_format_resumes_at_another_data_parallel_size": (_resumed_at_another_data_parallel_size,
                                                                      After("default")),
    f"{REFUSED}[tp1]": (_refused_then_the_model_alone, After("default"), []),
    f"{REFUSED}[tp1-pp2]": (_refused_then_the_model_alone, After("default"), PP2),
    # The references of the resharded checkpoints (one run serves two of them): the fully reshardable save resumed
    # at the new layout.
    "fully resumed at tp1": (_resumed, After("fully")),
    "fully resumed at tp1-pp2": (_resumed, After("fully"), *PP2),
    f"{RESHARDED}[tp2-to-tp1]": (_resharded_then_resumed, After("default"), ["--target-tensor-parallel-size", "1"],
                                 [], After("fully resumed at tp1")),
    f"{RESHARDED}[pp1-to-pp2]": (_resharded_then_resumed, After("default"), ["--target-tensor-parallel-size", "1",
                                 "--target-pipeline-parallel-size", "2"], PP2, After("fully resumed at tp1-pp2")),
    f"{RESHARDED}[fully-reshardable]": (_resharded_then_resumed, After("default"), [], [],
                                        After("fully resumed at tp1")),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, request):
    yield from side_by_side(request, tmp_path_factory, JOBS)
