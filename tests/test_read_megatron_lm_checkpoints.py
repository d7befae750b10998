"""A checkpoint Megatron-LM's own ``save_checkpoint`` wrote (no ``megatron_patch_args.json``) is read from the
``args`` in its common.pt or rank files: exported to Hugging Face, loaded by the trainer, its flags checked.

The checkpoints hold a tiny random LLaMA laid out as Megatron-LM's trainer lays out a save
(megatron/training/checkpointing.py at core_v0.16.1): ``iter_0000005/`` named by a tracker holding ``5``, no
description or tokenizer directory of ours, no ``args.megatron_patch`` (our own field), ``iteration`` 5. The
torch_dist one is saved from two tensor-parallel ranks (the model's sharded state under "model", Megatron-LM's
common state beside it); the legacy one is a TP=2 x PP=2 conversion's ``mp_rank_TT_PPP`` files, so renamed. What
a Megatron-LM save has besides (optimizer, scheduler and RNG state) the model does not need, and the trainer loads
such a checkpoint as --finetune or --no-load-optim.
"""

import argparse
import glob
import logging
import os
import shutil

import numpy
import pytest
import torch

from megatron_patch.checkpoint.format import CheckpointMismatch, info_from_megatron_lm, load_megatron_file, read_info
from megatron_patch.testing import run_on_ranks
from tests.convert_oracles import _fixed_data_pretrainer, cli, hf_reference, make_hf_model, training_sequences

ITERATION = 5
LAYOUTS = ("torch_dist-tp2", "torch-tp2pp2")


def save_as_megatron_lm(rank, world_size, converted: str, out: str) -> None:
    """Load the conversion at TP=2 and save it from both ranks as Megatron-LM's trainer does: the model's sharded
    state under "model" and its common state (args, checkpoint_version, iteration) in ``out/iter_0000005``."""
    import dataclasses

    from megatron.core import dist_checkpointing

    from megatron_patch.checkpoint.format import megatron_lm_common_state
    from megatron_patch.convert.verify import build_and_load

    info = dataclasses.replace(read_info(converted), tensor_model_parallel_size=world_size)
    [chunk] = build_and_load(converted, info, world_size, 1, "float32")
    common = megatron_lm_common_state(info, ITERATION)
    del common["args"].megatron_patch  # our own field; Megatron-LM's args lack it
    path = os.path.join(out, f"iter_{ITERATION:07d}")
    if rank == 0:
        os.makedirs(path)
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    torch.distributed.barrier()
    dist_checkpointing.save({**common, "model": chunk.sharded_state_dict()}, path)


