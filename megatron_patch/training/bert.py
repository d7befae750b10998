"""BERT on megatron-core for the trainer hooks: masked-LM + next-sentence pretraining on sentence-split mmap data
(Megatron-LM's ``pretrain_bert.py``), and sentence-pair classification (GLUE-style TSV) with accuracy and F1.

Example::

    megatron-patch preprocess-data --input corpus.jsonl --output-prefix data/corpus --split-sentences \
        --tokenizer-type BertWordPieceLowerCase --vocab-file vocab.txt
    rapidformer --user-script examples/bert/pretrain_bert.py --data-path data/corpus_text_sentence ...

    # hooks of a Pretrainer
    return bert_datasets(self.config.data, self.engine.tokenizer, train_val_test_num_samples, model_config,
                         self.config.training.seed)
    return bert_forward_step(data_iterator, model, model_config)
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_patch.data.datasets import build_bert_datasets
from megatron_patch.model import ModelConfig
from megatron_patch.training.config import DataConfig
from megatron_patch.model.forward import forward_only
from megatron_patch.training.data import SequenceClassificationMetric
from megatron_patch.training.models import megatron_model
from megatron_patch.training.step import broadcast_batch
from megatron_patch.training.trainers import Pretrainer

# megatron-core's BERTMaskedWordPieceDataset sample keys a forward step reads (all int64).
_PRETRAINING_KEYS = ["text", "types", "labels", "is_random", "loss_mask", "padding_mask"]


def _tp_rank_zero() -> bool:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0


def bert_datasets(data: DataConfig, tokenizer, train_val_test_num_samples, model_config: ModelConfig,
                  seed: int) -> tuple:
    """(train, valid, test) masked-LM datasets of ``--data-path`` (``preprocess-data --split-sentences``
    output); sentence pairs with a random-next label when the model has the binary head. Built on TP rank 0."""
    return build_bert_datasets(
        list(data.data_path or []), data.split, data.seq_length, tokenizer, train_val_test_num_samples, seed=seed,
        binary_head=model_config.add_binary_head, masked_lm_prob=data.mask_prob, short_seq_prob=data.short_seq_prob,
        data_cache_path=data.data_cache_path, mmap_bin_files=data.mmap_bin_files, is_built_on_rank=_tp_rank_zero)


def bert_loss_func(loss_mask: torch.Tensor, is_random: torch.Tensor, output):
    """Masked-LM loss (mean over masked tokens) plus, with a binary head, the next-sentence cross-entropy, as
    Megatron-LM's ``pretrain_bert.loss_func``; reports them under its names, ``lm loss`` and ``sop loss``."""
    per_token_loss, binary_logits = output
    mask = loss_mask.reshape(-1).float()
    lm_loss = torch.sum(per_token_loss.reshape(-1).float() * mask) / mask.sum().clamp(min=1.0)
    # The legacy two-value form: the schedule averages over microbatches; [value, 1] is what the trainers sum.
    report = {"lm loss": torch.stack([lm_loss.detach(), torch.ones_like(lm_loss)])}
    if binary_logits is None:
        return lm_loss, report
    sop_loss = F.cross_entropy(binary_logits.reshape(-1, 2).float(), is_random.reshape(-1), ignore_index=-1)
    report["sop loss"] = torch.stack([sop_loss.detach(), torch.ones_like(sop_loss)])
    return lm_loss + sop_loss, report


def bert_forward_step(data_iterator, model, model_config: ModelConfig):
    """TP rank 0's batch broadcast to its TP group, then ``BertModel(tokens, padding mask, types, labels)``;
    segment types go in only when the model has token-type embeddings (Megatron-LM: with the binary head)."""
    raw = next(data_iterator) if data_iterator is not None else None
    batch = broadcast_batch(_PRETRAINING_KEYS, raw, torch.int64)
    types = batch["types"] if model_config.num_tokentypes else None
    output = model(batch["text"], batch["padding_mask"], tokentype_ids=types, lm_labels=batch["labels"])
    return output, functools.partial(bert_loss_func, batch["loss_mask"], batch["is_random"])


