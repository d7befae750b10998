"""Test bodies for the model tests: deterministic weights by checkpoint key, forward steps, full gradients.

Weights are the same under every layout because each parameter shard is cut out of a global tensor generated
from the shard's megatron-core checkpoint key (``model.sharded_state_dict()``, the mapping dist_checkpointing
uses to reshard). Gradients are gathered back into global tensors with the same mapping, so layouts compare key
by key with the single-process run. That holds for experts too: under expert parallelism a rank's local expert
maps to its global expert's key, and replicas over the expert-data-parallel group are read once.

The loss of a mixture-of-experts model includes megatron-core's load-balancing loss, read from its tracker.
"""

from __future__ import annotations

import zlib

SEQ = 16
VOCAB = 128
GLOBAL_BATCH = 4  # sequences; one per microbatch, so every layout averages the same four per-sequence losses

# name -> overrides of the tiny registry entries: 4 layers (for PP=2 x VPP=2), no dropout (for exact oracles).
TINY = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, seq_length=SEQ,
            max_position_embeddings=SEQ, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)


def model_config(name: str, **overrides):
    from megatron_patch.model import get_model_config

    return get_model_config(name, **{**TINY, **overrides})


def _sharded_tensors(state_dict):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in state_dict.values():
        if isinstance(value, dict):
            yield from _sharded_tensors(value)
        elif isinstance(value, ShardedTensorFactory):
            built = value.build()
            yield from _sharded_tensors(built if isinstance(built, dict) else {i: t for i, t in enumerate(built)})
        elif isinstance(value, ShardedTensor):
            yield value


def _local_slice(sharded):
    local_shape = (1,) * sharded.prepend_axis_num + tuple(sharded.data.shape)
    return tuple(slice(o, o + s) for o, s in zip(sharded.global_offset, local_shape)), local_shape


def _global_init(key: str, shape):
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    noise = torch.randn(shape, generator=gen)
    if "norm" in key and key.endswith("weight"):
        return 1.0 + 0.1 * noise
    return 0.1 * noise


def init_weights(chunks) -> None:
    """Fill every parameter shard from its global tensor (same values at every layout)."""
    import torch

    with torch.no_grad():
        for chunk in chunks:
            for sharded in _sharded_tensors(chunk.sharded_state_dict()):
                index, local_shape = _local_slice(sharded)
                sharded.data.copy_(_global_init(sharded.key, sharded.global_shape)[index].reshape(sharded.data.shape))


def gather_grads(ddp_chunks) -> dict | None:
    """Global gradients (numpy arrays) by checkpoint key on rank 0 (None elsewhere)."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    shards = []
    for chunk in ddp_chunks:
        params = list(chunk.module.parameters())
        saved = [p.data for p in params]
        for p in params:
            p.data = p.main_grad
        try:
            for sharded in _sharded_tensors(chunk.module.sharded_state_dict()):
                if is_main_replica(sharded.replica_id):
                    index, local_shape = _local_slice(sharded)
                    shards.append((sharded.key, tuple(sharded.global_shape), index,
                                   sharded.data.detach().float().clone().reshape(local_shape)))
        finally:
            for p, data in zip(params, saved):
                p.data = data
    return gather_shards(shards)


def gather_shards(shards: list) -> dict | None:
    """The global tensors (numpy arrays) by checkpoint key on rank 0 (None elsewhere) from every rank's ``shards``:
    (key, global shape, index of this rank's slice, its data)."""
    import torch

    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, shards)
    if torch.distributed.get_rank() != 0:
        return None
    full = {}
    for rank_shards in gathered:
        for key, shape, index, data in rank_shards:
            full.setdefault(key, torch.full(shape, float("nan")))[index] = data
    # numpy, because torch tensors cross the harness's queues through shared-memory handles.
    return {key: tensor.numpy() for key, tensor in full.items()}


