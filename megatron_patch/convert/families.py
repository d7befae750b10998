"""Conversion as data: per Hugging Face ``model_type``, how its config and its tensors map onto megatron-core.

Example::

    from megatron_patch.convert.families import family_for
    family = family_for({"model_type": "llama", ...})        # the registry, keyed by config.json's model_type
    model_config = family.config_from_hf(hf_config)
    table = family.table(model_config, "LlamaForCausalLM")
    table.rules[3]   # Rule(hf=('model.layers.{}.self_attn.q_proj.weight', ...), mcore='decoder.layers.{}...')

A rule names the Hugging Face tensor(s), the megatron-core tensor (names of a TP=1, PP=1, EP=1 model's
``state_dict()``; ``{}`` is the layer index) and the transforms between them (``transforms.TRANSFORMS``).
GPT-2, LLaMA, Mistral, Qwen2 and Qwen3 differ only in their tables and config fields; Mixtral, Qwen2-MoE and
Qwen3-MoE are their tables with the MLP rows replaced by a router, one pair of rows per expert (the expert index
written into the names, Hugging Face's on-disk ``experts.N`` keys) and Qwen2-MoE's gated shared expert. Nothing
here branches on a model's name.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from megatron_patch.errors import UserError
from megatron_patch.model.config import ModelConfig, hf_sizes, is_model_type, model_of_type


class UnsupportedCheckpoint(UserError, ValueError):
    """The input is not something this converter can translate exactly (model type, architecture, option)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """Hugging Face tensor name(s) <-> one megatron-core tensor name, through named transforms."""

    hf: tuple[str, ...]
    mcore: str
    transforms: tuple[str, ...] = ()

    def expand(self, num_layers: int) -> list["Rule"]:
        """One rule per layer when the names carry ``{}``; the rule itself otherwise."""
        if "{}" not in self.mcore:
            return [self]
        return [Rule(tuple(n.format(i) for n in self.hf), self.mcore.format(i), self.transforms)
                for i in range(num_layers)]


def rule(hf: str | tuple[str, ...], mcore: str, *transforms: str) -> Rule:
    return Rule(hf if isinstance(hf, tuple) else (hf,), mcore, transforms)


@dataclasses.dataclass(frozen=True)
class Table:
    """The rules of one Hugging Face architecture, what its files may hold besides them, and the megatron
    tensors it cannot provide (heads an encoder-only checkpoint does not have: initialised and reported)."""

    rules: tuple[Rule, ...]
    ignored_hf: tuple[str, ...] = ()
    missing_mcore_prefixes: tuple[str, ...] = ()

    def expanded(self, num_layers: int) -> list[Rule]:
        return [r for template in self.rules for r in template.expand(num_layers)]


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything model-type specific about a conversion."""

    model_type: str
    config_from_hf: Callable[[dict], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict]
    table: Callable[[ModelConfig, str], Table]
    architectures: tuple[str, ...]
    recognises: Callable[[ModelConfig], bool] | None = None
    """Whether a model that records no Hugging Face config (trained from scratch, or saved by Megatron-LM) is this
    model type; None for a type only ``--model-type`` picks (a Mistral model without its window is a LLaMA one)."""
    held_by_files: Callable[[ModelConfig, list[str]], ModelConfig] | None = None
    """The config changed by what the weight files hold, for layers config.json announces but checkpoints may lack
    (DeepSeek-V3's multi-token prediction layers: the published checkpoint has them, transformers saves none)."""


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    if family.model_type in FAMILIES:
        raise ValueError(f"a converter for model_type {family.model_type!r} is already registered")
    FAMILIES[family.model_type] = family
    return family


def family_for(hf_config: dict) -> Family:
    """The converter registered for ``hf_config["model_type"]``, or an error listing the supported ones."""
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedCheckpoint(
            f"config.json has model_type {model_type!r}; supported model types are {sorted(FAMILIES)}"
        )
    return FAMILIES[model_type]


def recognised_model_type(m: ModelConfig) -> str | None:
    """The one model type whose ``recognises`` accepts ``m``, else None (the model needs ``--model-type``).

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> recognised_model_type(get_model_config("tiny-llama")), recognised_model_type(get_model_config("tiny-gpt2"))
        ('llama', 'gpt2')
        >>> recognised_model_type(get_model_config("tiny-llama", normalization="LayerNorm")) is None
        True
    """
    found = [f.model_type for f in FAMILIES.values() if f.recognises is not None and f.recognises(m)]
    return found[0] if len(found) == 1 else None


def recognised_model_types() -> list[str]:
    """The model types :func:`recognised_model_type` can return.

    Example::

        >>> recognised_model_types()
        ['gpt2', 'llama']
    """
    return sorted(f.model_type for f in FAMILIES.values() if f.recognises is not None)


def architecture_of(hf_config: dict, family: Family) -> str:
    """The Hugging Face class the checkpoint was saved from (``architectures[0]``), checked against the family."""
    architectures = hf_config.get("architectures") or [family.architectures[0]]
    if architectures[0] not in family.architectures:
        raise UnsupportedCheckpoint(
            f"config.json architecture {architectures[0]!r} is not supported for model_type "
            f"{family.model_type!r}; supported: {list(family.architectures)}"
        )
    return architectures[0]


def _require(hf_config: dict, key: str, allowed, default=None) -> None:
    value = hf_config.get(key, default)
    if value not in allowed:
        raise UnsupportedCheckpoint(
            f"config.json has {key}={value!r}; the {hf_config.get('model_type')} converter supports {list(allowed)}"
        )


# LLaMA 3.1's rope_scaling values megatron-core's RotaryEmbedding._apply_scaling hard-codes (only the factor is an
# argument there, RotaryEmbedding._apply_scaling at core_v0.16.1); transformers reads all four from config.json.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_fields(hf_config: dict) -> dict:
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


def _rope_parameters(m: ModelConfig) -> dict:
    """config.json's ``rope_parameters`` (transformers 5) of ``m``: the inverse of :func:`_rope_fields`."""
    params = {"rope_theta": float(m.rotary_base), "rope_type": "default"}
    if m.rope_scaling:
        params.update(rope_type="llama3", factor=m.rope_scaling_factor, **_LLAMA3_FIXED)
    if m.rotary_percent != 1.0:
        params["partial_rotary_factor"] = m.rotary_percent
    return params


# ----------------------------------------------------------------------------------------------------------
# GPT-2
# ----------------------------------------------------------------------------------------------------------

# Activation names: Hugging Face's ACT2FN key <-> ModelConfig.activation.
_GELU_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_GELU_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}


