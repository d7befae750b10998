"""Checkpoints cross the tested megatron-core range: what the other end of it saved, this end resumes bitwise.

    MEGATRON_PATCH_OTHER_PYTHON=.venv312/bin/python python -m pytest -q -p no:cacheprovider tests/test_cross_version.py

.ci/run runs each lane with the other lane's interpreter in ``MEGATRON_PATCH_OTHER_PYTHON`` (Python 3.11 with
megatron-core 0.16.1, Python 3.12 with 0.19.x, both installed from this checkout), so each direction is tested once:
in the lane that loads. Without it the tests are skipped. The oracle is the saving side's own unbroken run: the two
lanes give the same losses for the same run, bit for bit (checked here first), so the resumed iterations must
equal it.
"""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from tests.convert_oracles import make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTHER = os.environ.get("MEGATRON_PATCH_OTHER_PYTHON")
pytestmark = pytest.mark.skipif(not OTHER, reason="MEGATRON_PATCH_OTHER_PYTHON names no other lane's Python")

# Training on mock data without dropout (a resume draws its own masks) at a constant learning rate (the schedule a
# first half saves is its own --train-iters'); a tiny GPT from scratch.
TRAINING = ["--task", "pretraining", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--lr-decay-style", "constant",
            "--use-distributed-optimizer", "--seed", "5", "--log-interval", "1", "--eval-iters", "0"]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
FROM_SCRATCH = [*NULL_TOKENIZER, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                "--seq-length", "32", "--max-position-embeddings", "32"]
STEPS, SAVED_AT = 4, 2


def _megatron_patch(python: str, *argv: str) -> str:
    """``python -m megatron_patch.cli ARGV`` on this checkout's code, whichever environment ``python`` is."""
    result = subprocess.run([python, "-m", "megatron_patch.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{python} {' '.join(argv)}\n{(result.stdout + result.stderr)[-6000:]}"
    return result.stdout + result.stderr


def _losses(python: str, log_dir, *argv: str, processes: int = 1) -> list[float]:
    _megatron_patch(python, "train", "--nproc-per-node", str(processes), *TRAINING, "--log-dir", str(log_dir), *argv)
    with open(os.path.join(log_dir, "iterations.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def _megatron_core(python: str) -> str:
    return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('megatron-core'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_the_other_lane_runs_another_megatron_core_and_trains_bit_for_bit_alike(tmp_path):
    assert _megatron_core(OTHER) != importlib.metadata.version("megatron-core")
    steps = [*FROM_SCRATCH, "--train-iters", str(STEPS)]
    assert _losses(OTHER, tmp_path / "other", *steps) == _losses(sys.executable, tmp_path / "this", *steps)


def test_a_torch_dist_checkpoint_of_the_other_megatron_core_resumes_bitwise(tmp_path):
    saved = str(tmp_path / "checkpoints")
    unbroken = _losses(OTHER, tmp_path / "unbroken", *FROM_SCRATCH, "--train-iters", str(STEPS))
    _losses(OTHER, tmp_path / "first", *FROM_SCRATCH, "--train-iters", str(SAVED_AT), "--save", saved)
    # The first half saved a --train-iters SAVED_AT schedule; the unbroken run's is the flags' (Megatron-LM's flag).
    resumed = _losses(sys.executable, tmp_path / "second", *NULL_TOKENIZER, "--train-iters", str(STEPS), "--load",
                      saved, "--override-opt_param-scheduler")
    assert resumed == unbroken[SAVED_AT:], (resumed, unbroken)


def test_per_rank_files_the_other_megatron_core_converted_train_alike(tmp_path):
    """Megatron-LM's legacy per-rank format (``--ckpt-format torch``, TP=2), written by a conversion under the other
    release, loads under this one into the same model: the same losses from it, step by step."""
    hf, converted = make_hf_model("llama-gqa", str(tmp_path / "hf")), str(tmp_path / "per-rank")
    _megatron_patch(OTHER, "convert", "hf-to-megatron", "--hf-dir", hf, "--save-dir", converted, "--ckpt-format",
                    "torch", "--target-tensor-parallel-size", "2", "--no-progress")
    # The model comes from the checkpoint; a NullTokenizer of its 100 ids (99 and eod).
    run = ["--load", converted, "--tensor-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "99", "--seq-length", "16", "--train-iters", "2"]
    this = _losses(sys.executable, tmp_path / "this", *run, processes=2)
    assert this == _losses(OTHER, tmp_path / "other", *run, processes=2)
