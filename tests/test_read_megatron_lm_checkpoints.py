"""A checkpoint Megatron-LM's own ``save_checkpoint`` wrote (no ``megatron_patch_args.json``) is read from the
``args`` in its common.pt or rank files: exported to Hugging Face, loaded by the trainer, its flags checked.

The checkpoints hold a tiny random LLaMA laid out as Megatron-LM's trainer lays out a save
(megatron/training/checkpointing.py at core_v0.16.1): ``iter_0000005/`` named by a tracker holding ``5``, no
description or tokenizer directory of ours, no ``args.megatron_patch`` (our own field), ``iteration`` 5. The
torch_dist one is saved from two tensor-parallel ranks (the model's sharded state under "model", Megatron-LM's
common state beside it); the legacy one is a TP=2 x PP=2 conversion's ``mp_rank_TT_PPP`` files, so renamed. They
hold no optimizer state (as Megatron-LM's --no-save-optim), and the trainer loads them as --finetune or
--no-load-optim.

A training run's save with its optimizer is written as Megatron-LM 0.16.1 writes one (``save_as_megatron_lm_run``:
the distributed optimizer's state in its ``dp_reshardable`` buckets, the content metadata, scheduler, iteration and
consumed samples in common.pt); a plain ``--load`` resumes it where the saving run would have gone on. So does one
saved as Megatron-LM's per-rank files (``save_as_megatron_lm_legacy_run``: each rank file with its optimizer's
``state_dict`` and scheduler, the distributed optimizer's state in ``distrib_optim.pt`` beside it).
"""

import argparse
import glob
import importlib.metadata
import os
import shutil

import numpy
import pytest
import torch

from megatron_patch import compat
from megatron_patch.checkpoint.format import (
    CheckpointMismatch, info_from_megatron_lm, load_megatron_file, read_args_state, read_info,
)
from megatron_patch.errors import UserError
from megatron_patch.testing import logged_messages, run_on_ranks
from tests.convert_oracles import _fixed_data_pretrainer, cli, hf_reference, make_hf_model, training_sequences

ITERATION = 5
LAYOUTS = ("torch_dist-tp2", "torch-tp2pp2", "torch-tp2pp2-te")


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


def as_transformer_engine(megatron_lm: str, out: str) -> str:
    """A copy of the per-rank checkpoint ``megatron_lm`` as Megatron-LM writes it with Transformer Engine's layers
    (its default ``--transformer-impl``): each pre-norm under the linear layer it fuses into, and TE's FP8
    metadata in ``_extra_state``, a tensor in newer TE versions and a ``BytesIO`` in older ones."""
    import io

    shutil.copytree(megatron_lm, out)
    for path in glob.glob(os.path.join(out, "iter_*", "mp_rank_*", "model_optim_rng.pt")):
        state = load_megatron_file(path)
        model = {}
        for name, value in state["model"].items():
            name = (name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
                    .replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
            model[name] = value
            if name.endswith(("linear_qkv.weight", "linear_fc1.weight")):
                model[name.replace(".weight", "._extra_state")] = torch.zeros(0, dtype=torch.uint8)
            elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
                model[name.replace(".weight", "._extra_state")] = io.BytesIO()
        assert any("layer_norm_weight" in name for name in model)
        torch.save({**state, "model": model}, path)
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
    legacy_lm = as_megatron_lm(legacy, str(root / "legacy-megatron-lm"))
    return hf, {"torch_dist-tp2": (dist, dist_lm), "torch-tp2pp2": (legacy, legacy_lm),
                "torch-tp2pp2-te": (legacy, as_transformer_engine(legacy_lm, str(root / "legacy-te")))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_lm_checkpoint_exports_to_the_source_models_logits(checkpoints, layout, tmp_path):
    """Failed before: megatron-to-hf said '... has no megatron_patch_args.json' even with --model-type; and, with
    Transformer Engine's names, 'decoder.layers.0.self_attention.linear_qkv.layer_norm_weight ... is not a tensor
    of the model'."""
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


@pytest.fixture(scope="module")
def gpt2_megatron_lm(tmp_path_factory):
    """A tiny random GPT-2 and the same model in Megatron-LM's per-rank layout (TP=2 x PP=2)."""
    root = tmp_path_factory.mktemp("gpt2")
    hf = make_hf_model("gpt2", str(root / "hf"))
    legacy = str(root / "legacy")
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", legacy, "--no-progress",
                                       "--no-verify", "--ckpt-format", "torch", "--target-tensor-parallel-size", "2",
                                       "--target-pipeline-parallel-size", "2"],)) == [0]
    return hf, as_megatron_lm(legacy, str(root / "megatron-lm"))


