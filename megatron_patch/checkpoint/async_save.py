"""``--async-save`` written by a thread of the training process, from tensors that training no longer changes.

Example::

    saves = async_save_queue()          # megatron-core's AsyncCallsQueue, its calls run in threads
    # request: dist_checkpointing.save(..., async_sharded_save=True); returns at once, the files written meanwhile
    saves.schedule_async_request(with_snapshot(request, live_storages(chunks, optimizer)))
    saves.maybe_finalize_async_calls(blocking=False)  # after each step, on every rank: publishes finished saves

megatron-core's ``AsyncCallsQueue`` forks a process for each save (``TemporalAsyncCaller``,
dist_checkpointing/strategies/async_utils.py, ``TemporalAsyncCaller.schedule_async_call``). Training on a CPU keeps its
whole state in host memory, which the fork shares copy-on-write: the first step after it copied every page it wrote (the
weights, the gradients, Adam's moments), which made that step two to four times as long. A thread shares the memory
instead, so the tensors it writes must be ones training does not write: megatron-core's save already copies the model's
parameters (views of DDP's buffer, ``FileSystemWriterAsync.prepare_write_data``'s ``_clone_if_needed``) and builds the
distributed optimizer's state anew, and :func:`with_snapshot` copies whatever else still shares memory with the model or
the optimizer (a plain optimizer's moments, parameters outside DDP's buffer). On a GPU the save's own device-to-host
copy is the snapshot.

The thread runs the same write function the process would (``integrity.write_checksummed``): the files, checksums,
publishing on finalization and the crash safety are the same.
"""

from __future__ import annotations

import threading
from typing import Iterable


def async_save_queue():
    """megatron-core's ``AsyncCallsQueue`` whose calls run in a thread of this process (``ThreadCaller``)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    class ThreadCallsQueue(AsyncCallsQueue):
        def _get_async_caller(self):
            return _thread_caller()

    return ThreadCallsQueue()


def _thread_caller():
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller

    class ThreadCaller(AsyncCaller):
        """``TemporalAsyncCaller`` (strategies/async_utils.py) with a thread where it forks a process; done on every
        rank is agreed the same way (``sync_all_async_calls``, one all-reduce per check)."""

        def __init__(self):
            self.thread: threading.Thread | None = None

        def schedule_async_call(self, async_req) -> None:
            if async_req.async_fn is None:
                return
            args = list(async_req.async_fn_args)
            if async_req.preload_fn:
                args[1] = async_req.preload_fn()
            self.thread = threading.Thread(target=async_req.async_fn, args=args,
                                           kwargs=async_req.async_fn_kwargs or {}, name="async-save", daemon=True)
            self.thread.start()

        def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
            alive = self.thread is not None and self.thread.is_alive()
            if blocking and alive:
                self.thread.join()
                alive = False
            done = not alive if no_dist else self.sync_all_async_calls(int(alive))
            if done:
                self.close()
            return done

        def close(self, abort: bool = False) -> None:
            if self.thread is not None:
                self.thread.join()
                self.thread = None

        def __del__(self):
            pass  # the base class raises here; a finished thread needs no clean-up

    return ThreadCaller()


def live_storages(chunks: Iterable, optimizer) -> set[int]:
    """The addresses of the memory that training writes: the model chunks' parameters and buffers, and each
    optimizer part's state and (fp32 main) parameters."""
    import torch

    from megatron_patch.compat import optimizer_parts

    # Module's own methods: megatron-core's DDP names its gradient buffers ``buffers``.
    tensors = [t for chunk in chunks for t in (*torch.nn.Module.parameters(chunk), *torch.nn.Module.buffers(chunk))]
    for _, inner in optimizer_parts(optimizer):
        if inner is None:
            continue
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu"}


def with_snapshot(request, live: set[int]):
    """``request`` (the save's ``AsyncRequest``) with its staging of the write buckets in host memory
    (``preload_fn``) followed by a copy of each tensor that still shares memory with ``live``
    (:func:`live_storages`), so that the steps taken while the files are written cannot change what they hold."""
    stage = request.preload_fn or (lambda: request.async_fn_args[1])

    def preload():
        buckets = []
        for file_name, storage_key, (bytes_data, tensor_data) in stage():
            tensor_data = [(item, tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor)
                           for item, tensor in tensor_data]
            buckets.append((file_name, storage_key, (bytes_data, tensor_data)))
        return buckets

    return request._replace(preload_fn=preload)
