"""megatron-core models for the trainer hooks, built from the flags or from ``--load``'s description.

Example::

    rapidformer --user-script examples/gpt/pretrain_gpt.py --model-name tiny-llama ...   # from the flags
    rapidformer --user-script examples/gpt/pretrain_gpt.py --load ./llama-mcore ...      # from a conversion

    # in a trainer's model_optimizer_lr_scheduler_provider:
    model, self.checkpoint_info = megatron_model(self.engine, family="gpt")

``self.checkpoint_info`` is what the trainer writes next to each save (``megatron_patch_args.json``), so the
save loads again with ``--load`` alone and exports with ``megatron-patch convert megatron-to-hf``.
"""

from __future__ import annotations

from megatron_patch.checkpoint.format import CheckpointInfo
from megatron_patch.checkpoint.trainer import trained_model_info
from megatron_patch.model import ModelConfig
from megatron_patch.model.builder import build_model_chunks, build_sequence_classifier
from megatron_patch.training.config import RunConfig


def model_config_and_vocab(config: RunConfig, tokenizer, family: str) -> tuple[ModelConfig, int]:
    """The model to build and its padded vocabulary (``ModelSpec.model_and_vocab``, as the dry-run plan resolves
    them): ``--load``'s description, else the flags with the tokenizer's vocabulary (``tokenizer`` may be None
    with ``--load``). Refuses a model of another ``family``."""
    spec = config.model
    if spec.loaded is None and tokenizer is None:
        raise SystemExit("rapidformer: error: without --load the model needs --tokenizer-type (and its files) "
                         "for its vocabulary")
    model, vocab = spec.model_and_vocab(family, tokenizer and tokenizer.vocab_size,
                                        config.parallel.tensor_model_parallel_size)
    if model.family != family:
        source = (f"--load {config.checkpointing.load}" if spec.loaded else f"--model-name {spec.name}" if spec.name
                  else f"--model-family {spec.family}")
        raise SystemExit(f"rapidformer: error: {source} describes a {model.family} model; this trainer trains "
                         f"{family} models")
    return model, vocab


def megatron_model(engine, family: str = "gpt", num_labels: int | None = None) -> tuple[list, CheckpointInfo]:
    """``(model chunks, checkpoint info)`` for this rank: a GPTModel, a BertModel (masked LM + binary head) or,
    with ``num_labels``, a BERT sequence classifier, under the flags' TP/PP layout.

    Example::

        chunks, info = megatron_model(engine, family="bert", num_labels=2)
    """
    config = engine.config
    tokenizer = engine.tokenizer if config.tokenizer_type else None
    model, vocab = model_config_and_vocab(config, tokenizer, family)
    parallel = config.parallel
    if num_labels is None:
        chunks = build_model_chunks(model, parallel, vocab)
    else:
        chunks = build_sequence_classifier(model, parallel, vocab, num_labels)
    return chunks, trained_model_info(model, vocab, config.precision, parallel, config.checkpoint_info)

