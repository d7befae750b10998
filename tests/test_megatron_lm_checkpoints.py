"""Megatron-LM reads our checkpoints with ``--use-checkpoint-args``: a conversion's and a trainer's common state
(``common.pt``, or with megatron-core 0.19 the "common_state" object: ``compat.common_state_source``) and legacy
rank files carry ``args`` with every field its loader reads, under its names, and a load logs its
``successfully loaded checkpoint from DIR at iteration N`` line."""

import glob
import json
import os

import pytest

from megatron_patch.checkpoint.format import (
    CheckpointInfo, load_megatron_file, megatron_lm_args, read_args_state, read_info,
)
from megatron_patch.compat import common_state_source
from megatron_patch.model.config import get_model_config
from megatron_patch.testing import logged_messages, run_on_ranks
from tests.convert_oracles import cli, make_hf_model, training_sequences

# The fields Megatron-LM (megatron/training/checkpointing.py at core_v0.16.1) reads from a checkpoint's ``args``:
# load_args_from_checkpoint's _set_arg calls (dense-model ones; the MoE/Mamba ones may be absent) ...
MEGATRON_LM_FIELDS = [
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "rotary_interleaved",
    "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu", "untie_embeddings_and_output_weights",
    "apply_layernorm_1p", "normalization", "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout",
    "tokenizer_type", "padded_vocab_size", "ckpt_format", "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    # ... load_checkpoint's resume state and check_checkpoint_args' comparisons ...
    "consumed_train_samples", "consumed_valid_samples", "skipped_train_samples", "make_vocab_size_divisible_by",
    # ... and what its --load of a model needs besides (precision, epsilon under the checkpoint's older name).
    "fp16", "bf16", "vocab_size", "layernorm_epsilon",
]
RMS_NORM_EPS = 3e-6  # not the default (1e-5 in our config, 1e-6 in LlamaConfig): a value that must be carried


def _expected(hf_config: dict, padded_vocab: int, tp: int = 1, pp: int = 1, fmt: str = "torch_dist") -> dict:
    """The Megatron-LM values of a converted LLaMA-GQA, from its Hugging Face config."""
    heads, groups = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    return dict(
        num_layers=hf_config["num_hidden_layers"], hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"], num_attention_heads=heads, num_query_groups=groups,
        group_query_attention=groups != heads, kv_channels=hf_config["hidden_size"] // heads,
        max_position_embeddings=hf_config["max_position_embeddings"], position_embedding_type="rope",
        add_position_embedding=False, use_rotary_position_embeddings=True,
        rotary_base=hf_config["rope_parameters"]["rope_theta"],
        add_bias_linear=False, add_qkv_bias=False, swiglu=True, untie_embeddings_and_output_weights=True,
        normalization="RMSNorm", layernorm_epsilon=RMS_NORM_EPS, padded_vocab_size=padded_vocab,
        vocab_size=hf_config["vocab_size"], fp16=False, bf16=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, ckpt_format=fmt,
    )




def _check_args(args, expected: dict) -> None:
    missing = [f for f in MEGATRON_LM_FIELDS if not hasattr(args, f)]
    assert not missing, missing
    wrong = {k: (getattr(args, k), v) for k, v in expected.items() if getattr(args, k) != v}
    assert not wrong, wrong


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    hf = make_hf_model("llama-gqa", str(root / "hf"), rms_norm_eps=RMS_NORM_EPS)
    with open(os.path.join(hf, "config.json")) as f:
        return hf, json.load(f), root


def _convert(hf: str, out: str, *extra: str) -> dict:
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", out, "--no-progress",
                                       "--no-verify", *extra],)) == [0]
    with open(os.path.join(out, "megatron_patch_args.json")) as f:
        return json.load(f)


def test_conversion_common_pt_carries_megatron_lm_args(llama):
    """Failed before: common.pt was {} (no args, checkpoint_version or iteration)."""
    hf, hf_config, root = llama
    out = str(root / "dist")
    info = _convert(hf, out)
    common = read_args_state(common_state_source(os.path.join(out, "release")))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    _check_args(common["args"], _expected(hf_config, info["padded_vocab_size"]))
    assert common["args"].tokenizer_type == "HuggingFaceTokenizer"  # the saved tokenizer is a Hugging Face one


