"""Resuming with a changed learning-rate schedule, through ``megatron-patch train``: Megatron-LM's
``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler`` pick which schedule wins, neither is
refused in one line naming both (Megatron-LM's ``OptimizerParamScheduler._check_and_set`` asserts), and the
schedule in effect is logged.

Failed before: a resume with a longer ``--train-iters`` kept the checkpoint's schedule without a word (the learning
rate stayed at ``--min-lr`` for the new iterations) and both flags were unrecognized arguments.
"""

import re
import subprocess
import sys

import pytest

TINY = ["--task", "pretraining", "--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
        "2", "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--lr", "1e-3",
        "--min-lr", "1e-4", "--log-interval", "1"]


def train(*flags):
    result = subprocess.run([sys.executable, "-m", "megatron_patch.cli", "train", *TINY, *flags],
                            capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout + result.stderr


def learning_rates(log: str) -> dict[int, float]:
    return {int(i): float(lr) for i, lr in re.findall(r"iteration (\d+)/\d+ .*?learning rate: ([0-9.E+-]+)", log)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at iteration 2 of a 2-iteration linear decay: its learning rate has reached --min-lr."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    status, log = train("--train-iters", "2", "--save", str(ckpt))
    assert status == 0, log[-3000:]
    assert learning_rates(log)[2] == pytest.approx(1e-4)
    return ckpt


def test_changed_schedule_without_either_flag_is_refused_in_one_line(saved):
    status, log = train("--train-iters", "4", "--load", str(saved))
    assert status != 0
    # Said by the launcher from the checkpoint's scheduler state, before any rank starts (the ranks said it after
    # the model was built, 17 s in, among torch-elastic's lines).
    assert "torch.distributed.run" not in log and len(log.splitlines()) <= 3, log
    [line] = [line for line in log.splitlines() if "learning-rate schedule differs" in line]
    assert "total number of iterations 2.0 in the checkpoint, 4.0 from the flags" in line
    assert "--override-opt_param-scheduler" in line and "--use-checkpoint-opt_param-scheduler" in line
    assert "Traceback" not in log


def test_override_takes_the_flags_schedule_and_says_so(saved):
    status, log = train("--train-iters", "4", "--load", str(saved), "--override-opt_param-scheduler")
    assert status == 0, log[-3000:]
    assert ("learning-rate schedule on resume, from the flags (--override-opt_param-scheduler): lr 0.001, min lr "
            "0.0001, warmup 0 iterations, linear decay over 4 iterations") in log
    # Megatron-LM's linear decay over 4 iterations, continued from iteration 2: 1e-4 + (1 - 3/4) * 9e-4 at 3.
    rates = learning_rates(log)
    assert rates[3] == pytest.approx(1e-4 + 0.25 * 9e-4) and rates[4] == pytest.approx(1e-4)


def test_use_checkpoint_keeps_its_schedule_and_says_so(saved):
    status, log = train("--train-iters", "4", "--load", str(saved), "--use-checkpoint-opt-param-scheduler")
    assert status == 0, log[-3000:]
    assert "learning-rate schedule on resume, from the checkpoint (--use-checkpoint-opt_param-scheduler): lr 0.001, " \
           "min lr 0.0001, warmup 0 iterations, linear decay over 2 iterations" in log
    assert learning_rates(log) == {3: pytest.approx(1e-4), 4: pytest.approx(1e-4)}


def test_both_flags_are_refused_before_launch():
    status, log = train("--train-iters", "4", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler")
    assert status != 0
    assert "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler conflict; give one" in log
