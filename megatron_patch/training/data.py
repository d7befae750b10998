"""Datasets and metrics the Rapidformer scripts import: GPT/BERT mmap datasets in the keys those scripts read,
local GLUE-style sentence-pair data, accuracy/F1, and Megatron-LM's left-to-right masks.

Example::

    splits = load_sentence_pair_dataset("data/glue", "mrpc")     # data/glue/mrpc/{train,dev}.tsv or .jsonl
    splits["train"][0]                                           # {"sentence1": ..., "sentence2": ..., "label": 1}
    train, valid, test = build_train_valid_test_datasets_for_huggingface(
        data_prefix=["data/bert_text_sentence"], data_impl="mmap", splits_string="980,20",
        train_valid_test_num_samples=[800, 80, 0], max_seq_length=64, masked_lm_prob=0.15,
        short_seq_prob=0.1, seed=1234, skip_warmup=True, binary_head=True)
"""

from __future__ import annotations

import csv
import json
import os

import torch

from megatron_patch.data.datasets import build_bert_datasets, build_gpt_datasets

# GLUE's column names for the two sentences and the label, per file layout (MRPC's TSV, then the common ones).
_SENTENCE_COLUMNS = [("#1 String", "#2 String", "Quality"), ("sentence1", "sentence2", "label"),
                     ("question1", "question2", "is_duplicate")]
# split -> file stems tried in order (GLUE calls the validation split "dev").
_SPLIT_FILES = {"train": ("train",), "validation": ("dev", "validation"), "test": ("test",)}


def _read_tsv(path: str) -> list[dict]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        return []
    for first, second, label in _SENTENCE_COLUMNS:
        if first in rows[0] and second in rows[0]:
            return [{"sentence1": r[first], "sentence2": r[second],
                     "label": int(r[label]) if r.get(label) not in (None, "") else -1} for r in rows]
    raise ValueError(f"{path}: no sentence-pair columns; expected one of {_SENTENCE_COLUMNS}")


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"sentence1": r["sentence1"], "sentence2": r["sentence2"], "label": int(r.get("label", -1))}
            for r in rows]


_READERS = {".tsv": _read_tsv, ".jsonl": _read_jsonl}


def load_sentence_pair_dataset(data_path: str, data_name: str | None = None) -> dict[str, list[dict]]:
    """Local GLUE TSV (``train.tsv``/``dev.tsv``, MRPC's columns or ``sentence1/sentence2/label``) or JSONL
    (``train.jsonl``/``dev.jsonl``) under ``data_path[/data_name]``; splits that have no file are absent."""
    root = os.path.join(data_path, data_name) if data_name and os.path.isdir(os.path.join(data_path, data_name)) \
        else data_path
    splits = {}
    for split, stems in _SPLIT_FILES.items():
        for stem in stems:
            found = [root + os.sep + stem + ext for ext in _READERS if os.path.isfile(os.path.join(root, stem + ext))]
            if found:
                splits[split] = _READERS[os.path.splitext(found[0])[1]](found[0])
                break
    if "train" not in splits:
        raise ValueError(f"--data-path {data_path} --data-name {data_name}: no train.tsv or train.jsonl in {root}")
    return splits


class SequenceClassificationMetric:
    """Accuracy and binary F1 accumulated over batches (the ``metric.add_batch / compute`` of HF ``evaluate``).

    Example::

        >>> m = SequenceClassificationMetric()
        >>> m.add_batch(predictions=torch.tensor([1, 0, 1]), references=torch.tensor([1, 1, 1]))
        >>> m.compute()
        {'accuracy': 0.6666666666666666, 'f1': 0.8}
    """

    def __init__(self):
        self.predictions: list[torch.Tensor] = []
        self.references: list[torch.Tensor] = []

    def add_batch(self, predictions: torch.Tensor, references: torch.Tensor) -> None:
        self.predictions.append(torch.as_tensor(predictions).reshape(-1).cpu())
        self.references.append(torch.as_tensor(references).reshape(-1).cpu())

    def compute(self) -> dict[str, float]:
        predictions, references = torch.cat(self.predictions), torch.cat(self.references)
        self.predictions, self.references = [], []
        true_positive = ((predictions == 1) & (references == 1)).sum().item()
        predicted, actual = (predictions == 1).sum().item(), (references == 1).sum().item()
        f1 = 2 * true_positive / (predicted + actual) if predicted + actual else 0.0
        # In float64, as evaluate's (scikit-learn's) accuracy: float32 gave 0.6666666865348816 for 2 of 3.
        return {"accuracy": (predictions == references).double().mean().item(), "f1": f1}


class _Renamed(torch.utils.data.Dataset):
    """A megatron-core dataset whose samples are re-keyed (and converted) for the scripts that read them."""

    def __init__(self, dataset, convert):
        self.dataset, self.convert = dataset, convert

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.convert(self.dataset[index])


