"""Our GPT-2, LLaMA, Qwen2, Qwen3, post-LN BERT and BERT sequence classifier compute what Hugging Face transformers
computes with the same weights.

Weights are copied by hand here (the converter is a separate piece of work); a wrong layer-norm placement,
activation, q/k/v layout or RoPE convention shows up as a mismatch in logits or hidden states.
"""


import pytest

from megatron_patch.testing import run_on_ranks

SEQ, VOCAB = 16, 128
NUM_LABELS = 3


def _interleave_qkv(q, k, v, num_query_groups):
    """HF's separate q/k/v rows -> megatron's fused layout: per query group [its q heads, k, v]."""
    import torch

    return torch.cat([t.reshape(num_query_groups, -1, *t.shape[1:]) for t in (q, k, v)], dim=1).reshape(
        -1, *q.shape[1:]
    )


def _load(model, weights: dict) -> None:
    import torch

    state = model.state_dict()
    missing = {k for k in state if not k.endswith("_extra_state")} - set(weights)
    assert not missing, f"test mapping misses {sorted(missing)}"
    with torch.no_grad():
        for key, value in weights.items():
            state[key].copy_(value)


def _gpt2_weights(hf, config):
    sd, heads = hf.state_dict(), config.num_attention_heads
    weights = {"embedding.word_embeddings.weight": sd["transformer.wte.weight"],
               "embedding.position_embeddings.weight": sd["transformer.wpe.weight"],
               "decoder.final_layernorm.weight": sd["transformer.ln_f.weight"],
               "decoder.final_layernorm.bias": sd["transformer.ln_f.bias"]}
    for i in range(config.num_layers):
        hf_layer, ours = f"transformer.h.{i}.", f"decoder.layers.{i}."
        # GPT-2's Conv1D stores [in, out]: transpose to nn.Linear's [out, in].
        qkv_w, qkv_b = sd[hf_layer + "attn.c_attn.weight"].T, sd[hf_layer + "attn.c_attn.bias"]
        weights.update({
            ours + "input_layernorm.weight": sd[hf_layer + "ln_1.weight"],
            ours + "input_layernorm.bias": sd[hf_layer + "ln_1.bias"],
            ours + "self_attention.linear_qkv.weight": _interleave_qkv(*qkv_w.chunk(3), heads),
            ours + "self_attention.linear_qkv.bias": _interleave_qkv(*qkv_b.chunk(3), heads),
            ours + "self_attention.linear_proj.weight": sd[hf_layer + "attn.c_proj.weight"].T,
            ours + "self_attention.linear_proj.bias": sd[hf_layer + "attn.c_proj.bias"],
            ours + "pre_mlp_layernorm.weight": sd[hf_layer + "ln_2.weight"],
            ours + "pre_mlp_layernorm.bias": sd[hf_layer + "ln_2.bias"],
            ours + "mlp.linear_fc1.weight": sd[hf_layer + "mlp.c_fc.weight"].T,
            ours + "mlp.linear_fc1.bias": sd[hf_layer + "mlp.c_fc.bias"],
            ours + "mlp.linear_fc2.weight": sd[hf_layer + "mlp.c_proj.weight"].T,
            ours + "mlp.linear_fc2.bias": sd[hf_layer + "mlp.c_proj.bias"],
        })
    return weights


def _llama_weights(hf, config):
    import torch

    sd, groups = hf.state_dict(), config.num_query_groups
    weights = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
               "decoder.final_layernorm.weight": sd["model.norm.weight"],
               "output_layer.weight": sd["lm_head.weight"]}
    for i in range(config.num_layers):
        hf_layer, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf_layer + "self_attn."
        weights.update({
            ours + "input_layernorm.weight": sd[hf_layer + "input_layernorm.weight"],
            ours + "self_attention.linear_qkv.weight": _interleave_qkv(
                *(sd[attn + f"{p}_proj.weight"] for p in "qkv"), groups),
            ours + "self_attention.linear_proj.weight": sd[attn + "o_proj.weight"],
            ours + "pre_mlp_layernorm.weight": sd[hf_layer + "post_attention_layernorm.weight"],
            # SwiGLU: megatron's fc1 holds [gate; up].
            ours + "mlp.linear_fc1.weight": torch.cat([sd[hf_layer + "mlp.gate_proj.weight"],
                                                       sd[hf_layer + "mlp.up_proj.weight"]]),
            ours + "mlp.linear_fc2.weight": sd[hf_layer + "mlp.down_proj.weight"],
        })
        if config.add_qkv_bias:
            weights[ours + "self_attention.linear_qkv.bias"] = _interleave_qkv(
                *(sd[attn + f"{p}_proj.bias"] for p in "qkv"), groups)
        if config.qk_layernorm:
            weights[ours + "self_attention.q_layernorm.weight"] = sd[attn + "q_norm.weight"]
            weights[ours + "self_attention.k_layernorm.weight"] = sd[attn + "k_norm.weight"]
    return weights


