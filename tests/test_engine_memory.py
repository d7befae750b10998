"""
    python -m pytest -q tests/test_engine_memory.py

ZeRO memory modes for plain torch models at DP=2, measured in bytes per rank against the unsharded run:
ZeRO-1 halves Adam's state, ZeRO-2 also the gradients, ZeRO-3 and --fsdp-memory-optimization (FSDP2) also the
parameters.
"""

import pytest

from megatron_patch.testing import run_on_ranks

_MODES = [[], ["--zero-1-memory-optimization"], ["--zero-2-memory-optimization"], ["--zero-3-memory-optimization"],
          ["--fsdp-memory-optimization"]]


def _local_bytes(tensors) -> int:
    """Bytes this rank holds (a DTensor counts its local shard only)."""
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors if t is not None)


def measure_modes(rank, world_size):
    import torch

    from megatron_patch.training.engine import Engine

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.square().mean()

    results = {}
    for flags in _MODES:
        engine = Engine(["--micro-batch-size", "4", "--lr", "1e-3", "--train-iters", "2", *flags])
        torch.manual_seed(0)
        model, optimizer, scheduler = engine.compose(model_obj=Blocks())
        losses = []
        for _ in range(2):
            loss = model(torch.randn(4, 64, generator=torch.Generator().manual_seed(rank)))
            engine.backward(loss)
            grads = _local_bytes(p.grad for p in model.parameters())  # before zero_grad frees them
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        inner = optimizer.optimizer
        local = getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
        state = _local_bytes(t for s in local.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
        results[" ".join(flags) or "ddp"] = {
            "params": _local_bytes(model.parameters()), "grads": grads, "state": state, "losses": losses}
    return results


def test_zero_modes_shard_state_grads_and_params():
    results = run_on_ranks(measure_modes, 2)
    for per_rank in results:
        ddp = per_rank["ddp"]
        zero1, zero2 = (per_rank[f"--zero-{i}-memory-optimization"] for i in (1, 2))
        assert ddp["state"] == 2 * ddp["params"]  # Adam: exp_avg and exp_avg_sq
        # ZeroRedundancyOptimizer shards whole parameters; 8 tensors over 2 ranks split close to evenly.
        assert zero1["state"] == pytest.approx(ddp["state"] / 2, rel=0.1)
        assert (zero1["params"], zero1["grads"]) == (ddp["params"], ddp["grads"])
        assert zero2["state"] == pytest.approx(ddp["state"] / 2, rel=0.05)
        assert zero2["grads"] == pytest.approx(ddp["grads"] / 2, rel=0.05)
        for flag in ("--zero-3-memory-optimization", "--fsdp-memory-optimization"):
            sharded = per_rank[flag]
            for kind in ("params", "grads", "state"):
                assert sharded[kind] == pytest.approx(ddp[kind] / 2, rel=0.05), (flag, kind)
        for mode in per_rank.values():  # every mode trains: same data, same first loss, then lower
            assert mode["losses"][1] < mode["losses"][0]