def _gpt2_config(c: dict) -> ModelConfig:
    _require(c, "activation_function", _GELU_FROM_HF, "gelu_new")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        _require(c, flag, [False], False)
    _require(c, "scale_attn_weights", [True], True)
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
_LM_HEAD = rule("lm_head.weight", "output_layer.weight", "pad_vocab")


def _output_layer(m: ModelConfig) -> tuple[tuple[Rule, ...], tuple[str, ...]]:
    """An untied model has its own output matrix; a tied one may still carry a copy (which HF ignores too)."""
    return ((_LM_HEAD,), ()) if m.untie_embeddings_and_output_weights else ((), ("lm_head.weight",))


def _gpt2_table(m: ModelConfig, architecture: str) -> Table:
    head, ignored = _output_layer(m)
    # Older GPT-2 files carry the causal-mask buffers as tensors.
    return Table(_GPT2_RULES + head, ignored_hf=ignored + (r"transformer\.h\.\d+\.attn\.(masked_)?bias",))


def _is_gpt2(m: ModelConfig) -> bool:
    # GPT-2's block with a GELU MLP, one key and value head per query head of hidden_size / heads channels (its
    # c_attn is [q; k; v] of hidden_size each).
    return (is_model_type(m, "gpt2") and m.activation in _GELU_TO_HF
            and m.num_query_groups == m.num_attention_heads
            and m.kv_channels * m.num_attention_heads == m.hidden_size and m.num_moe_experts is None)


register_family(Family("gpt2", _gpt2_config, _gpt2_hf, _gpt2_table, ("GPT2LMHeadModel",), _is_gpt2))


# ----------------------------------------------------------------------------------------------------------
# LLaMA, Mistral, Qwen2 and Qwen3: one table; Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms
# ----------------------------------------------------------------------------------------------------------


def _llama_config(c: dict, **fields) -> ModelConfig:
    _require(c, "hidden_act", ["silu"], "silu")
    return model_of_type(
        c["model_type"], **hf_sizes(c), **_rope_fields(c),
        rotary_percent=(c.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                            c.get("partial_rotary_factor", 1.0)),
        layernorm_epsilon=c.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False), hidden_dropout=0.0,
        attention_dropout=c.get("attention_dropout", 0.0), **fields,
    )


def _llama_from_hf(c: dict) -> ModelConfig:
    # Megatron's add_bias_linear puts biases on the MLP too; LLaMA's attention_bias does not.
    _require(c, "attention_bias", [False], False)
    _require(c, "mlp_bias", [False], False)
    return _llama_config(c)


def _require_no_window(c: dict) -> None:
    # Mistral and Mixtral are LLaMA with a sliding attention window; ours attends to the whole sequence, which is
    # the same computation only while no sequence is longer than the window (seq_length is max_position_embeddings).
    window = c.get("sliding_window")
    if window is not None and window < c["max_position_embeddings"]:
        raise UnsupportedCheckpoint(
            f"config.json has sliding_window={window}, smaller than max_position_embeddings="
            f"{c['max_position_embeddings']}: our attention has no sliding window; set sliding_window to null (or "
            f"max_position_embeddings to {window} to convert for sequences the window does not cut)"
        )


def _mistral_from_hf(c: dict) -> ModelConfig:
    _require_no_window(c)
    _require(c, "attention_bias", [False], False)
    return _llama_config(c)


def _qwen2_from_hf(c: dict) -> ModelConfig:
    _require(c, "use_sliding_window", [False], False)
    return _llama_config(c)


def _qwen3_from_hf(c: dict) -> ModelConfig:
    _require(c, "use_sliding_window", [False], False)
    _require(c, "attention_bias", [False], False)
    return _llama_config(c)


def _llama_hf(m: ModelConfig) -> dict:
    if m.num_moe_experts is not None:
        raise UnsupportedCheckpoint(
            f"the model has {m.num_moe_experts} experts per layer, a dense Hugging Face model type has none; pass "
            "--model-type mixtral, qwen2_moe or qwen3_moe"
        )
    return _attention_hf(m)


def _attention_hf(m: ModelConfig) -> dict:
    return dict(
        num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_query_groups, head_dim=m.kv_channels,
        max_position_embeddings=m.max_positions, rms_norm_eps=m.layernorm_epsilon, hidden_act="silu",
        rope_parameters=_rope_parameters(m),
        vocab_size=m.vocab_size, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        attention_dropout=m.attention_dropout,
    )


