"""Run a test body on N ranks (CPU, gloo) with a hard timeout, reusing worker processes between tests.

Example::

    from megatron_patch.testing import run_on_ranks

    def body(rank, world_size, scale):           # module level, so the workers can import it
        import torch
        from megatron_patch.distributed import initialize_distributed
        initialize_distributed(tensor_model_parallel_size=world_size)
        t = torch.ones(1) * scale
        torch.distributed.all_reduce(t)
        return t.item()

    def test_all_reduce():
        assert run_on_ranks(body, world_size=2, args=(3.0,)) == [6.0, 6.0]

Start-up (importing torch and megatron-core) costs seconds per process, so the workers of each world size stay
alive and take one test body after another; the process group stays up and megatron-core's groups are rebuilt by
``initialize_distributed``. A body that raises fails the test with that rank's traceback. A body that does not
finish within ``timeout`` fails the test with the ranks still running and where each one is stuck (Python stacks
dumped by faulthandler); the workers are then killed and the next test gets fresh ones.

No worker outlives the process that started it: each worker leads a process group of its own (so Ctrl-C in a
terminal reaches pytest alone, and a kill takes the worker's own children with it), ``shutdown`` ends them all
(``tests/conftest.py`` calls it when the session finishes, and an ``atexit`` hook for other users), and a watchdog
thread in every worker kills its group within a second of the parent's death (SIGKILL, SIGTERM, a test timeout's
``os._exit``), even while a test body is stuck in a collective.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import gc
import logging
import multiprocessing
import multiprocessing.util  # before our atexit hook: see shutdown
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 120.0
STARTUP_TIMEOUT_S = 300.0
_READY = b"ready"


class RankFailure(AssertionError):
    """A test body raised on some rank, or did not finish in time."""


# A worker whose test bodies left more OS threads than this behind (gloo runs two per group and process
# group, and megatron-core builds dozens of groups per layout) is replaced before the next test.
MAX_WORKER_THREADS = 256


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # not Linux: no recycling
        return 0


def _exit_with_parent(parent: int) -> None:
    """Kill this worker's process group (itself and whatever it started) once ``parent`` is gone.

    A thread, not a check between tasks: a test body stuck in a collective never returns to the task loop, and
    PR_SET_PDEATHSIG would kill the worker alone, leaving its children behind.
    """
    while os.getppid() == parent:
        time.sleep(0.25)
    os.killpg(0, signal.SIGKILL)


def _worker_main(rank: int, world_size: int, port: int, tasks, results, sys_path: list[str], log_path: str,
                 parent: int):
    os.setpgrp()
    threading.Thread(target=_exit_with_parent, args=(parent,), name="exit-with-parent", daemon=True).start()
    # A worker's output goes to its own log: pytest's capture of the parent is not the place for it, and the
    # harness shows the tail of the log when the rank fails.
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.path[:] = sys_path
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    from megatron_patch.startup import import_libraries

    # Importing megatron-core takes seconds on a loaded machine: do it before reporting ready, so that a test's
    # timeout measures its body, not the start-up.
    import_libraries()
    import torch

    # A worker runs many tests, each followed by a full collection (below): set aside for good what exists now, the
    # libraries' ~400,000 objects, so that each collection walks only what later tests made (0.25-0.4 s less each).
    gc.freeze()
    # Ranks share two cores: one intra-op thread each keeps them from oversubscribing the machine.
    torch.set_num_threads(1)
    results.put((rank, True, _READY, 0))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            # Plain pickle, not the queue's: torch's multiprocessing reductions would pass tensors through
            # shared memory, which stalls for large results.
            value = pickle.dumps(fn(rank, world_size, *args, **kwargs))
        except BaseException:
            results.put((rank, False, traceback.format_exc(), 0))
        else:
            # Models and optimizers hold process groups in reference cycles; collecting them lets the groups'
            # communication threads end. The thread count tells the harness when to recycle this worker. What
            # survives (modules a test imported, caches) lives on like the libraries: set aside too.
            gc.collect()
            gc.freeze()
            results.put((rank, True, value, _thread_count()))
        sys.stdout.flush()
        sys.stderr.flush()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@dataclasses.dataclass
class _Pool:
    world_size: int
    processes: list
    tasks: list
    results: Any
    log_paths: list[str]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def log_tail(self, rank: int, chars: int = 4000) -> str:
        try:
            with open(self.log_paths[rank], errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL every worker's process group: the worker and the processes it started (checkpoint writers)."""
        for p in self.processes:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group is empty, or the worker died before leading one
                if p.is_alive():
                    p.kill()
        for p in self.processes:
            p.join(timeout=10)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        deadline = time.monotonic() + 10
        for p in self.processes:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self.kill()


