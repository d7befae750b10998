"""BERT: post-LN (the original, as Hugging Face's ``BertModel``), three kinds of checkpoint. Its model type,
named configurations and conversion.

Example::

    config = get_model_config("bert-base")
"""

from __future__ import annotations

import dataclasses

from megatron_patch.model.config import ModelConfig, hf_sizes, model_of_type, register_model_config, register_model_type
from megatron_patch.model.conversion import Rule, Table, UnsupportedCheckpoint, register_family, require, rule

# Google's BERT: post-LN, erf-GeLU, learned positions.
register_model_type("bert", family="bert", position_embedding_type="learned_absolute", normalization="LayerNorm",
                    activation="gelu", add_bias_linear=True, bert_layernorm_style="post")


def _bert(num_layers: int, hidden_size: int, num_attention_heads: int) -> ModelConfig:
    # Token types, NSP head, 512 positions, WordPiece vocabulary 30522.
    return model_of_type(
        "bert", num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        seq_length=512, max_position_embeddings=512, layernorm_epsilon=1e-12, vocab_size=30522,
        num_tokentypes=2, add_binary_head=True,
    )


register_model_config("bert-base")(lambda: _bert(12, 768, 12))
register_model_config("bert-large")(lambda: _bert(24, 1024, 16))
register_model_config("tiny-bert")(lambda: _bert(2, 64, 4).replace(
    seq_length=32, max_position_embeddings=32, vocab_size=128, make_vocab_size_divisible_by=1,
))


def _bert_config(c: dict) -> ModelConfig:
    require(c, "hidden_act", ["gelu"], "gelu")
    require(c, "position_embedding_type", ["absolute"], "absolute")
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


register_family(model_type="bert", config_from_hf=_bert_config, config_to_hf=_bert_hf, table=_bert_table,
                architectures=tuple(_BERT_KINDS), outputs={
                    "BertForPreTraining": {"logits": "prediction_logits", "binary_logits": "seq_relationship_logits"},
                    "BertForMaskedLM": {"logits": "logits"},
                    "BertModel": {"hidden_states": "last_hidden_state"},
                })