_LLAMA_LAYER = "model.layers.{}."
_LLAMA_RULES = (
    rule("model.embed_tokens.weight", "embedding.word_embeddings.weight", "pad_vocab"),
    rule(_LLAMA_LAYER + "input_layernorm.weight", "decoder.layers.{}.input_layernorm.weight"),
    rule(tuple(_LLAMA_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
         "decoder.layers.{}.self_attention.linear_qkv.weight", "fuse_qkv"),
    rule(_LLAMA_LAYER + "self_attn.o_proj.weight", "decoder.layers.{}.self_attention.linear_proj.weight"),
    rule(_LLAMA_LAYER + "post_attention_layernorm.weight", "decoder.layers.{}.pre_mlp_layernorm.weight"),
    rule("model.norm.weight", "decoder.final_layernorm.weight"),
)


def _swiglu_mlp(hf: str, mcore: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
                ) -> tuple[Rule, ...]:
    """A SwiGLU MLP under the prefixes ``hf`` and ``mcore``: gate and up stacked into megatron's linear_fc1."""
    return (rule((f"{hf}{gate}.weight", f"{hf}{up}.weight"), f"{mcore}linear_fc1.weight", "fuse_gate_up"),
            rule(f"{hf}{down}.weight", f"{mcore}linear_fc2.weight"))


_LLAMA_MLP = _swiglu_mlp(_LLAMA_LAYER + "mlp.", "decoder.layers.{}.mlp.")
_QKV_BIAS = rule(tuple(_LLAMA_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
                 "decoder.layers.{}.self_attention.linear_qkv.bias", "fuse_qkv")
# Qwen3's per-head RMSNorm weights ([head_dim], the same on every TP rank).
_QK_NORMS = (rule(_LLAMA_LAYER + "self_attn.q_norm.weight", "decoder.layers.{}.self_attention.q_layernorm.weight"),
             rule(_LLAMA_LAYER + "self_attn.k_norm.weight", "decoder.layers.{}.self_attention.k_layernorm.weight"))


def _llama_table(m: ModelConfig, architecture: str, mlp: tuple[Rule, ...] = _LLAMA_MLP) -> Table:
    head, ignored = _output_layer(m)
    qkv_bias = (_QKV_BIAS,) if m.add_qkv_bias else ()
    qk_norms = _QK_NORMS if m.qk_layernorm else ()
    return Table(_LLAMA_RULES + mlp + qkv_bias + qk_norms + head, ignored_hf=ignored + (r".*rotary_emb\.inv_freq",))


def _mistral_hf(m: ModelConfig) -> dict:
    # transformers' MistralConfig defaults sliding_window to 4096; ours attends to everything.
    return {**_llama_hf(m), "sliding_window": None}


def _is_llama(m: ModelConfig) -> bool:
    # Any number of query groups, tied or untied embeddings, no experts.
    return is_model_type(m, "llama") and m.num_moe_experts is None


register_family(Family("llama", _llama_from_hf, _llama_hf, _llama_table, ("LlamaForCausalLM",), _is_llama))
register_family(Family("mistral", _mistral_from_hf, _mistral_hf, _llama_table, ("MistralForCausalLM",)))
register_family(Family("qwen2", _qwen2_from_hf, _llama_hf, _llama_table, ("Qwen2ForCausalLM",)))
register_family(Family("qwen3", _qwen3_from_hf, _llama_hf, _llama_table, ("Qwen3ForCausalLM",)))


# ----------------------------------------------------------------------------------------------------------
# Mixtral, Qwen2-MoE and Qwen3-MoE: those tables with megatron-core's MoELayer for the MLP
# ----------------------------------------------------------------------------------------------------------
#
# Routing: Mixtral, and Qwen with norm_topk_prob true, take the softmax over all experts, keep the top k and
# renormalise them: the softmax over the k largest logits, megatron-core's default. Qwen with norm_topk_prob false
# keeps the top k of the softmax as they are: --moe-router-pre-softmax (moe_utils.topk_routing_with_score_function).


@dataclasses.dataclass(frozen=True)
class _Experts:
    """Where a Hugging Face MoE block keeps its tensors on disk (the hub's per-expert keys, which this
    transformers' save_pretrained also writes, though its modules hold the experts fused)."""

    block: str
    """The MoE block's name in a layer."""
    projections: tuple[str, str, str]
    """An expert's gate, up and down projections."""


_MIXTRAL_EXPERTS = _Experts("block_sparse_moe.", ("w1", "w3", "w2"))
_QWEN_EXPERTS = _Experts("mlp.", ("gate_proj", "up_proj", "down_proj"))


def _moe_mlp(m: ModelConfig, experts: _Experts) -> tuple[Rule, ...]:
    """The router (``gate``), every expert by its global index (megatron-core's sharded state dict places expert E
    on EP rank E // (experts / EP) when a checkpoint loads), and the shared expert with its sigmoid gate."""
    hf, mcore = _LLAMA_LAYER + experts.block, "decoder.layers.{}.mlp."
    rules = (rule(hf + "gate.weight", mcore + "router.weight"),)
    for e in range(m.num_moe_experts):
        rules += _swiglu_mlp(f"{hf}experts.{e}.", f"{mcore}experts.local_experts.{e}.", *experts.projections)
    if m.moe_shared_expert_intermediate_size:
        rules += _swiglu_mlp(hf + "shared_expert.", mcore + "shared_experts.")
    if m.moe_shared_expert_gate:  # Linear(hidden, 1).weight [1, hidden], megatron's gate_weight the same
        rules += (rule(hf + "shared_expert_gate.weight", mcore + "shared_experts.gate_weight"),)
    return rules


def _moe_table(experts: _Experts) -> Callable[[ModelConfig, str], Table]:
    """The table of a MoE family (its config_to_hf has refused a dense model before a table is asked for)."""
    return lambda m, architecture: _llama_table(m, architecture, _moe_mlp(m, experts))


def _require_every_layer_sparse(c: dict) -> None:
    """Qwen's MoE configs can keep some layers dense; ours puts experts in every layer."""
    if c.get("mlp_only_layers"):
        raise UnsupportedCheckpoint(f"config.json has mlp_only_layers={c['mlp_only_layers']}: our MoE model has "
                                    "experts in every layer; only mlp_only_layers=[] converts")
    _require(c, "decoder_sparse_step", [1], 1)


def _mixtral_from_hf(c: dict) -> ModelConfig:
    _require_no_window(c)
    if c.get("router_jitter_noise"):
        # megatron-core's moe_input_jitter_eps jitters the router's input only, Mixtral's block the experts' too.
        raise UnsupportedCheckpoint(f"config.json has router_jitter_noise={c['router_jitter_noise']}, which "
                                    "megatron-core's router does not reproduce; set it to 0.0")
    return _llama_config(c, num_moe_experts=c["num_local_experts"], moe_router_topk=c["num_experts_per_tok"],
                         moe_aux_loss_coeff=c.get("router_aux_loss_coef", 0.001))


def _qwen_moe_fields(c: dict) -> dict:
    _require(c, "use_sliding_window", [False], False)
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
    return _llama_config(c, add_qkv_bias=c.get("qkv_bias", True), moe_shared_expert_intermediate_size=shared,
                         **_qwen_moe_fields(c))


def _qwen3_moe_from_hf(c: dict) -> ModelConfig:
    _require(c, "attention_bias", [False], False)
    return _llama_config(c, **_qwen_moe_fields(c))


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
    return {**_attention_hf(m), **_moe_hf(m, "mixtral", shared_expert=False, pre_softmax=(False,)),
            "num_local_experts": m.num_moe_experts, "intermediate_size": m.moe_ffn_hidden_size,
            "sliding_window": None, "router_jitter_noise": 0.0}


def _qwen_moe_hf(m: ModelConfig, model_type: str, shared_expert: bool) -> dict:
    return {**_attention_hf(m), **_moe_hf(m, model_type, shared_expert, pre_softmax=(False, True)),
            "num_experts": m.num_moe_experts, "moe_intermediate_size": m.moe_ffn_hidden_size,
            "norm_topk_prob": not m.moe_router_pre_softmax, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen2_moe_hf(m: ModelConfig) -> dict:
    return {**_qwen_moe_hf(m, "qwen2_moe", shared_expert=True), "qkv_bias": m.add_qkv_bias,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size}


register_family(Family("mixtral", _mixtral_from_hf, _mixtral_hf, _moe_table(_MIXTRAL_EXPERTS),
                       ("MixtralForCausalLM",)))
register_family(Family("qwen2_moe", _qwen2_moe_from_hf, _qwen2_moe_hf, _moe_table(_QWEN_EXPERTS),
                       ("Qwen2MoeForCausalLM",)))
register_family(Family("qwen3_moe", _qwen3_moe_from_hf, lambda m: _qwen_moe_hf(m, "qwen3_moe", shared_expert=False),
                       _moe_table(_QWEN_EXPERTS), ("Qwen3MoeForCausalLM",)))


# ----------------------------------------------------------------------------------------------------------
# DeepSeek-V2 and -V3 (and Kimi K2, Moonlight): multi-latent attention, dense first layers, shared experts
# ----------------------------------------------------------------------------------------------------------
#
# MLA's projections are megatron-core's one for one (multi_latent_attention.py at core_v0.16.1 splits q into
# [nope; rope] per head and the key/value up projection into [k_nope; v] per head, as transformers does), so no
# tensor is reordered. Both libraries rotate the RoPE channels taken pairwise (transformers' rope_interleave, V2's
# complex rotation; megatron-core's multi_latent_attention path of apply_rotary_pos_emb): the same query-key products.

_YARN_KEYS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "type", "truncate", "attention_factor")


def _mla_rope_fields(c: dict) -> dict:
    """rotary_base and megatron-core's YaRN fields from config.json's ``rope_parameters`` (or ``rope_scaling``)."""
    params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    if theta != int(theta):
        raise UnsupportedCheckpoint(f"rope_theta {theta} is not an integer, which --rotary-base requires")
    if rope_type == "default":
        return dict(rotary_base=int(theta))
    if rope_type != "yarn":
        raise UnsupportedCheckpoint(f"config.json asks for RoPE scaling {rope_type!r}; multi-latent attention in "
                                    "megatron-core computes 'default' and 'yarn' only")
    unknown = sorted(set(params) - set(_YARN_KEYS))
    if unknown or params.get("truncate", True) is not True or params.get("attention_factor") is not None:
        # megatron-core's YarnRotaryEmbedding always truncates the correction range and derives the attention
        # factor from mscale / mscale_all_dim (yarn_rotary_pos_embedding.py at core_v0.16.1).
        raise UnsupportedCheckpoint(f"config.json's YaRN has {unknown or params}: megatron-core's YaRN has no "
                                    "explicit attention_factor, truncate=false or those keys")
    mscale, mscale_all_dim = params.get("mscale") or 0.0, params.get("mscale_all_dim") or 0.0
    if not (mscale and mscale_all_dim) and mscale not in (0.0, 1.0):
        # transformers falls back to 0.1 ln(factor) + 1 unless both are given; megatron-core to mscale's own.
        raise UnsupportedCheckpoint(f"config.json's YaRN has mscale={mscale} without mscale_all_dim: transformers "
                                    "then ignores mscale, megatron-core does not; give both or neither")
    if params.get("factor") is None:
        raise UnsupportedCheckpoint("config.json's YaRN has no factor; give rope_parameters.factor")
    return dict(rotary_base=int(theta), rope_type="yarn", rotary_scaling_factor=float(params["factor"]),
                mscale=float(mscale or 1.0), mscale_all_dim=float(mscale_all_dim),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1))


def _deepseek_config(c: dict, **router) -> ModelConfig:
    _require(c, "hidden_act", ["silu"], "silu")
    _require(c, "attention_bias", [False], False)
    _require(c, "mlp_bias", [False], False)
    # MLA has a key and value per head of its own widths; transformers' num_key_value_heads and head_dim are unused.
    sizes = {**hf_sizes(c), "kv_channels": None, "num_query_groups": None}
    return model_of_type(
        c["model_type"], **sizes, **_mla_rope_fields(c), layernorm_epsilon=c.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False), hidden_dropout=0.0,
        attention_dropout=c.get("attention_dropout", 0.0), q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"], **{**_deepseek_moe_fields(c), **router},
    )


