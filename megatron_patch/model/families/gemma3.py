"""Gemma 3's text decoder (Hugging Face ``gemma3_text``): its model type, named configurations and conversion.

Example::

    config = get_model_config("gemma-3-1b")
    megatron-patch convert hf-to-megatron --hf-dir gemma-3-1b-pt --save-dir gemma-3-1b-mcore

Gemma 3 is a LLaMA-like decoder (RMSNorm, RoPE, grouped queries, per-head q/k norms) with, from the shared
features of our layers: sliding-window attention in five layers of six (``window_size``, ``window_attn_skip_freq``)
whose RoPE has a base of its own (``rotary_base_local``); linear RoPE scaling in the full layers of the 4B and larger
(``rotary_seq_len_interpolation_factor``); norms after the attention and the MLP as well as before
(``sandwich_norm``); every norm zero-centred (its weight is gamma - 1, as megatron-core's
``layernorm_zero_centered_gamma``); the gated tanh-GeLU MLP (``geglu``); embeddings scaled by sqrt(hidden)
(``scale_embeddings``); scores scaled by ``query_pre_attn_scalar ** -0.5`` (``softmax_scale``).

Refused by name: logit soft-capping (Gemma 2's, which Gemma 3 configs set to null) and bidirectional attention.
"""

from __future__ import annotations

from megatron_patch.model.config import ModelConfig, hf_sizes, model_of_type, register_model_config, register_model_type
from megatron_patch.model.conversion import Table, UnsupportedCheckpoint, register_family, require, rule
from megatron_patch.model.features import (
    LLAMA_LAYER, LLAMA_RULES, QK_NORMS, attention_hf, output_layer, swiglu_mlp,
)

register_model_type("gemma3_text", family="gpt", position_embedding_type="rope", normalization="RMSNorm",
                    layernorm_zero_centered_gamma=True, activation="geglu", add_bias_linear=False,
                    add_qkv_bias=False, qk_layernorm=True, sandwich_norm=True, scale_embeddings=True)

_SLIDING, _FULL = "sliding_attention", "full_attention"


def gemma3_like(**fields) -> ModelConfig:
    # Gemma 3's RMSNorm eps 1e-6, head width 256, RoPE bases 1e6 (full) and 1e4 (sliding), 5 sliding layers to one
    # full, tied embeddings, no dropout, scores scaled by 256 ** -0.5.
    defaults = dict(layernorm_epsilon=1e-6, kv_channels=256, rotary_base=1000000, rotary_base_local=10000,
                    window_attn_skip_freq=6, softmax_scale=256 ** -0.5, hidden_dropout=0.0, attention_dropout=0.0)
    return model_of_type("gemma3_text", **{**defaults, **fields})


# google/gemma-3-1b-pt's and gemma-3-4b-pt's text config.json: windows of 512 and 1024 tokens, a 262k vocabulary
# (262208 with the 4B's image tokens); the 4B's full layers scale RoPE linearly by 8.
register_model_config("gemma-3-1b")(lambda: gemma3_like(
    num_layers=26, hidden_size=1152, ffn_hidden_size=6912, num_attention_heads=4, num_query_groups=1,
    seq_length=4096, max_position_embeddings=32768, window_size=(511, 0), vocab_size=262144,
))
register_model_config("gemma-3-4b")(lambda: gemma3_like(
    num_layers=34, hidden_size=2560, ffn_hidden_size=10240, num_attention_heads=8, num_query_groups=4,
    seq_length=4096, max_position_embeddings=131072, window_size=(1023, 0), rotary_seq_len_interpolation_factor=8.0,
    vocab_size=262208,
))
# A window of 4 tokens in 32 and a full layer every second one, so each pipeline stage of two has both kinds.
register_model_config("tiny-gemma3")(lambda: gemma3_like(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
    seq_length=32, window_size=(3, 0), window_attn_skip_freq=2, rotary_seq_len_interpolation_factor=8.0,
    softmax_scale=24 ** -0.5, vocab_size=128, make_vocab_size_divisible_by=1,
))


def _theta(params: dict, kind: str) -> int:
    theta = params.get("rope_theta")
    if theta is None or theta != int(theta):
        raise UnsupportedCheckpoint(f"config.json's {kind} RoPE has rope_theta={theta!r}; --rotary-base needs an "
                                    "integer")
    return int(theta)


def _rope(c: dict) -> dict:
    """The two RoPEs from transformers 5's ``rope_parameters`` per layer kind, or the older ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling`` (of the full layers)."""
    params = c.get("rope_parameters") or {}
    full = params.get(_FULL) or {**(c.get("rope_scaling") or {}), "rope_theta": c.get("rope_theta", 1e6)}
    sliding = params.get(_SLIDING) or {"rope_theta": c.get("rope_local_base_freq", 1e4)}
    types = {kind: p.get("rope_type", p.get("type", "default")) for kind, p in ((_FULL, full), (_SLIDING, sliding))}
    for kind, allowed in ((_FULL, ("default", "linear")), (_SLIDING, ("default",))):
        if types[kind] not in allowed:
            raise UnsupportedCheckpoint(f"config.json's {kind} RoPE is {types[kind]!r}; only {list(allowed)} convert "
                                        "exactly")
    return dict(rotary_base=_theta(full, _FULL), rotary_base_local=_theta(sliding, _SLIDING),
                rotary_seq_len_interpolation_factor=float(full["factor"]) if types[_FULL] == "linear" else None)


