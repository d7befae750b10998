"""DeepSeek-V2 and -V3 (and Kimi K2, Moonlight), and GLM-4.5: multi-latent attention or grouped-query attention,
dense first layers, shared experts, the biased sigmoid router. Their model types, named configurations and
conversion.

Example::

    config = get_model_config("deepseek-v3")

MLA's projections are megatron-core's one for one (multi_latent_attention.py at core_v0.16.1 splits q into
[nope; rope] per head and the key/value up projection into [k_nope; v] per head, as transformers does), so no
tensor is reordered. Both libraries rotate the RoPE channels taken pairwise (transformers' rope_interleave, V2's
complex rotation; megatron-core's multi_latent_attention path of apply_rotary_pos_emb): the same query-key products.

GLM-4.5 (glm4_moe): DeepSeek-V3's MoE (dense first layers, shared experts, the biased sigmoid router) under
grouped-query attention with q/k/v biases, optional per-head q/k norms (use_qk_norm) and RoPE over the first half
of each head's channels (partial_rotary_factor, megatron-core's rotary_percent: both rotate that part by halves).
"""

from __future__ import annotations

from megatron_patch.model.config import ModelConfig, hf_sizes, model_of_type, register_model_config, register_model_type
from megatron_patch.model.conversion import Rule, Table, UnsupportedCheckpoint, register_family, require, rule
from megatron_patch.model.features import LLAMA_TYPE, attention_hf, llama_config, llama_like, output_layer, swiglu_mlp

