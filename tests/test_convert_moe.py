"""HF -> Megatron -> HF for Mixtral, Qwen2-MoE (shared expert behind a sigmoid gate, pre-softmax routing) and
Qwen3-MoE (renormalised top-k, QK-norm, tied embeddings), tiny random models with GQA and an odd vocabulary:
megatron-core's forward equals transformers' at EP=2 (the conversion's own verify), TP=2, TP=2 x EP=2 and
PP=2 x EP=2; each EP rank holds its own experts; every tensor comes back bit for bit, also from a checkpoint
re-saved by EP ranks; the export loads with this transformers and generates the source's greedy tokens, as does
megatron-core at EP=2. Router options our MoE layer cannot compute are refused by name, both from Hugging Face
configs and from Megatron-LM's args."""

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_patch.checkpoint.format import (
    CheckpointInfo, CheckpointMismatch, info_from_megatron_lm, megatron_lm_args, write_info,
)
from megatron_patch.convert.core import ConversionError, check_pair, hf_to_megatron
from megatron_patch.model.conversion import UnsupportedCheckpoint, family_for
from megatron_patch.model.config import get_model_config
from megatron_patch.testing import run_on_ranks
from tests.convert_oracles import (
    MOE_MODELS, MOE_VOCAB, assert_bit_exact, assert_layouts_match_transformers, assert_round_trips_bit_exact, cli,
    convert_command, hf_greedy, hf_tensors, local_expert_weights, make_hf_model, megatron_greedy_at,
)