def _bert_encoder_weights(sd, config):
    """Embeddings, layers and pooler: what BertForPreTraining and BertForSequenceClassification share."""
    heads, emb = config.num_attention_heads, "bert.embeddings."
    weights = {
        "embedding.word_embeddings.weight": sd[emb + "word_embeddings.weight"],
        "embedding.position_embeddings.weight": sd[emb + "position_embeddings.weight"],
        "embedding.tokentype_embeddings.weight": sd[emb + "token_type_embeddings.weight"],
        "embedding.layer_norm.weight": sd[emb + "LayerNorm.weight"],
        "embedding.layer_norm.bias": sd[emb + "LayerNorm.bias"],
        "pooler.dense.weight": sd["bert.pooler.dense.weight"],
        "pooler.dense.bias": sd["bert.pooler.dense.bias"],
    }
    for i in range(config.num_layers):
        hf_layer, ours = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
        attn = hf_layer + "attention.self."
        for kind in ("weight", "bias"):
            weights.update({
                ours + f"self_attention.linear_qkv.{kind}": _interleave_qkv(
                    *(sd[attn + f"{p}.{kind}"] for p in ("query", "key", "value")), heads),
                ours + f"self_attention.linear_proj.{kind}": sd[hf_layer + f"attention.output.dense.{kind}"],
                ours + f"post_attention_layernorm.{kind}": sd[hf_layer + f"attention.output.LayerNorm.{kind}"],
                ours + f"mlp.linear_fc1.{kind}": sd[hf_layer + f"intermediate.dense.{kind}"],
                ours + f"mlp.linear_fc2.{kind}": sd[hf_layer + f"output.dense.{kind}"],
                ours + f"post_mlp_layernorm.{kind}": sd[hf_layer + f"output.LayerNorm.{kind}"],
            })
    return weights


def _bert_weights(hf, config):
    sd = hf.state_dict()
    return {
        **_bert_encoder_weights(sd, config),
        "lm_head.dense.weight": sd["cls.predictions.transform.dense.weight"],
        "lm_head.dense.bias": sd["cls.predictions.transform.dense.bias"],
        "lm_head.layer_norm.weight": sd["cls.predictions.transform.LayerNorm.weight"],
        "lm_head.layer_norm.bias": sd["cls.predictions.transform.LayerNorm.bias"],
        "output_layer.bias": sd["cls.predictions.bias"],
        "binary_head.weight": sd["cls.seq_relationship.weight"],
        "binary_head.bias": sd["cls.seq_relationship.bias"],
    }


def _bert_classifier_weights(hf, config):
    sd = hf.state_dict()
    return {**_bert_encoder_weights(sd, config),
            "classifier.weight": sd["classifier.weight"], "classifier.bias": sd["classifier.bias"]}


def _hf_gpt2(config):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=config.max_positions, n_embd=config.hidden_size, n_layer=config.num_layers,
        n_head=config.num_attention_heads, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, layer_norm_epsilon=config.layernorm_epsilon,
    ))


def _hf_llama_like(config):
    import transformers

    cls, config_cls = ((transformers.Qwen3ForCausalLM, transformers.Qwen3Config) if config.qk_layernorm
                       else (transformers.Qwen2ForCausalLM, transformers.Qwen2Config) if config.add_qkv_bias
                       else (transformers.LlamaForCausalLM, transformers.LlamaConfig))
    hf = cls(config_cls(
        vocab_size=VOCAB, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
        max_position_embeddings=config.max_positions,
        rms_norm_eps=config.layernorm_epsilon, rope_theta=config.rotary_base, tie_word_embeddings=False,
    ))
    import torch

    # HF initialises norm weights to ones, where a query norm mapped to the key's place would not show.
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.add_(0.5 * torch.randn_like(param))
    return hf


