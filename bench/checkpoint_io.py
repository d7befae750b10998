"""Checkpoint save/load time against writing and reading the same bytes with plain file I/O, and the training step
while an ``--async-save`` is written.

Example::

    python bench/checkpoint_io.py --hidden-size 512 --num-layers 8

Trains a GPT one step in one process (so the Adam state exists), then times the trainer's save and load
(``save_megatron_checkpoint`` / ``load_megatron_checkpoint``: megatron-core dist_checkpointing, torch_dist format,
model + optimizer + scheduler, checksummed, published by rename) and, as the floor, one ``write`` + ``fsync`` and
one ``readinto`` of as many bytes as the checkpoint holds. Both reads start from the disk, not the page cache
(``POSIX_FADV_DONTNEED`` on every file first): a resume reads a checkpoint another process wrote, and the trainer's
save writes its data files around the cache. Alternates them several times and keeps the best of each.
Prints ``RESULT {json}`` lines with ratio = ours / plain (lower is better; 1.0 is the disk's own speed); what the
checksums cost: the save against the same save with its CRC-32 (``integrity.crc32``, taken as the files are written)
stubbed out, and the load against ``verify_checksums=False``; and the median training step while an asynchronous
save (``checkpoint.async_save.async_save_queue``, as ``--async-save`` runs it) is in flight against the median step
without one, each step followed by the trainer's ``maybe_finalize_async_calls(blocking=False)``, beside the same
steps while a thread at the save writer's priority (nice 19) does nothing but write and ``fsync`` as many bytes: the
slowdown any background write brings on this machine, the floor for the row before it; and what an asynchronous
save costs training in all (its blocking part and the steps' slowdown) against a synchronous save. The distributed
optimizer's state is in the default format, Megatron-LM's ``dp_reshardable`` (loads at the saved tensor/pipeline
layout); beside it, the same save, load and async save's blocking part in the ``fully_reshardable`` format
(``--dist-ckpt-optim-fully-reshardable``, loads at any layout), the default before issue 39.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from unittest import mock


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _evict(path: str) -> None:
    """Drop ``path``'s files (written and synced) from the page cache, so that the next read goes to the disk."""
    files = [path] if os.path.isfile(path) else [os.path.join(root, name) for root, _, names in os.walk(path)
                                                 for name in names]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _write_synced(path: str, payload: bytearray) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def _plain_write_read(path: str, payload: bytearray) -> tuple[float, float]:
    start = time.perf_counter()
    _write_synced(path, payload)
    written = time.perf_counter() - start
    _evict(path)
    start = time.perf_counter()
    with open(path, "rb") as f:
        f.readinto(payload)
    return written, time.perf_counter() - start


