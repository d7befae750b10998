"""Named configurations, Megatron's model flags, parameter and FLOP counts, and refused layouts."""


import argparse
import re

import pytest

from megatron_patch.model import (
    ParallelConfig,
    add_model_arguments,
    add_parallel_arguments,
    get_model_config,
    list_model_configs,
    model_config_from_args,
    num_floating_point_operations,
    num_parameters,
    parallel_config_from_args,
)
from megatron_patch.model.config import model_config_from_flags
from megatron_patch.testing import run_on_ranks

# Hugging Face's parameter counts of the same shapes (unpadded vocabulary): GPT2Model, LlamaForCausalLM,
# MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM (Qwen1.5-MoE-A2.7B),
# Qwen3MoeForCausalLM, BertForPreTraining (encoder + pooler + MLM transform/bias + NSP head).
HF_PARAMETERS = {
    "gpt2-124m": 124_439_808,
    "gpt2-355m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama3.2-1b": 1_235_814_400,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "mistral-7b": 7_241_732_096,
    "qwen2-0.5b": 494_032_768,
    "qwen2-1.5b": 1_543_714_304,
    "qwen2-7b": 7_615_616_512,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2-moe-a2.7b": 14_315_784_192,
    "qwen3-moe-30b-a3b": 30_532_122_624,
    "bert-base": 110_106_428,
    "bert-large": 336_226_108,
}


def test_registry_has_real_and_debug_sizes():
    names = list_model_configs()
    assert set(HF_PARAMETERS) <= set(names)
    assert {"tiny-gpt2", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-bert", "tiny-mixtral", "tiny-qwen2-moe",
            "tiny-qwen3-moe"} <= set(names)


@pytest.mark.parametrize("name", sorted(HF_PARAMETERS))
def test_parameter_count_matches_hugging_face(name):
    config = get_model_config(name)
    assert num_parameters(config, config.vocab_size) == HF_PARAMETERS[name]


def _hf_parameters(config) -> int:
    """Parameters of the Hugging Face model of ``config``'s shape and unpadded vocabulary (the class HF_PARAMETERS
    counts for that architecture), built on the meta device.

    Example::

        _hf_parameters(get_model_config("tiny-llama"))      # LlamaForCausalLM with 2 layers, hidden 64
    """
    import torch
    import transformers

    # Token ids inside the tiny vocabularies, or transformers warns about its 50256 defaults.
    special = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    common = dict(vocab_size=config.vocab_size, max_position_embeddings=config.max_positions, **special)
    if config.family == "bert":
        model_class, hf_config = transformers.BertForPreTraining, transformers.BertConfig(
            hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
            num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_hidden_size,
            type_vocab_size=config.num_tokentypes, **common)
    elif config.position_embedding_type == "learned_absolute":
        model_class, hf_config = transformers.GPT2Model, transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.max_positions, n_embd=config.hidden_size,
            n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size, **special)
    elif config.sandwich_norm:
        from megatron_patch.model.conversion import family_for

        # Gemma 3's own config.json fields of this config (the converter's writer): its norms after attention and MLP.
        fields = family_for({"model_type": "gemma3_text"}).config_to_hf(config)
        model_class, hf_config = transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**{**fields, **common})
    elif config.multi_latent_attention or config.moe_router_score_function == "sigmoid":
        from megatron_patch.model.conversion import family_for

        # DeepSeek's or GLM-4.5's own config.json fields of this config (the converter's writer), in its own class.
        model_type, name = (("deepseek_v3", "DeepseekV3") if config.multi_latent_attention
                            and config.moe_router_score_function == "sigmoid" else ("deepseek_v2", "DeepseekV2")
                            if config.multi_latent_attention else ("glm4_moe", "Glm4Moe"))
        fields = family_for({"model_type": model_type}).config_to_hf(config)
        # transformers builds no multi-token prediction module: count each as one more layer (of the last layer's
        # kind) and its own tensors by hand: the RMSNorms of its two inputs and of its output, and the projection
        # of [embedding; hidden] to hidden.
        mtp = config.mtp_num_layers or 0
        fields["num_hidden_layers"] += mtp
        model_class = getattr(transformers, f"{name}ForCausalLM")
        hf_config = getattr(transformers, f"{name}Config")(**{**fields, **common})
        with torch.device("meta"):
            layers = sum(p.numel() for p in model_class(hf_config).parameters())
        return layers + mtp * (3 * config.hidden_size + 2 * config.hidden_size ** 2)
    elif config.num_moe_experts:
        experts = dict(num_experts_per_tok=config.moe_router_topk, moe_intermediate_size=config.moe_ffn_hidden_size)
        if config.moe_shared_expert_intermediate_size:
            model_class, hf_config = transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
                num_experts=config.num_moe_experts,
                shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size, **experts,
                **_decoder_fields(config), **common)
        elif config.qk_layernorm:
            model_class, hf_config = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
                num_experts=config.num_moe_experts, **experts, **_decoder_fields(config), **common)
        else:
            model_class, hf_config = transformers.MixtralForCausalLM, transformers.MixtralConfig(
                num_local_experts=config.num_moe_experts, num_experts_per_tok=config.moe_router_topk,
                **_decoder_fields(config, intermediate_size=config.moe_ffn_hidden_size), **common)
    else:
        model_class, config_class = (
            (transformers.Qwen3ForCausalLM, transformers.Qwen3Config) if config.qk_layernorm
            else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config) if config.add_qkv_bias
            else (transformers.LlamaForCausalLM, transformers.LlamaConfig))
        hf_config = config_class(**_decoder_fields(config), **common)
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(hf_config).parameters())


