"""Black-box tasks of ``rapidformer --task NAME``: the model and the data come from flags, no user code.

Example::

    rapidformer --task sequence_classification --pretrained-model-name-or-path ./bert-tiny \
        --data-path ./glue --data-name mrpc --epochs 3 --micro-batch-size 16 --lr 2e-5
    rapidformer --task pretraining --pretrained-model-name-or-path ./bert-tiny --tokenizer-type \
        BertWordPieceLowerCase --vocab-file vocab.txt --data-path corpus_text_sentence --train-iters 100
    rapidformer --task pretraining --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --tokenizer-type GPT2BPETokenizer ... --data-path corpus_text_document --train-iters 100   # megatron GPT
    rapidformer --task pretraining --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt --data-path corpus_text_sentence ...  # BERT

Each task is a trainer class registered in ``TASKS``; ``run_task`` picks one by name.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_patch.startup import paused_collector
from megatron_patch.training.bert import BertPretrainer
from megatron_patch.training.config import RunConfig
from megatron_patch.training.data import (
    SequenceClassificationMetric,
    build_train_valid_test_datasets_for_huggingface,
    load_sentence_pair_dataset,
)
from megatron_patch.training.engine import Engine
from megatron_patch.training.gpt import gpt_datasets, gpt_forward_step
from megatron_patch.training.models import megatron_model
from megatron_patch.training.trainers import Finetuner, Pretrainer

TASKS: dict[str, Callable[[Engine], object]] = {}


def register_task(name: str):
    def register(factory):
        TASKS[name] = factory
        return factory

    return register


class HuggingFacePairDataset(torch.utils.data.Dataset):
    """Rows of ``load_sentence_pair_dataset`` tokenized by a Hugging Face tokenizer (``input_ids``,
    ``token_type_ids``, ``attention_mask`` as lists, padded per batch by the loader) with their ``labels``."""

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

        config = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(config.pretrained_model_name_or_path)
        splits = load_sentence_pair_dataset(config.data.data_path[0], config.data.data_name)
        self.num_labels = max(r["label"] for r in splits["train"]) + 1
        built = [HuggingFacePairDataset(splits[s], self.tokenizer, config.data.seq_length) if s in splits else None
                 for s in ("train", "validation", "test")]

        def collate(examples):
            return self.tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return (*built, collate)

    def model_optimizer_lr_scheduler_provider(self):
        from transformers import AutoModelForSequenceClassification

        with paused_collector():  # the first use of a model class imports its module (startup.py)
            model = AutoModelForSequenceClassification.from_pretrained(
                self.config.pretrained_model_name_or_path, num_labels=self.num_labels)
        # What transformers would set at the first forward, from these integer labels. Set then, it changed the
        # config a --onnx-runtime-training forward was compiled against, and the forward was compiled again.
        if model.config.problem_type is None and self.num_labels > 1:
            model.config.problem_type = "single_label_classification"
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
        data = self.config.data
        return build_train_valid_test_datasets_for_huggingface(
            data_prefix=list(data.data_path), data_impl="mmap", splits_string=data.split,
            train_valid_test_num_samples=train_val_test_num_samples, max_seq_length=data.seq_length,
            masked_lm_prob=data.mask_prob, short_seq_prob=data.short_seq_prob, seed=self.config.training.seed,
            binary_head=True)

    def model_optimizer_lr_scheduler_provider(self):
        from transformers import AutoModelForPreTraining

        with paused_collector():  # the first use of a model class imports its module (startup.py)
            return AutoModelForPreTraining.from_pretrained(self.config.pretrained_model_name_or_path), None, None

    def run_forward_step(self, data_iterator, model):
        return model(**next(data_iterator)).loss


class MegatronGPTPretrainer(Pretrainer):
    """A megatron-core GPT from the model flags (or ``--model-name``, or ``--load``'s description) on mmap
    document data (or --mock-data); examples/gpt/pretrain_gpt.py is the same trainer as a user script."""

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        return gpt_datasets(self.config.data, self.engine.tokenizer, train_val_test_num_samples,
                            self.config.training.seed)

    def model_optimizer_lr_scheduler_provider(self):
        model, self.checkpoint_info = megatron_model(self.engine, family="gpt")
        return model, None, None

    def run_forward_step(self, data_iterator, model):
        return gpt_forward_step(data_iterator, model)


def pretraining_family(config: RunConfig) -> str:
    """"bert" or "gpt": the megatron model ``--task pretraining`` trains. Megatron-LM picks it by program
    (pretrain_bert.py or pretrain_gpt.py); here the flags say it: ``--model-family``, a ``--model-name`` or
    ``--load`` of that family, ``--bert-no-binary-head``, or a BERT WordPiece ``--tokenizer-type``.

    Example::

        >>> from megatron_patch.training.arguments import parse_run
        >>> config, _ = parse_run(["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "v.txt"], 1)
        >>> pretraining_family(config)
        'bert'
    """
    from megatron_patch.model.config import get_model_config

    model = config.model
    if model.loaded is not None:
        return model.loaded.model_config.family
    if model.family is not None:
        return model.family
    if model.name is not None:
        return get_model_config(model.name).family
    no_binary_head = dict(model.fields).get("add_binary_head") is False  # --bert-no-binary-head
    bert = no_binary_head or (config.tokenizer_type or "").startswith("BertWordPiece")
    return "bert" if bert else "gpt"


def _pretraining(engine: Engine):
    if engine.config.pretrained_model_name_or_path:
        return HuggingFaceBertPretrainer(engine=engine)
    family = pretraining_family(engine.config)
    engine.logger.info(f"--task pretraining: a megatron-core {'BERT' if family == 'bert' else 'GPT'} "
                       "(from the model flags; --model-family gpt|bert chooses)")
    return (BertPretrainer if family == "bert" else MegatronGPTPretrainer)(engine=engine)


register_task("sequence_classification")(SequenceClassificationFinetuner)
register_task("pretraining")(_pretraining)


def run_task(engine: Engine):
    """Build the trainer of ``--task`` and train it; returns the trainer."""
    trainer = TASKS[engine.config.task](engine)
    trainer.train()
    return trainer
