"""LLaMA, Mistral, Qwen2 and Qwen3: one decoder (``features.llama_table``); Qwen2 adds q/k/v biases, Qwen3 per-head
q/k norms. Their model types, named configurations and conversion.

Example::

    config = get_model_config("llama3.2-1b")
"""

from __future__ import annotations

from megatron_patch.model.config import ModelConfig, is_model_type, register_model_config, register_model_type
from megatron_patch.model.conversion import UnsupportedCheckpoint, register_family, require
from megatron_patch.model.features import (
    LLAMA_TYPE,
    attention_hf,
    llama_config,
    llama_like,
    llama_table,
    require_no_window,
)

# LLaMA: RoPE, RMSNorm, SwiGLU, no bias anywhere. Mistral is LLaMA with a sliding window (ours has none), Qwen2
# LLaMA with a bias on q/k/v, Qwen3 LLaMA with an RMSNorm over each head's query and key.
register_model_type("llama", **LLAMA_TYPE)
register_model_type("mistral", **LLAMA_TYPE)
register_model_type("qwen2", **{**LLAMA_TYPE, "add_qkv_bias": True})
register_model_type("qwen3", **{**LLAMA_TYPE, "qk_layernorm": True})


def qwen2_like(model_type: str = "qwen2", **fields) -> ModelConfig:
    # Qwen2's RMSNorm eps 1e-6, RoPE base 1e6, vocabulary 151936 (already a multiple of 128, so no padding), tied
    # embeddings below 7B.
    defaults = dict(layernorm_epsilon=1e-6, rotary_base=1000000, vocab_size=151936)
    return llama_like(model_type, **{**defaults, **fields})


def qwen3_like(model_type: str = "qwen3", **fields) -> ModelConfig:
    # Qwen3 = Qwen2's values with a head width of 128 whatever hidden_size / heads is.
    defaults = dict(kv_channels=128, seq_length=4096, max_position_embeddings=40960)
    return qwen2_like(model_type, **{**defaults, **fields})


register_model_config("llama2-7b")(lambda: llama_like(
    num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, seq_length=4096,
    layernorm_epsilon=1e-5, vocab_size=32000,
))
register_model_config("llama3.2-1b")(lambda: llama_like(
    num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, num_query_groups=8,
    seq_length=8192, max_position_embeddings=131072, rotary_base=500000, layernorm_epsilon=1e-5,
    vocab_size=128256, untie_embeddings_and_output_weights=False,
    # Its config.json: rope_scaling {rope_type: llama3, factor: 32, low/high_freq_factor 1/4, original 8192}.
    rope_scaling=True, rope_scaling_factor=32.0,
))
register_model_config("llama3-8b")(lambda: llama_like(
    num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
    seq_length=8192, rotary_base=500000, layernorm_epsilon=1e-5, vocab_size=128256,
))
register_model_config("llama3.1-8b")(lambda: llama_like(
    num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
    seq_length=8192, max_position_embeddings=131072, rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0,
    layernorm_epsilon=1e-5, vocab_size=128256,
))
# Mistral-7B-v0.1. Its 4096-token sliding window equals seq_length, where it masks nothing: full causal attention
# computes the same (a query at position i sees keys i-4095..i either way).
register_model_config("mistral-7b")(lambda: llama_like(
    num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
    seq_length=4096, max_position_embeddings=32768, layernorm_epsilon=1e-5, vocab_size=32000,
))
register_model_config("qwen2-0.5b")(lambda: qwen2_like(
    num_layers=24, hidden_size=896, ffn_hidden_size=4864, num_attention_heads=14, num_query_groups=2,
    seq_length=4096, max_position_embeddings=32768, untie_embeddings_and_output_weights=False,
))
register_model_config("qwen2-1.5b")(lambda: qwen2_like(
    num_layers=28, hidden_size=1536, ffn_hidden_size=8960, num_attention_heads=12, num_query_groups=2,
    seq_length=4096, max_position_embeddings=32768, untie_embeddings_and_output_weights=False,
))
register_model_config("qwen2-7b")(lambda: qwen2_like(
    num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4,
    seq_length=4096, max_position_embeddings=32768, vocab_size=152064,
))
register_model_config("qwen3-0.6b")(lambda: qwen3_like(
    num_layers=28, hidden_size=1024, ffn_hidden_size=3072, num_attention_heads=16, num_query_groups=8,
    untie_embeddings_and_output_weights=False,
))
register_model_config("qwen3-1.7b")(lambda: qwen3_like(
    num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=8,
    untie_embeddings_and_output_weights=False,
))
register_model_config("qwen3-4b")(lambda: qwen3_like(
    num_layers=36, hidden_size=2560, ffn_hidden_size=9728, num_attention_heads=32, num_query_groups=8,
    untie_embeddings_and_output_weights=False,
))
register_model_config("qwen3-8b")(lambda: qwen3_like(
    num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8,
))
register_model_config("tiny-llama")(lambda: llama_like(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, seq_length=32,
    vocab_size=128, make_vocab_size_divisible_by=1,
))
register_model_config("tiny-qwen2")(lambda: qwen2_like(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, seq_length=32,
    vocab_size=128, make_vocab_size_divisible_by=1,
))
# Head width 32, not hidden / heads = 16: the q/k norms and the projections must follow kv_channels.
register_model_config("tiny-qwen3")(lambda: qwen3_like(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
    seq_length=32, max_position_embeddings=32, vocab_size=128, make_vocab_size_divisible_by=1,
))