def _decoder_fields(config, intermediate_size=None) -> dict:
    return dict(hidden_size=config.hidden_size, intermediate_size=intermediate_size or config.ffn_hidden_size,
                num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
                tie_word_embeddings=not config.untie_embeddings_and_output_weights)


def count_built_parameters(rank, world_size, padded_vocabs):
    import torch

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks

    initialize_distributed()
    counts = {}
    for name, vocab in padded_vocabs.items():
        config = get_model_config(name)
        with torch.device("meta"):  # real sizes, no memory, no initialisation to run
            [model] = build_model_chunks(config, ParallelConfig(), vocab, initialize=False)
        counts[name] = sum(p.numel() for p in model.parameters())
    return counts


def built_tensors(rank, world_size, name, initialize):
    import torch

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks

    initialize_distributed()
    torch.manual_seed(0)
    [model] = build_model_chunks(get_model_config(name), ParallelConfig(), 128, initialize=initialize)
    return {key: (tuple(t.shape), str(t.dtype)) for key, t in model.state_dict().items() if torch.is_tensor(t)}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-bert", "tiny-mixtral"])
def test_a_model_built_without_initialisation_has_the_same_tensors(name):
    [initialised] = run_on_ranks(built_tensors, 1, args=(name, True))
    [plain] = run_on_ranks(built_tensors, 1, args=(name, False))
    assert plain == initialised