def _deepseek_moe_fields(c: dict) -> dict:
    """The experts of DeepSeek's MoE (also GLM-4.5's): dense first layers, shared experts, the scaling of the
    routed weights, multi-token prediction layers (GLM's transformers config calls them num_mtp_layers)."""
    layers, dense = c["num_hidden_layers"], c.get("first_k_dense_replace", 0)
    if not 0 <= dense < layers:
        raise UnsupportedCheckpoint(f"config.json has first_k_dense_replace={dense}: a model of {layers} layers "
                                    "needs at least one with experts to convert as a mixture of experts")
    scaling = c.get("routed_scaling_factor", 1.0)
    return dict(
        num_moe_experts=c["n_routed_experts"], moe_router_topk=c["num_experts_per_tok"],
        moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=c["moe_intermediate_size"] * c["n_shared_experts"]
        if c.get("n_shared_experts") else None,
        moe_layer_freq=[0] * dense + [1] * (layers - dense), moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none", moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
        mtp_num_layers=c.get("num_nextn_predict_layers", c.get("num_mtp_layers")) or None,
    )


def _mtp_in_files(m: ModelConfig, names: list[str]) -> ModelConfig:
    """DeepSeek keeps its multi-token prediction modules as layers num_hidden_layers, ...: without them in the files
    (transformers ignores them and saves none) the model has none."""
    held = {int(name.split(".")[2]) for name in names if name.startswith("model.layers.")} - set(range(m.num_layers))
    if not held:
        return m.replace(mtp_num_layers=None)
    if held != set(range(m.num_layers, m.num_layers + (m.mtp_num_layers or 0))):
        raise UnsupportedCheckpoint(f"the files hold layers {sorted(held)} after the {m.num_layers} of config.json, "
                                    f"which announces num_nextn_predict_layers={m.mtp_num_layers}")
    return m


