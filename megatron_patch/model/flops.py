"""Parameter and FLOP counts per model, for throughput and MFU reporting.

Example::

    config = get_model_config("gpt2-124m")
    num_parameters(config, padded_vocab_size=50304)                            # 124,475,904
    num_floating_point_operations(config, batch_size=8, seq_length=1024, padded_vocab_size=50304)

The FLOP count is Megatron-LM's ``num_floating_point_operations`` (training.py, r0.8): forward + backward
(3 x the forward GEMMs, 2 FLOPs per multiply-add), dense attention scores without discounting the causal mask,
the logit layer included; norms, activations and BERT's small heads left out. Using the same formula makes
our MFU comparable with published Megatron numbers.
"""

from __future__ import annotations

from megatron_patch.model.config import ModelConfig


def num_floating_point_operations(
    model_config: ModelConfig, batch_size: int, seq_length: int, padded_vocab_size: int
) -> float:
    """FLOPs of one training iteration over ``batch_size`` sequences of ``seq_length`` tokens.

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> m = get_model_config("tiny-gpt2")
        >>> num_floating_point_operations(m, batch_size=1, seq_length=32, padded_vocab_size=128)
        22020096.0
    """
    m = model_config
    h, layers = m.hidden_size, m.num_layers
    query_projection_ratio = m.kv_channels * m.num_attention_heads / h
    gated_linear_multiplier = 3 / 2 if m.gated_mlp else 1
    # A token passes through its top-k experts and the shared expert (Megatron-LM's count; the router left out).
    mlp_width = (m.moe_router_topk * m.moe_ffn_hidden_size + (m.moe_shared_expert_intermediate_size or 0)
                 if m.num_moe_experts else m.ffn_hidden_size)
    return (
        12 * batch_size * seq_length * layers * h * h
        * (
            # attention: q/k/v and output projections, scores and the weighted sum of values
            (1 + m.num_query_groups / m.num_attention_heads + seq_length / h) * query_projection_ratio
            # MLP
            + (mlp_width / h) * gated_linear_multiplier
            # logits
            + padded_vocab_size / (2 * layers * h)
        )
    )


def _norm_parameters(m: ModelConfig) -> int:
    return m.hidden_size * (2 if m.normalization == "LayerNorm" else 1)


def _mlp_parameters(m: ModelConfig, f: int) -> int:
    h, fc1_out = m.hidden_size, 2 * f if m.gated_mlp else f
    return h * fc1_out + f * h + ((fc1_out + h) if m.add_bias_linear else 0)


def expert_parameters(m: ModelConfig, layer: int = 0) -> int:
    """Parameters of layer ``layer``'s routed experts (all of them; 0 for a dense layer): what expert parallelism
    splits.

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> expert_parameters(get_model_config("mixtral-8x7b"))    # 8 experts x 3 x 4096 x 14336
        1409286144
    """
    return m.num_moe_experts * _mlp_parameters(m, m.moe_ffn_hidden_size) if m.is_moe_layer(layer) else 0


def _attention_parameters(m: ModelConfig) -> int:
    h = m.hidden_size
    norm = 2 if m.normalization == "LayerNorm" else 1  # weights per normalised channel
    if m.multi_latent_attention:
        # Multi-latent attention: the query directly or through its rank-q_lora_rank latent (and that latent's norm),
        # the key/value latent with the shared RoPE key, its norm, the per-head up projection, the output.
        q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
        heads = m.num_attention_heads
        query = (h * heads * q_head if m.q_lora_rank is None
                 else h * m.q_lora_rank + m.q_lora_rank * heads * q_head + norm * m.q_lora_rank * m.qk_layernorm)
        key_value = (h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + norm * m.kv_lora_rank * m.qk_layernorm
                     + m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim))
        return query + key_value + heads * m.v_head_dim * h
    q_size, kv_size = m.kv_channels * m.num_attention_heads, m.kv_channels * m.num_query_groups
    qkv_out = q_size + 2 * kv_size
    bias = m.add_bias_linear
    # Qwen3's query and key norms: one weight (and a bias for LayerNorm) per head channel each.
    qk_norms = 2 * m.kv_channels * norm if m.qk_layernorm else 0
    return h * qkv_out + (qkv_out if bias or m.add_qkv_bias else 0) + q_size * h + (h if bias else 0) + qk_norms


def layer_parameters(m: ModelConfig, layer: int = 0, active: bool = False) -> int:
    """Parameters of layer ``layer`` (0-based); ``active``: those one token passes through (its top-k experts).

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> m = get_model_config("tiny-deepseek-v3")
        >>> layer_parameters(m, 0) > layer_parameters(m, 1, active=True)     # the dense layer's MLP is wider
        True
    """
    h = m.hidden_size
    if m.is_moe_layer(layer):
        shared = m.moe_shared_expert_intermediate_size
        experts = (m.moe_router_topk * _mlp_parameters(m, m.moe_ffn_hidden_size) if active
                   else expert_parameters(m, layer))
        # the router's expert scores, the experts, the shared expert and its one-output gate
        mlp = (h * m.num_moe_experts + experts
               + (_mlp_parameters(m, shared) if shared else 0) + (h if m.moe_shared_expert_gate else 0))
    else:
        mlp = _mlp_parameters(m, m.ffn_hidden_size)
    # The norms before attention and MLP, and with sandwich norms (Gemma's) the two after them.
    return _attention_parameters(m) + mlp + (4 if m.sandwich_norm else 2) * _norm_parameters(m)


def mtp_parameters(m: ModelConfig) -> int:
    """One multi-token prediction module: a layer of the last layer's kind, the norms of its two inputs, their
    projection from [embedding; hidden] and its final norm (embedding and output layer are the model's).

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> m = get_model_config("tiny-deepseek-v3")
        >>> mtp_parameters(m) - layer_parameters(m, m.num_layers - 1)        # 2 x 64 x 64 + three norms of 64
        8384
    """
    return layer_parameters(m, m.num_layers - 1) + 2 * m.hidden_size * m.hidden_size + 3 * _norm_parameters(m)


def num_parameters(model_config: ModelConfig, padded_vocab_size: int, active: bool = False) -> int:
    """Parameters of the whole model as ``build_model_chunks`` builds it (all TP/PP shards together, tied
    embeddings counted once); ``active``: those one token's forward multiplies with, as DeepSeek counts its
    "activated parameters" (arXiv:2412.19437: 37B of 671B): each MoE layer's top k experts instead of all, the
    output layer but not the embedding tables, from which a token only reads its row.

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> num_parameters(get_model_config("gpt2-124m"), padded_vocab_size=50257)   # HF's GPT2Model
        124439808
    """
    m = model_config
    h, vocab = m.hidden_size, padded_vocab_size
    embedding = vocab * h
    if m.position_embedding_type == "learned_absolute":
        embedding += m.max_positions * h
    embedding += m.num_tokentypes * h
    # Pre-LN models end with a final norm; post-LN BERT has its norm on the embeddings instead.
    layers = sum(layer_parameters(m, layer, active) for layer in range(m.num_layers))
    if not active:  # multi-token prediction trains the model; a token's prediction does not pass through it
        layers += (m.mtp_num_layers or 0) * mtp_parameters(m)
    total = (0 if active else embedding) + layers + _norm_parameters(m)
    if m.untie_embeddings_and_output_weights or active:
        total += vocab * h
    if m.family == "bert":
        total += h * h + h + _norm_parameters(m) + vocab  # LM head transform (dense + norm) and output bias
        if m.add_binary_head:
            total += h * h + h + 2 * h + 2  # pooler and next-sentence head
    return total
