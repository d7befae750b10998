"""Mixtral, Qwen2-MoE and Qwen3-MoE: LLaMA's decoder with megatron-core's MoELayer for the MLP. Their model types,
named configurations and conversion.

Example::

    config = get_model_config("mixtral-8x7b")

Routing: Mixtral, and Qwen with norm_topk_prob true, take the softmax over all experts, keep the top k and
renormalise them: the softmax over the k largest logits, megatron-core's default. Qwen with norm_topk_prob false
keeps the top k of the softmax as they are: --moe-router-pre-softmax (moe_utils.topk_routing_with_score_function).
"""

from __future__ import annotations

from megatron_patch.model.config import ModelConfig, register_model_config, register_model_type
from megatron_patch.model.conversion import UnsupportedCheckpoint, register_family, require
from megatron_patch.model.families.llama import qwen2_like, qwen3_like
from megatron_patch.model.features import (
    Experts,
    LLAMA_TYPE,
    attention_hf,
    llama_config,
    llama_like,
    moe_table,
    require_no_window,
)

# LLaMA with experts in every MLP; Qwen2-MoE adds a shared expert behind a sigmoid gate.
register_model_type("mixtral", **LLAMA_TYPE)
register_model_type("qwen2_moe", **{**LLAMA_TYPE, "add_qkv_bias": True, "moe_shared_expert_gate": True})
register_model_type("qwen3_moe", **{**LLAMA_TYPE, "qk_layernorm": True})


def _mixtral(**fields) -> ModelConfig:
    # Mixtral = Mistral whose MLP is 8 experts, 2 per token, no shared expert, load-balancing loss weight 0.02;
    # RoPE base 1e6.
    defaults = dict(num_moe_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.02, rotary_base=1000000)
    return llama_like("mixtral", **{**defaults, **fields})


def _qwen2_moe(**fields) -> ModelConfig:
    # Qwen1.5/2-MoE: routed experts in every MLP plus the gated shared expert; top-k weights taken from the softmax
    # over all experts, not renormalised (norm_topk_prob false).
    defaults = dict(moe_router_pre_softmax=True, moe_aux_loss_coeff=0.001, untie_embeddings_and_output_weights=True)
    return qwen2_like("qwen2_moe", **{**defaults, **fields})


def _qwen3_moe(**fields) -> ModelConfig:
    # Qwen3-MoE: routed experts in every MLP, no shared expert, top-k weights renormalised (norm_topk_prob true,
    # which is the softmax over the k chosen logits).
    defaults = dict(moe_aux_loss_coeff=0.001, untie_embeddings_and_output_weights=True)
    return qwen3_like("qwen3_moe", **{**defaults, **fields})


register_model_config("mixtral-8x7b")(lambda: _mixtral(
    num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
    seq_length=4096, max_position_embeddings=32768, layernorm_epsilon=1e-5, vocab_size=32000,
))
# Qwen1.5-MoE-A2.7B (Qwen2MoeForCausalLM): 60 experts of 1408, 4 per token, a 5632-wide shared expert.
register_model_config("qwen2-moe-a2.7b")(lambda: _qwen2_moe(
    num_layers=24, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16, num_query_groups=16,
    seq_length=4096, max_position_embeddings=8192, num_moe_experts=60, moe_router_topk=4, moe_ffn_hidden_size=1408,
    moe_shared_expert_intermediate_size=5632,
))
register_model_config("qwen3-moe-30b-a3b")(lambda: _qwen3_moe(
    num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4,
    num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
))
# Four experts, two per token: with EP=2 each rank holds two, and tokens cross ranks.
register_model_config("tiny-mixtral")(lambda: _mixtral(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, seq_length=32,
    vocab_size=128, make_vocab_size_divisible_by=1, num_moe_experts=4, moe_ffn_hidden_size=32,
))
register_model_config("tiny-qwen2-moe")(lambda: _qwen2_moe(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, seq_length=32,
    vocab_size=128, make_vocab_size_divisible_by=1, num_moe_experts=4, moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=48,
))
register_model_config("tiny-qwen3-moe")(lambda: _qwen3_moe(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
    seq_length=32, max_position_embeddings=32, vocab_size=128, make_vocab_size_divisible_by=1, num_moe_experts=4,
    moe_ffn_hidden_size=32,
))

_MIXTRAL_EXPERTS = Experts("block_sparse_moe.", ("w1", "w3", "w2"))
_QWEN_EXPERTS = Experts("mlp.", ("gate_proj", "up_proj", "down_proj"))


def _require_every_layer_sparse(c: dict) -> None:
    """Qwen's MoE configs can keep some layers dense; ours puts experts in every layer."""
    if c.get("mlp_only_layers"):
        raise UnsupportedCheckpoint(f"config.json has mlp_only_layers={c['mlp_only_layers']}: our MoE model has "
                                    "experts in every layer; only mlp_only_layers=[] converts")
    require(c, "decoder_sparse_step", [1], 1)


