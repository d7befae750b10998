"""The Hugging Face features several families share, each written once: RoPE (and LLaMA 3.1's scaling of it), the
output layer, LLaMA's decoder layer with its options (q/k/v biases, per-head q/k norms, the SwiGLU MLP) and its
config.json, and mixture-of-experts MLPs (a router, experts, a gated shared expert).

Example::

    from megatron_patch.model.features import LLAMA_TYPE, llama_config, llama_table
    register_model_type("llama", **LLAMA_TYPE)
    register_family(model_type="llama", config_from_hf=llama_config, table=llama_table, ...)
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_patch.model.config import ModelConfig, hf_sizes, model_of_type
from megatron_patch.model.conversion import Rule, Table, UnsupportedCheckpoint, require, rule

# LLaMA: RoPE, RMSNorm, SwiGLU, no bias anywhere; the fields most GPT families start from.
LLAMA_TYPE = dict(family="gpt", position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False)
# LLaMA 3.1's rope_scaling values megatron-core's RotaryEmbedding._apply_scaling hard-codes (only the factor is an
# argument there, RotaryEmbedding._apply_scaling at core_v0.16.1); transformers reads all four from config.json.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_fields(hf_config: dict) -> dict:
    """rotary_base, rope_scaling and rope_scaling_factor from transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` and ``rope_scaling`` (whose type key was once ``type``)."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UnsupportedCheckpoint(
            f"config.json asks for RoPE scaling {rope_type!r} (its rope_type); only 'default' (unscaled) and "
            "'llama3' (LLaMA 3.1) convert exactly"
        )
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise UnsupportedCheckpoint(f"rope_theta {theta} is not an integer, which --rotary-base requires")
    if rope_type == "default":
        return dict(rotary_base=int(theta))
    for key, value in _LLAMA3_FIXED.items():
        if params.get(key) != value:
            raise UnsupportedCheckpoint(
                f"config.json's RoPE scaling 'llama3' has {key}={params.get(key)!r}; megatron-core builds it with "
                f"{key}={value} only (it fixes {_LLAMA3_FIXED}, LLaMA 3.1's values)"
            )
    if not (params.get("factor") or 0) > 0:
        raise UnsupportedCheckpoint(f"config.json's RoPE scaling 'llama3' has factor={params.get('factor')!r}; "
                                    "it needs a positive factor")
    return dict(rotary_base=int(theta), rope_scaling=True, rope_scaling_factor=float(params["factor"]))


def rope_parameters(m: ModelConfig) -> dict:
    """config.json's ``rope_parameters`` (transformers 5) of ``m``: the inverse of :func:`rope_fields`."""
    params = {"rope_theta": float(m.rotary_base), "rope_type": "default"}
    if m.rope_scaling:
        params.update(rope_type="llama3", factor=m.rope_scaling_factor, **_LLAMA3_FIXED)
    if m.rotary_percent != 1.0:
        params["partial_rotary_factor"] = m.rotary_percent
    return params


_LM_HEAD = rule("lm_head.weight", "output_layer.weight", "pad_vocab")


def output_layer(m: ModelConfig) -> tuple[tuple[Rule, ...], tuple[str, ...]]:
    """An untied model has its own output matrix; a tied one may still carry a copy (which HF ignores too)."""
    return ((_LM_HEAD,), ()) if m.untie_embeddings_and_output_weights else ((), ("lm_head.weight",))


def llama_config(c: dict, **fields) -> ModelConfig:
    require(c, "hidden_act", ["silu"], "silu")
    return model_of_type(
        c["model_type"], **hf_sizes(c), **rope_fields(c),
        rotary_percent=(c.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                            c.get("partial_rotary_factor", 1.0)),
        layernorm_epsilon=c.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        attention_dropout=c.get("attention_dropout", 0.0), **{"hidden_dropout": 0.0, **fields},
    )


def require_no_window(c: dict) -> None:
    # Mistral and Mixtral are LLaMA with a sliding attention window; ours attends to the whole sequence, which is
    # the same computation only while no sequence is longer than the window (seq_length is max_position_embeddings).
    window = c.get("sliding_window")
    if window is not None and window < c["max_position_embeddings"]:
        raise UnsupportedCheckpoint(
            f"config.json has sliding_window={window}, smaller than max_position_embeddings="
            f"{c['max_position_embeddings']}: our attention has no sliding window; set sliding_window to null (or "
            f"max_position_embeddings to {window} to convert for sequences the window does not cut)"
        )


def attention_hf(m: ModelConfig) -> dict:
    return dict(
        num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels,
        max_position_embeddings=m.max_positions, rms_norm_eps=m.layernorm_epsilon, hidden_act="silu",
        rope_parameters=rope_parameters(m),
        vocab_size=m.vocab_size, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        attention_dropout=m.attention_dropout,
    )


LLAMA_LAYER = "model.layers.{}."
LLAMA_RULES = (
    rule("model.embed_tokens.weight", "embedding.word_embeddings.weight", "pad_vocab"),
    rule(LLAMA_LAYER + "input_layernorm.weight", "decoder.layers.{}.input_layernorm.weight"),
    rule(tuple(LLAMA_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
         "decoder.layers.{}.self_attention.linear_qkv.weight", "fuse_qkv"),
    rule(LLAMA_LAYER + "self_attn.o_proj.weight", "decoder.layers.{}.self_attention.linear_proj.weight"),
    rule(LLAMA_LAYER + "post_attention_layernorm.weight", "decoder.layers.{}.pre_mlp_layernorm.weight"),
    rule("model.norm.weight", "decoder.final_layernorm.weight"),
)


def swiglu_mlp(hf: str, mcore: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
                ) -> tuple[Rule, ...]:
    """A SwiGLU MLP under the prefixes ``hf`` and ``mcore``: gate and up stacked into megatron's linear_fc1."""
    return (rule((f"{hf}{gate}.weight", f"{hf}{up}.weight"), f"{mcore}linear_fc1.weight", "fuse_gate_up"),
            rule(f"{hf}{down}.weight", f"{mcore}linear_fc2.weight"))


LLAMA_MLP = swiglu_mlp(LLAMA_LAYER + "mlp.", "decoder.layers.{}.mlp.")
QKV_BIAS = rule(tuple(LLAMA_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
                 "decoder.layers.{}.self_attention.linear_qkv.bias", "fuse_qkv")
# Qwen3's per-head RMSNorm weights ([head_dim], the same on every TP rank).
QK_NORMS = (rule(LLAMA_LAYER + "self_attn.q_norm.weight", "decoder.layers.{}.self_attention.q_layernorm.weight"),
             rule(LLAMA_LAYER + "self_attn.k_norm.weight", "decoder.layers.{}.self_attention.k_layernorm.weight"))


def llama_table(m: ModelConfig, architecture: str, mlp: tuple[Rule, ...] = LLAMA_MLP) -> Table:
    head, ignored = output_layer(m)
    qkv_bias = (QKV_BIAS,) if m.add_qkv_bias else ()
    qk_norms = QK_NORMS if m.qk_layernorm else ()
    return Table(LLAMA_RULES + mlp + qkv_bias + qk_norms + head, ignored_hf=ignored + (r".*rotary_emb\.inv_freq",))


@dataclasses.dataclass(frozen=True)
class Experts:
    """Where a Hugging Face MoE block keeps its tensors on disk (the hub's per-expert keys, which this
    transformers' save_pretrained also writes, though its modules hold the experts fused)."""

    block: str
    """The MoE block's name in a layer."""
    projections: tuple[str, str, str]
    """An expert's gate, up and down projections."""


def moe_mlp(m: ModelConfig, experts: Experts) -> tuple[Rule, ...]:
    """The router (``gate``), every expert by its global index (megatron-core's sharded state dict places expert E
    on EP rank E // (experts / EP) when a checkpoint loads), and the shared expert with its sigmoid gate."""
    hf, mcore = LLAMA_LAYER + experts.block, "decoder.layers.{}.mlp."
    rules = (rule(hf + "gate.weight", mcore + "router.weight"),)
    for e in range(m.num_moe_experts):
        rules += swiglu_mlp(f"{hf}experts.{e}.", f"{mcore}experts.local_experts.{e}.", *experts.projections)
    if m.moe_shared_expert_intermediate_size:
        rules += swiglu_mlp(hf + "shared_expert.", mcore + "shared_experts.")
    if m.moe_shared_expert_gate:  # Linear(hidden, 1).weight [1, hidden], megatron's gate_weight the same
        rules += (rule(hf + "shared_expert_gate.weight", mcore + "shared_experts.gate_weight"),)
    return rules


def moe_table(experts: Experts) -> Callable[[ModelConfig, str], Table]:
    """The table of a MoE family (its config_to_hf has refused a dense model before a table is asked for)."""
    return lambda m, architecture: llama_table(m, architecture, moe_mlp(m, experts))


def llama_like(model_type: str = "llama", **fields) -> ModelConfig:
    # Untied output and no dropout unless the entry says otherwise.
    defaults = dict(untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)
    return model_of_type(model_type, **{**defaults, **fields})
