"""GPT on megatron-core for the trainer hooks: pretraining on mmap documents (supervised fine-tuning on
conversations is training/sft.py).

Example::

    rapidformer --user-script examples/gpt/pretrain_gpt.py --data-path data/corpus_text_document ...

    # hooks of a Pretrainer
    return gpt_datasets(self.config.data, self.engine.tokenizer, train_val_test_num_samples,
                        self.config.training.seed)
    return gpt_forward_step(data_iterator, model)
"""

from __future__ import annotations

import torch

from megatron_patch.data.datasets import build_gpt_datasets
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
