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

import argparse
import dataclasses

from megatron_patch.checkpoint.format import CheckpointInfo
from megatron_patch.model import ModelConfig, model_config_from_args, parallel_config_from_args
from megatron_patch.model.builder import build_model_chunks, build_sequence_classifier, padded_vocab_size
from megatron_patch.training.checkpointing import trained_model_info


def _from_flags(args: argparse.Namespace, vocab_size: int, family: str) -> ModelConfig:
    # A BERT script given only Megatron-LM's shape flags builds a BERT without --model-family bert.
    flags = argparse.Namespace(**{**vars(args), "model_family": args.model_family or family})
    config = model_config_from_args(flags, vocab_size=vocab_size)
    if config.family == "bert" and args.model_name is None:
        # Megatron-LM's BERT: the next-sentence head and two segment types unless --bert-no-binary-head
        # (pretrain_bert.py: num_tokentypes = 2 if args.bert_binary_head else 0).
        binary = not args._switch_bert_no_binary_head
        config = dataclasses.replace(config, add_binary_head=binary, num_tokentypes=2 if binary else 0)
    return config


def model_config_and_vocab(args: argparse.Namespace, tokenizer, family: str) -> tuple[ModelConfig, int]:
    """The model to build and its padded vocabulary: ``--load``'s description when it has one
    (the stored vocabulary: a conversion pads for TP=1, recomputing it may not match), else the flags with the
    tokenizer's vocabulary (``tokenizer`` may be None with ``--load``). Refuses a model of another ``family``."""
    loaded: CheckpointInfo | None = args.checkpoint_info
    if loaded is not None:
        config, vocab, source = loaded.model_config, loaded.padded_vocab_size, f"--load {args.load}"
    else:
        if tokenizer is None:
            raise SystemExit("rapidformer: error: without --load the model needs --tokenizer-type (and its files) "
                             "for its vocabulary")
        config = _from_flags(args, tokenizer.vocab_size, family)
        vocab = padded_vocab_size(config.vocab_size, config.make_vocab_size_divisible_by,
                                  args.tensor_model_parallel_size)
        source = f"--model-name {args.model_name}" if args.model_name else f"--model-family {args.model_family}"
    if config.family != family:
        raise SystemExit(f"rapidformer: error: {source} describes a {config.family} model; this trainer trains "
                         f"{family} models")
    return config, vocab


def megatron_model(engine, family: str = "gpt", num_labels: int | None = None) -> tuple[list, CheckpointInfo]:
    """``(model chunks, checkpoint info)`` for this rank: a GPTModel, a BertModel (masked LM + binary head) or,
    with ``num_labels``, a BERT sequence classifier, under the flags' TP/PP layout.

    Example::

        chunks, info = megatron_model(engine, family="bert", num_labels=2)
    """
    args = engine.args
    tokenizer = engine.tokenizer if args.tokenizer_type else None
    config, vocab = model_config_and_vocab(args, tokenizer, family)
    parallel = parallel_config_from_args(args, config.num_layers)
    if num_labels is None:
        chunks = build_model_chunks(config, parallel, vocab)
    else:
        chunks = build_sequence_classifier(config, parallel, vocab, num_labels)
    return chunks, trained_model_info(config, vocab, args, args.checkpoint_info)