@pytest.mark.parametrize("kind", ["llama-torch_dist-tp2", "gpt2-torch-tp2pp2"])
def test_megatron_lm_checkpoint_exports_as_the_model_type_its_args_describe(checkpoints, gpt2_megatron_lm, kind,
                                                                            tmp_path):
    """Megatron-LM's args say which block the model is: RMSNorm + SwiGLU + RoPE without biases is LLaMA's,
    LayerNorm + GELU + learned positions with biases GPT-2's; megatron-to-hf exports it as that model type without
    --model-type, to the source model's logits. Failed before: '... records no Hugging Face config; pass
    --model-type'."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, megatron_lm = (checkpoints[0], checkpoints[1]["torch_dist-tp2"][1]) if kind.startswith("llama") else (
        gpt2_megatron_lm)
    exported = str(tmp_path / "exported")
    assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", megatron_lm, "--save-dir", exported,
                                       "--no-progress"],)) == [0]
    assert AutoConfig.from_pretrained(exported).model_type == AutoConfig.from_pretrained(hf).model_type
    tokens = torch.tensor(training_sequences(2, 12))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf).eval()(input_ids=tokens).logits
        got = AutoModelForCausalLM.from_pretrained(exported).eval()(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_megatron_lm_checkpoint_of_no_recognised_block_needs_model_type(checkpoints, tmp_path):
    """A block that is neither LLaMA's nor GPT-2's (here LLaMA's with LayerNorm) names no model type: the export is
    refused in one line naming --model-type and its choices, before anything is written. Failed before: the line
    named no choices."""
    from megatron_patch.convert.core import megatron_to_hf
    from megatron_patch.model.conversion import FAMILIES, UnsupportedCheckpoint

    _, made = checkpoints
    layer_norm = str(tmp_path / "layer-norm")
    shutil.copytree(made["torch-tp2pp2"][1], layer_norm)
    for path in glob.glob(os.path.join(layer_norm, "iter_*", "mp_rank_*", "model_optim_rng.pt")):
        state = load_megatron_file(path)
        state["args"].normalization = "LayerNorm"
        torch.save(state, path)
    exported = str(tmp_path / "exported")
    with pytest.raises(UnsupportedCheckpoint) as refused:
        megatron_to_hf(layer_norm, exported, progress=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{layer_norm} records no Hugging Face config"), message
    assert message.endswith(f"; pass --model-type, one of {', '.join(sorted(FAMILIES))}"), message
    assert not os.path.exists(exported)


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
    with logged_messages() as messages:
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
    # Megatron-LM's --no-save-optim), the per-rank one was saved at TP=2 x PP=2, where its state would be indexed.
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
    assert compat.common_state_source(os.path.join(dist_lm, f"iter_{ITERATION:07d}")) in message, message


def _common_state(iteration: str) -> dict:
    """The common state of a torch_dist save, where the saving megatron-core kept it: common.pt (0.16.1), or the
    "common_state" object DCP's .metadata indexes (0.19)."""
    return read_args_state(compat.common_state_source(iteration))


def _rewrite_common_state(iteration: str, state: dict) -> None:
    """Replace a torch_dist save's common state with ``state``, as a common.pt: both ends of the tested range read
    one first (0.19: dist_checkpointing/serialization.py's load_common_state_dict), and Megatron-LM saves of 0.16.1 hold
    it so. Written aside and renamed: ``state`` may be memory-mapped from the file it replaces (``read_args_state``)."""
    path = os.path.join(iteration, compat.COMMON_STATE_FILE)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def _state(**args) -> dict:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=128)
    return {"args": argparse.Namespace(**{**fields, **args}), "checkpoint_version": 3.0, "iteration": 1}


@pytest.mark.parametrize("field, value", [("mtp_num_layers", 1), ("squared_relu", True),
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


def _anonymous_memory() -> int:
    """This process's RssAnon in bytes: memory it allocated, not the file pages it maps."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "before-torch-1.6"])
def test_the_args_of_a_rank_file_are_read_without_loading_its_tensors(tmp_path, zip_format):
    """Reading a checkpoint's description (find_info, the resume's recorded samples) maps a rank file instead of
    loading it: its 128 MB of tensors take no memory. Failed before: the whole file was loaded for its args. A file
    of torch's older format, which torch cannot map, is read whole as before."""
    path = str(tmp_path / "model_optim_rng.pt")
    size = 128 << 20
    torch.save({**_state(), "model": {"embedding.word_embeddings.weight": torch.ones(size, dtype=torch.uint8)}}, path,
               _use_new_zipfile_serialization=zip_format)
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # the reader's first step, here before the measure: importing megatron-core takes memory
    before = _anonymous_memory()
    state = load_megatron_file(path, mapped=True)
    grown = _anonymous_memory() - before
    assert state["args"].hidden_size == 32 and state["model"]["embedding.word_embeddings.weight"].numel() == size
    assert grown < size // 4 if zip_format else grown >= size, grown


# The Megatron-LM run saves after SAVED_AT iterations; the resumed run and its reference go on to 4. The schedule
# (a warm-up iteration at lr 0, cosine decay over 8) does not depend on --train-iters, so every run shares it.
SAVED_AT = 2
RUN_FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "16", "--lr", "1e-3",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "8", "--seed", "3",
             "--log-interval", "1",
             # A resume here goes on to a longer --train-iters, so the scheduler's weight-decay iterations (train
             # iters x global batch) differ from the save's; Megatron-LM refuses that without one of its two flags.
             "--use-checkpoint-opt_param-scheduler"]