_pools: dict[int, _Pool] = {}
# Made by the first pool this process starts, not at import: every spawned worker imports this module too.
_log_dir: str | None = None


def _start_pool(world_size: int) -> _Pool:
    global _log_dir
    if _log_dir is None:
        _log_dir = tempfile.mkdtemp(prefix="megatron_patch_ranks_")
    ctx = multiprocessing.get_context("spawn")
    # Here, not at the top: every spawned worker imports this module, and its first import of torch is
    # import_libraries' (startup.py).
    from megatron_patch.distributed import free_port

    port = free_port()
    results = ctx.Queue()
    tasks = [ctx.Queue() for _ in range(world_size)]
    stamp = f"{world_size}_{port}"
    log_paths = [os.path.join(_log_dir, f"rank{r}_of_{stamp}.log") for r in range(world_size)]
    processes = [
        ctx.Process(
            target=_worker_main,
            args=(r, world_size, port, tasks[r], results, list(sys.path), log_paths[r], os.getpid()),
            # Not daemonic: dist_checkpointing's writer starts processes of its own, which daemons may not.
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in processes:
        p.start()
    pool = _Pool(world_size, processes, tasks, results, log_paths)
    ready: set[int] = set()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while len(ready) < world_size:
        try:
            rank, _, _, _ = results.get(timeout=1.0)
            ready.add(rank)
        except queue.Empty:
            dead = [r for r, p in enumerate(processes) if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                pool.kill()
                failed = dead or sorted(set(range(world_size)) - ready)
                raise RankFailure(
                    f"worker rank(s) {failed} of {world_size} did not start within {STARTUP_TIMEOUT_S:.0f}s:\n"
                    + "\n".join(f"--- rank {r} log ---\n{pool.log_tail(r)}" for r in failed)
                ) from None
    return pool


def _pool(world_size: int) -> _Pool:
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _pools[world_size] = _start_pool(world_size)
    return pool


def _discard(world_size: int) -> None:
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.kill()


# atexit runs hooks last-registered-first. multiprocessing.util (imported above) registered its own hook, which
# joins every non-daemonic child, so ours must come later to run first and stop the idle workers; otherwise
# the interpreter would wait on them forever at exit.
@atexit.register
def shutdown() -> None:
    """End every worker this process started (idle ones finish cleanly, the rest are killed with their groups), and
    remove their logs."""
    global _log_dir
    for world_size in list(_pools):
        _pools.pop(world_size).close()
    if _log_dir is not None:
        shutil.rmtree(_log_dir, ignore_errors=True)
        _log_dir = None


def _collect(pool: _Pool, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float):
    """Hand ``fn`` to every rank of ``pool``; return ``(values, errors, most_threads)`` as the ranks report.

    Stops waiting at ``timeout``, or 5 s after the first error; raises when a rank dies without reporting.
    """
    world_size = pool.world_size
    for q in pool.tasks:
        q.put((fn, args, kwargs))
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    most_threads = 0
    deadline = time.monotonic() + timeout
    while len(values) + len(errors) < world_size:
        if errors:
            # Once one rank failed, the others are usually blocked in a collective waiting for it: give them a
            # moment to report, then stop waiting.
            deadline = min(deadline, time.monotonic() + 5)
        try:
            rank, ok, value, threads = pool.results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [r for r, p in enumerate(pool.processes) if not p.is_alive() and r not in values]
            if dead:
                codes = {r: pool.processes[r].exitcode for r in dead}
                raise RankFailure(
                    f"rank(s) {dead} of {world_size} exited without reporting (exit codes {codes}):\n"
                    + "\n".join(f"--- rank {r} log ---\n{pool.log_tail(r)}" for r in dead)
                ) from None
            if time.monotonic() >= deadline:
                break
            continue
        (values if ok else errors)[rank] = value
        most_threads = max(most_threads, threads)
    return values, errors, most_threads


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the per-rank results in rank order.

    ``fn`` must be importable by name (a module-level function) and its results picklable. Raises
    :class:`RankFailure` naming the rank(s) when a body raises, or when any rank is still running after
    ``timeout`` seconds (then with each stuck rank's stack).
    """
    pool = _pool(world_size)
    try:
        values, errors, most_threads = _collect(pool, fn, args, kwargs or {}, timeout)
    except BaseException:
        # A dead rank, or an interruption (Ctrl-C, pytest-timeout's exception): the other ranks may still be
        # running this body, and their results would answer the next test's call. Start afresh.
        _discard(world_size)
        raise
    if errors:
        _discard(world_size)
        first = min(errors)
        raise RankFailure(
            f"test body raised on rank(s) {sorted(errors)} of {world_size}; traceback of rank {first}:\n"
            f"{errors[first]}"
        )
    stuck = [r for r in range(world_size) if r not in values]
    if stuck:
        for r in stuck:
            if pool.processes[r].is_alive():
                os.kill(pool.processes[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        stacks = "\n".join(f"--- rank {r} (stuck) ---\n{pool.log_tail(r)}" for r in stuck)
        _discard(world_size)
        raise RankFailure(
            f"rank(s) {stuck} of {world_size} did not finish within {timeout:.0f}s (finished: "
            f"{sorted(values)}); a rank that never joins a collective leaves the others waiting in it.\n{stacks}"
        )
    if most_threads > MAX_WORKER_THREADS:
        _pools.pop(world_size).close()
    return [pickle.loads(values[r]) for r in range(world_size)]


# The tiny model and data of the parallel-layout tests (tests/test_parallel_training.py) and the checkpoint
# benchmark (bench/checkpoint_io.py).

VOCAB = 128
SEQ = 32


def tiny_gpt(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, vocab_size: int = VOCAB,
             seq_length: int = SEQ, num_layers: int = 4):
    """A 4-layer, 32-wide GPT-2-style megatron-core ``GPTModel`` (local layer spec) for this process's stage."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size, pipeline_dtype=torch.float32,
        # Initialise full weights then split them, so every layout starts from the same numbers.
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab_size,
        max_sequence_length=seq_length, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def counting_batches(generator, micro_batch_size: int, num_microbatches: int):
    """Microbatches of sequences ``start, start+stride, ...`` (mod VOCAB) for causal-LM training."""
    import torch

    for _ in range(num_microbatches):
        start = torch.randint(0, VOCAB, (micro_batch_size, 1), generator=generator)
        stride = torch.randint(1, 4, (micro_batch_size, 1), generator=generator)
        sequence = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        yield {
            "tokens": sequence[:, :-1].contiguous(),
            "labels": sequence[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, SEQ),
            "position_ids": torch.arange(SEQ).expand(micro_batch_size, SEQ).contiguous(),
        }


def tiny_gpt_after_one_step(distributed_optimizer: bool):
    """``(DDP chunks, optimizer)``: :func:`tiny_gpt` on this process's own groups (seed 1234), after one Adam step on
    two counting sequences, so that the optimizer has state to save, load or free.

    Example::

        chunks, optimizer = tiny_gpt_after_one_step(distributed_optimizer=True)
    """
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    initialize_distributed(seed=1234)
    chunks = wrap_model([tiny_gpt()], DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer))
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-3,
                                                        use_distributed_optimizer=distributed_optimizer))
    train_step(lm_forward_step, counting_batches(torch.Generator().manual_seed(0), 2, 1), chunks, optimizer, 1, SEQ, 2)
    return chunks, optimizer


@contextlib.contextmanager
def logged_messages(logger: logging.Logger | str = "rapidformer"):
    """The messages ``logger`` (or the logger of that name) emits inside the block, in a list filled as they come.

    Example::

        with logged_messages() as messages:       # the trainer's logger, "rapidformer"
            trainer.train()
        assert any(m.startswith("successfully loaded checkpoint") for m in messages)

    The handler goes when the block ends, however it ends: a test worker runs many bodies, and a handler one of
    them left behind would keep collecting every later body's messages.
    """
    logger = logging.getLogger(logger) if isinstance(logger, str) else logger
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def recorded_clones():
    """The shapes of the tensors ``Tensor.clone`` copies inside the block, in a list filled as they come.

    Example::

        with recorded_clones() as cloned:
            save_megatron_checkpoint("ckpt", 1, chunks, optimizer, None)
        assert not cloned                          # the save wrote every tensor where it is
    """
    import torch

    cloned, clone = [], torch.Tensor.clone

    def recording(tensor, *args, **kwargs):
        cloned.append(tuple(tensor.shape))
        return clone(tensor, *args, **kwargs)

    torch.Tensor.clone = recording
    try:
        yield cloned
    finally:
        torch.Tensor.clone = clone