def as_megatron_lm(converted: str, out: str) -> str:
    """A copy of the legacy conversion ``converted`` in Megatron-LM's trainer layout (see the module docstring)."""
    shutil.copytree(converted, out)
    os.remove(os.path.join(out, "megatron_patch_args.json"))
    shutil.rmtree(os.path.join(out, "hf_tokenizer"), ignore_errors=True)
    os.rename(os.path.join(out, "release"), os.path.join(out, f"iter_{ITERATION:07d}"))
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    files = glob.glob(os.path.join(out, "iter_*", "mp_rank_*", "model_optim_rng.pt"))
    assert len(files) == 4
    for path in files:
        state = load_megatron_file(path)
        del state["args"].megatron_patch
        torch.save({**state, "iteration": ITERATION}, path)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The Hugging Face source and {layout: (our conversion, the same model in Megatron-LM's layout)}."""
    root = tmp_path_factory.mktemp("megatron_lm")
    hf = make_hf_model("llama-gqa", str(root / "hf"), rms_norm_eps=3e-6)

    def convert(out, *flags):
        assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", out, "--no-progress",
                                           "--no-verify", *flags],)) == [0]
        return out

    dist = convert(str(root / "dist"))
    dist_lm = str(root / "dist-megatron-lm")
    run_on_ranks(save_as_megatron_lm, 2, args=(dist, dist_lm), timeout=300)
    legacy = convert(str(root / "legacy"), "--ckpt-format", "torch", "--target-tensor-parallel-size", "2",
                     "--target-pipeline-parallel-size", "2")
    return hf, {"torch_dist-tp2": (dist, dist_lm),
                "torch-tp2pp2": (legacy, as_megatron_lm(legacy, str(root / "legacy-megatron-lm")))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_lm_checkpoint_exports_to_the_source_models_logits(checkpoints, layout, tmp_path):
    """Failed before: megatron-to-hf said '... has no megatron_patch_args.json' even with --model-type."""
    from transformers import AutoModelForCausalLM

    hf, made = checkpoints
    _, megatron_lm = made[layout]
    info = read_info(megatron_lm)
    assert (info.format, info.tensor_model_parallel_size) == (layout.split("-")[0], 2)
    assert info.model_config.layernorm_epsilon == 3e-6 and info.model_config.num_query_groups == 2
    exported = str(tmp_path / "exported")
    assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--model-type", "llama", "--load-dir", megatron_lm,
                                       "--save-dir", exported, "--no-progress"],)) == [0]
    tokens = torch.tensor(training_sequences(2, 12))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf).eval()(input_ids=tokens).logits
        got = AutoModelForCausalLM.from_pretrained(exported).eval()(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def first_losses(rank, world_size, loads, sequences):
    """The first loss of a one-step --finetune run from each of ``loads``; what the trainer logged when resuming
    every second one with --no-load-optim (at its iteration: nothing left to train), and the errors of resuming
    them with their optimizer."""
    from megatron_patch.training.engine import Engine

    common = ["--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "16", "--lr", "1e-3",
              "--lr-decay-style", "constant", "--seed", "3", "--log-interval", "1"]
    losses = []
    for load in loads:
        log = _fixed_data_pretrainer(sequences)(
            engine=Engine(["--load", load, "--finetune", "--train-iters", "1", *common])).train()
        losses.append(log.train_losses[0][1])
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("rapidformer").addHandler(handler)
    for load in loads[1::2]:
        _fixed_data_pretrainer(sequences)(engine=Engine(["--load", load, "--no-load-optim", "--train-iters",
                                                         str(ITERATION), *common])).train()
    refusals = []
    for load in loads[1::2]:
        try:
            _fixed_data_pretrainer(sequences)(engine=Engine(["--load", load, "--train-iters", "6", *common])).train()
            refusals.append(None)
        except Exception as error:  # the UserError of a checkpoint resumed with an optimizer state it lacks
            refusals.append(str(error))
    return losses, messages, refusals


def test_trainer_loads_megatron_lm_checkpoints(checkpoints):
    """Failed before: neither loaded without model flags ('without --load the model needs --tokenizer-type (and
    its files) for its vocabulary'): nothing described the model."""
    hf, made = checkpoints
    (dist, dist_lm), (legacy, legacy_lm) = made["torch_dist-tp2"], made["torch-tp2pp2"]
    sequences = training_sequences()
    [(losses, messages, (dist_refusal, legacy_refusal))] = run_on_ranks(
        first_losses, 1, args=([dist, dist_lm, legacy, legacy_lm], sequences), timeout=400)
    # The same weights, however described: the same first loss as from our own (described) conversion, and
    # transformers' loss of the source model over the checkpoint's padded vocabulary (TP=2 pads the legacy one
    # further: its softmax spans more zero rows, so the two formats' losses differ from each other).
    assert losses[1] == losses[0] and losses[3] == losses[2], losses
    for loss, checkpoint in ((losses[0], dist), (losses[2], legacy)):
        padded = read_info(checkpoint).padded_vocab_size
        reference = hf_reference(0, 1, hf, hf, sequences, padded, sequences[0][:4], 1)["loss"]
        assert loss == pytest.approx(reference, rel=1e-5), (checkpoint, loss, reference)
    # --no-load-optim resumes both at their iteration (Megatron-LM's line, as for our own checkpoints) ...
    for checkpoint in (dist_lm, legacy_lm):
        assert f"successfully loaded checkpoint from {checkpoint} at iteration {ITERATION}" in messages, messages
    # ... and resuming their optimizer is refused in one line: the torch_dist one has none (saved as by
    # Megatron-LM's --no-save-optim), Megatron-LM's per-rank optimizer state is not read.
    assert dist_refusal.endswith("has no optimizer state; pass --finetune or --no-load-optim to load its model")
    assert "Megatron-LM per-rank" in legacy_refusal and "pass --finetune or --no-load-optim" in legacy_refusal


def test_flag_contradicting_megatron_lm_args_is_refused(checkpoints, capsys):
    """Failed before: with no megatron_patch_args.json the flags were not checked against the checkpoint."""
    from megatron_patch.training.arguments import parse_args

    _, made = checkpoints
    _, dist_lm = made["torch_dist-tp2"]
    with pytest.raises(SystemExit) as refused:
        parse_args(["--load", dist_lm, "--hidden-size", "48", "--micro-batch-size", "2"])
    message = str(refused.value)
    assert "--hidden-size 48 contradicts hidden_size=32" in message, message
    assert os.path.join(dist_lm, f"iter_{ITERATION:07d}", "common.pt") in message, message


def _state(**args) -> dict:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=128)
    return {"args": argparse.Namespace(**{**fields, **args}), "checkpoint_version": 3.0, "iteration": 1}