LAYOUTS = [(2, 1, 1), (2, 1, 2), (1, 2, 2)]  # (TP, PP, EP) on 4 ranks; the last re-saves the checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every model converted to torch_dist by the CLI; Mixtral's conversion verifies itself at EP=2 (torchrun on two
    processes) before naming the checkpoint, the others are verified at every layout by the test below (one start
    of the ranks for all of them rather than one torchrun each)."""
    root = tmp_path_factory.mktemp("convert-moe")
    dirs = {}
    for name in MOE_MODELS:
        hf, dist = make_hf_model(name, str(root / f"{name}-hf")), str(root / f"{name}-dist")
        argv = ["hf-to-megatron", "--hf-dir", hf, "--save-dir", dist, "--target-expert-model-parallel-size", "2",
                "--no-progress", *(["--no-verify"] if name != "mixtral" else [])]
        assert convert_command(argv) == 0, f"{name}: conversion failed"
        dirs[name] = (hf, dist, root)
    return dirs


def test_forward_matches_transformers_with_tensor_pipeline_and_expert_parallelism(converted):
    assert_layouts_match_transformers(converted, LAYOUTS)


def test_round_trip_is_bit_exact_from_the_conversion_and_from_a_checkpoint_saved_by_expert_ranks(converted):
    # The re-save of the layout test (PP=2 x EP=2), or this one's own when it runs alone.
    assert_round_trips_bit_exact(converted, LAYOUTS)


def test_per_rank_files_round_trip_at_one_rank(converted):
    hf, _, root = converted["qwen2-moe"]
    legacy, out = str(root / "qwen2-moe-legacy"), str(root / "qwen2-moe-legacy-exported")
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", legacy, "--ckpt-format",
                                       "torch", "--no-verify", "--no-progress"],), timeout=120) == [0]
    assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", legacy, "--save-dir", out,
                                       "--no-progress"],), timeout=120) == [0]
    assert_bit_exact(hf, out)


@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_each_expert_rank_holds_its_own_experts(converted, name):
    hf, dist, _ = converted[name]
    down = {"mixtral": "block_sparse_moe.experts.{}.w2.weight"}.get(name, "mlp.experts.{}.down_proj.weight")
    source = hf_tensors(hf)
    for ep_rank, weights in run_on_ranks(local_expert_weights, 2, args=(dist, 2), timeout=120):
        assert len(weights) == 2
        for i, weight in enumerate(weights):
            assert torch.equal(weight, source["model.layers.0." + down.format(2 * ep_rank + i)])


@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_export_generates_the_greedy_tokens_of_transformers_and_of_megatron_at_ep2(converted, name):
    hf, dist, root = converted[name]
    out = str(root / f"{name}-greedy-exported")
    assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", dist, "--save-dir", out, "--no-progress"],),
                        timeout=120) == [0]
    prompt = torch.randint(0, MOE_VOCAB, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    ranks = run_on_ranks(megatron_greedy_at, 2, args=(dist, 1, prompt, 10), kwargs=dict(ep=2), timeout=300)
    [source] = run_on_ranks(hf_greedy, 1, args=(hf, prompt, 10), timeout=120)
    [exported] = run_on_ranks(hf_greedy, 1, args=(out, prompt, 10), timeout=120)
    assert ranks[0] == ranks[1] == source == exported, (ranks, source, exported)


_BASE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=32, vocab_size=MOE_VOCAB, num_experts_per_tok=2)
_MIXTRAL = dict(_BASE, model_type="mixtral", num_local_experts=4)
_QWEN2_MOE = dict(_BASE, model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48)
_QWEN3_MOE = dict(_BASE, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=32)


@pytest.mark.parametrize("config,message", [
    (dict(_MIXTRAL, router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    (dict(_MIXTRAL, sliding_window=16), "sliding_window=16"),
    (dict(_QWEN2_MOE, decoder_sparse_step=2), "decoder_sparse_step=2"),
    (dict(_QWEN2_MOE, mlp_only_layers=[1]), r"mlp_only_layers=\[1\]"),
    (dict(_QWEN2_MOE, shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    (dict(_QWEN2_MOE, use_sliding_window=True), "use_sliding_window=True"),
    (dict(_QWEN3_MOE, use_sliding_window=True), "use_sliding_window=True"),
    (dict(_QWEN3_MOE, mlp_only_layers=[0]), r"mlp_only_layers=\[0\]"),
])
def test_hugging_face_options_our_moe_layer_cannot_compute_are_refused_by_name(config, message):
    with pytest.raises(UnsupportedCheckpoint, match=message):
        family_for(config).config_from_hf(config)


@pytest.mark.parametrize("config,expected", [
    (_MIXTRAL, dict(num_moe_experts=4, moe_ffn_hidden_size=128, moe_router_pre_softmax=False,
                    moe_shared_expert_intermediate_size=None)),
    # norm_topk_prob false: the top-k of the softmax over all experts, not renormalised.
    (dict(_QWEN3_MOE, norm_topk_prob=False), dict(moe_router_pre_softmax=True, qk_layernorm=True)),
    (dict(_QWEN3_MOE, norm_topk_prob=True), dict(moe_router_pre_softmax=False, moe_ffn_hidden_size=32)),
    (dict(_QWEN2_MOE, qkv_bias=False), dict(add_qkv_bias=False, moe_shared_expert_gate=True,
                                            moe_shared_expert_intermediate_size=48)),
])
def test_moe_fields_from_hugging_face(config, expected):
    model_config = family_for(config).config_from_hf(config)
    assert {k: getattr(model_config, k) for k in expected} == expected


@pytest.mark.parametrize("model_type,config,message", [
    ("mixtral", get_model_config("tiny-qwen2-moe"), "mixtral has no gated shared expert"),
    ("qwen3_moe", get_model_config("tiny-qwen2-moe"), "qwen3_moe has no gated shared expert"),
    ("qwen2_moe", get_model_config("tiny-mixtral"), "qwen2_moe has gated shared expert"),
    ("mixtral", get_model_config("tiny-mixtral", moe_router_pre_softmax=True), "routes with --moe-router-pre-softmax"),
    ("llama", get_model_config("tiny-mixtral"), "pass --model-type mixtral, qwen2_moe or qwen3_moe"),
    ("qwen3_moe", get_model_config("tiny-qwen3"), "the model is dense"),
])
def test_export_refuses_what_the_model_type_cannot_express(model_type, config, message):
    with pytest.raises(UnsupportedCheckpoint, match=message):
        family_for({"model_type": model_type}).config_to_hf(config)


def test_a_model_trained_from_scratch_pairs_with_its_mixtral_export(tmp_path):
    """tiny-mixtral's ffn_hidden_size (128) is no expert's width (32), which is all Mixtral's config.json holds."""
    from transformers import AutoConfig

    model_config = get_model_config("tiny-mixtral")
    (tmp_path / "mcore").mkdir()
    write_info(str(tmp_path / "mcore"), CheckpointInfo(format="torch_dist", model_config=model_config,
                                                       padded_vocab_size=128, dtype="float32"))
    fields = family_for({"model_type": "mixtral"}).config_to_hf(model_config)
    AutoConfig.for_model("mixtral", **fields).save_pretrained(str(tmp_path / "hf"))
    assert check_pair(str(tmp_path / "hf"), str(tmp_path / "mcore"))[1] == "MixtralForCausalLM"
    with pytest.raises(CheckpointMismatch, match="moe_ffn_hidden_size 48 vs 32"):
        AutoConfig.for_model("mixtral", **{**fields, "intermediate_size": 48}).save_pretrained(str(tmp_path / "hf"))
        check_pair(str(tmp_path / "hf"), str(tmp_path / "mcore"))