def save_as_megatron_lm_run(trainer, out: str, **flags) -> None:
    """Save ``trainer``'s model, optimizer and scheduler in ``out`` as Megatron-LM 0.16.1's ``save_checkpoint``
    does (megatron/training/checkpointing.py at core_v0.16.1): ``_build_sharded_state_dict_metadata``'s metadata
    (the distributed optimizer's default 'dp_reshardable' without --dist-ckpt-optim-fully-reshardable) for the
    model's and the optimizer's sharded state alike (``generate_state_dict``), saved as common.pt's
    ``content_metadata`` beside ``args`` (the layout, ``consumed_train_samples``), ``iteration``,
    ``opt_param_scheduler`` and the RNG state as a ShardedObject (``get_rng_state``). ``flags``: args the
    Megatron-LM run's other flags set, as its parse_args keeps them (``tokenizer_type``, ``vocab_size``)."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_patch.checkpoint.format import megatron_lm_common_state

    distributed = trainer.config.training.use_distributed_optimizer
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed:
        metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    state = megatron_lm_common_state(
        trainer.checkpoint_info, trainer.iteration, consumed_train_samples=trainer.consumed_samples,
        use_distributed_optimizer=distributed, data_parallel_size=parallel_state.get_data_parallel_world_size(),
        world_size=torch.distributed.get_world_size(), **flags)
    del state["args"].megatron_patch  # our own field; Megatron-LM's args lack it
    with_group = {**metadata, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    [chunk] = trainer.model
    while hasattr(chunk, "module"):  # Megatron-LM's unwrap_model: DDP and Float16Module off
        chunk = chunk.module
    state["model"] = chunk.sharded_state_dict(metadata=dict(with_group))
    state["optimizer"] = trainer.optimizer.sharded_state_dict(state, metadata=dict(with_group))
    state["opt_param_scheduler"] = trainer.lr_scheduler.state_dict()
    # One object per pipeline x tensor rank, replicated over data-parallel ranks (get_rng_state's torch_dist case).
    ps = parallel_state
    state["rng_state"] = ShardedObject(
        "rng_state", [{"torch_rng_state": torch.get_rng_state()}],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
    state["num_floating_point_operations_so_far"] = 0
    path = os.path.join(out, f"iter_{trainer.iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(path)
    torch.distributed.barrier()
    dist_checkpointing.save(state, path, content_metadata=metadata)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(trainer.iteration))
    torch.distributed.barrier()


def _run(load: str, train_iters: int, sequences, flags):
    from megatron_patch.training.engine import Engine

    return _fixed_data_pretrainer(sequences)(
        engine=Engine(["--load", load, "--train-iters", str(train_iters), *RUN_FLAGS, *flags]))


def _optimizer_state(trainer) -> dict:
    """This rank's Adam state (per parameter in order: the fp32 main parameter, its moments and step), the
    scheduler's state, the iteration and the consumed samples."""
    adam = [{"param": param.detach().clone(), **{k: v.clone() for k, v in part.optimizer.state[param].items()}}
            for part in trainer.optimizer.chained_optimizers
            for group in part.optimizer.param_groups for param in group["params"]]
    return {"adam": adam, "scheduler": trainer.lr_scheduler.state_dict(), "iteration": trainer.iteration,
            "consumed_samples": trainer.consumed_samples}


def train_and_save_as_megatron_lm(rank, world_size, converted, out, sequences, flags):
    """Train SAVED_AT iterations from ``converted`` and save them as Megatron-LM does in ``out``; return their
    losses, the state saved, and the losses of an unbroken 4-iteration run (the reference for a resume)."""
    saving = _run(converted, SAVED_AT, sequences, flags)
    losses = saving.train().train_losses
    save_as_megatron_lm_run(saving, out)
    return {"losses": losses, "saved": _optimizer_state(saving),
            "unbroken": _run(converted, 4, sequences, flags).train().train_losses}


