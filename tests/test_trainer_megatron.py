"""The Pretrainer on megatron-core GPT: gradient accumulation equals one big batch, the distributed optimizer
shards its state, a checkpoint saved at one TP/PP resumes at another with the losses of an unbroken run, and a
NaN gradient on one rank skips the step on every rank without touching the weights."""

import os
import re

import pytest
from seed_scripts.assets import rapidformer_assets

from megatron_patch.testing import run_on_ranks
from megatron_patch.checkpoint.format import write_tracker


def _gpt_flags(assets, *extra):
    return [
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--make-vocab-size-divisible-by", "512",  # same padding at TP 1 and 2
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", assets.gpt_options["vocab_file"],
        "--merge-file", assets.gpt_options["merge_file"], "--data-path", assets.gpt_prefix, "--split", "98,2,0",
        "--lr", "3e-3", "--lr-decay-style", "constant", "--log-interval", "1", "--seed", "5", *extra,
    ]


def train_gpt(rank, world_size, argv):
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import MegatronGPTPretrainer

    trainer = MegatronGPTPretrainer(engine=Engine(argv))
    log = trainer.train()
    inner = trainer.optimizer.optimizer
    state = sum(t.numel() for s in inner.state.values() for t in s.values() if hasattr(t, "numel") and t.dim())
    return {"losses": [loss for _, loss in log.train_losses], "optimizer_state": state,
            "grad_norm_log": log.skipped}


def _last_stage(results):
    return next(r for r in results if r["losses"])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def test_gradient_accumulation_matches_one_big_batch_and_zero1_shards_state(assets):
    steps = ["--train-iters", "3"]
    [big] = run_on_ranks(train_gpt, 1, args=(_gpt_flags(assets, *steps, "--micro-batch-size", "8",
                                                           "--global-batch-size", "8"),))
    accumulated = run_on_ranks(train_gpt, 2, args=(_gpt_flags(
        assets, *steps, "--micro-batch-size", "2", "--global-batch-size", "8", "--zero-1-memory-optimization"),))
    plain = run_on_ranks(train_gpt, 2, args=(_gpt_flags(
        assets, *steps, "--micro-batch-size", "2", "--global-batch-size", "8"),))
    assert big["losses"][-1] < big["losses"][0]
    # Four microbatches of 2 on each of 2 data-parallel ranks make the same updates as one batch of 8.
    for losses in (accumulated[0]["losses"], plain[0]["losses"]):
        assert losses == pytest.approx(big["losses"], rel=2e-5)
    # The distributed optimizer keeps half of Adam's state per rank at DP=2.
    assert accumulated[0]["optimizer_state"] == pytest.approx(plain[0]["optimizer_state"] / 2, rel=0.01)


def test_resume_at_another_layout_and_data_parallel_size_matches_unbroken_run(assets, tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
              "--use-distributed-optimizer"]
    # The optimizer state gathered per parameter, to load at another TP/PP (the default format loads at the saved
    # TP/PP only: tests/test_checkpoint_reshard.py).
    unbroken = run_on_ranks(train_gpt, 2, args=(_gpt_flags(
        assets, *common, "--tensor-model-parallel-size", "2", "--save", save, "--save-interval", "3",
        "--dist-ckpt-optim-fully-reshardable"),))
    # Resume from an earlier checkpoint than the last one. Set before the ranks start: every rank reads the
    # tracker while parsing its flags.
    write_tracker(save, 3)
    resumed = run_on_ranks(train_gpt, 2, args=(_gpt_flags(
        assets, *common, "--pipeline-model-parallel-size", "2", "--load", save),))
    # At DP=2 (TP=PP=1) the same global batch is split over two ranks: the samples and their order stay, only
    # the summation order of the gradient reduction changes (so equal to float rounding, not bitwise).
    data_parallel = run_on_ranks(train_gpt, 2, args=(_gpt_flags(assets, *common, "--load", save),))
    full, tail = _last_stage(unbroken)["losses"], _last_stage(resumed)["losses"]
    assert len(full) == 6 and len(tail) == 3
    assert full[-1] < full[0]
    assert tail == pytest.approx(full[3:], rel=1e-4)
    assert data_parallel[0]["losses"] == pytest.approx(full[3:], rel=1e-4)
    assert os.path.isfile(os.path.join(save, "latest_checkpointed_iteration.txt"))
    assert os.path.isfile(os.path.join(save, "loss_curves.png"))