# DeepSeek-V2: multi-latent attention (its latents RMS-normalised), experts after the first dense layers, shared
# experts, softmax routing. DeepSeek-V3 (and Kimi K2, Moonlight) routes by sigmoid with a score-correction bias.
register_model_type("deepseek_v2", **{**LLAMA_TYPE, "qk_layernorm": True, "multi_latent_attention": True})
register_model_type("deepseek_v3", **{**LLAMA_TYPE, "qk_layernorm": True, "multi_latent_attention": True,
                                      "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True})
# GLM-4.5: DeepSeek-V3's experts and router under grouped-query attention with q/k/v biases and half-RoPE; q/k
# norms in GLM-4.5, none in GLM-4.5-Air (use_qk_norm), so they do not make the type.
register_model_type("glm4_moe", **{**{k: v for k, v in LLAMA_TYPE.items() if k != "qk_layernorm"},
                                   "add_qkv_bias": True, "moe_router_score_function": "sigmoid",
                                   "moe_router_enable_expert_bias": True})


def _deepseek(model_type: str, first_k_dense: int, num_layers: int, **fields) -> ModelConfig:
    # DeepSeek's MoE models: the first ``first_k_dense`` layers dense (first_k_dense_replace), RMSNorm eps 1e-6, the
    # bias update without an auxiliary loss (arXiv:2412.19437 2.1.2) where the router has the bias, no dropout.
    defaults = dict(layernorm_epsilon=1e-6, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                    num_layers=num_layers, moe_layer_freq=[0] * first_k_dense + [1] * (num_layers - first_k_dense))
    return llama_like(model_type, **{**defaults, **fields})


def _yarn(factor: float, mscale: float, mscale_all_dim: float, original: int = 4096) -> dict:
    # YaRN as DeepSeek's config.json gives it (rope_scaling type yarn, beta_fast 32, beta_slow 1).
    return dict(rope_type="yarn", rotary_scaling_factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim,
                original_max_position_embeddings=original)


# deepseek-ai/DeepSeek-V3's config.json: 256 routed experts of 2048 and one shared, 8 per token from 4 of 8 groups,
# weights x 2.5; MLA with q rank 1536, kv rank 512, heads of 128 + 64 (RoPE) channels, values of 128.
register_model_config("deepseek-v3")(lambda: _deepseek(
    "deepseek_v3", 3, num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128,
    seq_length=4096, max_position_embeddings=163840, vocab_size=129280, num_moe_experts=256, moe_router_topk=8,
    moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, moe_router_num_groups=8,
    moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512,
    **_yarn(40.0, 1.0, 1.0),
))
# deepseek-ai/DeepSeek-V2-Lite: no query compression, 64 experts of 1408 and two shared, 6 per token by softmax,
# weights not renormalised (norm_topk_prob false: --moe-router-pre-softmax); trained with a sequence-wise balance loss
# of weight 0.001 (aux_loss_alpha, seq_aux).
register_model_config("deepseek-v2-lite")(lambda: _deepseek(
    "deepseek_v2", 1, num_layers=27, hidden_size=2048, ffn_hidden_size=10944, num_attention_heads=16,
    seq_length=4096, max_position_embeddings=163840, vocab_size=102400, num_moe_experts=64, moe_router_topk=6,
    moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816, moe_router_pre_softmax=True,
    moe_aux_loss_coeff=0.001, moe_router_load_balancing_type="seq_aux_loss", kv_lora_rank=512,
    **_yarn(40.0, 0.707, 0.707),
))
# moonshotai/Moonlight-16B-A3B (model_type deepseek_v3): V2-Lite's shape with V3's router, unscaled RoPE.
register_model_config("moonlight-16b-a3b")(lambda: _deepseek(
    "deepseek_v3", 1, num_layers=27, hidden_size=2048, ffn_hidden_size=11264, num_attention_heads=16,
    seq_length=8192, max_position_embeddings=8192, vocab_size=163840, rotary_base=50000, num_moe_experts=64,
    moe_router_topk=6, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=2816,
    moe_router_topk_scaling_factor=2.446, kv_lora_rank=512, layernorm_epsilon=1e-5,
))
# moonshotai/Kimi-K2-Instruct (model_type deepseek_v3): 384 experts, 64 heads, one dense layer, no groups.
register_model_config("kimi-k2")(lambda: _deepseek(
    "deepseek_v3", 1, num_layers=61, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=64,
    seq_length=4096, max_position_embeddings=131072, vocab_size=163840, rotary_base=50000, num_moe_experts=384,
    moe_router_topk=8, moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
    moe_router_topk_scaling_factor=2.827, q_lora_rank=1536, kv_lora_rank=512, **_yarn(32.0, 1.0, 1.0),
))
# zai-org/GLM-4.5 (model_type glm4_moe): 160 experts of 1536 and one shared, 8 per token by biased sigmoid,
# weights x 2.5; 96 heads of 128 in 8 KV groups with q/k/v biases and q/k norms, RoPE on half of each head; one
# multi-token prediction layer. GLM-4.5-Air: 128 experts of 1408, one dense layer, no q/k norms, weights x 1.
register_model_config("glm-4.5")(lambda: _deepseek(
    "glm4_moe", 3, num_layers=92, hidden_size=5120, ffn_hidden_size=12288, num_attention_heads=96,
    num_query_groups=8, kv_channels=128, seq_length=4096, max_position_embeddings=131072, vocab_size=151552,
    rotary_base=1000000, rotary_percent=0.5, qk_layernorm=True, layernorm_epsilon=1e-5, num_moe_experts=160,
    moe_router_topk=8, moe_ffn_hidden_size=1536, moe_shared_expert_intermediate_size=1536,
    moe_router_topk_scaling_factor=2.5, mtp_num_layers=1,
))
register_model_config("glm-4.5-air")(lambda: _deepseek(
    "glm4_moe", 1, num_layers=46, hidden_size=4096, ffn_hidden_size=10944, num_attention_heads=96,
    num_query_groups=8, kv_channels=128, seq_length=4096, max_position_embeddings=131072, vocab_size=151552,
    rotary_base=1000000, rotary_percent=0.5, layernorm_epsilon=1e-5, num_moe_experts=128, moe_router_topk=8,
    moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=1408, mtp_num_layers=1,
))
# Four layers, the first dense; 4 experts in 2 groups, 2 per token from 1 group, a shared expert; query rank 32,
# latent 32, heads of 16 + 8 (RoPE) channels, values 16; YaRN.
register_model_config("tiny-deepseek-v3")(lambda: _deepseek(
    "deepseek_v3", 1, num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
    max_position_embeddings=32, vocab_size=128, make_vocab_size_divisible_by=1, num_moe_experts=4, moe_router_topk=2,
    moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_router_num_groups=2, moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
    v_head_dim=16, **_yarn(4.0, 1.0, 1.0, original=8),
))

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
    require(c, "hidden_act", ["silu"], "silu")
    require(c, "attention_bias", [False], False)
    require(c, "mlp_bias", [False], False)
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
    require(c, "topk_method", ["noaux_tc"], "noaux_tc")
    return _deepseek_config(c, **_groups(c, "two best scores", 2))


def _deepseek_v2_from_hf(c: dict) -> ModelConfig:
    # transformers' V2 router ignores norm_topk_prob: the top k of the softmax as they are (--moe-router-pre-softmax).
    require(c, "topk_method", ["greedy", "group_limited_greedy"], "greedy")
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
    head, ignored = output_layer(m)
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
            rules += swiglu_mlp(hf + "mlp.", mc + "mlp.")
            continue
        rules.append(rule(hf + "mlp.gate.weight", mc + "mlp.router.weight"))
        if m.moe_router_enable_expert_bias:
            rules.append(rule(hf + "mlp.gate.e_score_correction_bias", mc + "mlp.router.expert_bias"))
        for e in range(m.num_moe_experts):
            rules += swiglu_mlp(f"{hf}mlp.experts.{e}.", f"{mc}mlp.experts.local_experts.{e}.")
        if m.moe_shared_expert_intermediate_size:
            rules += swiglu_mlp(hf + "mlp.shared_experts.", mc + "mlp.shared_experts.")
    return Table(tuple(rules) + head, ignored_hf=ignored + (r".*rotary_emb\.inv_freq",))


register_family(model_type="deepseek_v3", config_from_hf=_deepseek_v3_from_hf, config_to_hf=_deepseek_v3_hf,
                table=_deepseek_table, architectures=("DeepseekV3ForCausalLM",), held_by_files=_mtp_in_files)
register_family(model_type="deepseek_v2", config_from_hf=_deepseek_v2_from_hf, config_to_hf=_deepseek_v2_hf,
                table=_deepseek_table, architectures=("DeepseekV2ForCausalLM",))


def _glm4_moe_from_hf(c: dict) -> ModelConfig:
    if not c.get("norm_topk_prob", True):
        raise UnsupportedCheckpoint("config.json has norm_topk_prob=false: megatron-core's sigmoid router always "
                                    "renormalises the chosen scores; only norm_topk_prob=true converts")
    # transformers' Glm4MoeConfig rotates half of each head where config.json says nothing.
    half = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("partial_rotary_factor", 0.5))
    return llama_config({**c, "partial_rotary_factor": half}, add_qkv_bias=c.get("attention_bias", False),
                         qk_layernorm=c.get("use_qk_norm", False), **_deepseek_moe_fields(c),
                         **_groups(c, "two best scores", 2))


def _glm4_moe_hf(m: ModelConfig) -> dict:
    if m.multi_latent_attention or m.num_moe_experts is None or m.add_bias_linear:
        raise UnsupportedCheckpoint("glm4_moe is grouped-query attention (biases on q, k, v only) with experts; the "
                                    f"model has --multi-latent-attention {m.multi_latent_attention}, --num-experts "
                                    f"{m.num_moe_experts} and biases on every linear layer: {m.add_bias_linear}")
    _require_biased_sigmoid(m, "glm4_moe")
    return {**attention_hf(m), **_deepseek_moe_hf(m, "glm4_moe"), "attention_bias": m.add_qkv_bias,
            "use_qk_norm": m.qk_layernorm, "norm_topk_prob": True}


register_family(model_type="glm4_moe", config_from_hf=_glm4_moe_from_hf, config_to_hf=_glm4_moe_hf,
                table=_deepseek_table, architectures=("Glm4MoeForCausalLM",), held_by_files=_mtp_in_files)
