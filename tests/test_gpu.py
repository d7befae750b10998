"""On a CUDA device, through the commands a user types: bf16 training follows the CPU's fp32 run, conversions verify
on the GPU, and a resume from a GPU checkpoint is bitwise the unbroken run.

    python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py      # on a machine with a GPU

Skipped where torch sees no CUDA device (tests/conftest.py). Every step is a ``megatron-patch`` process, as a user
would run it; the CPU reference is the same command with ``CUDA_VISIBLE_DEVICES`` empty, which runs fp32 on gloo.
All runs start from one converted Hugging Face checkpoint, so they share their initial weights whatever the device's
random generator would have drawn.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import transformers

from tests.convert_oracles import assert_bit_exact, make_hf_model

pytestmark = pytest.mark.gpu

STEPS, RESUME_AT = 6, 3
# bf16 keeps 8 bits of mantissa: the logits of this 2-layer model, and so its loss (~6.9, ln of the vocabulary),
# are off by a few parts in a thousand against fp32; 2% leaves room for the first steps' updates to differ as much.
BF16_LOSS_RTOL = 2e-2


def _run(argv: list[str], cpu: bool = False, timeout: int = 300) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(argv)}\n{output[-6000:]}"
    return output


def _megatron_patch(*argv: str, cpu: bool = False) -> str:
    return _run([sys.executable, "-m", "megatron_patch.cli", *argv], cpu=cpu)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random LLaMA with a tokenizer trained on the stdlib corpus, its conversion, and documents
    preprocessed with that tokenizer."""
    from conftest_data import data_assets

    assets = data_assets(tmp_path_factory)
    root = tmp_path_factory.mktemp("gpu")
    hf = str(root / "hf")
    tokenizer_dir = assets.options["HuggingFaceTokenizer"]["tokenizer_model"]
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    make_hf_model("llama-gqa", hf, num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=64)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), hf)
    converted = str(root / "converted")
    _megatron_patch("convert", "hf-to-megatron", "--hf-dir", hf, "--save-dir", converted, "--no-progress")
    prefix = str(root / "data")
    _megatron_patch("preprocess-data", "--input", assets.corpus, "--output-prefix", prefix, "--append-eod",
                    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf)
    return {"root": root, "hf": hf, "converted": converted, "data": prefix + "_text_document"}


def _train(model, name: str, *extra: str, load: str | None = None, cpu: bool = False) -> list[float]:
    """``megatron-patch train --task pretraining`` (rapidformer) on one device for ``STEPS`` (or ``--train-iters`` in
    ``extra``); the losses it logged."""
    log_dir = model["root"] / name
    _megatron_patch("train", "--task", "pretraining", "--nproc-per-node", "1", "--load", load or model["converted"],
          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", model["hf"], "--data-path", model["data"],
          "--split", "98,2,0", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--train-iters", str(STEPS), "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "7",
          "--log-interval", "1", "--eval-iters", "0", "--log-dir", str(log_dir), *extra, cpu=cpu)
    with open(log_dir / "iterations.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture(scope="module")
def cpu_fp32_losses(model):
    return _train(model, "cpu-fp32", cpu=True)


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["adam", "distributed-optimizer"])
def test_bf16_training_on_the_gpu_follows_the_cpu_fp32_run(model, cpu_fp32_losses, optimizer):
    losses = _train(model, "gpu-bf16" + "-".join(optimizer), "--bf16", *optimizer)
    assert losses == pytest.approx(cpu_fp32_losses, rel=BF16_LOSS_RTOL), (losses, cpu_fp32_losses)
    assert losses[-1] < losses[0], losses


def test_a_resume_on_the_gpu_is_bitwise_the_unbroken_run(model):
    flags = ("--bf16", "--use-distributed-optimizer")
    unbroken = _train(model, "unbroken", *flags)
    saved = str(model["root"] / "resumed-ckpt")
    first = _train(model, "first-half", *flags, "--train-iters", str(RESUME_AT), "--save", saved)
    # The first half saved a --train-iters RESUME_AT schedule; the unbroken run's is the flags' (Megatron-LM's flag).
    second = _train(model, "second-half", *flags, "--save", saved, "--override-opt_param-scheduler", load=saved)
    assert first == unbroken[:RESUME_AT]
    assert second == unbroken[RESUME_AT:], (second, unbroken)


@pytest.mark.parametrize("family", ["llama-gqa", "mixtral"])
def test_conversion_verifies_against_transformers_on_the_gpu_and_exports_bit_exact(tmp_path, family):
    """The converted model runs on the GPU (fp32, then bf16) against transformers' fp32 forward on the CPU; each
    command exits non-zero on a mismatch."""
    hf = make_hf_model(family, str(tmp_path / "hf"))
    converted, exported = str(tmp_path / "mcore"), str(tmp_path / "hf2")
    _megatron_patch("convert", "hf-to-megatron", "--hf-dir", hf, "--save-dir", converted, "--no-progress")
    _megatron_patch("convert", "verify", "--hf-dir", hf, "--megatron-dir", converted, "--dtype", "bfloat16")
    _megatron_patch("convert", "megatron-to-hf", "--load-dir", converted, "--save-dir", exported, "--no-progress")
    assert_bit_exact(hf, exported)
