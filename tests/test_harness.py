"""The multi-process harness: results in rank order, tracebacks from the failing rank, and a hard timeout."""

import logging
import time

import pytest

from megatron_patch.testing import RankFailure, logged_messages, run_on_ranks


def all_reduce_rank(rank, world_size):
    import torch

    from megatron_patch.distributed import initialize_distributed

    initialize_distributed()
    value = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(value)
    return rank, value.item()


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def rank_one_never_joins(rank, world_size):
    import torch

    from megatron_patch.distributed import initialize_distributed

    initialize_distributed()
    if rank == 1:
        time.sleep(3600)  # never reaches the collective below
    torch.distributed.all_reduce(torch.ones(1))
    return rank


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    total = world_size * (world_size + 1) / 2
    assert run_on_ranks(all_reduce_rank, world_size) == [(r, total) for r in range(world_size)]


def test_exception_reports_the_rank_and_its_traceback():
    with pytest.raises(RankFailure, match=r"raised on rank\(s\) \[1\] of 2") as failure:
        run_on_ranks(raise_on_rank_one, 2)
    assert "ValueError: boom on purpose" in str(failure.value)
    assert run_on_ranks(all_reduce_rank, 2) == [(0, 3.0), (1, 3.0)], "the next call gets working ranks"


def test_rank_that_never_joins_a_collective_fails_within_the_timeout():
    timeout = 8.0
    run_on_ranks(all_reduce_rank, 2)  # workers up, process group joined: the timeout is the body's alone
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(rank_one_never_joins, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    message = str(failure.value)
    assert elapsed < timeout + 15, f"took {elapsed:.1f}s"
    assert "rank(s) [0, 1] of 2 did not finish within 8s" in message
    # each stuck rank's stack says where it waits: rank 1 in the test body's sleep, rank 0 in the collective
    rank1 = message.split("--- rank 1 (stuck) ---")[1]
    assert "in rank_one_never_joins" in rank1
    assert "all_reduce" in message.split("--- rank 0 (stuck) ---")[1].split("--- rank 1")[0]


def reinitialise_layouts(rank, world_size):
    import os

    from megatron_patch.distributed import initialize_distributed

    counts = []
    for tp in (1, 2, 1, 2, 1, 2):
        initialize_distributed(tensor_model_parallel_size=tp)
        counts.append(len(os.listdir("/proc/self/task")))  # OS threads: gloo's are C++ threads
    return counts


def test_reinitialising_frees_the_previous_groups():
    """Workers are reused, so rebuilding megatron-core's groups must not leave the old ones running."""
    counts = run_on_ranks(reinitialise_layouts, 2)[0]
    assert counts[2:] == counts[:2] * 2, counts


def _libraries_set_aside(rank, world_size):
    import gc

    import torch

    return not any(obj is torch.__dict__ for obj in gc.get_objects())  # frozen objects are in no generation


def test_workers_set_the_libraries_aside_from_the_collection_after_each_test():
    """Failed before: the full collection after each test walked torch's and megatron-core's ~400,000 objects too,
    0.25-0.4 s of a worker's CPU per test."""
    assert run_on_ranks(_libraries_set_aside, 1) == [True]


def test_logged_messages_collects_inside_the_block_and_then_lets_go():
    """A worker runs many bodies: a handler left on the trainer's logger would collect every later body's lines."""
    logger = logging.getLogger("test_harness.logged_messages")
    logger.setLevel(logging.INFO)
    handlers = list(logger.handlers)
    with pytest.raises(ValueError):
        with logged_messages(logger) as messages:
            logger.info("step %d", 1)
            raise ValueError("a body that fails")
    logger.info("after the block")
    assert messages == ["step 1"]
    assert logger.handlers == handlers
