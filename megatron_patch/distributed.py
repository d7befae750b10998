"""Distributed start-up in one place: torchrun's environment -> process group -> megatron-core's parallel state.

Example::

    torchrun --nproc-per-node 2 my_script.py      # my_script.py calls:

    from megatron_patch.distributed import initialize_distributed
    layout = initialize_distributed(tensor_model_parallel_size=2, seed=1234)
    print(layout.rank, layout.data_parallel_size)

NCCL with one GPU per local rank when CUDA is there, gloo on the CPU otherwise (with megatron_patch.compat's
CPU shim applied first). Re-initialising with another layout in the same processes is allowed: the process group
is kept and megatron-core's model-parallel groups are rebuilt, which lets the test harness reuse its workers.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import socket
import sys

import torch

from megatron_patch import compat


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


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (torchrun sets it)") from None


def check_layout(
    world_size: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    context_parallel_size: int = 1,
) -> int:
    """Return the data-parallel size, or raise naming the flags when the sizes do not tile the world.

    Example::

        >>> check_layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        2
    """
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if min(tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size) < 1:
        raise ValueError("--tensor-model-parallel-size, --pipeline-model-parallel-size and "
                         "--context-parallel-size must be at least 1")
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by --tensor-model-parallel-size "
            f"({tensor_model_parallel_size}) x --pipeline-model-parallel-size ({pipeline_model_parallel_size}) x "
            f"--context-parallel-size ({context_parallel_size}) = {model_parallel}; change the sizes or the "
            f"number of processes"
        )
    return world_size // model_parallel


def initialize_distributed(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
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

    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    data_parallel_size = check_layout(
        world_size, tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    )

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"

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
        _destroy_model_parallel_groups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
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
        data_parallel_size=data_parallel_size,
        device=device,
    )


def _destroy_model_parallel_groups() -> None:
    """Forget megatron-core's groups *and* free them.

    ``parallel_state.destroy_model_parallel()`` only drops its references (``parallel_state.py:2085-2234``
    destroys just the gloo data-parallel groups); torch keeps every other group registered, each with its own
    communication threads, so re-initialising in a long-lived process would leak ~30 groups a time.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    c10d = torch.distributed.distributed_c10d
    default = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not default:
            torch.distributed.destroy_process_group(group)


def destroy_distributed() -> None:
    """Tear down megatron-core's groups and the process group (safe to call when nothing was set up)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
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
    exception" (SIGABRT; shared/notes/megatron-core-on-cpu.md, "Torch-native sharding"), which torchrun reports
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
_finished_iterations = 0


def record_progress(finished_iterations: int | None = None) -> None:
    """Note in torchrun's rendezvous store how far this rank got (for ``progress_report``): the iterations it
    finished, or, called without a count, that it computed the gradients of the next one.

    The store lives in the launcher's agent, so it outlives a rank that died; one small write each time.
    """
    global _finished_iterations
    if finished_iterations is not None:
        _finished_iterations = finished_iterations
    milestone = 2 * _finished_iterations + (finished_iterations is None)
    store = torch.distributed.distributed_c10d._get_default_store()
    store.set(_PROGRESS_KEY.format(torch.distributed.get_rank()), str(milestone))


def _describe_milestone(milestone: int) -> str:
    if milestone % 2:
        return f"computed the gradients of iteration {milestone // 2 + 1}"
    return f"finished {milestone // 2} iteration(s)"


def progress_report() -> str:
    """How far each rank got, from ``record_progress``: after a collective timed out, the ranks that got least far
    are the ones that hung or died (their peers wait for them).

    Example::

        progress_report()
        # 'rank 1: finished 1 iteration(s); rank 0: computed the gradients of iteration 2 -> rank 1 fell behind'
    """
    store = torch.distributed.distributed_c10d._get_default_store()
    reached: dict[int, list[int]] = {}
    for rank in range(torch.distributed.get_world_size()):
        key = _PROGRESS_KEY.format(rank)
        reached.setdefault(int(store.get(key)) if store.check([key]) else 0, []).append(rank)
    names = lambda ranks: f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"  # noqa: E731
    report = "; ".join(f"{names(ranks)}: {_describe_milestone(m)}" for m, ranks in sorted(reached.items()))
    if len(reached) > 1:
        report += f" -> {names(reached[min(reached)])} fell behind"
    return report