def test_every_named_config_builds_with_the_hugging_face_count():
    from megatron_patch.tokenizer.registry import padded_vocab_size

    padded_vocabs, expected = {}, {}
    for name in list_model_configs():
        config = get_model_config(name)
        # Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP (TP = 1 here).
        multiple = config.make_vocab_size_divisible_by
        padded_vocabs[name] = -(-config.vocab_size // multiple) * multiple
        assert padded_vocab_size(config.vocab_size, multiple, 1) == padded_vocabs[name], name
        extra_rows = padded_vocabs[name] - config.vocab_size
        hf_count = HF_PARAMETERS[name] if name in HF_PARAMETERS else _hf_parameters(config)
        # The padding rows add to the word embeddings, to the output matrix when it is separate, and to BERT's
        # output bias; nothing else differs from Hugging Face's model.
        vocab_matrices = 2 if config.untie_embeddings_and_output_weights else 1
        output_bias = 1 if config.family == "bert" else 0
        expected[name] = hf_count + extra_rows * (vocab_matrices * config.hidden_size + output_bias)
    [built] = run_on_ranks(count_built_parameters, 1, args=(padded_vocabs,), timeout=300)
    assert built == expected
    # The formula MFU reporting uses counts what was built.
    assert {name: num_parameters(get_model_config(name), padded_vocabs[name]) for name in built} == expected


def test_flops_formula_matches_hand_count():
    # tiny LLaMA-style case with GQA and SwiGLU; count every GEMM by hand: 2 FLOPs per multiply-add,
    # x3 for forward + backward.
    config = get_model_config("tiny-llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                              num_query_groups=2, ffn_hidden_size=128)
    b, s, h, f, vocab, layers = 2, 32, 64, 128, 256, 2
    kv_channels, q_size, kv_size = 16, 64, 32
    per_layer = (
        2 * b * s * h * (q_size + 2 * kv_size)  # fused q/k/v projection
        + 2 * b * s * s * q_size  # scores
        + 2 * b * s * s * q_size  # attention-weighted values
        + 2 * b * s * q_size * h  # output projection
        + 2 * b * s * h * 2 * f  # fc1 (gate and up)
        + 2 * b * s * f * h  # fc2
    )
    logits = 2 * b * s * h * vocab
    assert kv_channels * 4 == q_size
    expected = 3 * (layers * per_layer + logits)
    assert num_floating_point_operations(config, b, s, vocab) == pytest.approx(expected, rel=1e-12)


def test_flags_override_named_config():
    from megatron_patch.model.builder import to_transformer_config

    parser = add_parallel_arguments(add_model_arguments(argparse.ArgumentParser()))
    args = parser.parse_args([
        "--model-name", "gpt2-124m", "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
        "--ffn-hidden-size", "1536", "--position-embedding-type", "rope", "--rotary-base",
        "500000", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--add-qkv-bias",
        "--untie-embeddings-and-output-weights", "--num-query-groups", "4", "--group-query-attention",
        "--checkpoint-activations", "--tensor-model-parallel-size", "2",
    ])
    config = model_config_from_args(args)
    # gpt2-124m is 12 layers x 768 wide with 12 heads and a 4 x 768 MLP: every shape field comes from the flags.
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_hidden_size) == (
        4, 512, 8, 1536)
    assert (config.kv_channels, config.position_embedding_type, config.rotary_base) == (64, "rope", 500000)
    assert (config.normalization, config.activation, config.add_bias_linear, config.add_qkv_bias) == (
        "RMSNorm", "swiglu", False, True)
    assert config.untie_embeddings_and_output_weights and config.num_query_groups == 4
    parallel = parallel_config_from_args(args, num_layers=config.num_layers)
    assert (parallel.recompute_granularity, parallel.recompute_method, parallel.recompute_num_layers) == (
        "full", "uniform", 1)
    assert parallel.tensor_model_parallel_size == 2
    # ...and reach megatron-core's config unchanged.
    transformer = to_transformer_config(config, parallel)
    assert (transformer.num_layers, transformer.hidden_size, transformer.num_attention_heads,
            transformer.ffn_hidden_size, transformer.num_query_groups, transformer.kv_channels) == (
        4, 512, 8, 1536, 4, 64)


def _sizes(config) -> tuple[int, int, int]:
    return config.ffn_hidden_size, config.num_query_groups, config.kv_channels


def test_qwen3_and_llama31_flags_reach_the_model():
    from megatron_patch.model.builder import to_transformer_config

    parser = add_model_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--model-name", "tiny-llama", "--qk-layernorm", "--use-rope-scaling",
                              "--rope-scaling-factor", "32"])
    config = model_config_from_args(args)
    assert (config.qk_layernorm, config.rope_scaling, config.rope_scaling_factor) == (True, True, 32.0)
    assert to_transformer_config(config, ParallelConfig()).qk_layernorm
    assert get_model_config("llama3.1-8b").rope_scaling and not get_model_config("llama3-8b").rope_scaling
    # Qwen3's heads are 128 wide whatever hidden_size / heads is (1024 / 16 = 64 for the 0.6B).
    assert get_model_config("qwen3-0.6b").kv_channels == 128
    with pytest.raises(ValueError, match="--use-rope-scaling.*--position-embedding-type rope"):
        get_model_config("tiny-gpt2", rope_scaling=True)


