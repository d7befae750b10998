"""Tiny megatron-core models train to the same losses under every parallel layout as in one process.

    python -m pytest -q -p no:cacheprovider tests/test_parallel_training.py

Each model is built from one layer spec: megatron-core's own local spec, and the project's (``model/specs.py``
through ``build_model_chunks``) for a GPT-2, a LLaMA (RMSNorm, SwiGLU, RoPE, grouped queries, untied output) and
a post-LN BERT. Per spec the oracle is the single-process run: it saves its initial weights with megatron-core's
dist_checkpointing, and each parallel run loads them (resharded by megatron-core) and trains on the same global
batches for a few optimizer steps.
"""

import pytest

from megatron_patch.testing import run_on_ranks
from tests.model_oracles import GLOBAL_BATCH, SEQ, VOCAB

STEPS = 4

# spec -> None for megatron-core's local spec (megatron_patch.testing.tiny_gpt), else (registry name, overrides
# of tests.model_oracles.TINY) for the project's spec. Every model is 4 layers of width 32, without dropout.
SPECS = {
    "mcore-local": None,
    "gpt2": ("tiny-gpt2", {}),
    "llama": ("tiny-llama", {}),
    "bert-post-ln": ("tiny-bert", {}),
}


def _gpt_batches(step: int, dp_rank: int, dp_size: int, micro_batch: int):
    """The global batch of ``step``: sequences ``start, start + stride, ...`` (mod VOCAB) from deterministic
    random starts and strides, which a model learns within a few steps; this rank's DP slice as microbatches."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    local = tokens.chunk(dp_size)[dp_rank]
    for mb in local.split(micro_batch):
        yield {
            "tokens": mb[:, :-1].contiguous(),
            "labels": mb[:, 1:].contiguous(),
            "loss_mask": torch.ones(mb.shape[0], SEQ),
            "position_ids": torch.arange(SEQ).expand(mb.shape[0], SEQ).contiguous(),
        }


def _bert_batches(step: int, dp_rank: int, dp_size: int, micro_batch: int):
    """The global masked-LM batch of ``step`` in megatron-core's BERT sample keys, the masked tokens left in place
    (a copy task a model learns within a few steps); this rank's DP slice as microbatches."""
    import torch

    gen = torch.Generator().manual_seed(2000 + step)
    lengths = torch.tensor([SEQ, SEQ - 3, SEQ - 6, SEQ])  # padded sequences exercise the key-padding mask
    padding_mask = (torch.arange(SEQ) < lengths[:, None]).long()
    loss_mask = (torch.rand(GLOBAL_BATCH, SEQ, generator=gen) < 0.3).long() * padding_mask
    loss_mask[:, 1] = 1  # at least one predicted token per sequence
    text = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)
    batch = {
        "text": text,
        "types": (torch.arange(SEQ) >= SEQ // 2).long().expand(GLOBAL_BATCH, SEQ).contiguous(),
        "labels": text,
        "is_random": torch.tensor([0, 1, 1, 0]),
        "loss_mask": loss_mask,
        "padding_mask": padding_mask,
    }
    local = {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}
    for start in range(0, GLOBAL_BATCH // dp_size, micro_batch):
        yield {key: value[start:start + micro_batch] for key, value in local.items()}


def _build(spec: str, tp: int, pp: int):
    """(model chunks, forward step, batches) of ``spec`` for this rank's stage."""
    import functools

    from megatron_patch.model.builder import build_model_chunks, padded_vocab_size
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.testing import tiny_gpt
    from megatron_patch.training.bert import bert_forward_step
    from megatron_patch.training.step import lm_forward_step
    from tests.model_oracles import model_config

    if SPECS[spec] is None:
        return [tiny_gpt(tp, pp, vocab_size=VOCAB, seq_length=SEQ)], lm_forward_step, _gpt_batches
    name, overrides = SPECS[spec]
    config = model_config(name, **overrides)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    chunks = build_model_chunks(config, parallel, padded_vocab_size(VOCAB, 1, tp))
    if config.family == "bert":
        return chunks, functools.partial(bert_forward_step, model_config=config), _bert_batches
    return chunks, lm_forward_step, _gpt_batches


def train_tiny_model(rank, world_size, spec, tp, pp, distributed_optimizer, ckpt_dir, save_initial):
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.training.step import build_optimizer, train_step, wrap_model

    layout = initialize_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=7)
    [model], forward_step, batches = _build(spec, tp, pp)
    if save_initial:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    chunks = wrap_model([model], DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer))
    optimizer = build_optimizer(
        chunks, OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=distributed_optimizer),
    )
    # The losses match either way: only the optimizer's class says the distributed one ran.
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    assert all(isinstance(part, DistributedOptimizer) for part in parts) == distributed_optimizer, parts
    micro_batch = 1
    dp_rank, dp = parallel_state.get_data_parallel_rank(), layout.data_parallel_size
    losses = []
    for step in range(STEPS):
        stats = train_step(
            forward_step, batches(step, dp_rank, dp, micro_batch), chunks, optimizer,
            num_microbatches=GLOBAL_BATCH // dp // micro_batch, seq_length=SEQ, micro_batch_size=micro_batch,
        )
        losses.append(stats.loss)
    return losses


@pytest.fixture(scope="module", params=list(SPECS))
def spec(request):
    return request.param


@pytest.fixture(scope="module")
def reference(spec, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp(f"initial_weights_{spec}"))
    [losses] = run_on_ranks(train_tiny_model, 1, args=(spec, 1, 1, False, ckpt, True))
    assert losses[-1] < losses[0], "the reference run must learn for the comparison to mean anything"
    return ckpt, losses


def _last_stage_losses(results):
    return [r for r in results if r[0] is not None][0]


@pytest.mark.parametrize(
    "world_size,tp,pp,distributed_optimizer",
    [(2, 2, 1, False), (2, 1, 2, False), (4, 2, 2, False), (2, 1, 1, False), (2, 1, 1, True)],
    ids=["tp2", "pp2", "tp2xpp2", "dp2", "dp2-distopt"],
)
def test_layout_matches_single_process(spec, reference, world_size, tp, pp, distributed_optimizer):
    ckpt, expected = reference
    results = run_on_ranks(train_tiny_model, world_size, args=(spec, tp, pp, distributed_optimizer, ckpt, False))
    assert _last_stage_losses(results) == pytest.approx(expected, rel=1e-5)