def resume(rank, world_size, load, sequences, flags):
    """The state right after loading ``load`` (a run whose --train-iters it has reached), and the losses and
    messages of resuming it up to iteration 4."""
    loaded = _run(load, SAVED_AT, sequences, flags)
    loaded.train()
    with logged_messages() as messages:
        losses = _run(load, 4, sequences, flags).train().train_losses
    return {"loaded": _optimizer_state(loaded), "losses": losses, "messages": messages}


def _assert_resumed_exactly(saves: list, resumes: list) -> None:
    """Each rank's resume loaded the saved iteration, samples, scheduler and Adam state bit for bit, and its next
    iterations are those of the run that did not stop."""
    for rank, (save, resumed) in enumerate(zip(saves, resumes)):
        saved, loaded = save["saved"], resumed["loaded"]
        assert (loaded["iteration"], loaded["consumed_samples"]) == (SAVED_AT, SAVED_AT * 4)
        assert loaded["scheduler"] == saved["scheduler"] and saved["scheduler"]["num_steps"] == SAVED_AT * 4
        assert len(loaded["adam"]) == len(saved["adam"]) > 0
        for got, expected in zip(loaded["adam"], saved["adam"]):
            assert got.keys() == expected.keys() >= {"param", "exp_avg", "exp_avg_sq", "step"}
            assert int(got["step"]) == SAVED_AT, (rank, got["step"])
            for key in expected:
                assert torch.equal(got[key], expected[key]), (rank, key)
        assert resumed["losses"] == save["unbroken"][SAVED_AT:], (resumed["losses"], save["unbroken"])


@pytest.mark.parametrize("world_size, flags", [
    (1, ["--use-distributed-optimizer"]), (2, ["--use-distributed-optimizer", "--bf16"]), (1, ["--bf16"]),
], ids=["distributed-dp1-fp32", "distributed-dp2-bf16", "plain-bf16"])
def test_trainer_resumes_megatron_lm_optimizer_state(checkpoints, tmp_path, world_size, flags):
    """Failed before: the distributed optimizer's 'dp_reshardable' state did not load ("KeyError:
    optimizer.state.param.decoder.final_layernorm.weight from model not in state dict": the state to load was built
    as our 'fully_reshardable'), and in bf16 the loaded conversion's weights were lost at the first step (the
    optimizer's main parameters kept the weights the model was built with)."""
    _, made = checkpoints
    converted, _ = made["torch_dist-tp2"]  # our TP=1 conversion
    out = str(tmp_path / "megatron-lm")
    sequences = training_sequences()
    saves = run_on_ranks(train_and_save_as_megatron_lm, world_size, args=(converted, out, sequences, flags),
                         timeout=400)
    resumes = run_on_ranks(resume, world_size, args=(out, sequences, flags), timeout=400)
    common = _common_state(os.path.join(out, f"iter_{SAVED_AT:07d}"))
    distributed = "--use-distributed-optimizer" in flags
    assert common["args"].consumed_train_samples == SAVED_AT * 4 and common["iteration"] == SAVED_AT
    assert common["content_metadata"].get("distrib_optim_sharding_type") == (
        "dp_reshardable" if distributed else None)
    assert (common["optimizer"].get("param_state_sharding_type") == "dp_reshardable") == distributed
    for save in saves:
        # The warm-up iteration (lr 0) leaves the loaded weights as they were.
        assert save["losses"][1][1] == save["losses"][0][1], save["losses"]
    _assert_resumed_exactly(saves, resumes)
    # The last rank logs (it holds the loss).
    assert f"successfully loaded checkpoint from {out} at iteration {SAVED_AT}" in resumes[-1]["messages"]
    if not distributed:
        # The plain optimizer's state is keyed by parameter, not laid out as the distributed optimizer's.
        [[refusal]] = run_on_ranks(refusals, 1, args=(sequences, [(out, [*flags, "--use-distributed-optimizer"])]),
                                   timeout=400)
        assert refusal == (
            f"--load {out}: {os.path.join(out, f'iter_{SAVED_AT:07d}')} holds the state of an optimizer saved "
            "without the distributed optimizer, which megatron-core does not load into one; resume without "
            "--use-distributed-optimizer and --zero-*-memory-optimization, or pass --finetune or --no-load-optim to "
            "load the model alone")


def refusals(rank, world_size, sequences, loads):
    """The one-line error of resuming each ``(directory, flags)`` of ``loads``."""
    errors = []
    for load, flags in loads:
        with pytest.raises(UserError) as refused:
            _run(load, 4, sequences, flags).train()
        errors.append(str(refused.value))
    return errors


def as_before_megatron_core_0_13(saved: str, out: str) -> str:
    """A copy of the Megatron-LM save ``saved`` as one from before megatron-core 0.13 records it: no content
    metadata, the distributed optimizer's state sharded as 'fully_sharded_model_space' (its default then, with
    --ckpt-fully-parallel-save)."""
    shutil.copytree(saved, out)
    iteration = os.path.join(out, f"iter_{SAVED_AT:07d}")
    common = _common_state(iteration)
    del common["content_metadata"]
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_model_space"
    _rewrite_common_state(iteration, common)
    return out