@pytest.mark.parametrize("name", ["tiny-qwen3", "llama3.1-8b"])
def test_qk_norms_and_rope_scaling_survive_megatron_lm_args(name):
    from megatron_patch.checkpoint.format import CheckpointInfo, info_from_megatron_lm, megatron_lm_common_state

    config = get_model_config(name, rope_scaling_factor=32.0) if name == "llama3.1-8b" else get_model_config(name)
    info = CheckpointInfo(format="torch_dist", model_config=config, padded_vocab_size=config.vocab_size)
    state = megatron_lm_common_state(info, iteration=0)
    assert info_from_megatron_lm(state, "torch_dist", "common.pt").model_config == config


def test_a_new_shape_derives_the_default_sizes_again():
    """Failed before (get_model_config was dataclasses.replace of the entry with its sizes resolved): gpt2-124m at
    hidden 64 with 4 heads kept hidden 768's 3072-wide MLP, its 12 query groups and 64-wide heads."""
    from megatron_patch.training.config import ModelSpec

    assert _sizes(get_model_config("gpt2-124m")) == (3072, 12, 64)
    assert _sizes(get_model_config("gpt2-124m", hidden_size=64, num_attention_heads=4)) == (256, 4, 16)
    # The debug entries are themselves a replace of a real shape.
    assert _sizes(get_model_config("tiny-gpt2", hidden_size=128, num_attention_heads=8)) == (512, 8, 16)
    assert _sizes(get_model_config("tiny-bert", hidden_size=128, num_attention_heads=8)) == (512, 8, 16)
    # The same through the flags, model_config_from_flags and the trainer's ModelSpec.
    parser = add_model_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--model-name", "gpt2-124m", "--hidden-size", "64", "--num-attention-heads", "4"])
    assert _sizes(model_config_from_args(args)) == (256, 4, 16)
    assert _sizes(model_config_from_flags({"hidden_size": 64, "num_attention_heads": 4}, name="gpt2-124m")) == (
        256, 4, 16)
    spec = ModelSpec(name="tiny-gpt2", family=None, fields=(("hidden_size", 128), ("num_attention_heads", 8)))
    assert _sizes(spec.build("gpt", 128)) == (512, 8, 16)


def test_sizes_given_explicitly_are_kept_under_a_new_shape():
    # llama3.2-1b gives its MLP width and query groups; its head width is derived (2048 / 32).
    assert _sizes(get_model_config("llama3.2-1b")) == (8192, 8, 64)
    assert _sizes(get_model_config("llama3.2-1b", hidden_size=1024)) == (8192, 8, 32)
    # A derived size set explicitly stays set through later replaces; None derives it again.
    narrow = get_model_config("gpt2-124m", hidden_size=64, num_attention_heads=4, ffn_hidden_size=100)
    assert _sizes(narrow) == (100, 4, 16)
    assert _sizes(narrow.replace(hidden_size=128)) == (100, 4, 32)
    assert _sizes(narrow.replace(hidden_size=128, ffn_hidden_size=None)) == (512, 4, 32)
    # Whether a size was derived or given is not part of the model: the same sizes are the same config.
    assert get_model_config("gpt2-124m", ffn_hidden_size=3072, num_query_groups=12) == get_model_config("gpt2-124m")


