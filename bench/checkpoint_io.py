"""Checkpoint save/load time against writing and reading the same bytes with plain file I/O.

Example::

    python bench/checkpoint_io.py --hidden-size 512 --num-layers 8

Trains a GPT one step in one process (so the Adam state exists), then times our ``save_checkpoint`` /
``load_checkpoint`` (megatron-core dist_checkpointing, torch_dist format, model + optimizer + scheduler) and, as
the floor, one ``write`` + ``fsync`` and one ``readinto`` of as many bytes as the checkpoint holds. Alternates
the two several times and keeps the best of each. Prints ``RESULT {json}`` lines with ratio = ours / plain
(lower is better; 1.0 is the disk's own speed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


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
    from megatron_patch.training.checkpointing import load_checkpoint, save_checkpoint
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
    best = {"save": float("inf"), "load": float("inf"), "write": float("inf"), "read": float("inf")}
    size = 0
    for attempt in range(args.repeats):
        root = os.path.join(work, f"ckpt{attempt}")
        start = time.perf_counter()
        save_checkpoint(root, 1, chunks, optimizer, scheduler, megatron=True)
        best["save"] = min(best["save"], time.perf_counter() - start)
        start = time.perf_counter()
        load_checkpoint(root, chunks, optimizer, scheduler, megatron=True)
        best["load"] = min(best["load"], time.perf_counter() - start)
        size = _dir_bytes(root)
        written, read = _plain_write_read(os.path.join(work, "plain.bin"), bytearray(os.urandom(size)))
        best["write"], best["read"] = min(best["write"], written), min(best["read"], read)
        shutil.rmtree(root)
    shutil.rmtree(work)
    print(f"checkpoint of {size / 1e6:.0f} MB: save {best['save']:.2f}s vs plain write+fsync {best['write']:.2f}s; "
          f"load {best['load']:.2f}s vs plain read {best['read']:.2f}s")
    for what, plain in (("save", "write"), ("load", "read")):
        print("RESULT " + json.dumps({
            "benchmark": f"checkpoint {what} vs plain {plain} of the same bytes (ours / plain)",
            "ratio": round(best[what] / best[plain], 2), "target": "lower is better",
            "note": f"{size / 1e6:.0f} MB, best of {args.repeats}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
