"""Distributed start-up in one place: torchrun's environment -> process group -> megatron-core's parallel state.

Example::

    torchrun --nproc-per-node 2 my_script.py      # my_script.py calls:

    from megatron_patch.distributed import initialize_distributed
    layout = initialize_distributed(tensor_model_parallel_size=2, seed=1234)
    print(layout.rank, layout.data_parallel_size)

NCCL with one GPU per local rank when CUDA is there, gloo on the CPU otherwise (with megatron_patch.compat's
CPU shim applied first). Re-initialising with another layout in the same processes is allowed: the process group
is kept and megatron-core's model-parallel groups are rebuilt, which lets the test harness reuse its workers.
A conversion in a script's own process runs in ``one_rank_world()``, which leaves no group behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import multiprocessing
import os
import socket
import sys
import time

import torch

from megatron_patch import compat
from megatron_patch.layout import check_layout


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the (dp, pp, cp, tp) grid megatron-core built."""

    rank: int
    world_size: int
    local_rank: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    context_parallel_size: int
    expert_model_parallel_size: int
    data_parallel_size: int
    device: torch.device


def free_port() -> int:
    """A TCP port that is free on this host now, for a rendezvous (``MASTER_PORT``) of local processes.

    Example::

        >>> 1024 <= free_port() < 65536
        True
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env_int(name: str, default: int) -> int:
    """torchrun's integer variable ``name`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), ``default`` when unset.

    Example::

        env_int("WORLD_SIZE", 1)    # 4 under torchrun --nproc-per-node 4; 1 for a plain python script.py
    """
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (torchrun sets it)") from None


def initialize_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    seed: int = 1234,
    timeout_minutes: float = 30.0,
) -> ParallelLayout:
    """Start (or reuse) the process group from torchrun's variables and build megatron-core's groups.

    Example::

        >>> layout = initialize_distributed(tensor_model_parallel_size=1)
        >>> layout.world_size
        1

    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` default to a single process and ``MASTER_ADDR``/``MASTER_PORT`` to
    localhost:29500, so plain ``python script.py`` works. ``seed`` seeds torch and megatron-core's
    tensor-parallel RNG tracker (``model_parallel_cuda_manual_seed``) the way Megatron-LM does.
    """
    compat.apply()
    from megatron.core import parallel_state, tensor_parallel

    rank = env_int("RANK", 0)
    world_size = env_int("WORLD_SIZE", 1)
    local_rank = env_int("LOCAL_RANK", 0)
    data_parallel_size = check_layout(
        world_size, tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size, context_parallel_size=context_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        from megatron_patch.startup import quiet_cpu_noise

        device = torch.device("cpu")
        backend = "gloo"
        quiet_cpu_noise()  # every rank on CPU: training's, convert verify's, a user script's

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29500")
        torch.distributed.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    elif torch.distributed.get_world_size() != world_size:
        raise RuntimeError(
            f"a process group of {torch.distributed.get_world_size()} ranks already exists, but WORLD_SIZE is "
            f"{world_size}"
        )

    if parallel_state.model_parallel_is_initialized():
        compat.destroy_model_parallel_and_free_groups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,  # a float: timedelta(minutes=...) takes it
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelLayout(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        data_parallel_size=data_parallel_size,
        device=device,
    )


def start_one_rank_world() -> bool:
    """Start a process group of this process alone when there is none and torchrun's ``WORLD_SIZE`` names no larger
    world (whose ranks meet through ``initialize_distributed``); whether it started one.

    Example::

        start_one_rank_world()    # True in a plain ``python convert.py``; False in a torchrun rank
    """
    if torch.distributed.is_initialized() or env_int("WORLD_SIZE", 1) != 1:
        return False
    # A store in this process's memory: a world of one has no one to meet, so it binds no port (29500 may be
    # another job's) and sets no MASTER_PORT that a launch from this process would inherit.
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                         store=torch.distributed.HashStore(), rank=0, world_size=1)
    global ran_a_process_group
    ran_a_process_group = True
    return True


ran_a_process_group = False
"""Whether this process started a world of its own (``start_one_rank_world``), destroyed since or not: after its
gloo collectives the interpreter's exit may still abort, so the command ends through ``exit_rank`` (cli.exit_with)."""


@contextlib.contextmanager
def one_rank_world():
    """Run the block (or, as a decorator, the function) in a process group of this process alone when there is
    none; on the way out that group and megatron-core's are destroyed and torch's generators are as they were, so a
    conversion followed by training in the same process finds nothing of it (a torchrun rank keeps its world).

    Example::

        with one_rank_world():
            model = build_reference_model(config, padded_vocab_size=128)
            load_into_reference_model(model, "ckpt", info)
    """
    started = start_one_rank_world()
    try:
        # initialize_distributed seeds torch's generators (and megatron-core's) for the conversion's model.
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            yield
    finally:
        if started:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
            if torch.distributed.is_initialized():  # the block may have destroyed it
                torch.distributed.destroy_process_group()


def sum_over_data_parallel(values: list, device=None) -> list[float]:
    """``values`` (numbers or 0-d tensors) summed over the data-parallel ranks, in float64, with one host sync
    and no collective at DP=1.

    Example::

        loss_sum, tokens = sum_over_data_parallel([loss.detach(), 512])
    """
    from megatron.core import parallel_state

    total = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    group = parallel_state.get_data_parallel_group()
    if group.size() > 1:
        torch.distributed.all_reduce(total, group=group)
    return total.tolist()


def exit_rank(status: int) -> None:
    """End a torchrun rank for good: barrier (on success), flush, stop helper processes, ``os._exit(status)``.

    Example::

        exit_rank(run_my_rank())     # never returns

    After gloo collectives a normal interpreter exit sometimes aborts with "terminate called without an active
    exception" (SIGABRT; docs/megatron-core-on-cpu.md, item 11), which torchrun reports
    as a failed rank. ``os._exit`` skips multiprocessing's atexit hook, which would stop dist_checkpointing's
    spawned Manager; left alone it outlives the rank, holding the launcher's stdout open (a caller reading it
    waits forever), so its children are stopped here.
    """
    if torch.distributed.is_initialized() and status == 0:
        torch.distributed.barrier()
    for child in multiprocessing.active_children():
        child.terminate()
        child.join()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


_PROGRESS_KEY = "megatron_patch/progress/{}"
_FAILED_KEY = "megatron_patch/failed/{}"  # "waited": a collective timed out there; "failed": any other error
_REPORTER_KEY = "megatron_patch/reporter"
_REPORTED_KEY = "megatron_patch/reported"
_finished_iterations = 0
_iteration_ends: list[float] = []  # monotonic times of the last two finished iterations


def record_progress(finished_iterations: int | None = None) -> None:
    """Note in torchrun's rendezvous store how far this rank got (for ``progress_report``): the iterations it
    finished, or, called without a count, that it computed the gradients of the next one.

    The store lives in the launcher's agent, so it outlives a rank that died; one small write each time.
    """
    global _finished_iterations
    if finished_iterations is not None:
        _finished_iterations = finished_iterations
        _iteration_ends[:] = [*_iteration_ends[-1:], time.monotonic()]
    milestone = 2 * _finished_iterations + (finished_iterations is None)
    compat.default_store().set(_PROGRESS_KEY.format(torch.distributed.get_rank()), str(milestone))


def _describe_milestone(milestone: int) -> str:
    if milestone % 2:
        return f"computed the gradients of iteration {milestone // 2 + 1}"
    return f"finished {milestone // 2} iteration(s)"


def _timed_out(error: BaseException) -> bool:
    # gloo: "Timed out waiting 15000ms for recv operation to complete" (gloo/transport/tcp/unbound_buffer.cc).
    return "timed out" in str(error).lower()


def report_failure(error: BaseException) -> str | None:
    """Called by a rank that failed with ``error``: mark it in the store, and when a collective timed out, return
    the report on which rank stopped making progress, from one rank (the first to time out; None on the others).

    Example::

        except Exception as error:
            report = report_failure(error)
            # 'rank 1: finished 3 iteration(s); rank 0: finished 3 iteration(s), timed out waiting -> rank 1 fell
            #  behind (stopped making progress: no collective timed out there)'

    How far each rank got cannot tell a stopped rank from its peers: stopped between two iterations, it finished as
    many as the peer now waiting for it. What tells them apart is that a waiting rank's collective times out and a
    stopped one's does not. The healthy ranks block within about one iteration of each other (every iteration ends
    in collectives all ranks join), so their timeouts fire within that time of the first: the first waits two
    iterations' time (measured here) and 2 s more for their marks, and the ranks still unmarked are the ones that
    stopped. The others wait for its report before they exit: the launcher stops every rank once one has exited.
    """
    if not torch.distributed.is_initialized():
        return None
    rank = torch.distributed.get_rank()
    try:
        store = compat.default_store()
        waited = _timed_out(error)
        store.set(_FAILED_KEY.format(rank), "waited" if waited else "failed")
        if not waited:
            return None
        iteration = _iteration_ends[-1] - _iteration_ends[0] if len(_iteration_ends) == 2 else 0.0
        patience = 2.0 + 2 * iteration
        if store.add(_REPORTER_KEY, 1) > 1:
            store.wait([_REPORTED_KEY], datetime.timedelta(seconds=patience + 10))
            return None
        marks = [_FAILED_KEY.format(r) for r in range(torch.distributed.get_world_size())]
        deadline = time.monotonic() + patience
        while not store.check(marks) and time.monotonic() < deadline:
            time.sleep(0.05)
        report = progress_report()
        store.set(_REPORTED_KEY, "1")
        return report
    except (RuntimeError, torch.distributed.DistError):  # the store went away with the launcher: nothing to add
        return None


def progress_report() -> str:
    """How far each rank got (``record_progress``) and how it failed (``report_failure``), and which ranks fell
    behind: those no collective timed out on while their peers' did, or else the ones that got least far.

    Example::

        progress_report()
        # 'rank 1: finished 1 iteration(s); rank 0: computed the gradients of iteration 2, timed out waiting
        #  -> rank 1 fell behind (stopped making progress: no collective timed out there)'
    """
    store = compat.default_store()
    states: dict[tuple[int, str], list[int]] = {}
    for rank in range(torch.distributed.get_world_size()):
        progress, failed = _PROGRESS_KEY.format(rank), _FAILED_KEY.format(rank)
        milestone = int(store.get(progress)) if store.check([progress]) else 0
        state = store.get(failed).decode() if store.check([failed]) else ""
        states.setdefault((milestone, state), []).append(rank)
    names = lambda ranks: f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"  # noqa: E731
    what = {"": "", "waited": ", timed out waiting", "failed": ", failed"}
    report = "; ".join(f"{names(ranks)}: {_describe_milestone(m)}{what[state]}"
                       for (m, state), ranks in sorted(states.items()))
    stopped = sorted(r for (_, state), ranks in states.items() if not state for r in ranks)
    if stopped and any(state == "waited" for _, state in states):
        return report + f" -> {names(stopped)} fell behind (stopped making progress: no collective timed out there)"
    milestones = {m for m, _ in states}
    if len(milestones) > 1:
        behind = sorted(r for (m, _), ranks in states.items() if m == min(milestones) for r in ranks)
        report += f" -> {names(behind)} fell behind"
    return report
