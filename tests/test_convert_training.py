"""A converted checkpoint trains on with our Pretrainer given only ``--load`` (at TP=2, on the recorded padded
vocabulary; a contradicting model flag is refused), the trainer's own save exports, and that export generates with
transformers exactly the greedy tokens the trained megatron-core model predicts; the command line's ``verify``
relaunches itself under torchrun for a multi-rank layout."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from megatron_patch.checkpoint.format import read_info
from megatron_patch.testing import run_on_ranks
from tests.convert_oracles import (
    cli, hf_reference, hf_tensors, make_hf_model, train_converted, training_sequences,
)

STEPS = 5


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random LLaMA (GQA) and its torch_dist conversion (verified at TP=1 by the CLI)."""
    root = tmp_path_factory.mktemp("llama")
    hf, converted = make_hf_model("llama-gqa", str(root / "hf")), str(root / "converted")
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", converted,
                                       "--no-progress"],)) == [0]
    return hf, converted


def test_converted_checkpoint_trains_and_its_export_generates_the_same_tokens(llama, tmp_path):
    hf, converted = llama
    trained, exported = str(tmp_path / "trained"), str(tmp_path / "exported")
    sequences = training_sequences()
    prompt, new_tokens = sequences[0][:6], 10
    # No model flags: the model and its padded vocabulary come from the conversion's megatron_patch_args.json.
    argv = ["--load", converted, "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--seq-length", "16", "--train-iters", str(STEPS), "--lr", "1e-2",
            "--lr-decay-style", "constant", "--log-interval", "1", "--seed", "3", "--save", trained]
    ranks = run_on_ranks(train_converted, 2, args=(argv, sequences, prompt, new_tokens), timeout=300)

    # megatron-to-hf reads the trainer's own save directory (its iter_N and megatron_patch_args.json).
    stored = read_info(converted).model_config
    assert read_info(trained).model_config == dataclasses.replace(stored, seq_length=16)  # the trained length
    assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", trained, "--save-dir", exported,
                                       "--no-progress"],)) == [0]
    [reference] = run_on_ranks(hf_reference, 1, args=(hf, exported, sequences, read_info(converted).padded_vocab_size,
                                                         prompt, new_tokens))

    losses = ranks[0]["losses"]
    assert len(losses) == STEPS and losses[-1] < 0.9 * losses[0], losses
    # Step 1's loss is the converted weights' (not a fresh initialisation's): transformers' on the same batch.
    assert abs(losses[0] - reference["loss"]) < 1e-4 * reference["loss"], (losses[0], reference["loss"])
    original, after = hf_tensors(hf), hf_tensors(exported)
    assert not torch.equal(original["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    assert reference["tokens"] == ranks[0]["tokens"], (reference["tokens"], ranks[0]["tokens"])


def test_model_flag_contradicting_the_loaded_checkpoint_is_refused(llama):
    from megatron_patch.training.arguments import parse_args

    _, converted = llama
    with pytest.raises(SystemExit, match=r"--hidden-size 64 contradicts hidden_size=32 in .*megatron_patch_args"):
        parse_args(["--load", converted, "--hidden-size", "64"])
    with pytest.raises(SystemExit, match=r"--add-qkv-bias \(sets add_qkv_bias=True\) contradicts add_qkv_bias=False"):
        parse_args(["--load", converted, "--add-qkv-bias"])
    args = parse_args(["--load", converted, "--hidden-size", "32", "--seq-length", "16"])
    assert (args.num_layers, args.num_query_groups, args.seq_length) == (4, 2, 16)
    assert args.checkpoint_info.padded_vocab_size == read_info(converted).padded_vocab_size


@pytest.mark.parametrize("command", ["verify", "hf-to-megatron"])
def test_verify_relaunches_itself_on_two_ranks(llama, tmp_path, command):
    """``verify`` at TP=2, alone or ending a conversion (whose own process group exists meanwhile)."""
    hf, converted = llama
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    argv = (["verify", "--hf-dir", hf, "--megatron-dir", converted, "--tensor-model-parallel-size", "2"]
            if command == "verify" else
            ["hf-to-megatron", "--hf-dir", hf, "--save-dir", str(tmp_path / "tp2"), "--target-tensor-parallel-size",
             "2", "--no-progress"])
    done = subprocess.run([sys.executable, "-m", "megatron_patch.cli", "convert", *argv],
                          capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "torch.distributed.run --nproc-per-node=2" in done.stdout
    [line] = [line for line in done.stdout.splitlines() if line.startswith("logits:")]  # one rank reports
    assert line.endswith("PASS") and "top-1 100.0%" in line, line


# A user's script: convert, then train in the same process. The conversion's one-rank world held MASTER_PORT and
# left it in the environment, so the launch that followed failed with EADDRINUSE (issue 53).
_CONVERT_THEN_TRAIN = """
import os, sys, torch
from megatron_patch.convert.core import hf_to_megatron
from megatron_patch.training.launcher import main

hf, converted, logs = sys.argv[1:]
generator = torch.get_rng_state()
hf_to_megatron(hf, converted, progress=False)
left = [what for what, there in (("MASTER_PORT", "MASTER_PORT" in os.environ),
        ("a process group", torch.distributed.is_initialized()),
        ("a reseeded torch generator", not torch.equal(torch.get_rng_state(), generator))) if there]
assert not left, f"the conversion left {left}"
sys.exit(main(["--task", "pretraining", "--mock-data", "--nproc-per-node", "2", "--load", converted,
               "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--seq-length", "16", "--train-iters", "2",
               "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3", "--log-interval", "1",
               "--eval-iters", "0", "--log-dir", logs]))
"""


def test_a_script_converts_and_then_trains_in_the_same_process(tmp_path):
    hf = make_hf_model("llama-gqa", str(tmp_path / "hf"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", _CONVERT_THEN_TRAIN, hf, str(tmp_path / "converted"),
                           str(tmp_path / "logs")], capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "logs" / "iterations.jsonl") as f:
        assert len(f.readlines()) == 2