@pytest.mark.parametrize("field, value", [("num_experts", 8), ("squared_relu", True),
                                          ("position_embedding_type", "relative"), ("normalization", "L2Norm")])
def test_args_our_model_cannot_build_are_refused_by_name(field, value):
    """Failed before: there was no reading of Megatron-LM's args at all (no info_from_megatron_lm)."""
    assert info_from_megatron_lm(_state(), "torch_dist", "common.pt").model_config.hidden_size == 32
    with pytest.raises(CheckpointMismatch, match=f"common.pt: args.{field}="):
        info_from_megatron_lm(_state(**{field: value}), "torch_dist", "common.pt")


@pytest.mark.parametrize("args, groups", [
    (dict(num_query_groups=1, group_query_attention=False), 4),  # Megatron-LM's default of 1, GQA off: MHA
    (dict(num_query_groups=2, group_query_attention=True), 2),
    (dict(num_query_groups=4, group_query_attention=True), 4),
])
def test_query_groups_count_only_with_group_query_attention(args, groups):
    """Megatron-LM keeps --num-query-groups' default of 1 when --group-query-attention is off; the model is then
    one group per head, and the sizes it left to their defaults are resolved."""
    config = info_from_megatron_lm(_state(**args), "torch_dist", "common.pt").model_config
    assert (config.num_query_groups, config.ffn_hidden_size, config.kv_channels) == (groups, 128, 8)


def test_rank_file_with_megatron_lm_types_loads_and_leaves_the_safe_globals(tmp_path):
    """Megatron-LM's rank files hold its ModelType in args and numpy's RNG state; both unpickle, and reading one
    leaves megatron-core's safe globals registered (its dist_checkpointing.load of a common.pt needs Namespace).
    Failed before: torch's safe_globals context manager unregistered Namespace on exit, so exporting a
    torch_dist checkpoint after reading its args failed with 'Unsupported global: argparse.Namespace'."""
    from megatron.core.enums import ModelType

    path = str(tmp_path / "model_optim_rng.pt")
    torch.save({**_state(model_type=ModelType.encoder_or_decoder),
                "rng_state": [{"np_rng_state": numpy.random.get_state()}]}, path)
    assert load_megatron_file(path)["args"].model_type == ModelType.encoder_or_decoder
    assert argparse.Namespace in torch.serialization.get_safe_globals()