def test_legacy_rank_files_carry_megatron_lm_args(llama):
    """Failed before: the legacy files' args had norm_epsilon but no layernorm_epsilon, fp16, bf16 or tokenizer."""
    hf, hf_config, root = llama
    out = str(root / "legacy")
    info = _convert(hf, out, "--ckpt-format", "torch", "--target-tensor-parallel-size", "2",
                    "--target-pipeline-parallel-size", "2")
    files = sorted(glob.glob(os.path.join(out, "release", "mp_rank_*", "model_optim_rng.pt")))
    assert [os.path.basename(os.path.dirname(f)) for f in files] == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    for path in files:
        state = load_megatron_file(path)
        assert state["checkpoint_version"] == 3.0 and state["iteration"] == 0
        _check_args(state["args"], _expected(hf_config, info["padded_vocab_size"], tp=2, pp=2, fmt="torch"))


@pytest.mark.parametrize("name, overrides, expected", [
    ("tiny-gpt2", {}, (False, 4, 256, 16)),                       # no --num-query-groups: one group per head
    ("tiny-llama", {}, (True, 2, 128, 16)),                       # 2 groups for 4 heads
    ("tiny-llama", {"num_query_groups": 4}, (False, 4, 128, 16)),  # as many groups as heads, given explicitly
])
def test_megatron_lm_args_turn_gqa_on_only_when_groups_differ_from_heads(name, overrides, expected):
    """Megatron-LM's --group-query-attention follows the groups, however they were given: ModelConfig always holds
    the resolved sizes, so a test of "num_query_groups is not None" would turn it on for every model."""
    info = CheckpointInfo(format="torch_dist", model_config=get_model_config(name, **overrides), padded_vocab_size=128)
    args = megatron_lm_args(info)
    assert (args.group_query_attention, args.num_query_groups, args.ffn_hidden_size, args.kv_channels) == expected


# tiny-gpt2's megatron_patch_args.json as it was written before ModelConfig resolved its sizes: null for the
# sizes left to their defaults.
_UNRESOLVED_TINY_GPT2 = {
    "format": "torch_dist", "model_config": {
        "family": "gpt", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
        "ffn_hidden_size": None, "num_query_groups": None, "kv_channels": None, "max_position_embeddings": 32,
        "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
        "normalization": "LayerNorm", "layernorm_epsilon": 1e-05, "activation": "gelu_tanh", "add_bias_linear": True,
        "add_qkv_bias": False, "untie_embeddings_and_output_weights": False, "vocab_size": 128,
        "make_vocab_size_divisible_by": 1, "hidden_dropout": 0.1, "attention_dropout": 0.1, "init_method_std": 0.02,
        "num_tokentypes": 0, "add_binary_head": False, "layernorm_zero_centered_gamma": False,
        "bert_layernorm_style": "pre"},
    "padded_vocab_size": 128, "dtype": "float32", "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "hf_config": None, "hf_architecture": None, "initialized_tensors": [], "tokenizer_files": [],
}