def test_megatron_lm_optimizer_buckets_reshard_across_data_parallel_ranks_only(checkpoints, tmp_path):
    """Failed before: any resume of the 'dp_reshardable' state failed on the missing keys. megatron-core reshards
    that state across data-parallel ranks, not to another tensor/pipeline layout or another optimizer, and reads
    no 'fully_sharded_model_space' state at all: the trainer says so before its loader fails."""
    _, made = checkpoints
    converted, _ = made["torch_dist-tp2"]
    out = str(tmp_path / "megatron-lm")
    sequences = training_sequences()
    distributed = ["--use-distributed-optimizer"]
    [save] = run_on_ranks(train_and_save_as_megatron_lm, 1, args=(converted, out, sequences, distributed),
                          timeout=400)
    # At DP=2 the same global batch is split over two ranks: equal to float rounding (the reduction order).
    resumed = run_on_ranks(resume, 2, args=(out, sequences, distributed), timeout=400)
    for rank in resumed:
        assert [i for i, _ in rank["losses"]] == [3, 4]
        assert [loss for _, loss in rank["losses"]] == pytest.approx(
            [loss for _, loss in save["unbroken"][SAVED_AT:]], rel=1e-5)
    old = as_before_megatron_core_0_13(out, str(tmp_path / "before-0.13"))
    at_tp2, without, flattened = run_on_ranks(refusals, 2, args=(sequences, [
        (out, [*distributed, "--tensor-model-parallel-size", "2"]), (out, []), (old, distributed)]), timeout=400)[0]
    path = os.path.join(out, f"iter_{SAVED_AT:07d}")
    assert at_tp2 == (
        f"--load {out}: {path} holds the distributed optimizer's state in its buckets ('dp_reshardable', "
        "Megatron-LM's default format), which loads at another data-parallel size but only at the tensor/pipeline "
        "layout it was saved at: saved at TP=1 PP=1 VPP=1 DP=1, requested TP=2 PP=1 VPP=1 DP=1; resume at TP=1 PP=1 "
        "VPP=1, pass --no-load-optim to load the model alone with a new optimizer state, or reshard it first: "
        f"megatron-patch checkpoint reshard --load-dir {out} --save-dir RESHARDED --target-tensor-parallel-size 2 "
        "--target-pipeline-parallel-size 1, then --load RESHARDED")
    assert "requested TP=1 PP=1 VPP=1 DP=2 without the distributed optimizer" in without, without
    assert flattened.startswith(f"--load {old}: ") and flattened.endswith(
        "('fully_sharded_model_space', Megatron-LM's before megatron-core 0.13), which megatron-core "
        f"{importlib.metadata.version('megatron-core')} no longer reads; pass --finetune or --no-load-optim to load "
        "the model alone"), flattened


# A GPT trained from scratch (Megatron-LM's --tokenizer-type NullTokenizer --vocab-size 1000, or a tokenizer's files)
# at TP=2, without dropout (its RNG state is not part of a Megatron-LM save, so a resume would draw other masks).
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
FROM_SCRATCH = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                "--max-position-embeddings", "16", "--hidden-dropout", "0", "--attention-dropout", "0",
                "--tensor-model-parallel-size", "2"]


def save_from_scratch_then_resume(rank, world_size, out, resaved, sequences, tokenizer, saved_args, other):
    """Train SAVED_AT iterations of a model with the ``tokenizer`` flags from scratch and save them as Megatron-LM
    does, with the args its flags set (``saved_args``); then resume that save with the same tokenizer flags up to 4
    (saving in ``resaved``). Return the losses of both and of an unbroken 4-iteration run, what the resume logged,
    and the error of resuming it with the ``other`` tokenizer flags."""
    from megatron_patch.training.engine import Engine

    def run(train_iters, *flags):
        return _fixed_data_pretrainer(sequences)(engine=Engine(["--train-iters", str(train_iters), *RUN_FLAGS,
                                                                *flags]))

    saving = run(SAVED_AT, *FROM_SCRATCH, *tokenizer)
    losses = saving.train().train_losses
    save_as_megatron_lm_run(saving, out, **saved_args)
    unbroken = run(4, *FROM_SCRATCH, *tokenizer).train().train_losses
    with logged_messages() as messages:
        resumed = run(4, "--load", out, "--save", resaved, "--tensor-model-parallel-size", "2", *tokenizer)
        resumed_losses = resumed.train().train_losses
    with pytest.raises(SystemExit) as refused:
        run(4, "--load", out, "--tensor-model-parallel-size", "2", *other).train()
    return {"losses": losses, "unbroken": unbroken, "resumed": resumed_losses, "messages": messages,
            "refusal": str(refused.value)}