def _gpt_batches(dp_rank: int, dp_size: int):
    import torch

    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    for mb in tokens.chunk(dp_size)[dp_rank].split(1):
        yield {
            "tokens": mb[:, :-1].contiguous(),
            "labels": mb[:, 1:].contiguous(),
            "loss_mask": torch.ones(1, SEQ),
            "position_ids": torch.arange(SEQ).unsqueeze(0),
        }


def _bert_batches(dp_rank: int, dp_size: int):
    import torch

    gen = torch.Generator().manual_seed(4321)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    lengths = torch.tensor([SEQ, SEQ - 3, SEQ - 6, SEQ])  # padded sequences exercise the key-padding mask
    padding_mask = (torch.arange(SEQ) < lengths[:, None]).long()
    tokentype_ids = (torch.arange(SEQ) >= SEQ // 2).long().expand(GLOBAL_BATCH, SEQ).contiguous()
    loss_mask = ((torch.rand(GLOBAL_BATCH, SEQ, generator=gen) < 0.3) & padding_mask.bool()).float()
    loss_mask[:, 1] = 1.0  # at least one predicted token per sequence
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    is_random = torch.tensor([0, 1, 1, 0])
    per_rank = GLOBAL_BATCH // dp_size
    for i in range(dp_rank * per_rank, (dp_rank + 1) * per_rank):
        yield {
            "tokens": tokens[i:i + 1], "padding_mask": padding_mask[i:i + 1], "types": tokentype_ids[i:i + 1],
            "labels": labels[i:i + 1], "loss_mask": loss_mask[i:i + 1], "is_random": is_random[i:i + 1],
        }


def _mean_loss_report(loss_sum, num_tokens):
    """Three-value loss form; the report carries this microbatch's mean so layouts sum the same four numbers."""
    import torch

    report = torch.stack([(loss_sum / num_tokens).detach(), torch.ones(())])
    return loss_sum, num_tokens.to(torch.int), {"loss": report}


def gpt_forward_step(data_iterator, model):
    batch = next(data_iterator)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output):
        mask = batch["loss_mask"].reshape(-1)
        return _mean_loss_report((output.reshape(-1).float() * mask).sum(), mask.sum())

    return per_token, loss_func


def bert_forward_step(data_iterator, model):
    import torch.nn.functional as F

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["padding_mask"], tokentype_ids=batch["types"], lm_labels=batch["labels"])

    def loss_func(output):
        lm_loss, binary_logits = output
        mask = batch["loss_mask"].reshape(-1)
        num_tokens = mask.sum()
        loss_sum = (lm_loss.reshape(-1).float() * mask).sum()
        # Megatron's BERT loss: masked-LM mean + sentence-order mean, in the three-value form.
        loss_sum = loss_sum + F.cross_entropy(binary_logits.float(), batch["is_random"]) * num_tokens
        return _mean_loss_report(loss_sum, num_tokens)

    return output, loss_func


_FORWARD = {"gpt": (gpt_forward_step, _gpt_batches), "bert": (bert_forward_step, _bert_batches)}


def _check_memory_options_reached_the_model(chunks, parallel) -> None:
    """Sequence parallelism and recompute leave the loss unchanged by design, so a layout whose flags were dropped
    on the way to megatron-core would still match the oracle; check that the built chunks really use them."""
    from megatron.core.transformer.attention import Attention

    for chunk in chunks:
        config = chunk.config
        assert (config.sequence_parallel, config.recompute_granularity, config.recompute_method,
                config.recompute_num_layers) == (parallel.sequence_parallel, parallel.recompute_granularity,
                                                 parallel.recompute_method, parallel.recompute_num_layers)
        attentions = [m for m in chunk.modules() if isinstance(m, Attention)]
        assert attentions and all(
            m.checkpoint_core_attention == (parallel.recompute_granularity == "selective") for m in attentions)