class BertPretrainer(Pretrainer):
    """Megatron-LM's ``pretrain_bert.py`` as a trainer: a megatron-core BERT from the flags (or ``--model-name``,
    or ``--load``'s description) on sentence-split mmap data; ``rapidformer --task pretraining`` with BERT flags
    and examples/bert/pretrain_bert.py run it."""

    def model_optimizer_lr_scheduler_provider(self):
        if self.config.training.calculate_per_token_loss:
            raise SystemExit("rapidformer: error: --calculate-per-token-loss: BERT's loss averages each microbatch "
                             "(masked-LM mean plus sentence-order loss, as Megatron-LM's pretrain_bert.py); drop it")
        model, self.checkpoint_info = megatron_model(self.engine, family="bert")
        return model, None, None  # None: megatron-core's optimizer and scheduler from the flags

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        # The model is built first: whether it has the binary head decides the samples (sentence pairs or not).
        return bert_datasets(self.config.data, self.engine.tokenizer, train_val_test_num_samples,
                             self.checkpoint_info.model_config, self.config.training.seed)

    def run_forward_step(self, data_iterator, model):
        return bert_forward_step(data_iterator, model, self.checkpoint_info.model_config)


# ----------------------------------------------------------------------------------------------------------
# Sentence-pair classification
# ----------------------------------------------------------------------------------------------------------


def pair_sample(first: list[int], second: list[int], label: int, seq_length: int, tokenizer) -> dict:
    """``[CLS] first [SEP] second [SEP]`` padded to ``seq_length``, with segment types and a padding mask (the
    longer sentence is truncated first, as Megatron-LM's ``tasks/data_utils.py``).

    Example::

        sample = pair_sample(tokenizer.tokenize("a b"), tokenizer.tokenize("c"), 1, 8, tokenizer)
        sample["types"].tolist()     # [0, 0, 0, 0, 1, 1, 0, 0]
    """
    first, second = list(first), list(second)
    while len(first) + len(second) > seq_length - 3:
        (first if len(first) >= len(second) else second).pop()
    text = [tokenizer.cls, *first, tokenizer.sep, *second, tokenizer.sep]
    padding = seq_length - len(text)
    return {
        "text": torch.tensor(text + [tokenizer.pad] * padding),
        "types": torch.tensor([0] * (len(first) + 2) + [1] * (len(second) + 1) + [0] * padding),
        "padding_mask": torch.tensor([1] * len(text) + [0] * padding),
        "label": torch.tensor(label),
    }


class SentencePairDataset(torch.utils.data.Dataset):
    """Rows of ``load_sentence_pair_dataset`` tokenized once with a Megatron WordPiece tokenizer."""

    def __init__(self, rows: list[dict], tokenizer, seq_length: int):
        self.samples = [pair_sample(tokenizer.tokenize(r["sentence1"]), tokenizer.tokenize(r["sentence2"]),
                                    r["label"], seq_length, tokenizer) for r in rows]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def _classify(batch: dict, model, model_config: ModelConfig, labels=None):
    types = batch["types"] if model_config.num_tokentypes else None
    return model(batch["text"], batch["padding_mask"], tokentype_ids=types, labels=labels)


def classification_forward_step(batch: dict, model, model_config: ModelConfig) -> torch.Tensor:
    """Mean cross-entropy of the classifier over ``batch``."""
    return _classify(batch, model, model_config, labels=batch["label"]).mean()


def classification_metrics(chunks: list, loader, model_config: ModelConfig, seq_length: int,
                           gather) -> dict[str, float]:
    """Accuracy and F1 of the classifier over ``loader`` (predictions ``gather``-ed from all data-parallel ranks);
    ``{}`` off the last pipeline stage."""

    def step(data_iterator, model):
        batch = next(data_iterator)
        return _classify(batch, model, model_config), \
            lambda logits, non_loss_data=False: (logits.argmax(dim=-1), batch["label"])

    outputs = forward_only(chunks, loader, step, seq_length, collect_non_loss_data=True)
    if not outputs:
        return {}
    metric = SequenceClassificationMetric()
    for predictions, labels in outputs:
        metric.add_batch(predictions=gather(predictions), references=gather(labels))
    return metric.compute()