def test_null_tokenizer_checkpoint_resumes_with_the_flags_it_was_trained_with(tmp_path):
    """Megatron-LM keeps --vocab-size as given in args.vocab_size, and its NullTokenizer adds eod after those ids
    (vocab_size + 1 tokens); it resumes such a save with the same flags. Failed before: "--tokenizer-type
    NullTokenizer has 1001 tokens but .../megatron_patch_args.json records vocab_size=1000" (args.vocab_size read as
    the tokenizer's size), and our own save recorded vocab_size=1001 where Megatron-LM records its flag, 1000."""
    out, resaved = str(tmp_path / "megatron-lm"), str(tmp_path / "resumed")
    # Another NullTokenizer: its eod is another id. The last rank logs (it holds the loss).
    other = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "999"]
    saved = run_on_ranks(save_from_scratch_then_resume, 2, args=(
        out, resaved, training_sequences(), NULL_TOKENIZER, {"tokenizer_type": "NullTokenizer", "vocab_size": 1000},
        other), timeout=400)[-1]
    common_pt = compat.common_state_source(os.path.join(out, f"iter_{SAVED_AT:07d}"))
    args = read_args_state(common_pt)["args"]
    # The save is laid out as Megatron-LM's: its flag, and the embedding rows _vocab_size_with_padding gives 1001
    # tokens at --make-vocab-size-divisible-by 128 x TP=2.
    assert (args.tokenizer_type, args.vocab_size, args.padded_vocab_size) == ("NullTokenizer", 1000, 1024)
    assert not os.path.exists(os.path.join(out, "megatron_patch_args.json"))
    assert f"successfully loaded checkpoint from {out} at iteration {SAVED_AT}" in saved["messages"]
    assert saved["resumed"] == saved["unbroken"][SAVED_AT:], (saved["resumed"], saved["unbroken"])
    assert saved["refusal"].startswith(f"rapidformer: error: --tokenizer-type NullTokenizer has 1000 tokens but "
                                       f"{common_pt} describes a vocabulary of 1001: "), saved["refusal"]
    assert saved["refusal"].endswith("or, for a NullTokenizer, its --vocab-size"), saved["refusal"]
    # Our own save of the resumed run records the flag as Megatron-LM does, and reads back as the same vocabulary.
    common = _common_state(os.path.join(resaved, "iter_0000004"))
    assert (common["args"].tokenizer_type, common["args"].vocab_size) == ("NullTokenizer", 1000)
    assert info_from_megatron_lm(common, "torch_dist", "common.pt").model_config.vocab_size == 1001


def test_checkpoint_of_a_tokenizer_from_files_resumes_with_the_flags_it_was_trained_with(tmp_path, tmp_path_factory):
    """Without --vocab-size (a GPT-2 BPE tokenizer from its files) Megatron-LM's args keep vocab_size None and only the
    embedding's padded rows; it resumes such a save with the same files. Failed before: "--tokenizer-type
    GPT2BPETokenizer has 1000 tokens but .../common.pt describes a vocabulary of 1024" (the padded rows read as the
    tokenizer's size). A tokenizer that pads to other rows is refused in one line."""
    from conftest_data import data_assets

    files = data_assets(tmp_path_factory).options["GPT2BPETokenizer"]
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files["vocab_file"],
                 "--merge-file", files["merge_file"]]
    out, resaved = str(tmp_path / "megatron-lm"), str(tmp_path / "resumed")
    other = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "2000"]  # 2001 tokens: 2048 rows at TP=2
    saved = run_on_ranks(save_from_scratch_then_resume, 2, args=(
        out, resaved, training_sequences(), tokenizer, {"tokenizer_type": "GPT2BPETokenizer", "vocab_size": None},
        other), timeout=400)[-1]
    common_pt = compat.common_state_source(os.path.join(out, f"iter_{SAVED_AT:07d}"))
    args = read_args_state(common_pt)["args"]
    assert (args.tokenizer_type, args.vocab_size, args.padded_vocab_size) == ("GPT2BPETokenizer", None, 1024)
    assert f"successfully loaded checkpoint from {out} at iteration {SAVED_AT}" in saved["messages"]
    assert saved["resumed"] == saved["unbroken"][SAVED_AT:], (saved["resumed"], saved["unbroken"])
    assert saved["refusal"].startswith(f"rapidformer: error: --tokenizer-type NullTokenizer has 2001 tokens, 2048 "
                                       f"rows at TP=2, but {common_pt} stores 1024 rows: "), saved["refusal"]