def _groups(c: dict, per_group_score: str, k_per_group: int) -> dict:
    """megatron-core's group-limited routing, which scores a group by the sum of its top (top-k / group top-k)
    scores (moe_utils.group_limited_topk at core_v0.16.1); a config whose group score differs is refused."""
    groups, group_topk = c.get("n_group") or 1, c.get("topk_group") or 1
    if groups == 1:
        return {}
    if c["num_experts_per_tok"] // group_topk != k_per_group:
        raise UnsupportedCheckpoint(
            f"config.json has num_experts_per_tok={c['num_experts_per_tok']}, topk_group={group_topk}: transformers "
            f"scores a group by its {per_group_score}, megatron-core by the sum of its top num_experts_per_tok / "
            f"topk_group = {c['num_experts_per_tok'] // group_topk}; only a ratio of {k_per_group} converts")
    return dict(moe_router_num_groups=groups, moe_router_group_topk=group_topk)


def _deepseek_v3_from_hf(c: dict) -> ModelConfig:
    if not c.get("norm_topk_prob", True):
        raise UnsupportedCheckpoint("config.json has norm_topk_prob=false: megatron-core's sigmoid router always "
                                    "renormalises the chosen scores; only norm_topk_prob=true converts")
    _require(c, "topk_method", ["noaux_tc"], "noaux_tc")
    return _deepseek_config(c, **_groups(c, "two best scores", 2))


def _deepseek_v2_from_hf(c: dict) -> ModelConfig:
    # transformers' V2 router ignores norm_topk_prob: the top k of the softmax as they are (--moe-router-pre-softmax).
    _require(c, "topk_method", ["greedy", "group_limited_greedy"], "greedy")
    groups = _groups(c, "best score", 1) if c.get("topk_method") == "group_limited_greedy" else {}
    # DeepSeek's own config.json names the training's balance loss (transformers' class keeps it as an extra key).
    balance = (dict(moe_aux_loss_coeff=c["aux_loss_alpha"],
                    moe_router_load_balancing_type="seq_aux_loss" if c.get("seq_aux", True) else "aux_loss")
               if c.get("aux_loss_alpha") else {})
    return _deepseek_config(c, moe_router_pre_softmax=True, **groups, **balance)


def _first_k_dense(m: ModelConfig) -> int:
    """DeepSeek's first_k_dense_replace: the dense layers must all come first."""
    freq = m.moe_layer_freq if isinstance(m.moe_layer_freq, list) else [
        int(m.is_moe_layer(i)) for i in range(m.num_layers)]
    dense = freq.index(1) if 1 in freq else m.num_layers
    if freq != [0] * dense + [1] * (m.num_layers - dense):
        raise UnsupportedCheckpoint(f"--moe-layer-freq {m.moe_layer_freq}: DeepSeek's config.json can only say that "
                                    "the first first_k_dense_replace layers are dense and the rest MoE")
    return dense


