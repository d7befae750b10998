"""Black-box tasks of ``rapidformer --task NAME``: the model and the data come from flags, no user code.

Example::

    rapidformer --task sequence_classification --pretrained-model-name-or-path ./bert-tiny \
        --data-path ./glue --data-name mrpc --epochs 3 --micro-batch-size 16 --lr 2e-5
    rapidformer --task pretraining --pretrained-model-name-or-path ./bert-tiny --tokenizer-type \
        BertWordPieceLowerCase --vocab-file vocab.txt --data-path corpus_text_sentence --train-iters 100
    rapidformer --task pretraining --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --tokenizer-type GPT2BPETokenizer ... --data-path corpus_text_document --train-iters 100   # megatron GPT

Each task is a trainer class registered in ``TASKS``; ``run_task`` picks one by name.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_patch.training.data import (
    SequenceClassificationMetric,
    build_train_valid_test_datasets_for_huggingface,
    load_sentence_pair_dataset,
)
from megatron_patch.training.engine import Engine
from megatron_patch.training.trainers import Finetuner, Pretrainer

TASKS: dict[str, Callable[[Engine], object]] = {}


def register_task(name: str):
    def register(factory):
        TASKS[name] = factory
        return factory

    return register


class _PairDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict], tokenizer, max_length: int | None):
        self.encodings = [tokenizer(r["sentence1"], r["sentence2"], truncation=True, max_length=max_length)
                          for r in rows]
        self.labels = [r["label"] for r in rows]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {**self.encodings[index], "labels": self.labels[index]}


class SequenceClassificationFinetuner(Finetuner):
    """A local Hugging Face model fine-tuned on local GLUE-style pairs; accuracy and F1 on dev every epoch."""

    def train_valid_test_datasets_provider(self):
        from transformers import AutoTokenizer

        args = self.args
        self.tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
        splits = load_sentence_pair_dataset(args.data_path[0], args.data_name)
        self.num_labels = max(r["label"] for r in splits["train"]) + 1
        built = [_PairDataset(splits[s], self.tokenizer, args.seq_length) if s in splits else None
                 for s in ("train", "validation", "test")]

        def collate(examples):
            return self.tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return (*built, collate)

    def model_optimizer_lr_scheduler_provider(self):
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(
            self.args.pretrained_model_name_or_path, num_labels=self.num_labels)
        return model, None, None

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        metric = SequenceClassificationMetric()
        with torch.no_grad():
            for batch in eval_dataloader:
                predictions = model[0](**batch).logits.argmax(dim=-1)
                metric.add_batch(predictions=self.gather(predictions), references=self.gather(batch["labels"]))
        return metric.compute()


class HuggingFaceBertPretrainer(Pretrainer):
    """Masked-LM + next-sentence pretraining of a local Hugging Face BERT on mmap sentence data."""

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        args = self.args
        return build_train_valid_test_datasets_for_huggingface(
            data_prefix=args.data_path, data_impl=args.data_impl, splits_string=args.split,
            train_valid_test_num_samples=train_val_test_num_samples, max_seq_length=args.seq_length,
            masked_lm_prob=args.mask_prob, short_seq_prob=args.short_seq_prob, seed=args.seed, binary_head=True)

    def model_optimizer_lr_scheduler_provider(self):
        from transformers import AutoModelForPreTraining

        return AutoModelForPreTraining.from_pretrained(self.args.pretrained_model_name_or_path), None, None

    def run_forward_step(self, data_iterator, model):
        return model(**next(data_iterator)).loss


class MegatronGPTPretrainer(Pretrainer):
    """A megatron-core GPT from the model flags (or ``--model-name``) on mmap document data (or --mock-data)."""

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        from megatron.core import parallel_state

        from megatron_patch.data.datasets import build_gpt_datasets

        args = self.args
        return build_gpt_datasets(
            args.data_path, args.split, args.seq_length, self.engine.tokenizer, train_val_test_num_samples,
            seed=args.seed, mock=args.mock_data, create_attention_mask=False,
            is_built_on_rank=lambda: parallel_state.get_tensor_model_parallel_rank() == 0)

    def model_optimizer_lr_scheduler_provider(self):
        from megatron_patch.model import model_config_from_args, parallel_config_from_args
        from megatron_patch.model.builder import build_model_chunks, padded_vocab_size
        from megatron_patch.training.checkpointing import trained_model_info

        args = self.args
        loaded = args.checkpoint_info
        if loaded is not None:
            # The stored padded vocabulary, not one recomputed from the tokenizer x TP: that may differ (a
            # conversion pads for TP=1) and give a shape mismatch on load.
            model_config, vocab = loaded.model_config, loaded.padded_vocab_size
        else:
            model_config = model_config_from_args(args, vocab_size=self.engine.tokenizer.vocab_size)
            vocab = padded_vocab_size(model_config.vocab_size, model_config.make_vocab_size_divisible_by,
                                      args.tensor_model_parallel_size)
        parallel = parallel_config_from_args(args, model_config.num_layers)
        self.checkpoint_info = trained_model_info(model_config, vocab, args, loaded)
        return build_model_chunks(model_config, parallel, vocab), None, None

    def run_forward_step(self, data_iterator, model):
        from megatron.core import tensor_parallel

        from megatron_patch.training.step import lm_loss_func

        keys = ["tokens", "labels", "loss_mask", "position_ids"]
        raw = next(data_iterator) if data_iterator is not None else None
        batch = tensor_parallel.broadcast_data(keys[:2] + keys[3:], raw, torch.int64)
        loss_mask = tensor_parallel.broadcast_data(["loss_mask"], raw, torch.float32)["loss_mask"]
        per_token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return per_token_loss, lambda output: lm_loss_func(loss_mask, output)


def _pretraining(engine: Engine):
    cls = HuggingFaceBertPretrainer if engine.args.pretrained_model_name_or_path else MegatronGPTPretrainer
    return cls(engine=engine)


register_task("sequence_classification")(SequenceClassificationFinetuner)
register_task("pretraining")(_pretraining)


def run_task(engine: Engine):
    """Build the trainer of ``--task`` and train it; returns the trainer."""
    trainer = TASKS[engine.args.task](engine)
    trainer.train()
    return trainer