def resume_at_recorded_samples(rank, world_size, load, save, sequences):
    """The losses of resuming ``load`` for one iteration (saving it in ``save``), and the first loss of the
    loaded weights on the data from sample 12 on (a --finetune run that starts there: the reference)."""
    resumed = _run(load, SAVED_AT + 1, sequences, ["--save", save])
    losses = resumed.train().train_losses
    reference = _run(load, 1, sequences[12:], ["--finetune"]).train().train_losses
    return {"losses": losses, "consumed": resumed.consumed_samples, "reference": reference}


def test_resume_continues_at_the_samples_the_checkpoint_records(checkpoints, tmp_path):
    """A run whose batch ramped up (or whose --global-batch-size changed) consumed other than iteration x batch
    samples; Megatron-LM's load_checkpoint resumes its data at the args' consumed_train_samples and carries
    skipped_train_samples. Failed before: the trainer recomputed 2 x 4 = 8 from the iteration, so it trained on
    samples 8-11 instead of 12-15 and saved consumed_train_samples 12, skipped_train_samples 0."""
    _, made = checkpoints
    converted, _ = made["torch_dist-tp2"]
    out, resaved = str(tmp_path / "megatron-lm"), str(tmp_path / "resumed")
    sequences = training_sequences(16)  # 16 distinct samples: from sample 8 and from 12 are other batches
    run_on_ranks(train_and_save_as_megatron_lm, 1, args=(converted, out, sequences, []), timeout=400)
    iteration = os.path.join(out, f"iter_{SAVED_AT:07d}")
    common = _common_state(iteration)
    common["args"].consumed_train_samples, common["args"].skipped_train_samples = 12, 3
    _rewrite_common_state(iteration, common)
    [result] = run_on_ranks(resume_at_recorded_samples, 1, args=(out, resaved, sequences), timeout=400)
    # The first resumed iteration's loss is the loaded weights' on samples 12-15 (before its update).
    assert result["losses"][0] == (SAVED_AT + 1, result["reference"][0][1]), result
    assert result["consumed"] == 16
    args = _common_state(os.path.join(resaved, f"iter_{SAVED_AT + 1:07d}"))["args"]
    assert (args.consumed_train_samples, args.skipped_train_samples) == (16, 3)