def _skip_one_nan_gradient(rank, world_size, distributed_optimizer, bf16):
    """A step in which one gradient element is NaN on rank 1 only, then a clean step: per rank, (skipped, grad
    norm, weights unchanged, Adam state entries) of the first and (skipped, grad norm, weights changed) of the
    second."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.testing import SEQ, counting_batches, tiny_gpt
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    initialize_distributed(seed=7)
    model = tiny_gpt(num_layers=2)
    model.config.bf16 = bf16
    chunks = wrap_model([model], DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                                               grad_reduce_in_fp32=bf16))
    optimizer = build_optimizer(chunks, OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=distributed_optimizer))
    generator = torch.Generator().manual_seed(rank)
    weights = lambda: [p.detach().clone() for p in chunks[0].parameters()]  # noqa: E731
    adam_entries = lambda: sum(len(part.optimizer.state) for part in optimizer.chained_optimizers)  # noqa: E731

    def poison(grad):
        # One element of one rank: with the distributed optimizer only the rank owning it sees it after the
        # reduce-scatter, yet every rank must skip.
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    hook = model.decoder.final_layernorm.weight.register_hook(poison) if rank == 1 else None
    before = weights()
    bad = train_step(lm_forward_step, counting_batches(generator, 2, 1), chunks, optimizer, 1, SEQ, 2)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, weights()))
    entries = adam_entries()
    if hook is not None:
        hook.remove()
    good = train_step(lm_forward_step, counting_batches(generator, 2, 1), chunks, optimizer, 1, SEQ, 2)
    changed = not all(torch.equal(a, b) for a, b in zip(before, weights()))
    return (bad.skipped, bad.grad_norm, unchanged, entries), (good.skipped, good.grad_norm, changed)


@pytest.mark.parametrize("distributed_optimizer,bf16", [(False, False), (True, False), (True, True)],
                         ids=["fp32", "fp32-distopt", "bf16-distopt"])
def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(distributed_optimizer, bf16):
    results = run_on_ranks(_skip_one_nan_gradient, 2, args=(distributed_optimizer, bf16), timeout=180)
    for bad, good in results:
        assert bad == (True, None, True, 0)  # skipped, the weights and Adam's moments untouched
        assert good[0] is False and good[2] and 0 < good[1] < float("inf")
    assert results[0][1][1] == results[1][1][1]  # one global norm


def forward_step_broadcasts(rank, world_size, tensor_model_parallel_size):
    import torch
    from megatron.core import parallel_state

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.testing import counting_batches, tiny_gpt
    from megatron_patch.training.gpt import gpt_forward_step

    initialize_distributed(tensor_model_parallel_size=tensor_model_parallel_size)
    model = tiny_gpt(tensor_model_parallel_size=tensor_model_parallel_size)
    batch = next(counting_batches(torch.Generator().manual_seed(rank), micro_batch_size=2, num_microbatches=1))
    reads_data = parallel_state.get_tensor_model_parallel_rank() == 0
    broadcasts = []
    broadcast = torch.distributed.broadcast
    torch.distributed.broadcast = lambda *args, **kwargs: broadcasts.append(1) or broadcast(*args, **kwargs)
    try:
        per_token_loss, _ = gpt_forward_step(iter([batch]) if reads_data else None, model)
    finally:
        torch.distributed.broadcast = broadcast
    return len(broadcasts), per_token_loss


def test_the_gpt_forward_step_broadcasts_only_at_tensor_parallel_sizes_above_one():
    """At TP=1 every rank reads its own batch (no collective, as each DP rank); at TP=2 rank 1 gets rank 0's."""
    (calls0, loss0), (calls1, loss1) = run_on_ranks(forward_step_broadcasts, 2, args=(1,))
    assert calls0 == calls1 == 0
    assert not loss0.equal(loss1), "each data-parallel rank computes on its own batch"
    (calls0, loss0), (calls1, loss1) = run_on_ranks(forward_step_broadcasts, 2, args=(2,))
    assert calls0 > 0 and calls1 > 0
    assert loss0.equal(loss1), "both tensor-parallel ranks compute on rank 0's batch"


def train_gpt_logging(rank, world_size, argv):
    """train_gpt's first loss and every message the trainer logged."""
    from megatron_patch.testing import logged_messages

    with logged_messages() as messages:
        return train_gpt(rank, world_size, argv)["losses"][0], messages


def test_a_load_directory_without_a_checkpoint_is_named_before_training_from_random_weights(assets, tmp_path):
    """Failed before: a --load with no checkpoint started from random weights without a word (Megatron-LM warns):
    the first run of a job saving to its --load. A Hugging Face model's directory is refused instead (issue 38)."""
    from megatron_patch.training.arguments import parse_run
    from tests.convert_oracles import make_hf_model

    hf = make_hf_model("llama-gqa", str(tmp_path / "hf"))
    missing = str(tmp_path / "ckpt")
    step = ["--train-iters", "1", "--micro-batch-size", "2", "--global-batch-size", "2"]
    [(scratch, _)] = run_on_ranks(train_gpt_logging, 1, args=(_gpt_flags(assets, *step),))
    [(loss, messages)] = run_on_ranks(train_gpt_logging, 1, args=(_gpt_flags(assets, *step, "--load", missing),))
    assert loss == scratch  # nothing was loaded
    assert [m for m in messages if m.startswith(f"--load {missing}: no checkpoint there")], messages
    convert = f"convert it with `megatron-patch convert hf-to-megatron --hf-dir {hf} --save-dir CONVERTED`"
    with pytest.raises(SystemExit, match=re.escape(convert)):
        parse_run(_gpt_flags(assets, *step, "--load", hf), 1)


def test_a_hook_s_broad_except_does_not_swallow_the_end_of_a_non_last_pipeline_stage():
    """On a non-last stage calling the model ends the hook, carrying the stage's output; a hook that catches
    ``Exception`` around its model call (to log, to retry) still ends there."""
    from megatron_patch.training.backends.megatron import StageModel, StageOutput

    model = StageModel(lambda tokens: tokens + 1)

    def hook():
        try:
            return model(1)
        except Exception:
            return "swallowed"

    with pytest.raises(StageOutput) as ended:
        hook()
    assert ended.value.output == 2