def _deepseek_hf(m: ModelConfig, model_type: str) -> dict:
    if not m.multi_latent_attention or m.num_moe_experts is None:
        raise UnsupportedCheckpoint(f"{model_type} is multi-latent attention with experts; the model has "
                                    f"--multi-latent-attention {m.multi_latent_attention} and --num-experts "
                                    f"{m.num_moe_experts}")
    if not m.qk_layernorm:
        raise UnsupportedCheckpoint(f"{model_type} normalises the query and key/value latents; the model was built "
                                    "without --qk-layernorm")
    rope = {"rope_theta": float(m.rotary_base), "rope_type": m.rope_type.replace("rope", "default")}
    if m.rope_type == "yarn":
        rope.update(factor=m.rotary_scaling_factor, original_max_position_embeddings=m.original_max_position_embeddings,
                    beta_fast=m.beta_fast, beta_slow=m.beta_slow, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim)
    return dict(
        num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_attention_heads,
        max_position_embeddings=m.max_positions, rms_norm_eps=m.layernorm_epsilon, hidden_act="silu",
        rope_parameters=rope, vocab_size=m.vocab_size, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        attention_dropout=m.attention_dropout, attention_bias=False, q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim, **_deepseek_moe_hf(m, model_type),
    )


def _deepseek_moe_hf(m: ModelConfig, model_type: str) -> dict:
    """config.json's fields of :func:`_deepseek_moe_fields`."""
    shared = m.moe_shared_expert_intermediate_size or 0
    if shared % m.moe_ffn_hidden_size or m.moe_shared_expert_gate:
        raise UnsupportedCheckpoint(f"{model_type}'s shared experts are n_shared_experts x moe_intermediate_size "
                                    "wide and ungated; the model's --moe-shared-expert-intermediate-size "
                                    f"{shared} is not a multiple of --moe-ffn-hidden-size {m.moe_ffn_hidden_size}")
    return dict(
        n_routed_experts=m.num_moe_experts, num_experts_per_tok=m.moe_router_topk,
        moe_intermediate_size=m.moe_ffn_hidden_size, n_shared_experts=shared // m.moe_ffn_hidden_size,
        first_k_dense_replace=_first_k_dense(m), routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
        n_group=m.moe_router_num_groups or 1, topk_group=m.moe_router_group_topk or 1,
        num_nextn_predict_layers=m.mtp_num_layers or 0,
    )


def _require_biased_sigmoid(m: ModelConfig, model_type: str) -> None:
    """DeepSeek-V3's router (also GLM-4.5's): sigmoid scores, a score-correction bias, groups scored by their two
    best experts."""
    if m.moe_router_score_function != "sigmoid" or not m.moe_router_enable_expert_bias:
        raise UnsupportedCheckpoint(f"{model_type} routes by sigmoid with a score-correction bias; the model has "
                                    f"--moe-router-score-function {m.moe_router_score_function} and "
                                    f"--moe-router-enable-expert-bias {m.moe_router_enable_expert_bias}; pass "
                                    "--model-type deepseek_v2 for softmax routing")
    if m.moe_router_num_groups and m.moe_router_topk // m.moe_router_group_topk != 2:
        raise UnsupportedCheckpoint(f"{model_type} scores an expert group by its two best experts; the model's "
                                    f"--moe-router-topk / --moe-router-group-topk is "
                                    f"{m.moe_router_topk // m.moe_router_group_topk}")


def _deepseek_v3_hf(m: ModelConfig) -> dict:
    _require_biased_sigmoid(m, "deepseek_v3")
    return {**_deepseek_hf(m, "deepseek_v3"), "norm_topk_prob": True, "topk_method": "noaux_tc",
            "rope_interleave": True}


def _deepseek_v2_hf(m: ModelConfig) -> dict:
    if m.moe_router_score_function != "softmax" or not m.moe_router_pre_softmax or m.moe_router_enable_expert_bias:
        raise UnsupportedCheckpoint("deepseek_v2 takes the top k of a softmax over all experts, unbiased; the model "
                                    "needs --moe-router-pre-softmax, softmax scores and no expert bias")
    if m.moe_router_num_groups and m.moe_router_topk // m.moe_router_group_topk != 1:
        raise UnsupportedCheckpoint("deepseek_v2 scores an expert group by its best expert; the model's "
                                    "--moe-router-topk must equal --moe-router-group-topk")
    balance = ({"aux_loss_alpha": m.moe_aux_loss_coeff,
                "seq_aux": m.moe_router_load_balancing_type == "seq_aux_loss"} if m.moe_aux_loss_coeff else {})
    return {**_deepseek_hf(m, "deepseek_v2"), "norm_topk_prob": False, **balance,
            "topk_method": "group_limited_greedy" if m.moe_router_num_groups else "greedy"}