def save_as_megatron_lm_legacy_run(trainer, out: str) -> None:
    """Save ``trainer``'s model, optimizer and scheduler in ``out`` as Megatron-LM 0.16.1's ``save_checkpoint``
    does with --ckpt-format torch (megatron/training/checkpointing.py at core_v0.16.1): with the distributed
    optimizer every data-parallel rank takes part in ``save_parameter_state`` (gathered into ``distrib_optim.pt``
    by DP rank 0), then DP rank 0 of each TP x PP rank writes ``mp_rank_TT[_PPP]/model_optim_rng.pt``: args,
    checkpoint_version, iteration, the unwrapped model's ``state_dict_for_save_checkpoint``, the optimizer's
    ``state_dict``, ``opt_param_scheduler`` and ``rng_state`` (``get_rng_state``'s list, one per DP rank saved)."""
    import random

    from megatron.core import parallel_state, tensor_parallel

    from megatron_patch.checkpoint.format import megatron_lm_common_state
    from megatron_patch.checkpoint.legacy import rank_dir_name

    training = trainer.config.training
    state = megatron_lm_common_state(
        trainer.checkpoint_info, trainer.iteration, consumed_train_samples=trainer.consumed_samples,
        use_distributed_optimizer=training.use_distributed_optimizer, ckpt_format="torch",
        data_parallel_size=parallel_state.get_data_parallel_world_size(), world_size=torch.distributed.get_world_size())
    del state["args"].megatron_patch  # our own field; Megatron-LM's args lack it
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    here = os.path.join(out, f"iter_{trainer.iteration:07d}", rank_dir_name(
        parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(), pp))
    os.makedirs(here, exist_ok=True)
    if training.use_distributed_optimizer:
        trainer.optimizer.save_parameter_state(os.path.join(here, "distrib_optim.pt"))
    if parallel_state.get_data_parallel_rank() == 0:
        [chunk] = trainer.model
        while hasattr(chunk, "module"):  # Megatron-LM's unwrap_model: DDP and Float16Module off
            chunk = chunk.module
        rng = {"random_rng_state": random.getstate(), "np_rng_state": numpy.random.get_state(),
               "torch_rng_state": torch.get_rng_state(),
               "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
        torch.save({**state, "model": chunk.state_dict_for_save_checkpoint(),
                    "optimizer": trainer.optimizer.state_dict(),
                    "opt_param_scheduler": trainer.lr_scheduler.state_dict(), "rng_state": [rng],
                    "num_floating_point_operations_so_far": 0},
                   os.path.join(here, "model_optim_rng.pt"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(trainer.iteration))
    torch.distributed.barrier()


def train_and_save_as_megatron_lm_legacy(rank, world_size, converted, out, sequences, flags):
    """As train_and_save_as_megatron_lm, saved as Megatron-LM's per-rank (--ckpt-format torch) files."""
    saving = _run(converted, SAVED_AT, sequences, flags)
    losses = saving.train().train_losses
    save_as_megatron_lm_legacy_run(saving, out)
    return {"losses": losses, "saved": _optimizer_state(saving),
            "unbroken": _run(converted, 4, sequences, flags).train().train_losses}


@pytest.mark.parametrize("world_size, flags", [
    (1, ["--bf16"]), (2, ["--tensor-model-parallel-size", "2"]), (2, ["--use-distributed-optimizer", "--bf16"]),
], ids=["plain-bf16", "plain-tp2-fp32", "distributed-dp2-bf16"])
def test_trainer_resumes_megatron_lm_legacy_optimizer_state(checkpoints, tmp_path, world_size, flags):
    """Failed before: a plain --load of Megatron-LM's per-rank files was refused ("... whose optimizer state is not
    read; pass --finetune or --no-load-optim"); now each rank resumes its own file's optimizer (with the
    distributed optimizer's distrib_optim.pt) and scheduler where the saving run would have gone on."""
    _, made = checkpoints
    converted, _ = made["torch_dist-tp2"]  # our TP=1 conversion
    out = str(tmp_path / "megatron-lm")
    sequences = training_sequences()
    saves = run_on_ranks(train_and_save_as_megatron_lm_legacy, world_size,
                         args=(converted, out, sequences, flags), timeout=400)
    resumes = run_on_ranks(resume, world_size, args=(out, sequences, flags), timeout=400)
    assert read_info(out).format == "torch"
    _assert_resumed_exactly(saves, resumes)
    assert any("loaded the model, optimizer and scheduler of" in m for m in resumes[-1]["messages"])


def test_megatron_lm_legacy_optimizer_state_at_another_layout_or_kind_is_refused(checkpoints, tmp_path):
    """The per-rank optimizer state is indexed by the saved layout's parameters and shaped by the optimizer's kind
    and precision: another layout, optimizer or precision is refused by name before anything is loaded."""
    _, made = checkpoints
    converted, _ = made["torch_dist-tp2"]
    out = str(tmp_path / "megatron-lm")
    sequences = training_sequences()
    run_on_ranks(train_and_save_as_megatron_lm_legacy, 1, args=(converted, out, sequences, ["--bf16"]), timeout=400)
    at_tp2, distributed, fp32 = run_on_ranks(refusals, 2, args=(sequences, [
        (out, ["--bf16", "--tensor-model-parallel-size", "2"]), (out, ["--bf16", "--use-distributed-optimizer"]),
        (out, [])]), timeout=400)[0]
    path = os.path.join(out, f"iter_{SAVED_AT:07d}")
    model_alone = "pass --finetune or --no-load-optim to load its model"
    assert at_tp2 == (
        f"--load {out}: {path} holds Megatron-LM per-rank (--ckpt-format torch) optimizer state of TP=1 PP=1, "
        f"indexed by that layout's parameters; requested TP=2 PP=1: resume at TP=1 PP=1, or {model_alone}")
    rank_file = os.path.join(path, "mp_rank_00", "model_optim_rng.pt")
    assert distributed == (
        f"--load {out}: {rank_file} holds the state of an optimizer run with --bf16, which does not load into one "
        f"run with --use-distributed-optimizer --bf16: resume with the saving run's flags, or {model_alone}")
    assert fp32.endswith("which does not load into one run with neither --use-distributed-optimizer nor "
                         f"--bf16/--fp16: resume with the saving run's flags, or {model_alone}"), fp32


@pytest.mark.parametrize("flags", [["--use-distributed-optimizer"], []], ids=["distributed", "plain"])
def test_megatron_lm_legacy_optimizer_state_resumes_at_another_data_parallel_size(checkpoints, tmp_path, flags):
    """Saved at DP=1, resumed at DP=2: megatron-core scatters distrib_optim.pt's buckets over the two ranks (a
    plain optimizer's state is the same on both); the resumed iterations are the unbroken run's, to float rounding
    (the same global batch is reduced over two ranks)."""
    _, made = checkpoints
    converted, _ = made["torch_dist-tp2"]
    out = str(tmp_path / "megatron-lm")
    sequences = training_sequences()
    [save] = run_on_ranks(train_and_save_as_megatron_lm_legacy, 1, args=(converted, out, sequences, flags),
                          timeout=400)
    for rank in run_on_ranks(resume, 2, args=(out, sequences, flags), timeout=400):
        assert [i for i, _ in rank["losses"]] == [3, 4]
        assert [loss for _, loss in rank["losses"]] == pytest.approx(
            [loss for _, loss in save["unbroken"][SAVED_AT:]], rel=1e-5)