def _mixtral_from_hf(c: dict) -> ModelConfig:
    require_no_window(c)
    if c.get("router_jitter_noise"):
        # megatron-core's moe_input_jitter_eps jitters the router's input only, Mixtral's block the experts' too.
        raise UnsupportedCheckpoint(f"config.json has router_jitter_noise={c['router_jitter_noise']}, which "
                                    "megatron-core's router does not reproduce; set it to 0.0")
    return llama_config(c, num_moe_experts=c["num_local_experts"], moe_router_topk=c["num_experts_per_tok"],
                         moe_aux_loss_coeff=c.get("router_aux_loss_coef", 0.001))


def _qwen_moe_fields(c: dict) -> dict:
    require(c, "use_sliding_window", [False], False)
    _require_every_layer_sparse(c)
    # transformers 5 saves Qwen3-MoE's num_experts under its attribute_map name, num_local_experts.
    return dict(num_moe_experts=c["num_experts"] if "num_experts" in c else c["num_local_experts"],
                moe_router_topk=c["num_experts_per_tok"], moe_ffn_hidden_size=c["moe_intermediate_size"],
                moe_router_pre_softmax=not c.get("norm_topk_prob", False),
                moe_aux_loss_coeff=c.get("router_aux_loss_coef", 0.001))


def _qwen2_moe_from_hf(c: dict) -> ModelConfig:
    shared = c.get("shared_expert_intermediate_size")
    if not shared:
        raise UnsupportedCheckpoint(f"config.json has shared_expert_intermediate_size={shared!r}: a Qwen2-MoE "
                                    "without its shared expert is not converted; give its width")
    return llama_config(c, add_qkv_bias=c.get("qkv_bias", True), moe_shared_expert_intermediate_size=shared,
                         **_qwen_moe_fields(c))


def _qwen3_moe_from_hf(c: dict) -> ModelConfig:
    require(c, "attention_bias", [False], False)
    return llama_config(c, **_qwen_moe_fields(c))


def _moe_hf(m: ModelConfig, model_type: str, shared_expert: bool, pre_softmax: tuple[bool, ...]) -> dict:
    """The MoE fields every exported config has; what ``model_type`` cannot express is refused by name."""
    if m.num_moe_experts is None:
        raise UnsupportedCheckpoint(f"the model is dense (no --num-experts), {model_type} is a mixture of experts; "
                                    "pass the --model-type of its dense family (llama, mistral, qwen2, qwen3)")
    has_shared = (m.moe_shared_expert_intermediate_size is not None, m.moe_shared_expert_gate)
    if has_shared != (shared_expert, shared_expert):
        raise UnsupportedCheckpoint(
            f"{model_type} {'has' if shared_expert else 'has no'} gated shared expert, the model's "
            f"--moe-shared-expert-intermediate-size is {m.moe_shared_expert_intermediate_size} and "
            f"--moe-shared-expert-gate {m.moe_shared_expert_gate}; pass the --model-type that matches "
            "(qwen2_moe has one)"
        )
    if m.moe_router_pre_softmax not in pre_softmax:
        raise UnsupportedCheckpoint(f"{model_type} renormalises the top-k router weights, the model routes with "
                                    "--moe-router-pre-softmax; pass --model-type qwen2_moe or qwen3_moe")
    return dict(num_experts_per_tok=m.moe_router_topk, router_aux_loss_coef=m.moe_aux_loss_coeff)


def _mixtral_hf(m: ModelConfig) -> dict:
    # Mixtral's intermediate_size is an expert's width; its config has no other.
    return {**attention_hf(m), **_moe_hf(m, "mixtral", shared_expert=False, pre_softmax=(False,)),
            "num_local_experts": m.num_moe_experts, "intermediate_size": m.moe_ffn_hidden_size,
            "sliding_window": None, "router_jitter_noise": 0.0}


def _qwen_moe_hf(m: ModelConfig, model_type: str, shared_expert: bool) -> dict:
    return {**attention_hf(m), **_moe_hf(m, model_type, shared_expert, pre_softmax=(False, True)),
            "num_experts": m.num_moe_experts, "moe_intermediate_size": m.moe_ffn_hidden_size,
            "norm_topk_prob": not m.moe_router_pre_softmax, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen2_moe_hf(m: ModelConfig) -> dict:
    return {**_qwen_moe_hf(m, "qwen2_moe", shared_expert=True), "qkv_bias": m.add_qkv_bias,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size}


register_family(model_type="mixtral", config_from_hf=_mixtral_from_hf, config_to_hf=_mixtral_hf,
                table=moe_table(_MIXTRAL_EXPERTS), architectures=("MixtralForCausalLM",))
register_family(model_type="qwen2_moe", config_from_hf=_qwen2_moe_from_hf, config_to_hf=_qwen2_moe_hf,
                table=moe_table(_QWEN_EXPERTS), architectures=("Qwen2MoeForCausalLM",))
register_family(model_type="qwen3_moe", config_from_hf=_qwen3_moe_from_hf,
                config_to_hf=lambda m: _qwen_moe_hf(m, "qwen3_moe", shared_expert=False),
                table=moe_table(_QWEN_EXPERTS), architectures=("Qwen3MoeForCausalLM",))
