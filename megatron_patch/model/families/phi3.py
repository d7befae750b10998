"""Phi-3 and Phi-4 (Hugging Face ``phi3``): LLaMA's decoder (RMSNorm, SwiGLU, RoPE, no biases) whose q, k and v
are one projection (``qkv_proj``: [q; k; v], k and v of the query groups' width) and whose gate and up are one
(``gate_up_proj``: [gate; up], megatron-core's ``linear_fc1`` as it is). Its model type, named configurations and
conversion.

Example::

    config = get_model_config("phi-4")
    megatron-patch convert hf-to-megatron --hf-dir phi-4 --save-dir phi-4-mcore

Phi-3-mini-4k's attention window (2047 tokens) is refused as Mistral's is; the long-context variants' ``longrope``
(Phi-3-mini-128k, Phi-3.5, Phi-4-mini) is refused by ``rope_fields``.
"""

from __future__ import annotations

from megatron_patch.model.config import ModelConfig, register_model_config, register_model_type
from megatron_patch.model.conversion import Table, UnsupportedCheckpoint, register_family, rule
from megatron_patch.model.features import (
    LLAMA_LAYER,
    LLAMA_TYPE,
    attention_hf,
    llama_config,
    llama_like,
    output_layer,
    require_no_window,
)

register_model_type("phi3", **LLAMA_TYPE)


def phi3_like(**fields) -> ModelConfig:
    # Phi's RMSNorm eps 1e-5, untied output, no dropout.
    return llama_like("phi3", **{"layernorm_epsilon": 1e-5, **fields})


# microsoft/phi-4's config.json: 40 layers, 40 heads in 10 key/value groups, a 16k context, RoPE base 250000.
register_model_config("phi-4")(lambda: phi3_like(
    num_layers=40, hidden_size=5120, ffn_hidden_size=17920, num_attention_heads=40, num_query_groups=10,
    seq_length=4096, max_position_embeddings=16384, rotary_base=250000, vocab_size=100352,
))
# Two key/value groups and RoPE over half of each head: the fused q/k/v must be cut by the groups' width.
register_model_config("tiny-phi3")(lambda: phi3_like(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, seq_length=32,
    rotary_percent=0.5, vocab_size=128, make_vocab_size_divisible_by=1,
))


def _phi3_from_hf(c: dict) -> ModelConfig:
    require_no_window(c)
    # Phi-3's residual dropout is megatron-core's hidden dropout (which also drops the embeddings' output).
    return llama_config(c, hidden_dropout=c.get("resid_pdrop", 0.0))


def _phi3_hf(m: ModelConfig) -> dict:
    if m.num_moe_experts is not None:
        raise UnsupportedCheckpoint(f"the model has {m.num_moe_experts} experts per layer, phi3 has none; pass "
                                    "--model-type mixtral, qwen2_moe or qwen3_moe")
    return {**attention_hf(m), "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout,
            "sliding_window": None, "original_max_position_embeddings": m.max_positions}


def _phi3_table(m: ModelConfig, architecture: str) -> Table:
    head, ignored = output_layer(m)
    layer = "decoder.layers.{}."
    return Table((
        rule("model.embed_tokens.weight", "embedding.word_embeddings.weight", "pad_vocab"),
        rule(LLAMA_LAYER + "input_layernorm.weight", layer + "input_layernorm.weight"),
        rule(LLAMA_LAYER + "self_attn.qkv_proj.weight", layer + "self_attention.linear_qkv.weight",
             "fuse_stacked_qkv"),
        rule(LLAMA_LAYER + "self_attn.o_proj.weight", layer + "self_attention.linear_proj.weight"),
        rule(LLAMA_LAYER + "post_attention_layernorm.weight", layer + "pre_mlp_layernorm.weight"),
        rule(LLAMA_LAYER + "mlp.gate_up_proj.weight", layer + "mlp.linear_fc1.weight"),
        rule(LLAMA_LAYER + "mlp.down_proj.weight", layer + "mlp.linear_fc2.weight"),
        rule("model.norm.weight", "decoder.final_layernorm.weight"),
    ) + head, ignored_hf=ignored)


register_family(model_type="phi3", config_from_hf=_phi3_from_hf, config_to_hf=_phi3_hf, table=_phi3_table,
                architectures=("Phi3ForCausalLM",))