def _hf_bert_config(config, **fields):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=VOCAB, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_hidden_size,
        max_position_embeddings=config.max_positions, type_vocab_size=config.num_tokentypes,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, layer_norm_eps=config.layernorm_epsilon, **fields,
    )


def _hf_bert(config):
    from transformers import BertForPreTraining

    return BertForPreTraining(_hf_bert_config(config))


def _hf_bert_classifier(config):
    from transformers import BertForSequenceClassification

    return BertForSequenceClassification(_hf_bert_config(config, num_labels=NUM_LABELS))


def _relative(ours, theirs):
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _compare_gpt(model, hf, tokens):
    import torch

    logits = model(tokens, torch.arange(SEQ).expand_as(tokens), None)
    return {"logits": _relative(logits, hf(input_ids=tokens).logits)}


def _bert_inputs(tokens):
    """A padded second sequence and two segments, so key padding and token types both matter."""
    import torch

    padding_mask = (torch.arange(SEQ)[None, :] < torch.tensor([[SEQ], [SEQ - 5]])).long()
    return padding_mask, (torch.arange(SEQ) >= SEQ // 2).long().expand_as(tokens)


def _compare_bert(model, hf, tokens):
    padding_mask, types = _bert_inputs(tokens)
    captured = {}
    model.encoder.register_forward_hook(lambda module, args, output: captured.update(hidden=output))
    logits, binary_logits = model(tokens, padding_mask, tokentype_ids=types)
    theirs = hf(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types, output_hidden_states=True)
    return {
        # every position, padding included: HF masks keys only, and so do we
        "hidden_states": _relative(captured["hidden"].transpose(0, 1), theirs.hidden_states[-1]),
        "mlm_logits": _relative(logits, theirs.prediction_logits),
        "binary_logits": _relative(binary_logits, theirs.seq_relationship_logits),
    }


def _compare_classifier(model, hf, tokens):
    import torch

    padding_mask, types = _bert_inputs(tokens)
    labels = torch.tensor([2, 0])
    per_sample_loss = model(tokens, padding_mask, tokentype_ids=types, labels=labels)
    theirs = hf(input_ids=tokens, attention_mask=padding_mask, token_type_ids=types, labels=labels)
    return {
        "logits": _relative(model(tokens, padding_mask, tokentype_ids=types), theirs.logits),
        "loss": _relative(per_sample_loss.mean(), theirs.loss),
    }


def _build_lm(config):
    from megatron_patch.model import ParallelConfig
    from megatron_patch.model.builder import build_model_chunks

    return build_model_chunks(config, ParallelConfig(), VOCAB)


def _build_classifier(config):
    from megatron_patch.model import ParallelConfig
    from megatron_patch.model.builder import build_sequence_classifier

    return build_sequence_classifier(config, ParallelConfig(), VOCAB, num_labels=NUM_LABELS)


# case -> (registry name, Hugging Face model, weight mapping, comparison, our model)
CASES = {
    "gpt2": ("tiny-gpt2", _hf_gpt2, _gpt2_weights, _compare_gpt, _build_lm),
    "llama": ("tiny-llama", _hf_llama_like, _llama_weights, _compare_gpt, _build_lm),
    "qwen2": ("tiny-qwen2", _hf_llama_like, _llama_weights, _compare_gpt, _build_lm),
    "qwen3": ("tiny-qwen3", _hf_llama_like, _llama_weights, _compare_gpt, _build_lm),
    "bert": ("tiny-bert", _hf_bert, _bert_weights, _compare_bert, _build_lm),
    "bert-sequence-classification": ("tiny-bert", _hf_bert_classifier, _bert_classifier_weights,
                                     _compare_classifier, _build_classifier),
}


def compare_with_hf(rank, world_size, case):
    import torch

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model import get_model_config

    name, build_hf, weights, compare, build_ours = CASES[case]
    initialize_distributed()
    torch.manual_seed(0)
    config = get_model_config(name, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    hf = build_hf(config).eval()
    [model] = build_ours(config)
    _load(model, weights(hf, config))
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with torch.no_grad():
        return compare(model, hf, tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_hugging_face(case):
    [errors] = run_on_ranks(compare_with_hf, 1, args=(case,))
    assert all(error < 1e-5 for error in errors.values()), errors
