"""BERT on megatron-core's ``BertModel``: Megatron's pre-LN or the original post-LN, and a classifier head.

Example::

    chunks = build_model_chunks(get_model_config("bert-base"), ParallelConfig(), padded_vocab_size=30592)
    lm_loss, binary_logits = chunks[0](tokens, padding_mask, tokentype_ids=types, lm_labels=labels)

Subclasses change only what megatron-core's class cannot be told through its arguments: the norm of the LM head,
the mask layout our core attention takes, the embedding LayerNorm of post-LN BERT, and (for fine-tuning) the
heads on top of the pooled first token.
"""

from __future__ import annotations

import torch
from megatron.core.models.bert.bert_model import BertModel as MCoreBertModel
from megatron.core.transformer.utils import get_linear_layer

from megatron_patch import compat


class BertModel(MCoreBertModel):
    """megatron-core's BertModel with our norm in its LM head, [b, 1, 1, s] key-padding masks (HF's semantics)
    and, for post-LN BERT, a LayerNorm on the embeddings.

    Example::

        model = BertModel(config, norm=TorchNorm, embedding_layernorm=True, num_tokentypes=2,
                          transformer_layer_spec=block_spec, vocab_size=30592, max_sequence_length=512)
    """

    def __init__(self, config, *, norm: type, embedding_layernorm: bool, **kwargs):
        # The LM head's norm is the layer spec's, like every other norm of the model (megatron-core's own choice
        # refuses sequence parallelism without apex).
        with compat.bert_lm_head_norm(norm):
            super().__init__(config, **kwargs)
        if embedding_layernorm and self.pre_process:
            add_embedding_layernorm(self.embedding, norm(config=config, hidden_size=config.hidden_size,
                                                         eps=config.layernorm_epsilon))

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        # Our SDPA core attention and TE >= 1.10 (the versions megatron-core 0.16 supports) both take a
        # [b, 1, 1, s] mask over keys only, which is what Hugging Face BERT computes. The upstream check
        # (BertModel._sanity_check_attention_and_get_attn_mask_dimension) would ask TE for its version even when TE is
        # not installed.
        return "b11s"


def add_embedding_layernorm(embedding: torch.nn.Module, norm: torch.nn.Module) -> None:
    """Give megatron-core's ``LanguageModelEmbedding`` the LayerNorm that post-LN BERT applies to the summed
    word + position + token-type embeddings, as ``embedding.layer_norm``.

    Example::

        add_embedding_layernorm(model.embedding, TorchNorm(config, hidden_size=768, eps=1e-12))

    HF's ``BertEmbeddings`` normalises, then drops out. ``LanguageModelEmbedding.forward`` ends with its dropout
    (after the sequence-parallel scatter, LanguageModelEmbedding.forward), so the norm runs as a pre-hook of
    that dropout: the order is HF's, and with sequence parallelism each rank normalises its own tokens.
    """
    embedding.layer_norm = norm
    embedding.embedding_dropout.register_forward_pre_hook(lambda _, inputs: (embedding.layer_norm(inputs[0]),))


class BertForSequenceClassification(BertModel):
    """BERT encoder + pooler + dropout + a linear classifier (Hugging Face ``BertForSequenceClassification``).

    Example::

        model = build_sequence_classifier(get_model_config("bert-base"), ParallelConfig(), 30592, num_labels=3)
        per_sample_loss = model(tokens, padding_mask, tokentype_ids=types, labels=labels)
        logits = model(tokens, padding_mask, tokentype_ids=types)               # [b, num_labels]

    Parameter names match the pre-training BertModel (``embedding.*``, ``encoder.*``, ``pooler.*``), so a
    pre-training checkpoint loads into it with only ``classifier.*`` missing. On all but the last pipeline
    stage the forward returns the encoder's hidden states, as BertModel's does.
    """

    def __init__(self, config, *, num_labels: int, classifier_dropout: float | None = None, **kwargs):
        kwargs.update(add_binary_head=True, share_embeddings_and_output_weights=False)
        super().__init__(config, **kwargs)
        self.classify = self.post_process
        if self.classify:
            # The pooler is the part of the pre-training heads a classifier keeps.
            del self.lm_head, self.output_layer, self.binary_head
            self.classifier_dropout = torch.nn.Dropout(
                config.hidden_dropout if classifier_dropout is None else classifier_dropout
            )
            self.classifier = get_linear_layer(
                config.hidden_size, num_labels, config.init_method, config.perform_initialization
            )
        # With post_process off, BertModel.forward stops after the encoder (and its final norm, which the
        # TransformerBlock was built with), and LanguageModule looks for no output layer.
        self.post_process = False

    def forward(self, input_ids, attention_mask, tokentype_ids=None, labels=None):
        hidden_states = super().forward(input_ids, attention_mask, tokentype_ids=tokentype_ids)
        if not self.classify:
            return hidden_states
        logits = self.classifier(self.classifier_dropout(self.pooler(hidden_states, 0)))
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
