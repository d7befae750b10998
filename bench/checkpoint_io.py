"""Checkpoint save/load time against writing and reading the same bytes with plain file I/O.

Example::

    python bench/checkpoint_io.py --hidden-size 512 --num-layers 8

Trains a GPT one step in one process (so the Adam state exists), then times the trainer's save and load
(``save_megatron_checkpoint`` / ``load_megatron_checkpoint``: megatron-core dist_checkpointing, torch_dist format,
model + optimizer + scheduler) and, as the floor, one ``write`` + ``fsync`` and one ``readinto`` of as many bytes as
the checkpoint holds. Alternates them several times and keeps the best of each. Prints ``RESULT {json}`` lines with
ratio = ours / plain (lower is better; 1.0 is the disk's own speed), and what the checksums cost: the save against
the same save with its CRC-32 pass over the files (``checkpoint.integrity.checksum_files``) stubbed out, that pass's
own share of the save, and the load against ``verify_checksums=False``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from unittest import mock


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _plain_write_read(path: str, payload: bytearray) -> tuple[float, float]:
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    written = time.perf_counter() - start
    start = time.perf_counter()
    with open(path, "rb") as f:
        f.readinto(payload)
    return written, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.testing import counting_batches
    from megatron_patch.checkpoint import integrity
    from megatron_patch.training.backends.megatron import load_megatron_checkpoint, save_megatron_checkpoint
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    initialize_distributed(seed=1234)
    seq = 32
    model_config = get_model_config("tiny-gpt2", num_layers=args.num_layers, hidden_size=args.hidden_size,
                                    num_attention_heads=8, seq_length=seq, max_position_embeddings=seq)
    chunks = wrap_model(build_model_chunks(model_config, ParallelConfig(), 128),
                        DistributedDataParallelConfig(use_distributed_optimizer=True))
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True))
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-4, min_lr=0.0, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
    import torch

    train_step(lm_forward_step, counting_batches(torch.Generator().manual_seed(0), 2, 1), chunks, optimizer, 1,
               seq, 2)

    work = tempfile.mkdtemp(prefix="bench_checkpoint_io_")
    best = dict.fromkeys(["save", "save unchecked", "crc pass", "load", "load unverified", "write", "read"],
                         float("inf"))

    def timed(what, fn, *fn_args, **fn_kwargs):
        start = time.perf_counter()
        fn(*fn_args, **fn_kwargs)
        best[what] = min(best[what], time.perf_counter() - start)

    checksum_files, crc_seconds = integrity.checksum_files, [0.0]

    def timed_checksum_files(paths):
        start = time.perf_counter()
        found = checksum_files(paths)
        crc_seconds[0] += time.perf_counter() - start
        return found

    unchecked = {"bytes": 0, "crc32": "00000000"}
    root = os.path.join(work, "ckpt")

    def save_checked_then_load(attempt):
        crc_seconds[0] = 0.0
        with mock.patch.object(integrity, "checksum_files", timed_checksum_files):
            timed("save", save_megatron_checkpoint, root, 1, chunks, optimizer, scheduler)
        best["crc pass"] = min(best["crc pass"], crc_seconds[0])
        loads = [("load", True), ("load unverified", False)]
        for what, verify in loads[::-1] if attempt % 2 else loads:
            timed(what, load_megatron_checkpoint, root, chunks, optimizer, scheduler, verify_checksums=verify)
        size = _dir_bytes(root)
        shutil.rmtree(root)
        return size

    def save_unchecked():
        with mock.patch.object(integrity, "checksum_files", lambda paths: [unchecked] * len(paths)):
            timed("save unchecked", save_megatron_checkpoint, root, 1, chunks, optimizer, scheduler)
        shutil.rmtree(root)

    for attempt in range(args.repeats):
        # Each first in turn (the loads too), so that neither always follows the plain write's writeback.
        if attempt % 2:
            save_unchecked()
            size = save_checked_then_load(attempt)
        else:
            size = save_checked_then_load(attempt)
            save_unchecked()
        written, read = _plain_write_read(os.path.join(work, "plain.bin"), bytearray(os.urandom(size)))
        best["write"], best["read"] = min(best["write"], written), min(best["read"], read)
    shutil.rmtree(work)
    print(f"checkpoint of {size / 1e6:.0f} MB: save {best['save']:.2f}s (its CRC-32 pass {best['crc pass']:.2f}s; "
          f"without it {best['save unchecked']:.2f}s) vs plain write+fsync {best['write']:.2f}s; "
          f"load {best['load']:.2f}s (without verifying checksums {best['load unverified']:.2f}s) vs plain read "
          f"{best['read']:.2f}s")
    note = f"{size / 1e6:.0f} MB, best of {args.repeats}"
    for what, against, benchmark in (
            ("save", "write", "checkpoint save vs plain write of the same bytes (ours / plain)"),
            ("load", "read", "checkpoint load vs plain read of the same bytes (ours / plain)"),
            ("save", "save unchecked", "checkpoint save with checksums vs without (the checksums' cost)"),
            ("crc pass", "save", "checkpoint save's CRC-32 pass / the whole save (timed inside the same saves)"),
            ("load", "load unverified", "checkpoint load verifying checksums vs --no-verify-checksums")):
        print("RESULT " + json.dumps({"benchmark": benchmark, "ratio": round(best[what] / best[against], 3),
                                      "target": "lower is better", "note": note}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