def _llama_from_hf(c: dict) -> ModelConfig:
    # Megatron's add_bias_linear puts biases on the MLP too; LLaMA's attention_bias does not.
    require(c, "attention_bias", [False], False)
    require(c, "mlp_bias", [False], False)
    return llama_config(c)


def _mistral_from_hf(c: dict) -> ModelConfig:
    require_no_window(c)
    require(c, "attention_bias", [False], False)
    return llama_config(c)


def _qwen2_from_hf(c: dict) -> ModelConfig:
    require(c, "use_sliding_window", [False], False)
    return llama_config(c)


def _qwen3_from_hf(c: dict) -> ModelConfig:
    require(c, "use_sliding_window", [False], False)
    require(c, "attention_bias", [False], False)
    return llama_config(c)


def _llama_hf(m: ModelConfig) -> dict:
    if m.num_moe_experts is not None:
        raise UnsupportedCheckpoint(
            f"the model has {m.num_moe_experts} experts per layer, a dense Hugging Face model type has none; pass "
            "--model-type mixtral, qwen2_moe or qwen3_moe"
        )
    return attention_hf(m)


def _mistral_hf(m: ModelConfig) -> dict:
    # transformers' MistralConfig defaults sliding_window to 4096; ours attends to everything.
    return {**_llama_hf(m), "sliding_window": None}


def _is_llama(m: ModelConfig) -> bool:
    # Any number of query groups, tied or untied embeddings, no experts.
    return is_model_type(m, "llama") and m.num_moe_experts is None


register_family(model_type="llama", config_from_hf=_llama_from_hf, config_to_hf=_llama_hf, table=llama_table,
                architectures=("LlamaForCausalLM",), recognises=_is_llama)
register_family(model_type="mistral", config_from_hf=_mistral_from_hf, config_to_hf=_mistral_hf, table=llama_table,
                architectures=("MistralForCausalLM",))
register_family(model_type="qwen2", config_from_hf=_qwen2_from_hf, config_to_hf=_llama_hf, table=llama_table,
                architectures=("Qwen2ForCausalLM",))
register_family(model_type="qwen3", config_from_hf=_qwen3_from_hf, config_to_hf=_llama_hf, table=llama_table,
                architectures=("Qwen3ForCausalLM",))