def _windows(c: dict) -> dict:
    """``window_size`` and ``window_attn_skip_freq`` from ``layer_types`` (or the older ``sliding_window_pattern``:
    every N-th layer full) and ``sliding_window`` (a query sees that many keys, itself included)."""
    pattern = c.get("sliding_window_pattern", 6)
    kinds = c.get("layer_types") or [_FULL if (i + 1) % pattern == 0 else _SLIDING
                                     for i in range(c["num_hidden_layers"])]
    if set(kinds) - {_SLIDING, _FULL} or len(kinds) != c["num_hidden_layers"]:
        raise UnsupportedCheckpoint(f"config.json's layer_types {kinds} must name {_SLIDING!r} or {_FULL!r} for each "
                                    f"of the {c['num_hidden_layers']} layers")
    windowed = [int(kind == _SLIDING) for kind in kinds]
    if not any(windowed):
        return {}
    window = c.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        raise UnsupportedCheckpoint(f"config.json has sliding_window={window!r} with sliding layers; it needs the "
                                    "window's tokens")
    if 0 not in windowed:
        skip = None  # the window is in every layer
    else:
        every = windowed.index(0) + 1
        regular = windowed == [int((i + 1) % every != 0) for i in range(len(windowed))]
        skip = every if regular else windowed  # every N-th layer full, or the pattern as it is
    return dict(window_size=(window - 1, 0), window_attn_skip_freq=skip)


def _gemma3_from_hf(c: dict) -> ModelConfig:
    require(c, "hidden_activation", ["gelu_pytorch_tanh"], "gelu_pytorch_tanh")
    require(c, "attention_bias", [False], False)
    require(c, "final_logit_softcapping", [None])
    require(c, "attn_logit_softcapping", [None])
    require(c, "use_bidirectional_attention", [False, None], False)
    fields = dict(**hf_sizes(c), **_windows(c), **_rope(c))
    if "window_size" not in fields:
        fields["rotary_base_local"] = None  # no sliding layer uses it
    return model_of_type(
        "gemma3_text", **fields, layernorm_epsilon=c.get("rms_norm_eps", 1e-6),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
        softmax_scale=c.get("query_pre_attn_scalar", 256) ** -0.5, hidden_dropout=0.0,
        attention_dropout=c.get("attention_dropout", 0.0),
    )


def _gemma3_hf(m: ModelConfig) -> dict:
    if m.num_moe_experts is not None:
        raise UnsupportedCheckpoint(f"the model has {m.num_moe_experts} experts per layer, gemma3_text has none")
    full = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.rotary_seq_len_interpolation_factor is not None:
        full.update(rope_type="linear", factor=m.rotary_seq_len_interpolation_factor)
    hf = {k: v for k, v in attention_hf(m).items() if k != "hidden_act"}
    scalar = (m.softmax_scale or m.kv_channels ** -0.5) ** -2
    return {**hf, "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
            "sliding_window": m.window_size[0] + 1 if m.window_size else None,
            "layer_types": [_SLIDING if m.is_window_layer(i) else _FULL for i in range(m.num_layers)],
            "rope_parameters": {_FULL: full, _SLIDING: {"rope_type": "default",
                                                        "rope_theta": float(m.rotary_base_local or m.rotary_base)}},
            "final_logit_softcapping": None, "attn_logit_softcapping": None}


def _gemma3_table(m: ModelConfig, architecture: str) -> Table:
    head, ignored = output_layer(m)
    layer = "decoder.layers.{}."
    # LLaMA's embedding, input norm, q/k/v and o_proj, and its final norm; its post_attention_layernorm is the norm
    # before the MLP, which Gemma calls pre_feedforward_layernorm.
    embedding_to_o_proj, final_norm = LLAMA_RULES[:4], LLAMA_RULES[-1]
    return Table((
        *embedding_to_o_proj,
        *QK_NORMS,
        rule(LLAMA_LAYER + "post_attention_layernorm.weight",
             layer + "self_attention.linear_proj.post_layernorm.weight"),
        rule(LLAMA_LAYER + "pre_feedforward_layernorm.weight", layer + "pre_mlp_layernorm.weight"),
        *swiglu_mlp(LLAMA_LAYER + "mlp.", layer + "mlp."),
        rule(LLAMA_LAYER + "post_feedforward_layernorm.weight", layer + "mlp.linear_fc2.post_layernorm.weight"),
        final_norm,
    ) + head, ignored_hf=ignored)


register_family(model_type="gemma3_text", config_from_hf=_gemma3_from_hf, config_to_hf=_gemma3_hf,
                table=_gemma3_table, architectures=("Gemma3ForCausalLM",), zero_centered_norms=True)
