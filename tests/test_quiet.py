"""Quiet by default, through the ``megatron-patch`` command: the upstream warnings we know about
(startup.KNOWN_WARNINGS, KNOWN_LOG_RECORDS) are not on stderr of a training run, a resume or a conversion, and
``megatron-patch --debug`` shows them; the subcommands' usage lines name the subcommand.

Failed before: every resume and conversion printed torch DCP's FutureWarnings (6 lines), every --mock-data run
"Unable to save MockGPTDataset indexes" three times, and the data tools' usage lines read ``usage: cli.py``.
"""

import os
import re
import subprocess
import sys

import pytest
from convert_oracles import make_hf_model

from megatron_patch.startup import KNOWN_LOG_RECORDS, KNOWN_WARNINGS

TINY = ["--task", "pretraining", "--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
        "2", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "64"]
# What each known item prints: its message pattern, or the start of its log record's message. Which of them an
# install prints depends on its torch and megatron-core (torch 2.13's DCP FutureWarnings, megatron-core 0.19.2's
# GPTModel deprecation), so the tests compare a run with its --debug twin instead of naming a fixed list.
KNOWN = [re.compile(message) for _, message, _ in KNOWN_WARNINGS] + [
    re.compile(re.escape(start)) for _, start, _ in KNOWN_LOG_RECORDS]


def _known_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(known.search(line) for known in KNOWN)]


def megatron_patch(*args):
    environment = {k: v for k, v in os.environ.items() if k != "MEGATRON_PATCH_DEBUG"}
    result = subprocess.run([sys.executable, "-m", "megatron_patch.cli", *args], capture_output=True, text=True,
                            timeout=300, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A one-iteration run's checkpoint, and that run's stderr."""
    save = tmp_path_factory.mktemp("ckpt")
    return save, megatron_patch("train", *TINY, "--train-iters", "1", "--save", str(save))


def test_known_items_are_listed_with_a_reason():
    assert all(len(why) > 40 for *_, why in KNOWN_WARNINGS + KNOWN_LOG_RECORDS)


def test_training_and_resuming_print_no_known_warning_and_debug_shows_them(checkpoint, tmp_path):
    save, first = checkpoint
    resume = [*TINY, "--train-iters", "2", "--load", str(save), "--override-opt_param-scheduler"]
    quiet = megatron_patch("train", *resume, "--save", str(tmp_path))
    for stderr in (first, quiet):
        assert not _known_lines(stderr), stderr
        assert "Warning" not in stderr, stderr
    loud = megatron_patch("--debug", "train", *resume)
    assert "Transformer Engine and Apex are not installed" in loud and len(_known_lines(loud)) >= 3, loud


def test_conversion_prints_no_known_warning_and_debug_shows_them(tmp_path):
    hf = make_hf_model("llama-gqa", str(tmp_path / "hf"))
    convert = ["convert", "hf-to-megatron", "--hf-dir", hf, "--no-progress"]  # its verification loads the save
    quiet = megatron_patch(*convert, "--save-dir", str(tmp_path / "quiet"))
    assert "Warning" not in quiet and not _known_lines(quiet), quiet
    # verify at TP=2 starts two ranks (torchrun) and loads the Hugging Face model into a file, not a terminal.
    verified = megatron_patch("convert", "verify", "--hf-dir", hf, "--megatron-dir", str(tmp_path / "quiet"),
                              "--tensor-model-parallel-size", "2")
    assert not NOISE.search(verified) and not _known_lines(verified), verified
    loud = megatron_patch("--debug", *convert, "--save-dir", str(tmp_path / "loud"))
    assert "Warning" in loud and _known_lines(loud), loud


@pytest.mark.parametrize("command", ["make-corpus", "train-tokenizer", "preprocess-data", "convert", "train"])
def test_usage_line_names_the_subcommand(command):
    result = subprocess.run([sys.executable, "-m", "megatron_patch.cli", command, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.startswith(f"usage: megatron-patch {command} "), result.stdout[:200]


# What a recipe printed on every run before issue 53: torchrun's OMP_NUM_THREADS banner, megatron-core 0.19's absl
# notice, the CUDA_DEVICE_MAX_CONNECTIONS advice on CPU, the ~210-line arguments block, progress redrawn with \r.
NOISE = re.compile(r"OMP_NUM_THREADS|absl|CUDA_DEVICE_MAX_CONNECTIONS|end of arguments|\r|Warning")


def test_a_two_rank_recipe_prints_none_of_the_noise(tmp_path):
    from test_prelaunch import _write_prefix

    _write_prefix(str(tmp_path / "c_text_document"), 300)
    recipe = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "gpt",
                           "run_pretrain_gpt.sh"), "--cpu", "--nproc-per-node", "2", "--tp", "2", "--tokenizer-type",
              "NullTokenizer", "--data-path", str(tmp_path / "c_text_document"), "--micro-batch-size", "2",
              "--global-batch-size", "4", "--train-iters", "3", "--output-dir", str(tmp_path / "out")]
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("OMP_NUM_THREADS", "PYTHONWARNINGS", "MEGATRON_PATCH_DEBUG", "MASTER_PORT")}
    environment["PYTHON"] = sys.executable
    outputs = []
    for extra in (["--dry-run"], []):
        result = subprocess.run(["bash", *recipe, *extra, "--", "--vocab-size", "64", "--split", "90,10,0"],
                                capture_output=True, text=True, timeout=300, env=environment)
        assert result.returncode == 0, result.stdout + result.stderr
        outputs.append(result.stdout + result.stderr)
    dry, run = outputs
    assert "0.00 GiB" not in dry and "memory per process: " in dry, dry
    assert not [line for line in run.splitlines() if NOISE.search(line)], run
    assert len(run.splitlines()) < 20, run
    assert (tmp_path / "out" / "logs" / "arguments.txt").read_text().count("end of arguments") == 1