def test_conversion_targets_are_checked_before_anything_is_written(tmp_path):
    hf = make_hf_model("mixtral", str(tmp_path / "hf"))
    refused = [(dict(target_expert_model_parallel_size=3), "--target-expert-model-parallel-size 3 does not divide"),
               (dict(ckpt_format="torch", target_tensor_parallel_size=2), "--ckpt-format torch writes a mixture")]
    for kwargs, message in refused:
        with pytest.raises(ConversionError, match=message):
            hf_to_megatron(hf, str(tmp_path / "out"), progress=False, **kwargs)
        assert not (tmp_path / "out").exists()
    dense = make_hf_model("qwen3", str(tmp_path / "dense"))
    with pytest.raises(ConversionError, match="the model has no experts"):
        hf_to_megatron(dense, str(tmp_path / "out"), target_expert_model_parallel_size=2, progress=False)


@pytest.mark.parametrize("model_config", [
    get_model_config("tiny-mixtral", moe_router_load_balancing_type="seq_aux_loss", moe_expert_capacity_factor=1.5),
    get_model_config("tiny-qwen2-moe", moe_aux_loss_coeff=0.01, moe_token_drop_policy="position"),
    get_model_config("tiny-qwen3-moe"), get_model_config("tiny-qwen3"),
    get_model_config("tiny-deepseek-v3", moe_router_bias_update_rate=0.01),
    get_model_config("tiny-deepseek-v3", q_lora_rank=None, rope_type="rope"),
])
def test_megatron_lm_args_carry_the_moe_and_multi_latent_attention_fields_both_ways(model_config):
    info = CheckpointInfo(format="torch_dist", model_config=model_config, padded_vocab_size=128, dtype="float32")
    args = megatron_lm_args(info)
    assert args.num_experts == model_config.num_moe_experts
    read = info_from_megatron_lm({"args": args, "checkpoint_version": 3.0}, "torch_dist", "common.pt").model_config
    fields = [f.name for f in dataclasses.fields(model_config) if f.name.startswith(("moe_", "num_moe_"))
              or f.name in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                            "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor", "mscale",
                            "mscale_all_dim", "original_max_position_embeddings", "beta_fast", "beta_slow")]
    assert {f: getattr(read, f) for f in fields} == {f: getattr(model_config, f) for f in fields}


# Megatron-LM's own argument names and values (megatron/training/arguments.py), beside a MoE model's.
_MEGATRON_LM_MOE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, padded_vocab_size=128,
                        ffn_hidden_size=128, swiglu=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                        moe_layer_freq=1, moe_router_score_function="softmax",
                        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_router_pre_softmax=True,
                        moe_shared_expert_intermediate_size=48)


@pytest.mark.parametrize("field,value,fmt", [
    ("moe_latent_size", 16, "torch_dist"),
    ("num_experts", 4, "torch"),
])
def test_megatron_lm_moe_options_our_layer_cannot_compute_are_refused_by_name(field, value, fmt):
    state = {"args": argparse.Namespace(**_MEGATRON_LM_MOE), "checkpoint_version": 3.0}
    config = info_from_megatron_lm(state, "torch_dist", "common.pt").model_config
    assert (config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_router_pre_softmax) == (4, 32, True)
    state["args"] = argparse.Namespace(**{**_MEGATRON_LM_MOE, field: value})
    with pytest.raises(CheckpointMismatch, match="^common.pt: " + ("args." + field if fmt != "torch" else "per-rank")):
        info_from_megatron_lm(state, fmt, "common.pt")


def test_verify_compares_a_text_of_any_length_at_tensor_parallelism(tmp_path, tmp_path_factory):
    """``verify --text`` at TP=2 on a mixture-of-experts model, whose layers need sequence parallelism there (the
    sequence split over the TP ranks): a text of an odd number of tokens is compared as it is, token for token."""
    from conftest_data import data_assets
    from transformers import AutoTokenizer

    tokenizer_dir = data_assets(tmp_path_factory).options["HuggingFaceTokenizer"]["tokenizer_model"]
    hf, dist = make_hf_model("mixtral", str(tmp_path / "hf"), vocab_size=1000), str(tmp_path / "dist")
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), hf)
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", dist, "--no-verify",
                                       "--no-progress"],), timeout=300) == [0]
    tokenizer = AutoTokenizer.from_pretrained(hf)
    text = "def main():\n    return 0"
    while len(tokenizer(text)["input_ids"]) % 2 == 0:
        text += " x"
    done = subprocess.run([sys.executable, "-m", "megatron_patch.cli", "convert", "verify", "--hf-dir", hf,
                           "--megatron-dir", dist, "--tensor-model-parallel-size", "2", "--text", text],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    [logits] = [line for line in done.stdout.splitlines() if line.startswith("logits: ")]
    assert logits.endswith("PASS"), done.stdout