def _deepseek_attention(m: ModelConfig, hf: str, mc: str) -> list[Rule]:
    """One layer's attention projections (and norms): multi-latent attention's (DeepSeek), or q, k and v fused
    into megatron-core's linear_qkv with their biases and per-head norms as the model has them (GLM-4.5)."""
    if not m.multi_latent_attention:
        qkv = [rule(tuple(f"{hf}self_attn.{p}_proj.{w}" for p in "qkv"), f"{mc}self_attention.linear_qkv.{w}",
                    "fuse_qkv") for w in ("weight", "bias")[:1 + m.add_qkv_bias]]
        norms = [rule(f"{hf}self_attn.{p}_norm.weight", f"{mc}self_attention.{p}_layernorm.weight")
                 for p in "qk"] if m.qk_layernorm else []
        return qkv + norms
    pairs = [("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight"),
             ("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight"),
             ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight")]
    if m.q_lora_rank is None:
        pairs.append(("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight"))
    else:
        pairs += [("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight"),
                  ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight"),
                  ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight")]
    return [rule(hf + a, mc + b) for a, b in pairs]


def _deepseek_table(m: ModelConfig, architecture: str) -> Table:
    """Rules per layer (dense and MoE layers differ): MLA, then a dense MLP or the router (with DeepSeek-V3's
    score-correction bias, megatron-core's ``expert_bias``), the experts and the shared experts. The multi-token
    prediction modules are layers num_layers, ... on disk: a layer of the same kind, its two input norms, the
    projection of [embedding; hidden], the norm before the output layer and copies of the embedding and output
    matrices, which megatron-core's modules share with the model."""
    mtp = range(m.num_layers, m.num_layers + (m.mtp_num_layers or 0))
    embedding = ("model.embed_tokens.weight", *(f"model.layers.{i}.embed_tokens.weight" for i in mtp))
    head, ignored = _output_layer(m)
    if mtp and not m.untie_embeddings_and_output_weights:
        raise UnsupportedCheckpoint("DeepSeek's multi-token prediction layers keep an output matrix of their own; "
                                    "the model ties its embeddings (tie_word_embeddings true)")
    copies = ("shared_copy",) * len(mtp)
    rules = [rule(embedding, "embedding.word_embeddings.weight", *copies, "pad_vocab"),
             rule("model.norm.weight", "decoder.final_layernorm.weight")]
    if mtp:
        head = (rule(("lm_head.weight", *(f"model.layers.{i}.shared_head.head.weight" for i in mtp)),
                     "output_layer.weight", *copies, "pad_vocab"),)
    for k, i in enumerate(mtp):
        hf, mc = f"model.layers.{i}.", f"mtp.layers.{k}."
        rules += [rule(hf + a, mc + b) for a, b in (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                                                    ("eh_proj.weight", "eh_proj.weight"),
                                                    ("shared_head.norm.weight", "final_layernorm.weight"))]
    for i in [*range(m.num_layers), *mtp]:
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        if i >= m.num_layers:
            mc = f"mtp.layers.{i - m.num_layers}.transformer_layer."
        pairs = [("input_layernorm.weight", "input_layernorm.weight"),
                 ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
                 ("self_attn.o_proj.weight", "self_attention.linear_proj.weight")]
        rules += [rule(hf + a, mc + b) for a, b in pairs] + _deepseek_attention(m, hf, mc)
        if not m.is_moe_layer(min(i, m.num_layers - 1)):  # a multi-token prediction layer is of the last's kind
            rules += _swiglu_mlp(hf + "mlp.", mc + "mlp.")
            continue
        rules.append(rule(hf + "mlp.gate.weight", mc + "mlp.router.weight"))
        if m.moe_router_enable_expert_bias:
            rules.append(rule(hf + "mlp.gate.e_score_correction_bias", mc + "mlp.router.expert_bias"))
        for e in range(m.num_moe_experts):
            rules += _swiglu_mlp(f"{hf}mlp.experts.{e}.", f"{mc}mlp.experts.local_experts.{e}.")
        if m.moe_shared_expert_intermediate_size:
            rules += _swiglu_mlp(hf + "mlp.shared_experts.", mc + "mlp.shared_experts.")
    return Table(tuple(rules) + head, ignored_hf=ignored + (r".*rotary_emb\.inv_freq",))


register_family(Family("deepseek_v3", _deepseek_v3_from_hf, _deepseek_v3_hf, _deepseek_table,
                       ("DeepseekV3ForCausalLM",), held_by_files=_mtp_in_files))
register_family(Family("deepseek_v2", _deepseek_v2_from_hf, _deepseek_v2_hf, _deepseek_table,
                       ("DeepseekV2ForCausalLM",)))


# GLM-4.5 (glm4_moe): DeepSeek-V3's MoE (dense first layers, shared experts, the biased sigmoid router) under
# grouped-query attention with q/k/v biases, optional per-head q/k norms (use_qk_norm) and RoPE over the first half
# of each head's channels (partial_rotary_factor, megatron-core's rotary_percent: both rotate that part by halves).

def _glm4_moe_from_hf(c: dict) -> ModelConfig:
    if not c.get("norm_topk_prob", True):
        raise UnsupportedCheckpoint("config.json has norm_topk_prob=false: megatron-core's sigmoid router always "
                                    "renormalises the chosen scores; only norm_topk_prob=true converts")
    # transformers' Glm4MoeConfig rotates half of each head where config.json says nothing.
    half = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))
    return _llama_config({**c, "partial_rotary_factor": half}, add_qkv_bias=c.get("attention_bias", False),
                         qk_layernorm=c.get("use_qk_norm", False), **_deepseek_moe_fields(c),
                         **_groups(c, "two best scores", 2))


def _glm4_moe_hf(m: ModelConfig) -> dict:
    if m.multi_latent_attention or m.num_moe_experts is None or m.add_bias_linear:
        raise UnsupportedCheckpoint("glm4_moe is grouped-query attention (biases on q, k, v only) with experts; the "
                                    f"model has --multi-latent-attention {m.multi_latent_attention}, --num-experts "
                                    f"{m.num_moe_experts} and biases on every linear layer: {m.add_bias_linear}")
    _require_biased_sigmoid(m, "glm4_moe")
    return {**_attention_hf(m), **_deepseek_moe_hf(m, "glm4_moe"), "attention_bias": m.add_qkv_bias,
            "use_qk_norm": m.qk_layernorm, "norm_topk_prob": True}


register_family(Family("glm4_moe", _glm4_moe_from_hf, _glm4_moe_hf, _deepseek_table, ("Glm4MoeForCausalLM",),
                       held_by_files=_mtp_in_files))