def test_a_description_with_unresolved_sizes_still_reads(tmp_path):
    """A megatron_patch_args.json written before (nulls for the default sizes) reads as the same model, gives
    Megatron-LM the same args, and is written back with the sizes resolved under the same keys."""
    with open(tmp_path / "megatron_patch_args.json", "w") as f:
        json.dump(_UNRESOLVED_TINY_GPT2, f)
    info = read_info(str(tmp_path))
    fresh = CheckpointInfo(format="torch_dist", model_config=get_model_config("tiny-gpt2"), padded_vocab_size=128)
    assert info == fresh
    assert (info.model_config.ffn_hidden_size, info.model_config.num_query_groups, info.model_config.kv_channels) == (
        256, 4, 16)
    assert vars(megatron_lm_args(info)) == vars(megatron_lm_args(fresh))
    written = info.to_json()
    assert written.keys() == _UNRESOLVED_TINY_GPT2.keys()
    # ...and with the fields added since (Qwen3's q/k norms, LLaMA 3.1's RoPE scaling, mixture of experts, DeepSeek's
    # architecture) at their defaults.
    moe_defaults = {"num_moe_experts": None, "moe_router_topk": 2, "moe_ffn_hidden_size": None,
                    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
                    "moe_router_pre_softmax": False, "moe_router_load_balancing_type": "aux_loss",
                    "moe_aux_loss_coeff": 0.0, "moe_expert_capacity_factor": None,
                    "moe_pad_expert_input_to_capacity": False, "moe_token_drop_policy": "probs",
                    # issue 41's: dense/MoE layer pattern, router, multi-latent attention, multi-token prediction
                    "moe_layer_freq": 1, "moe_router_score_function": "softmax",
                    "moe_router_enable_expert_bias": False, "moe_router_bias_update_rate": 1e-3,
                    "moe_router_num_groups": None, "moe_router_group_topk": None,
                    "moe_router_topk_scaling_factor": None, "multi_latent_attention": False, "q_lora_rank": None,
                    "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
                    "rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mtp_num_layers": None, "mtp_loss_scaling_factor": 0.1,
                    # issue 51's Gemma 3: sliding windows, a RoPE base per layer kind, sandwich norms
                    "rotary_seq_len_interpolation_factor": None, "rotary_base_local": None, "window_size": None,
                    "window_attn_skip_freq": None, "softmax_scale": None, "sandwich_norm": False,
                    "scale_embeddings": False}
    assert written["model_config"] == {**_UNRESOLVED_TINY_GPT2["model_config"], "ffn_hidden_size": 256,
                                       "num_query_groups": 4, "kv_channels": 16, "qk_layernorm": False,
                                       "rope_scaling": False, "rope_scaling_factor": 8.0, **moe_defaults}
    assert CheckpointInfo.from_json(written) == info


def train_and_resume(rank, world_size, converted, trained, sequences):
    """Train 2 iterations from ``converted`` (saving), then resume from that save for a third; return the
    messages the trainer logged."""
    from megatron_patch.training.engine import Engine
    from tests.convert_oracles import _fixed_data_pretrainer

    common = ["--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "16", "--lr", "1e-3",
              "--lr-decay-style", "constant", "--seed", "3", "--save", trained]
    with logged_messages() as messages:
        _fixed_data_pretrainer(sequences)(engine=Engine(["--load", converted, "--train-iters", "2", *common])).train()
        _fixed_data_pretrainer(sequences)(engine=Engine(["--load", trained, "--train-iters", "3",
                                                         "--use-checkpoint-opt_param-scheduler", *common])).train()
    return messages


def test_trainer_checkpoint_carries_megatron_lm_args_and_its_load_is_logged(llama, tmp_path):
    """Failed before: the trainer's common.pt had no args (Megatron-LM resumed at consumed sample 0) nor the
    content metadata its load reads, and no load logged Megatron-LM's line."""
    hf, hf_config, root = llama
    converted, trained = str(root / "dist"), str(tmp_path / "trained")
    if not os.path.isdir(converted):
        _convert(hf, converted)
    [messages] = run_on_ranks(train_and_resume, 1, args=(converted, trained, training_sequences()), timeout=300)
    assert f"successfully loaded checkpoint from {converted} at iteration 0" in messages, messages
    assert f"successfully loaded checkpoint from {trained} at iteration 2" in messages, messages

    with open(os.path.join(trained, "megatron_patch_args.json")) as f:
        info = json.load(f)
    for iteration in (2, 3):
        path = os.path.join(trained, f"iter_{iteration:07d}")
        common = read_args_state(common_state_source(path))
        assert common["checkpoint_version"] == 3.0 and common["iteration"] == iteration
        expected = dict(_expected(hf_config, info["padded_vocab_size"]), seq_length=16,
                        consumed_train_samples=iteration * 4, consumed_valid_samples=0)
        _check_args(common["args"], expected)
        # What Megatron-LM's load builds its state with (load_content_metadata); without it, it would take the
        # distributed optimizer's state for another format than the one saved. This run's optimizer is not the
        # distributed one: its state is keyed by parameter, as the fully reshardable format's is.
        assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
        with open(os.path.join(path, "checksums.json")) as f:
            assert os.path.basename(common_state_source(path)) in json.load(f)["files"]
