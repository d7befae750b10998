"""GPT on megatron-core for the trainer hooks: pretraining on mmap documents and supervised fine-tuning (SFT) on
prompt/response pairs whose loss covers the response only.

Example::

    rapidformer --user-script examples/gpt/pretrain_gpt.py --data-path data/corpus_text_document ...
    rapidformer --user-script examples/gpt/finetune_gpt.py --load ./llama-mcore --data-path data/sft ...

    # hooks of a Pretrainer
    return gpt_datasets(self.config.data, self.engine.tokenizer, train_val_test_num_samples,
                        self.config.training.seed)
    return gpt_forward_step(data_iterator, model)
"""

from __future__ import annotations

import json
import math
import os

import torch

from megatron_patch.data.datasets import build_gpt_datasets
from megatron_patch.model.forward import forward_only
from megatron_patch.training.config import DataConfig
from megatron_patch.training.step import broadcast_batch, lm_loss_func


def _tp_rank_zero() -> bool:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0


def gpt_datasets(data: DataConfig, tokenizer, train_val_test_num_samples, seed: int) -> tuple:
    """(train, valid, test) megatron-core GPT datasets of ``--data-path`` (or ``--mock-data``), built on TP rank 0
    only: the forward step broadcasts each batch to the other TP ranks, as Megatron-LM's ``pretrain_gpt.py``."""
    return build_gpt_datasets(
        list(data.data_path or []), data.split, data.seq_length, tokenizer, train_val_test_num_samples, seed=seed,
        mock=data.mock_data, data_cache_path=data.data_cache_path, mmap_bin_files=data.mmap_bin_files,
        reset_position_ids=data.reset_position_ids,
        eod_mask_loss=data.eod_mask_loss, create_attention_mask=False, is_built_on_rank=_tp_rank_zero)


def gpt_forward_step(data_iterator, model):
    """Megatron-LM's GPT forward step: TP rank 0's batch broadcast to its TP group (at TP>1), per-token losses averaged
    over the loss mask (``(output, loss_func)``; the attention is causal, no mask tensor is built)."""
    raw = next(data_iterator) if data_iterator is not None else None
    batch = broadcast_batch(["tokens", "labels", "position_ids"], raw, torch.int64)
    loss_mask = broadcast_batch(["loss_mask"], raw, torch.float32)["loss_mask"]
    # The loss mask also masks the multi-token prediction losses, which the model computes itself.
    per_token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=loss_mask)
    return per_token_loss, lambda output: lm_loss_func(loss_mask, output)


# ----------------------------------------------------------------------------------------------------------
# Supervised fine-tuning
# ----------------------------------------------------------------------------------------------------------

# split -> file stem (the layout of load_sentence_pair_dataset: DIR[/NAME]/train.jsonl, DIR[/NAME]/dev.jsonl).
_SFT_SPLITS = {"train": "train", "validation": "dev"}


def load_sft_dataset(data_path: str, data_name: str | None = None) -> dict[str, list[dict]]:
    """``{"prompt": ..., "response": ...}`` lines of ``train.jsonl`` (and ``dev.jsonl``) under
    ``data_path[/data_name]``; a split without a file is absent."""
    root = os.path.join(data_path, data_name) if data_name else data_path
    splits = {}
    for split, stem in _SFT_SPLITS.items():
        path = os.path.join(root, stem + ".jsonl")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            missing = [n for n, row in enumerate(rows, 1) if not {"prompt", "response"} <= row.keys()]
            if missing:
                raise ValueError(f"{path}: line {missing[0]} lacks a 'prompt' or 'response' field")
            splits[split] = rows
    if "train" not in splits:
        raise ValueError(f"--data-path {data_path} --data-name {data_name}: no train.jsonl in {root}")
    return splits


def sft_sample(prompt_length: int, ids: list[int], seq_length: int, pad: int) -> dict:
    """One causal-LM sample of ``seq_length`` tokens from ``ids`` (prompt, response, end of document) whose
    loss mask selects the predictions of response tokens.

    Example::

        >>> s = sft_sample(2, [5, 6, 7, 8, 0], seq_length=6, pad=0)    # prompt 5 6, response 7 8, eod 0
        >>> s["labels"].tolist(), s["loss_mask"].tolist()
        ([6, 7, 8, 0, 0, 0], [0.0, 1.0, 1.0, 1.0, 0.0, 0.0])

    Position ``i`` predicts ``ids[i + 1]``, so the first response token is the label at ``prompt_length - 1``
    (masking from ``prompt_length`` instead is the off-by-one of Pai-Megatron-Patch issue 699).
    """
    ids = ids[: seq_length + 1]
    tokens, labels = ids[:-1], ids[1:]
    padding = seq_length - len(tokens)
    loss_mask = [float(i + 1 >= prompt_length) for i in range(len(labels))]
    return {
        "tokens": torch.tensor(tokens + [pad] * padding),
        "labels": torch.tensor(labels + [pad] * padding),
        "loss_mask": torch.tensor(loss_mask + [0.0] * padding),
        "position_ids": torch.arange(seq_length),
    }


class SFTDataset(torch.utils.data.Dataset):
    """Prompt/response rows as fixed-length samples (``sft_sample``), tokenized once.

    The prompt is tokenized alone for its length and the response follows it as written (put the separator,
    e.g. a newline, at the end of the prompt); the tokenizer's end-of-document token ends each response.
    """

    def __init__(self, rows: list[dict], tokenizer, seq_length: int):
        eod = tokenizer.eod
        if eod is None:
            raise ValueError("this --tokenizer-type has no end-of-document token; SFT ends each response with one")
        self.samples = [
            sft_sample(len(tokenizer.tokenize(row["prompt"])), tokenizer.tokenize(row["prompt"] + row["response"])
                       + [eod], seq_length, pad=eod)
            for row in rows
        ]

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index]


def sft_forward_step(batch: dict, model):
    """Per-token loss over the response tokens of ``batch`` (the three-value loss form: token-weighted)."""
    per_token_loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                           loss_mask=batch["loss_mask"])
    return per_token_loss, lambda output: lm_loss_func(batch["loss_mask"], output)


def sft_metrics(chunks: list, loader, seq_length: int) -> dict[str, float]:
    """Response-token loss and perplexity over ``loader`` (all data-parallel ranks); ``{}`` off the last
    pipeline stage."""
    from megatron.core import parallel_state

    reports = forward_only(chunks, loader, lambda it, model: sft_forward_step(next(it), model), seq_length)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return {}
    total = torch.stack([r["lm loss"].float() for r in reports]).sum(dim=0)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    loss = (total[0] / total[1].clamp(min=1.0)).item()
    return {"loss": loss, "ppl": math.exp(min(loss, 20.0))}