# ----------------------------------------------------------------------------------------------------------
# BERT: post-LN (the original), three kinds of checkpoint
# ----------------------------------------------------------------------------------------------------------


def _bert_config(c: dict) -> ModelConfig:
    _require(c, "hidden_act", ["gelu"], "gelu")
    _require(c, "position_embedding_type", ["absolute"], "absolute")
    architecture = (c.get("architectures") or ["BertForPreTraining"])[0]
    if architecture not in _BERT_KINDS:
        raise UnsupportedCheckpoint(
            f"config.json architecture {architecture!r} is not supported for model_type 'bert'; "
            f"supported: {list(_BERT_KINDS)}"
        )
    return model_of_type(
        "bert", **hf_sizes(c), layernorm_epsilon=c.get("layer_norm_eps", 1e-12),
        num_tokentypes=c.get("type_vocab_size", 2), hidden_dropout=c.get("hidden_dropout_prob", 0.1),
        attention_dropout=c.get("attention_probs_dropout_prob", 0.1),
        # Megatron builds its pooler together with the binary head: keep both where the checkpoint has a pooler.
        add_binary_head=_BERT_KINDS[architecture].pooler,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
    )


def _bert_hf(m: ModelConfig) -> dict:
    if m.bert_layernorm_style != "post":
        # Megatron's BERT normalises before attention and MLP and ends in a final norm; Hugging Face's BertModel
        # normalises after each residual add. No renaming of tensors turns one computation into the other.
        raise UnsupportedCheckpoint("this BERT is pre-LN (Megatron-LM's pretrain_bert.py, --bert-layernorm-style "
                                    "pre); Hugging Face's BERT is post-LN, so it has no Hugging Face form. Train "
                                    "with --bert-layernorm-style post to export")
    return dict(
        num_hidden_layers=m.num_layers, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads, max_position_embeddings=m.max_positions,
        layer_norm_eps=m.layernorm_epsilon, vocab_size=m.vocab_size, hidden_act="gelu",
        type_vocab_size=m.num_tokentypes, hidden_dropout_prob=m.hidden_dropout,
        attention_probs_dropout_prob=m.attention_dropout, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
    )


@dataclasses.dataclass(frozen=True)
class _BertKind:
    prefix: str          # where the encoder's names start
    pooler: bool
    mlm_head: bool
    binary_head: bool


_BERT_KINDS = {
    "BertForPreTraining": _BertKind("bert.", pooler=True, mlm_head=True, binary_head=True),
    "BertForMaskedLM": _BertKind("bert.", pooler=False, mlm_head=True, binary_head=False),
    "BertModel": _BertKind("", pooler=True, mlm_head=False, binary_head=False),
}


def _bert_encoder_rules(p: str) -> tuple[Rule, ...]:
    layer = p + "encoder.layer.{}."
    return (
        rule(p + "embeddings.word_embeddings.weight", "embedding.word_embeddings.weight", "pad_vocab"),
        rule(p + "embeddings.position_embeddings.weight", "embedding.position_embeddings.weight"),
        rule(p + "embeddings.token_type_embeddings.weight", "embedding.tokentype_embeddings.weight"),
        rule(p + "embeddings.LayerNorm.weight", "embedding.layer_norm.weight"),
        rule(p + "embeddings.LayerNorm.bias", "embedding.layer_norm.bias"),
        *(rule(tuple(layer + f"attention.self.{n}.{w}" for n in ("query", "key", "value")),
               f"encoder.layers.{{}}.self_attention.linear_qkv.{w}", "fuse_qkv") for w in ("weight", "bias")),
        *(rule(layer + hf + w, "encoder.layers.{}." + mc + w) for hf, mc in (
            ("attention.output.dense.", "self_attention.linear_proj."),
            ("attention.output.LayerNorm.", "post_attention_layernorm."),
            ("intermediate.dense.", "mlp.linear_fc1."),
            ("output.dense.", "mlp.linear_fc2."),
            ("output.LayerNorm.", "post_mlp_layernorm."),
        ) for w in ("weight", "bias")),
    )


def _pairs(hf: str, mcore: str) -> tuple[Rule, ...]:
    return tuple(rule(hf + w, mcore + w) for w in ("weight", "bias"))


def _bert_table(m: ModelConfig, architecture: str) -> Table:
    kind = _BERT_KINDS[architecture]
    rules = _bert_encoder_rules(kind.prefix)
    missing = []
    if kind.pooler:
        rules += _pairs(kind.prefix + "pooler.dense.", "pooler.dense.")
    if kind.mlm_head:
        rules += (*_pairs("cls.predictions.transform.dense.", "lm_head.dense."),
                  *_pairs("cls.predictions.transform.LayerNorm.", "lm_head.layer_norm."),
                  rule("cls.predictions.bias", "output_layer.bias", "pad_vocab"))
        if m.untie_embeddings_and_output_weights:
            rules += (rule("cls.predictions.decoder.weight", "output_layer.weight", "pad_vocab"),)
    else:
        missing += ["lm_head.", "output_layer."]
    if kind.binary_head:
        rules += _pairs("cls.seq_relationship.", "binary_head.")
    elif kind.pooler:
        missing.append("binary_head.")
    # decoder.bias is the same Parameter as predictions.bias, decoder.weight the tied word embeddings; older
    # files also store the position_ids buffer.
    ignored = (r"cls\.predictions\.decoder\.bias", r".*embeddings\.position_ids")
    if not m.untie_embeddings_and_output_weights:
        ignored += (r"cls\.predictions\.decoder\.weight",)
    return Table(rules, ignored_hf=ignored, missing_mcore_prefixes=tuple(missing))


register_family(Family("bert", _bert_config, _bert_hf, _bert_table, tuple(_BERT_KINDS)))
