"""GPT-2 (OpenAI): learned positions, LayerNorm, biases on every linear layer, a GeLU MLP and one fused q/k/v
projection (``c_attn``, stored transposed as Conv1D weights). Its model type, named configurations and conversion.

Example::

    config = get_model_config("gpt2-124m")
"""

from __future__ import annotations

from megatron_patch.model.config import (
    ModelConfig,
    hf_sizes,
    is_model_type,
    model_of_type,
    register_model_config,
    register_model_type,
)
from megatron_patch.model.conversion import Table, register_family, require, rule
from megatron_patch.model.features import output_layer

# OpenAI GPT-2: learned positions, LayerNorm, biases on every linear layer (its GeLU is the tanh one, but a GPT-2
# block with erf-GeLU exports as gelu too).
register_model_type("gpt2", family="gpt", position_embedding_type="learned_absolute", normalization="LayerNorm",
                    add_bias_linear=True, qk_layernorm=False)


def _gpt2(num_layers: int, hidden_size: int, num_attention_heads: int) -> ModelConfig:
    # 1024 context, vocabulary 50257 (padded to 50304 by make_vocab_size_divisible_by=128 x TP), tied embeddings.
    return model_of_type(
        "gpt2", num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        seq_length=1024, max_position_embeddings=1024, activation="gelu_tanh", vocab_size=50257,
    )


register_model_config("gpt2-124m")(lambda: _gpt2(12, 768, 12))
register_model_config("gpt2-355m")(lambda: _gpt2(24, 1024, 16))
register_model_config("gpt2-774m")(lambda: _gpt2(36, 1280, 20))
register_model_config("gpt2-1.5b")(lambda: _gpt2(48, 1600, 25))
# Debug shapes: seconds on a CPU, every architectural feature switched on.
register_model_config("tiny-gpt2")(lambda: _gpt2(2, 64, 4).replace(
    seq_length=32, max_position_embeddings=32, vocab_size=128, make_vocab_size_divisible_by=1,
))

# Activation names: Hugging Face's ACT2FN key <-> ModelConfig.activation.
_GELU_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_GELU_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


def _gpt2_config(c: dict) -> ModelConfig:
    require(c, "activation_function", _GELU_FROM_HF, "gelu_new")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        require(c, flag, [False], False)
    require(c, "scale_attn_weights", [True], True)
    # GPT-2's n_inner null is an MLP of 4 x hidden.
    sizes = hf_sizes(c, optional=("num_query_groups", "kv_channels", "ffn_hidden_size"))
    return model_of_type(
        "gpt2", **sizes, activation=_GELU_FROM_HF[c.get("activation_function", "gelu_new")],
        layernorm_epsilon=c.get("layer_norm_epsilon", 1e-5),
        hidden_dropout=c.get("resid_pdrop", 0.1), attention_dropout=c.get("attn_pdrop", 0.1),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
    )


def _gpt2_hf(m: ModelConfig) -> dict:
    return dict(
        n_layer=m.num_layers, n_embd=m.hidden_size, n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size,
        n_positions=m.max_positions, activation_function=_GELU_TO_HF[m.activation],
        layer_norm_epsilon=m.layernorm_epsilon, vocab_size=m.vocab_size, resid_pdrop=m.hidden_dropout,
        embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights,
    )


_GPT2_LAYER = "transformer.h.{}."
_GPT2_RULES = (
    rule("transformer.wte.weight", "embedding.word_embeddings.weight", "pad_vocab"),
    rule("transformer.wpe.weight", "embedding.position_embeddings.weight"),
    rule(_GPT2_LAYER + "ln_1.weight", "decoder.layers.{}.input_layernorm.weight"),
    rule(_GPT2_LAYER + "ln_1.bias", "decoder.layers.{}.input_layernorm.bias"),
    rule(_GPT2_LAYER + "attn.c_attn.weight", "decoder.layers.{}.self_attention.linear_qkv.weight",
         "transpose", "fuse_stacked_qkv"),
    rule(_GPT2_LAYER + "attn.c_attn.bias", "decoder.layers.{}.self_attention.linear_qkv.bias", "fuse_stacked_qkv"),
    rule(_GPT2_LAYER + "attn.c_proj.weight", "decoder.layers.{}.self_attention.linear_proj.weight", "transpose"),
    rule(_GPT2_LAYER + "attn.c_proj.bias", "decoder.layers.{}.self_attention.linear_proj.bias"),
    rule(_GPT2_LAYER + "ln_2.weight", "decoder.layers.{}.pre_mlp_layernorm.weight"),
    rule(_GPT2_LAYER + "ln_2.bias", "decoder.layers.{}.pre_mlp_layernorm.bias"),
    rule(_GPT2_LAYER + "mlp.c_fc.weight", "decoder.layers.{}.mlp.linear_fc1.weight", "transpose"),
    rule(_GPT2_LAYER + "mlp.c_fc.bias", "decoder.layers.{}.mlp.linear_fc1.bias"),
    rule(_GPT2_LAYER + "mlp.c_proj.weight", "decoder.layers.{}.mlp.linear_fc2.weight", "transpose"),
    rule(_GPT2_LAYER + "mlp.c_proj.bias", "decoder.layers.{}.mlp.linear_fc2.bias"),
    rule("transformer.ln_f.weight", "decoder.final_layernorm.weight"),
    rule("transformer.ln_f.bias", "decoder.final_layernorm.bias"),
)


def _gpt2_table(m: ModelConfig, architecture: str) -> Table:
    head, ignored = output_layer(m)
    # Older GPT-2 files carry the causal-mask buffers as tensors.
    return Table(_GPT2_RULES + head, ignored_hf=ignored + (r"transformer\.h\.\d+\.attn\.(masked_)?bias",))


def _is_gpt2(m: ModelConfig) -> bool:
    # GPT-2's block with a GELU MLP, one key and value head per query head of hidden_size / heads channels (its
    # c_attn is [q; k; v] of hidden_size each).
    return (is_model_type(m, "gpt2") and m.activation in _GELU_TO_HF
            and m.num_query_groups == m.num_attention_heads
            and m.kv_channels * m.num_attention_heads == m.hidden_size and m.num_moe_experts is None)


register_family(model_type="gpt2", config_from_hf=_gpt2_config, config_to_hf=_gpt2_hf, table=_gpt2_table,
                architectures=("GPT2LMHeadModel",), recognises=_is_gpt2)