def _check_expert_options_reached_the_model(chunks, parallel) -> None:
    """Both token dispatchers compute the same thing, so a layout whose dispatcher or expert split was dropped on the
    way to megatron-core would still match the oracle; check the built MoE layers."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import (MoEAllGatherTokenDispatcher,
                                                                MoEAlltoAllTokenDispatcher)

    dispatcher = {"allgather": MoEAllGatherTokenDispatcher,
                  "alltoall": MoEAlltoAllTokenDispatcher}[parallel.moe_token_dispatcher_type]
    expert_tp = parallel.expert_tensor_parallel_size or parallel.tensor_model_parallel_size
    assert parallel_state.get_expert_tensor_parallel_world_size() == expert_tp
    for chunk in chunks:
        layers = [m for m in chunk.modules() if isinstance(m, MoELayer)]
        assert layers and all(type(m.token_dispatcher) is dispatcher for m in layers)
        assert all(m.num_local_experts == chunk.config.num_moe_experts // parallel.expert_model_parallel_size
                   for m in layers)


def _clear_aux_loss_tracker() -> None:
    """Forget the load-balancing losses of earlier layouts: values and the (since destroyed) groups they name."""
    from megatron_patch.compat import clear_moe_aux_losses

    clear_moe_aux_losses()


def _aux_loss(config, num_microbatches: int) -> float:
    """The load-balancing loss the backward pass added, as megatron-core's tracker recorded it: per layer, the sum
    over this rank's microbatches of ``aux_loss / coeff``, reduced over PP, TP x CP and averaged over DP. Divided by
    the microbatches it is the mean over the global batch, the weight the schedule gives it in backward."""
    from megatron_patch.compat import take_moe_aux_losses

    if not config.moe_aux_loss_coeff:
        return 0.0
    values = take_moe_aux_losses()["load_balancing_loss"]
    return (config.moe_aux_loss_coeff * values.sum() / num_microbatches).item()


def loss_and_grads(rank, world_size, name, overrides, layouts):
    """For each ``(label, ParallelConfig kwargs)``: mean loss over the global batch (for MoE models with the
    load-balancing loss) and global grads by key.

    Returns ``{label: (loss, grads)}`` on rank 0 (loss from the last pipeline stage); other ranks return None.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks, padded_vocab_size
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.training.step import wrap_model

    results = {}
    for label, layout in layouts:
        parallel = ParallelConfig(**layout)
        initialize_distributed(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            seed=7,
        )
        config = model_config(name, **overrides)
        chunks = build_model_chunks(config, parallel,
                                    padded_vocab_size(VOCAB, 1, parallel.tensor_model_parallel_size))
        _check_memory_options_reached_the_model(chunks, parallel)
        if config.num_moe_experts is not None:
            _check_expert_options_reached_the_model(chunks, parallel)
        init_weights(chunks)
        ddp_chunks = wrap_model(chunks, DistributedDataParallelConfig())
        for chunk in ddp_chunks:
            chunk.zero_grad_buffer()
        chunks[0].config.finalize_model_grads_func = finalize_model_grads
        forward_step, batches = _FORWARD[config.family]
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        num_microbatches = GLOBAL_BATCH // dp
        # With virtual stages every chunk reads its own copy of the microbatch stream (masks, labels).
        data = [batches(dp_rank, dp) for _ in ddp_chunks] if len(ddp_chunks) > 1 else batches(dp_rank, dp)
        _clear_aux_loss_tracker()
        # The schedule itself scales the load-balancing loss's backward (MoEAuxLossAutoScaler.set_loss_scale with
        # 1 / num_microbatches); with DDP's average over DP it weighs 1 / GLOBAL_BATCH per microbatch at every layout.
        reports = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=ddp_chunks,
            num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=1, forward_only=False,
        )
        total = torch.zeros(2)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            total = torch.stack([r["loss"] for r in reports]).sum(dim=0)
        # Sum over DP, then take it from the last stage: every rank learns the loss.
        torch.distributed.all_reduce(total)
        loss = (total[0] / total[1]).item() + _aux_loss(config, num_microbatches)
        grads = gather_grads(ddp_chunks)
        results[label] = (loss, grads)
    return results if rank == 0 else None
