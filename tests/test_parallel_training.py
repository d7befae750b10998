"""A tiny megatron-core GPT trains to the same losses under every parallel layout as in one process.

The oracle is the single-process run: it saves its initial weights with megatron-core's dist_checkpointing, and
each parallel run loads them (resharded by megatron-core) and trains on the same global batches.
"""

import pytest

from megatron_patch.testing import run_on_ranks

STEPS = 4
GLOBAL_BATCH = 4
SEQ = 16
VOCAB = 128


def _batches(step: int, dp_rank: int, dp_size: int, micro_batch: int):
    """The global batch of ``step`` as deterministic random tokens; this rank's DP slice as microbatches."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    local = tokens.chunk(dp_size)[dp_rank]
    for mb in local.split(micro_batch):
        yield {
            "tokens": mb[:, :-1].contiguous(),
            "labels": mb[:, 1:].contiguous(),
            "loss_mask": torch.ones(mb.shape[0], SEQ),
            "position_ids": torch.arange(SEQ).expand(mb.shape[0], SEQ).contiguous(),
        }


def train_tiny_gpt(rank, world_size, tp, pp, distributed_optimizer, ckpt_dir, save_initial):
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.testing import tiny_gpt
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    layout = initialize_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=7)
    model = tiny_gpt(tp, pp, vocab_size=VOCAB, seq_length=SEQ)
    if save_initial:
        dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    else:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
    chunks = wrap_model([model], DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer))
    optimizer = build_optimizer(
        chunks, OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=distributed_optimizer),
    )
    micro_batch = 1
    dp_rank, dp = parallel_state.get_data_parallel_rank(), layout.data_parallel_size
    losses = []
    for step in range(STEPS):
        stats = train_step(
            lm_forward_step, _batches(step, dp_rank, dp, micro_batch), chunks, optimizer,
            num_microbatches=GLOBAL_BATCH // dp // micro_batch, seq_length=SEQ, micro_batch_size=micro_batch,
        )
        losses.append(stats.loss)
    return losses


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("initial_weights"))
    [losses] = run_on_ranks(train_tiny_gpt, 1, args=(1, 1, False, ckpt, True))
    assert losses[-1] < losses[0], "the reference run must learn for the comparison to mean anything"
    return ckpt, losses


def _last_stage_losses(results):
    return [r for r in results if r[0] is not None][0]


@pytest.mark.parametrize(
    "world_size,tp,pp,distributed_optimizer",
    [(2, 2, 1, False), (2, 1, 2, False), (4, 2, 2, False), (2, 1, 1, False), (2, 1, 1, True)],
    ids=["tp2", "pp2", "tp2xpp2", "dp2", "dp2-distopt"],
)
def test_layout_matches_single_process(reference, world_size, tp, pp, distributed_optimizer):
    ckpt, expected = reference
    results = run_on_ranks(train_tiny_gpt, world_size, args=(tp, pp, distributed_optimizer, ckpt, False))
    assert _last_stage_losses(results) == pytest.approx(expected, rel=1e-5)