def _as_huggingface_bert(sample: dict) -> dict:
    labels = torch.as_tensor(sample["labels"], dtype=torch.int64)
    return {
        "input_ids": torch.as_tensor(sample["text"], dtype=torch.int64),
        "attention_mask": torch.as_tensor(sample["padding_mask"], dtype=torch.int64),
        "token_type_ids": torch.as_tensor(sample["types"], dtype=torch.int64),
        # megatron-core marks unpredicted positions with -1, Hugging Face's loss ignores -100.
        "labels": torch.where(labels < 0, torch.full_like(labels, -100), labels),
        "next_sentence_label": torch.as_tensor(int(sample["is_random"]), dtype=torch.int64),
    }


def _as_text(sample: dict) -> dict:
    """Megatron-LM's old GPT sample: ``text`` holds seq_length + 1 tokens (inputs and shifted labels)."""
    tokens = torch.as_tensor(sample["tokens"], dtype=torch.int64)
    return {"text": torch.cat([tokens, torch.as_tensor(sample["labels"][-1:], dtype=torch.int64)])}


def _wrap(datasets, convert):
    return tuple(None if d is None else _Renamed(d, convert) for d in datasets)


def _tokenizer():
    from megatron_patch.training.engine import get_tokenizer

    return get_tokenizer()


class _VocabFileOnly:
    """The engine's tokenizer as megatron-core's BERT masking sees it for a Hugging Face model: without the tokens
    Megatron's BERT tokenizers append after the vocab file's ([BOS], [EOS], as Megatron-LM's do). Masking replaces
    one token in ten with any id of ``inv_vocab`` (BERTMaskedWordPieceDataset._get_token_mask), and a Hugging Face
    BERT of that vocab file has no embedding row for the appended ones."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        appended = getattr(tokenizer, "appended_ids", frozenset())
        self.inv_vocab = {i: token for i, token in tokenizer.inv_vocab.items() if i not in appended}

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def build_train_valid_test_datasets_for_huggingface(
    data_prefix, data_impl: str, splits_string: str, train_valid_test_num_samples, max_seq_length: int,
    masked_lm_prob: float, short_seq_prob: float, seed: int, skip_warmup: bool = True, binary_head: bool = True,
):
    """BERT masked-LM datasets over mmap sentence data, with Hugging Face's keys (``input_ids``,
    ``attention_mask``, ``token_type_ids``, ``labels``, ``next_sentence_label``); the tokenizer is the engine's
    ``--tokenizer-type``. ``data_impl`` and ``skip_warmup`` are accepted for Rapidformer's signature (mmap only)."""
    datasets = build_bert_datasets(
        list(data_prefix), splits_string, max_seq_length, _VocabFileOnly(_tokenizer()),
        list(train_valid_test_num_samples), seed=seed, binary_head=binary_head, masked_lm_prob=masked_lm_prob,
        short_seq_prob=short_seq_prob,
    )
    return _wrap(datasets, _as_huggingface_bert)


def build_train_valid_test_datasets(
    data_prefix, data_impl: str, splits_string: str, train_valid_test_num_samples, seq_length: int, seed: int,
    skip_warmup: bool = True,
):
    """GPT datasets over mmap document data whose samples are ``{"text": seq_length + 1 tokens}``, as
    Megatron-LM's ``pretrain_gpt.py`` of the Rapidformer days read them."""
    datasets = build_gpt_datasets(
        list(data_prefix), splits_string, seq_length, _tokenizer(), list(train_valid_test_num_samples),
        seed=seed, create_attention_mask=False,
    )
    return _wrap(datasets, _as_text)


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool):
    """Megatron-LM's left-to-right masks: ``(attention_mask, loss_mask, position_ids)``; the attention mask is
    boolean with True where attention is *not* allowed, as megatron-core expects.

    Example::

        >>> mask, loss_mask, pos = get_ltor_masks_and_position_ids(torch.tensor([[5, 0, 7]]), 0, True, True, True)
        >>> loss_mask.tolist(), pos.tolist()
        ([[1.0, 0.0, 1.0]], [[0, 1, 0]])
    """
    batch, length = data.shape
    attention_mask = torch.tril(torch.ones(length, length, device=data.device)).expand(
        batch if reset_attention_mask else 1, 1, length, length).clone()
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(length, dtype=torch.long, device=data.device).unsqueeze(0).expand_as(data).clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(batch):
            eod_positions = (data[b] == eod_token).nonzero().flatten().tolist()
            previous = 0
            for i in eod_positions:
                if reset_attention_mask:
                    attention_mask[b, 0, i + 1:, : i + 1] = 0
                if reset_position_ids:
                    position_ids[b, i + 1:] -= i + 1 - previous
                    previous = i + 1
    return attention_mask < 0.5, loss_mask, position_ids