def test_flags_alone_describe_a_model():
    parser = add_parallel_arguments(add_model_arguments(argparse.ArgumentParser()))
    args = parser.parse_args(["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--seq-length", "32", "--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "2"])
    config = model_config_from_args(args, vocab_size=100)
    assert config.family == "gpt" and config.vocab_size == 100
    assert parallel_config_from_args(args, config.num_layers).virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="--seq-length"):
        model_config_from_args(parser.parse_args(["--num-layers", "2", "--hidden-size", "8",
                                                  "--num-attention-heads", "2"]))


@pytest.mark.parametrize("model_overrides,layout,world_size,message", [
    ({}, dict(tensor_model_parallel_size=5), None,
     "--num-attention-heads 12 is not divisible by --tensor-model-parallel-size 5"),
    (dict(num_query_groups=2, num_attention_heads=4, hidden_size=64), dict(tensor_model_parallel_size=4), None,
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (dict(num_layers=6), dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), None,
     "--num-layers 6 is not divisible by --pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel-size 2"),
    ({}, dict(sequence_parallel=True), None,
     "--sequence-parallel needs --tensor-model-parallel-size greater than 1"),
    ({}, dict(virtual_pipeline_model_parallel_size=2), None, "needs --pipeline-model-parallel-size of at least 2"),
    ({}, dict(tensor_model_parallel_size=2), 3, "world size 3 is not divisible by --tensor-model-parallel-size 2"),
    (dict(ffn_hidden_size=3070), dict(tensor_model_parallel_size=4), None,
     "--ffn-hidden-size 3070 is not divisible by --tensor-model-parallel-size 4"),
    (dict(seq_length=1022), dict(tensor_model_parallel_size=4, sequence_parallel=True), None,
     "--sequence-parallel needs --seq-length 1022 divisible by --tensor-model-parallel-size 4"),
    ({}, dict(recompute_granularity="selective", recompute_method="block"), None,
     "--recompute-method and --recompute-num-layers only apply with --recompute-granularity full"),
    ({}, dict(recompute_granularity="full", recompute_num_layers=13), None,
     "--recompute-num-layers 13 must be between 1 and the 12 layers"),
    ({}, dict(precision="fp8"), None, "precision must be fp32, fp16 or bf16, got 'fp8'"),
    ({}, dict(context_parallel_size=2), None, "--context-parallel-size greater than 1 needs Transformer Engine"),
])
def test_invalid_layouts_are_refused(model_overrides, layout, world_size, message):
    config = get_model_config("gpt2-124m", **model_overrides)
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(**layout).validate(config, world_size=world_size)


@pytest.mark.parametrize("argv,message", [
    (["--checkpoint-activations", "--recompute-granularity", "selective"],
     "--checkpoint-activations means --recompute-granularity full; do not combine it with "
     "--recompute-granularity selective"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "3"],
     "give --num-layers-per-virtual-pipeline-stage or --virtual-pipeline-model-parallel-size, not both"),
    # gpt2-124m's 12 layers over 2 stages leave 6 per stage, which 4 does not divide.
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "4"],
     "--num-layers-per-virtual-pipeline-stage 4 must divide the 6 layers of a pipeline stage "
     "(--num-layers 12 / --pipeline-model-parallel-size 2)"),
])
def test_conflicting_flags_are_refused(argv, message):
    parser = add_parallel_arguments(add_model_arguments(argparse.ArgumentParser()))
    args = parser.parse_args(["--model-name", "gpt2-124m", *argv])
    config = model_config_from_args(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        parallel_config_from_args(args, config.num_layers)


def test_invalid_model_fields_are_refused():
    with pytest.raises(ValueError, match="--num-attention-heads 12 is not divisible by --num-query-groups 5"):
        get_model_config("gpt2-124m", num_query_groups=5)
    with pytest.raises(ValueError, match="--num-query-groups must be at least 1, got 0"):
        get_model_config("gpt2-124m", num_query_groups=0)
    with pytest.raises(ValueError, match="--hidden-size 64 is not divisible by --num-attention-heads 12; set "
                                         "--kv-channels"):
        get_model_config("gpt2-124m", hidden_size=64)
    assert get_model_config("gpt2-124m", hidden_size=64, kv_channels=8).kv_channels == 8
    with pytest.raises(ValueError, match="BERT-only"):
        get_model_config("gpt2-124m", add_binary_head=True)
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        get_model_config("gpt5")
