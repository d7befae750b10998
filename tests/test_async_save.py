"""Where a save's work runs. ``--async-save`` writes the state of the iteration it was called at, however far training
has gone on while the files were being written: its thread (checkpoint/async_save.py) shares the training process's
memory. No save, synchronous or not, starts a process."""

import pytest

from megatron_patch.testing import run_on_ranks


def state_after_a_mutated_async_save(rank, world_size, save_dir, distributed_optimizer, snapshot):
    """Train one step, save asynchronously, and before the save's thread writes a byte change every weight and every
    Adam moment in place (what the next steps do); then load the save into the model and return both states."""
    import threading
    from unittest import mock

    import torch

    from megatron_patch.checkpoint import async_save
    from megatron_patch.testing import tiny_gpt_after_one_step
    from megatron_patch.checkpoint import megatron

    chunks, optimizer = tiny_gpt_after_one_step(distributed_optimizer)

    saved = {k: v.clone() for k, v in chunks[0].module.state_dict().items() if isinstance(v, torch.Tensor)}
    moments = {name: [s[name].clone() for s in optimizer.optimizer.state.values()]
               for name in ("exp_avg", "exp_avg_sq")}
    mutated = threading.Event()
    write = megatron.write_checksummed

    def write_after_the_mutation(*args, **kwargs):
        mutated.wait(timeout=60)
        return write(*args, **kwargs)

    queue = async_save.async_save_queue()
    with mock.patch.object(megatron, "write_checksummed", write_after_the_mutation), \
            mock.patch.object(megatron, "with_snapshot", async_save.with_snapshot if snapshot else lambda r, _: r):
        megatron.save_megatron_checkpoint(save_dir, 1, chunks, optimizer, None, async_queue=queue)
    with torch.no_grad():
        for param in chunks[0].module.parameters():
            param.add_(1.0)
        for state in optimizer.optimizer.state.values():
            state["exp_avg"].add_(1.0)
            state["exp_avg_sq"].add_(1.0)
    mutated.set()
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    megatron.load_megatron_checkpoint(save_dir, chunks, optimizer, None)
    loaded = {k: v for k, v in chunks[0].module.state_dict().items() if isinstance(v, torch.Tensor)}
    weights_equal = all(torch.equal(saved[k], loaded[k]) for k in saved)
    moments_equal = all(torch.equal(a, b) for name in moments
                        for a, b in zip(moments[name], [s[name] for s in optimizer.optimizer.state.values()]))
    return weights_equal, moments_equal


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed-optimizer"])
def test_the_save_holds_the_state_it_was_called_at(tmp_path, distributed_optimizer):
    [(weights, moments)] = run_on_ranks(state_after_a_mutated_async_save, 1,
                                        args=(str(tmp_path / "ckpt"), distributed_optimizer, True))
    assert weights and moments


def test_without_the_snapshot_the_save_holds_the_later_state(tmp_path):
    """The test above can fail: with a plain optimizer (weights and moments in their own memory) a save written
    from the live tensors holds what training did after the call."""
    [(weights, moments)] = run_on_ranks(state_after_a_mutated_async_save, 1,
                                        args=(str(tmp_path / "ckpt"), False, False))
    assert not (weights and moments)


def what_saves_leave(rank, world_size, save_dir):
    """A synchronous and an asynchronous save, starting from a process that never saved (megatron-core keeps its
    results queue's server for the process's lifetime): the processes this rank has after them that it had not
    before, and what megatron-core's checkpointing logged at WARNING or above meanwhile."""
    import io
    import logging

    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_patch.checkpoint import async_save
    from megatron_patch.testing import tiny_gpt_after_one_step
    from megatron_patch.checkpoint import megatron

    chunks, optimizer = tiny_gpt_after_one_step(distributed_optimizer=True)
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    handler.setLevel(logging.WARNING)
    logging.getLogger("megatron.core.dist_checkpointing").addHandler(handler)
    earlier_queue, filesystem_async._results_queue = filesystem_async._results_queue, None
    try:
        megatron.save_megatron_checkpoint(save_dir, 1, chunks, optimizer, None)
        queue = async_save.async_save_queue()
        megatron.save_megatron_checkpoint(save_dir, 2, chunks, optimizer, None, async_queue=queue)
        queue.maybe_finalize_async_calls(blocking=True)
        queue.close()
        started = [child.cmdline() for child in psutil.Process().children(recursive=True) if child.pid not in before]
    finally:
        filesystem_async._results_queue = earlier_queue
        logging.getLogger("megatron.core.dist_checkpointing").removeHandler(handler)
    return started, logged.getvalue()


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    [left] = run_on_ranks(what_saves_leave, 1, args=(str(tmp_path_factory.mktemp("saves") / "ckpt"),))
    return left


def test_no_save_starts_a_process(two_saves):
    """megatron-core reports its writers' results through a queue served by a process it spawns on the first save of
    each process (~2 s of start-up); ours report in-process."""
    started, _ = two_saves
    assert started == []


def test_no_save_warns_of_overwriting_a_checkpoint(two_saves):
    """Each save writes into a fresh staging directory: megatron-core's warning that it overwrites an "old incomplete
    / corrupted checkpoint" (a directory not empty when its save starts) would tell the user of damage there is not."""
    _, logged = two_saves
    assert logged == ""
