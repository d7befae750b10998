"""Forward passes without backward through megatron-core's pipeline schedule, under any TP/PP/VPP layout.

Example::

    logits = forward_only(chunks, eval_loader, classify_step, seq_length=128, collect_non_loss_data=True)

``forward_only`` takes each batch as one microbatch of its own size, so a short last batch needs no padding;
``forward_only_step`` runs one global batch of a data stream (the trainers' validation). Outputs arrive on the last
pipeline stage only, as megatron-core's schedules return them. The fine-tuning tasks' predictions and
``megatron-patch convert verify``'s comparison run through here.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch


def forward_only(chunks: list, batches: Iterable[dict], forward_step: Callable, seq_length: int,
                 collect_non_loss_data: bool = False) -> list:
    """Run megatron-core's schedule without backward on each batch (one microbatch of the batch's size, so a
    short last batch is fine) and return what ``forward_step``'s loss functions report on the last pipeline
    stage: their dicts, or with ``collect_non_loss_data`` whatever ``loss_func(output, non_loss_data=True)``
    returns (e.g. logits). Empty on other stages.

    Example::

        logits = forward_only(model, eval_loader, classify_step, args.seq_length, collect_non_loss_data=True)
    """
    results = []
    for batch in batches:
        size = next(iter(batch.values())).shape[0]
        iterators = [iter([batch]) for _ in chunks]
        results += forward_only_step(chunks, iterators if len(chunks) > 1 else iterators[0], forward_step, 1,
                                     seq_length, size, collect_non_loss_data)
    return results


def forward_only_step(chunks: list, data_iterator, forward_step: Callable, num_microbatches: int, seq_length: int,
                      micro_batch_size: int, collect_non_loss_data: bool = False) -> list:
    """One pass of megatron-core's schedule without backward over ``num_microbatches`` microbatches of
    ``data_iterator`` (one iterator per model chunk under virtual pipelining): what the loss functions report on
    the last pipeline stage, empty on the others.

    Example::

        reports = forward_only_step(chunks, valid_iterator, forward_step, num_microbatches=4, seq_length=1024,
                                    micro_batch_size=2)   # a validation batch of 4 x 2 x DP samples
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with torch.no_grad():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data_iterator, model=chunks,
            num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
            forward_only=True, collect_non_loss_data=collect_non_loss_data)
