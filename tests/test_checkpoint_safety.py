"""Crash-safe checkpoints: a save killed half-way leaves the previous checkpoint current, a damaged checkpoint
is named in the error (or skipped with --load-fallback), and --keep-last-k prunes old ones."""

import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from seed_scripts.assets import rapidformer_assets
from test_trainer_megatron import _gpt_flags, train_gpt

from megatron_patch.compat import common_state_source
from megatron_patch.distributed import free_port
from megatron_patch.testing import run_on_ranks

TRACKER = "latest_checkpointed_iteration.txt"
_BATCH = ["--micro-batch-size", "2", "--global-batch-size", "2"]


def resumed_iteration(rank, world_size, argv):
    """The iteration a trainer resumes from (``--train-iters`` equal to it, so no step is taken)."""
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import MegatronGPTPretrainer

    trainer = MegatronGPTPretrainer(engine=Engine(argv))
    trainer.train()
    return trainer.iteration


def _tracker(save):
    with open(os.path.join(save, TRACKER)) as f:
        return f.read()


def _iter_dirs(save):
    return sorted(name for name in os.listdir(save) if name.startswith("iter_"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


@pytest.fixture(scope="module")
def three_saves(assets, tmp_path_factory):
    """Checkpoints of iterations 2 and 3 (--keep-last-k 2 removed iteration 1); tests copy it before damaging."""
    save = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    run_on_ranks(train_gpt, 1, args=(_gpt_flags(assets, *_BATCH, "--train-iters", "3", "--save", save,
                                                "--save-interval", "1", "--keep-last-k", "2"),))
    return save


def test_keep_last_k_keeps_the_newest_k(three_saves):
    assert _iter_dirs(three_saves) == ["iter_0000002", "iter_0000003"]
    assert _tracker(three_saves) == "3"


def _copy(save, tmp_path):
    return shutil.copytree(save, str(tmp_path / "ckpt"))


@pytest.mark.parametrize("damage", ["truncate-distcp", "remove-common", "remove-metadata"])
def test_damaged_checkpoint_is_named_and_fallback_loads_the_previous(assets, three_saves, tmp_path, damage):
    save = _copy(three_saves, tmp_path)
    latest = os.path.join(save, "iter_0000003")
    if damage == "truncate-distcp":
        file = max(glob.glob(os.path.join(latest, "*.distcp")), key=os.path.getsize)
        os.truncate(file, os.path.getsize(file) // 2)
        name = os.path.basename(file)
    else:
        # The common state's file: common.pt (megatron-core 0.16.1), or DCP's .metadata (0.19 keeps the common state
        # among the sharded objects it indexes).
        common = os.path.basename(common_state_source(latest))
        name = {"remove-common": common, "remove-metadata": "metadata.json"}[damage]
        os.remove(os.path.join(latest, name))
    # The saves ran with --train-iters 3: the scheduler flag lets a shorter run load them (Megatron-LM's too).
    load = _gpt_flags(assets, *_BATCH, "--load", save, "--train-iters", "2", "--use-checkpoint-opt_param-scheduler")
    with pytest.raises(AssertionError) as failure:
        run_on_ranks(resumed_iteration, 1, args=(load,))
    message = str(failure.value)
    assert "CorruptCheckpointError" in message and latest in message and name in message
    assert "--load-fallback" in message
    assert run_on_ranks(resumed_iteration, 1, args=(load + ["--load-fallback"],)) == [2]


def test_killed_save_leaves_the_previous_checkpoint_current(assets, tmp_path):
    """SIGKILL a trainer while it writes its second checkpoint; the first one still loads."""
    save = str(tmp_path / "ckpt")
    argv = _gpt_flags(assets, *_BATCH, "--train-iters", "2", "--save", save, "--save-interval", "1")
    # A tiny model's save takes milliseconds, too short to aim a kill at; the second save stops after its
    # files are written (before the rename and the tracker) so the kill lands mid-save.
    script = textwrap.dedent(f"""
        import time
        from megatron_patch.checkpoint import trainer
        from test_trainer_megatron import train_gpt

        publish = trainer._publish_when_written
        def stalling_publish(root, staging, *args):
            if "iter_0000002.tmp-" in staging:
                time.sleep(600)
            publish(root, staging, *args)
        trainer._publish_when_written = stalling_publish
        train_gpt(0, 1, {argv!r})
    """)
    port = free_port()
    tests = os.path.dirname(__file__)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
               PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "trainer.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not glob.glob(os.path.join(save, "iter_0000002.tmp-*", "metadata.json")):
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert _tracker(save) == "1"
    assert _iter_dirs(save)[0] == "iter_0000001" and "iter_0000002" not in _iter_dirs(save)
    assert run_on_ranks(resumed_iteration, 1, args=(_gpt_flags(
        assets, *_BATCH, "--load", save, "--train-iters", "1", "--use-checkpoint-opt_param-scheduler"),)) == [1]
    # The next successful save replaces the leftover.
    run_on_ranks(resumed_iteration, 1, args=(argv + ["--load", save],))
    assert _iter_dirs(save) == ["iter_0000001", "iter_0000002"] and _tracker(save) == "2"
