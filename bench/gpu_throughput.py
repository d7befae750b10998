"""bf16 training throughput on one GPU: tokens/s, TFLOP/s, MFU and peak memory per configuration.

Example::

    python bench/gpu_throughput.py --out bench/results/gpu_throughput.md     # on a GPU machine
    python bench/gpu_throughput.py --dry-run --out /tmp/table.md             # CPU-sized, same code path (CI)

On a GPU each case runs in its own process (fresh memory statistics and compile caches): the ~1B LLaMA-style model
at sequence length 2048 with the local layer spec and our SDPA attention (PyTorch's choice of kernel, and its math
kernel), with and without selective recompute and torch.compile'd fusions, BERT-large, and a mixture-of-experts
model (Mixtral-8x7B's layer shape, 3 of its 32 layers). FLOPs follow megatron-core's formula
(``megatron_patch.model.flops``; for MoE only the top-k experts a token passes), so MFU is comparable with
Megatron's published figures (peak 989 TFLOP/s bf16 dense on H100/H200). The table is rewritten after every case,
so a run stopped by ``gpu_throughput.sh``'s time limit keeps the rows it finished. The dry run's tiny cases share
one process: its start-up (importing torch and megatron-core) took most of each case's time on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from typing import NoReturn

PEAK_TFLOPS = 989.0


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    recompute: str | None = None
    fused: bool = True
    num_layers: int | None = None
    """Fewer layers than the named model has, to fit one GPU (the dry run's tiny model keeps its own)."""
    attention: str | None = None
    """A ``torch.nn.attention.SDPBackend`` name the attention must use ("math", "flash_attention", ...); None lets
    PyTorch choose."""


# Budget on an H200, whole process: ~15 s imports and CUDA/NCCL start, ~5-10 s building the model and optimizer,
# 20-40 s of torch.compile on the first steps (the fused cases), then 13 steps of ~270 TFLOP (LLaMA, MoE) or
# ~70 TFLOP (BERT) each at an assumed 250-400 TFLOP/s: ~10-15 s. That is about 60 s per LLaMA case, 40 s for BERT
# and 75 s for the MoE case, ~5 minutes in all. The most telling cases come first: a run stopped by
# gpu_throughput.sh's time limit keeps the rows it finished.
CASES = [
    Case("llama-1b", "llama3.2-1b", 2048, 4, 4),
    Case("llama-1b no-fusions", "llama3.2-1b", 2048, 4, 4, fused=False),
    Case("bert-large", "bert-large", 512, 16, 4),
    # Mixtral's full expert shape (8 experts of 4096 x 14336, top-2) at EP=1, so the expert GEMMs are the real ones.
    # bf16 weights, fp32 grads, fp32 main weights and Adam's two moments are 18 bytes a parameter (the
    # distributed optimizer shards nothing at DP=1), and torch's foreach AdamW (no apex or TE there) adds one
    # fp32 temporary in its step: 22 bytes. 3 layers are 4.62B parameters (1.45B active): ~95 GiB at the optimizer
    # step, activations (~10 GiB at 2 x 4096 tokens) freed by then, leaving room on a 139 GiB H200. 4 layers
    # (6.07B, ~124 GiB) would leave too little for the allocator's fragmentation. 32k tokens an iteration as in
    # the LLaMA rows.
    Case("mixtral moe 3 layers", "mixtral-8x7b", 4096, 2, 4, num_layers=3),
    # SDPAttention lets PyTorch pick its kernel (flash on a GPU in bf16); the math kernel materialises the scores,
    # as megatron-core's unfused local attention does: what the flash kernel is worth.
    Case("llama-1b sdpa-math", "llama3.2-1b", 2048, 4, 4, attention="math"),
    Case("llama-1b selective-recompute", "llama3.2-1b", 2048, 4, 4, recompute="selective"),
]
# The same cases shrunk to run on a CPU in seconds: what CI runs so the script cannot rot.
DRY_MODELS = {"llama3.2-1b": "tiny-llama", "bert-large": "tiny-bert", "mixtral-8x7b": "tiny-mixtral"}
WARMUP_ITERS, TIMED_ITERS = 3, 10


def _batches(family: str, vocab: int, micro_batch_size: int, seq_length: int, count: int, device):
    import torch

    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        tokens = torch.randint(0, vocab, (micro_batch_size, seq_length + 1), generator=generator)
        batch = {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(micro_batch_size, seq_length),
            "position_ids": torch.arange(seq_length).expand(micro_batch_size, seq_length),
        }
        if family == "bert":
            batch["padding_mask"] = torch.ones(micro_batch_size, seq_length, dtype=torch.bool)
            batch["tokentype_ids"] = torch.zeros(micro_batch_size, seq_length, dtype=torch.long)
        yield {key: value.to(device, non_blocking=True).contiguous() for key, value in batch.items()}


def _bert_forward_step(data_iterator, model):
    from megatron_patch.training.step import lm_loss_func

    batch = next(data_iterator)
    lm_loss, _ = model(batch["tokens"], batch["padding_mask"], tokentype_ids=batch["tokentype_ids"],
                       lm_labels=batch["labels"])
    return lm_loss, lambda output: lm_loss_func(batch["loss_mask"], output)


def run_case(case: Case, dry_run: bool) -> dict:
    """Train ``case`` for a few iterations in this process and measure it."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks, padded_vocab_size
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.flops import expert_parameters, num_floating_point_operations, num_parameters
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    on_gpu = torch.cuda.is_available() and not dry_run
    layout = initialize_distributed(seed=1234)
    model_name = DRY_MODELS[case.model] if dry_run else case.model
    layers = {} if dry_run or case.num_layers is None else {"num_layers": case.num_layers}
    model_config = get_model_config(model_name, **layers)
    seq_length = min(case.seq_length, model_config.max_positions) if dry_run else case.seq_length
    micro_batch_size = 2 if dry_run else case.micro_batch_size
    parallel_config = ParallelConfig(precision="bf16" if on_gpu else "fp32", recompute_granularity=case.recompute,
                                     fused_kernels=case.fused)
    vocab = padded_vocab_size(model_config.vocab_size, model_config.make_vocab_size_divisible_by, 1)
    chunks = wrap_model(build_model_chunks(model_config, parallel_config, vocab),
                        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-4, bf16=on_gpu, clip_grad=1.0,
                                                        use_distributed_optimizer=True))
    forward_step = _bert_forward_step if model_config.family == "bert" else lm_forward_step
    warmup, timed = (1, 2) if dry_run else (WARMUP_ITERS, TIMED_ITERS)

    def step():
        batches = _batches(model_config.family, model_config.vocab_size, micro_batch_size, seq_length,
                           case.num_microbatches, layout.device)
        return train_step(forward_step, batches, chunks, optimizer, num_microbatches=case.num_microbatches,
                          seq_length=seq_length, micro_batch_size=micro_batch_size)

    with _attention_kernel(case.attention):
        for _ in range(warmup):
            step()
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(timed):
            stats = step()
        if on_gpu:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / timed
    global_batch = micro_batch_size * case.num_microbatches
    # Counts only the top-k experts each token passes (flops.py), so a MoE row's MFU is that of its active part.
    tflops = num_floating_point_operations(model_config, global_batch, seq_length, vocab) / seconds / 1e12
    m = model_config
    size = f"{num_parameters(m, vocab) / 1e9:.2f}B"
    if m.num_moe_experts:
        idle_experts = m.num_layers * expert_parameters(m) * (1 - m.moe_router_topk / m.num_moe_experts)
        size += f", {(num_parameters(m, vocab) - idle_experts) / 1e9:.2f}B active"
    return {
        "case": case.name,
        "model": f"{model_name}{f' {m.num_layers} layers' if layers else ''} ({size})",
        "seq": seq_length,
        "global batch": global_batch,
        "tokens/s": round(global_batch * seq_length / seconds),
        "TFLOP/s": _rounded(tflops, on_gpu),
        "MFU %": _rounded(100 * tflops / PEAK_TFLOPS, on_gpu),
        "peak GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1) if on_gpu else None,
        "loss": round(stats.loss, 3),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (dry run)",
    }


def _attention_kernel(name: str | None):
    """The context that restricts scaled_dot_product_attention to the kernel ``name``; no restriction for None."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, name.upper()))


def _rounded(value: float, on_gpu: bool) -> float:
    # A tiny dry-run model makes ~1e-4 TFLOP/s on a busy CPU: three significant digits keep it from rounding to 0.
    return round(value, 1) if on_gpu else float(f"{value:.3g}")


def run_cases_process(cases: list[Case], dry_run: bool) -> NoReturn:
    """Run ``cases`` one after another as this process's whole work, print a row for each that finishes, and end
    the process the way trainer ranks end (status 1 if any case failed).

    Example::

        run_cases_process(CASES[:1], dry_run=True)     # prints "ROW {...}", never returns

    A normal interpreter exit after gloo work sometimes aborts ("terminate called without an active exception",
    docs/megatron-core-on-cpu.md item 11), which made a finished case look failed; ``exit_rank`` flushes the rows
    and leaves with ``os._exit``. The process is a one-rank world of its own: it listens on a free port, not on
    whatever MASTER_PORT says or initialize_distributed's default 29500, either of which another job may hold.
    """
    from megatron_patch.distributed import exit_rank, free_port

    os.environ["MASTER_PORT"] = str(free_port())
    status = 0
    try:
        for case in cases:
            try:
                print("ROW " + json.dumps(run_case(case, dry_run)), flush=True)
            except Exception:  # noqa: BLE001  (reported; the next case still runs)
                traceback.print_exc()
                status = 1
    except BaseException:  # noqa: BLE001  (Ctrl-C, SystemExit: reported before the hard exit)
        traceback.print_exc()
        status = 1
    exit_rank(status)


def write_table(path: str, rows: list[dict]) -> None:
    """Replace ``path`` with the Markdown table of ``rows`` (written aside and renamed: never half a table)."""
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        f.write(markdown_table(rows))
    os.replace(tmp, path)


def markdown_table(rows: list[dict]) -> str:
    """Rows of equal keys as a Markdown table."""
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if row[key] is None else str(row[key]) for key in header) + " |"
              for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Markdown file for the results table")
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU: checks the script runs")
    # internal: run these cases in this process, print their rows as JSON
    parser.add_argument("--case", action="append", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = {case.name: case for case in CASES}
    if args.case:
        run_cases_process([cases[name] for name in args.case], args.dry_run)
    rows, failures = [], []
    for group in [CASES] if args.dry_run else [[case] for case in CASES]:
        command = [sys.executable, os.path.abspath(__file__), "--out", args.out]
        command += [flag for case in group for flag in ("--case", case.name)] + (["--dry-run"] if args.dry_run else [])
        result = subprocess.run(command, capture_output=True, text=True)
        finished = {row["case"]: row for row in (json.loads(line[4:]) for line in result.stdout.splitlines()
                                                 if line.startswith("ROW "))}
        for case in group:
            if case.name not in finished:
                failures.append(case.name)
                print(f"{case.name}: FAILED\n{result.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(finished[case.name])
            print(json.dumps(rows[-1]), flush=True)
            write_table(args.out, rows)
        if result.returncode and len(finished) == len(group):
            failures.append(f"the process of {', '.join(case.name for case in group)}")
            print(f"every case wrote its row, but the process exited {result.returncode}\n{result.stderr[-3000:]}",
                  file=sys.stderr)
    if rows:
        print(markdown_table(rows))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