def _background_write(path: str, payload: bytearray) -> threading.Thread:
    """A started thread that writes ``payload`` to ``path`` and syncs it, at the priority of an ``--async-save``'s
    writer (``integrity.write_checksummed``: nice 19, which on Linux applies to the calling thread)."""

    def write():
        os.nice(19)
        _write_synced(path, payload)

    thread = threading.Thread(target=write, name="plain-background-write")
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.startup import import_libraries

    import_libraries()  # as a training rank imports them, which leaves the collector's generations as a rank has them
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_patch.checkpoint import integrity
    from megatron_patch.checkpoint.async_save import async_save_queue
    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.testing import SEQ, counting_batches
    from megatron_patch.checkpoint.megatron import load_megatron_checkpoint, save_megatron_checkpoint
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="steps timed without a save, per repeat")
    args = parser.parse_args(argv)

    initialize_distributed(seed=1234)
    model_config = get_model_config("tiny-gpt2", num_layers=args.num_layers, hidden_size=args.hidden_size,
                                    num_attention_heads=8, seq_length=SEQ, max_position_embeddings=SEQ)
    chunks = wrap_model(build_model_chunks(model_config, ParallelConfig(), 128),
                        DistributedDataParallelConfig(use_distributed_optimizer=True))
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True))
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-4, min_lr=0.0, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
    batches = torch.Generator().manual_seed(0)
    saves = async_save_queue()

    def step() -> float:
        """One training step as the trainer takes it with --async-save; its seconds."""
        start = time.perf_counter()
        train_step(lm_forward_step, counting_batches(batches, 2, 1), chunks, optimizer, 1, SEQ, 2)
        saves.maybe_finalize_async_calls(blocking=False)
        return time.perf_counter() - start

    step()
    work = tempfile.mkdtemp(prefix="bench_checkpoint_io_")
    best = dict.fromkeys(["save", "save unchecked", "load", "load unverified", "write", "read",
                          "save fully_reshardable", "load fully_reshardable"], float("inf"))

    def timed(what, fn, *fn_args, **fn_kwargs):
        start = time.perf_counter()
        fn(*fn_args, **fn_kwargs)
        best[what] = min(best[what], time.perf_counter() - start)

    root = os.path.join(work, "ckpt")

    def save_checked_then_load(attempt):
        timed("save", save_megatron_checkpoint, root, 1, chunks, optimizer, scheduler)
        loads = [("load", True), ("load unverified", False)]
        for what, verify in loads[::-1] if attempt % 2 else loads:
            _evict(root)
            timed(what, load_megatron_checkpoint, root, chunks, optimizer, scheduler, verify_checksums=verify)
        size = _dir_bytes(root)
        shutil.rmtree(root)
        return size

    def save_unchecked():
        with mock.patch.object(integrity, "crc32", lambda data, value=0: 0):
            timed("save unchecked", save_megatron_checkpoint, root, 1, chunks, optimizer, scheduler)
        shutil.rmtree(root)

    def fully_reshardable():
        """The save, load and async save's blocking part with the optimizer state gathered per parameter;
        returns the checkpoint's size."""
        timed("save fully_reshardable", save_megatron_checkpoint, root, 1, chunks, optimizer, scheduler,
              fully_reshardable=True)
        _evict(root)
        timed("load fully_reshardable", load_megatron_checkpoint, root, chunks, optimizer, scheduler)
        size = _dir_bytes(root)
        shutil.rmtree(root)
        start = time.perf_counter()
        save_megatron_checkpoint(root, 2, chunks, optimizer, scheduler, async_queue=saves, fully_reshardable=True)
        blocked_fully_reshardable.append(time.perf_counter() - start)
        saves.maybe_finalize_async_calls(blocking=True)
        shutil.rmtree(root)
        return size

    alone, in_flight, blocked, beside_plain, blocked_fully_reshardable = [], [], [], [], []
    for attempt in range(args.repeats):
        # Each first in turn (the loads too), so that neither always follows the plain write's writeback.
        if attempt % 2:
            save_unchecked()
            size = save_checked_then_load(attempt)
        else:
            size = save_checked_then_load(attempt)
            save_unchecked()
        size_fully_reshardable = fully_reshardable()
        payload = bytearray(os.urandom(size))
        written, read = _plain_write_read(os.path.join(work, "plain.bin"), payload)
        best["write"], best["read"] = min(best["write"], written), min(best["read"], read)
        alone += [step() for _ in range(args.steps)]
        start = time.perf_counter()
        save_megatron_checkpoint(root, 2, chunks, optimizer, scheduler, async_queue=saves)
        blocked.append(time.perf_counter() - start)
        while saves.get_num_unfinalized_calls():
            in_flight.append(step())
        shutil.rmtree(root)
        writing = _background_write(os.path.join(work, "plain.bin"), payload)
        beside_plain.append(step())  # one at least: a small write may end before the first step would start
        while writing.is_alive():
            beside_plain.append(step())
        writing.join()
    saves.close()
    shutil.rmtree(work)
    step_alone, step_saving = statistics.median(alone), statistics.median(in_flight)
    step_beside_plain = statistics.median(beside_plain)
    # What an asynchronous save costs training in all: its blocking part plus what the steps it overlapped took beyond
    # the median step, per save; a synchronous save costs training its whole time.
    async_cost = (sum(blocked) + sum(in_flight) - len(in_flight) * step_alone) / args.repeats
    print(f"checkpoint of {size / 1e6:.0f} MB: save {best['save']:.2f}s (without checksums "
          f"{best['save unchecked']:.2f}s) vs plain write+fsync {best['write']:.2f}s; load {best['load']:.2f}s "
          f"(without verifying checksums {best['load unverified']:.2f}s) vs plain read {best['read']:.2f}s; "
          f"step {step_alone * 1e3:.0f} ms, {step_saving * 1e3:.0f} ms over {len(in_flight)} steps while "
          f"{args.repeats} async saves were written (each blocked training {min(blocked):.2f}s to "
          f"{max(blocked):.2f}s before going to the background)")
    note = f"{size / 1e6:.0f} MB, best of {args.repeats}"
    for what, against, benchmark, target in (
            ("save", "write", "checkpoint save vs plain write of the same bytes (ours / plain)", 1.3),
            ("load", "read", "checkpoint load vs plain read of the same bytes (ours / plain)", 1.5),
            ("save", "save unchecked", "checkpoint save with checksums vs without (the checksums' cost)",
             "lower is better"),
            ("load", "load unverified", "checkpoint load verifying checksums vs --no-verify-checksums",
             "lower is better")):
        print("RESULT " + json.dumps({"benchmark": benchmark, "ratio": round(best[what] / best[against], 3),
                                      "target": target, "note": note}), flush=True)
    print("RESULT " + json.dumps({
        "benchmark": "training time an --async-save blocks before going to the background (seconds, best of "
                     f"{args.repeats})", "ratio": round(min(blocked), 3), "target": 0.15,
        "note": f"{min(blocked):.2f}s to {max(blocked):.2f}s; --dist-ckpt-optim-fully-reshardable "
                f"{min(blocked_fully_reshardable):.2f}s"}), flush=True)
    for what, against, ours in (("save fully_reshardable", "write", "save"),
                                ("load fully_reshardable", "read", "load")):
        print("RESULT " + json.dumps({
            "benchmark": f"checkpoint {ours} vs plain I/O of the same bytes, the optimizer state fully reshardable "
                         "(--dist-ckpt-optim-fully-reshardable, loads at any TP/PP)",
            "ratio": round(best[what] / best[against], 3), "target": "none (the alternative to the default)",
            "note": f"{best[what]:.2f}s vs the default's {best[ours]:.2f}s, {size_fully_reshardable / 1e6:.0f} MB vs "
                    f"{size / 1e6:.0f} MB (best of {args.repeats})"}),
              flush=True)
    print("RESULT " + json.dumps({
        "benchmark": "training step while an --async-save is written vs without (median step, ours / alone)",
        "ratio": round(step_saving / step_alone, 3), "target": 1.05,
        "note": f"{len(in_flight)} steps in flight, {len(alone)} alone, their mean "
                f"{statistics.mean(in_flight) / statistics.mean(alone):.3f}x; the save's blocking part "
                f"{min(blocked):.2f}s not counted"}), flush=True)
    print("RESULT " + json.dumps({
        "benchmark": "training step while a background thread at the save writer's priority writes and syncs as "
                     "many bytes vs without (median step; this machine's floor for the row above)",
        "ratio": round(step_beside_plain / step_alone, 3), "target": "none (the floor)",
        "note": f"{len(beside_plain)} steps in flight; the async save's steps are "
                f"{step_saving / step_beside_plain:.3f}x these"}), flush=True)
    print("RESULT " + json.dumps({
        "benchmark": "training time an --async-save costs (blocking part + slowdown of the steps in flight) vs a "
                     "synchronous save's time", "ratio": round(async_cost / best["save"], 3),
        "target": "lower is better",
        "note": f"{async_cost:.2f}s per save vs {best['save']:.2f}s, mean of {args.repeats}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
