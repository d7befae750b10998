"""Benchmark hf-to-megatron against just reading the safetensors files, and its peak memory against model size.

    PYTHONPATH=. python bench/convert.py            # ~1B LLaMA-shaped random model (hidden 2048, 16 layers)
    PYTHONPATH=. python bench/convert.py --quick    # a small one, to check that it runs

Writes a random LLaMA-shaped model (safetensors, bf16 by default) straight from tensors (no transformers model
is built), then measures, each in a fresh process with 2 threads:
- read: every tensor of the files read into memory, one at a time (the floor any conversion pays);
- convert: ``megatron-patch convert hf-to-megatron --no-verify`` to torch_dist, end to end;
- start-up: a process that only imports what the conversion imports (torch, megatron-core and its
  dist_checkpointing, our CPU shim) and exits: the part of the conversion no file I/O can remove.
Peak memory is the converting process's own RSS (and its anonymous part, RssAnon: memory it allocated, not file
pages it maps), sampled every 20 ms; both runs include interpreter and library start-up. Prints
``RESULT {json}`` lines: time ratio convert / read (target < 2), the same beyond start-up ((convert - start-up)
/ the read's own reading time; the conversion reads while it imports megatron-core, so this may fall below 1), and
peak RSS / model size (target < 1.5).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_READ = """
import sys, time
from safetensors import safe_open
import glob
start = time.perf_counter()
total = 0
for path in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    with safe_open(path, "pt") as f:
        for name in f.keys():
            total += f.get_tensor(name).clone().numel()
print(time.perf_counter() - start)
"""

_START_UP = """
from megatron_patch import compat
from megatron_patch.convert.startup import import_megatron_core
import_megatron_core()
import megatron_patch.convert.core, megatron.core.dist_checkpointing
compat.apply()
"""


def write_model(out_dir: str, hidden: int, layers: int, ffn: int, heads: int, groups: int, vocab: int,
                dtype: str) -> int:
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (groups * head_dim, hidden),
            p + "self_attn.v_proj.weight": (groups * head_dim, hidden),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        })
    total, shard, index, shard_bytes = 0, {}, {}, 0
    names = list(shapes)

    def flush(k):
        save_file(shard, os.path.join(out_dir, f"model-{k:05d}.safetensors"), metadata={"format": "pt"})
        index.update({n: f"model-{k:05d}.safetensors" for n in shard})

    k = 0
    for name in names:
        tensor = (torch.randn(shapes[name]) * 0.02).to(torch_dtype)
        shard[name] = tensor
        shard_bytes += tensor.numel() * tensor.element_size()
        total += tensor.numel() * tensor.element_size()
        if shard_bytes > 1 << 30:
            flush(k)
            k, shard, shard_bytes = k + 1, {}, 0
    if shard:
        flush(k)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=layers,
                  hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=groups,
                  max_position_embeddings=4096, vocab_size=vocab, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, dtype=dtype)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return total


def _rss(process: psutil.Process) -> tuple[int, int]:
    """(RSS, RssAnon) in bytes, from /proc/PID/status."""
    fields = {}
    with open(f"/proc/{process.pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["RssAnon"]


def run_measured(command: list[str]) -> tuple[float, int, int, str]:
    """Wall time, peak RSS and peak RssAnon of the process (sampled every 20 ms in a thread), and its stdout."""
    peaks = [0, 0]

    def sample(process: psutil.Process, done: threading.Event):
        while not done.is_set():
            try:
                peaks[:] = [max(p, v) for p, v in zip(peaks, _rss(process))]
            except (OSError, KeyError, psutil.Error):
                pass
            done.wait(0.02)

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "2"}
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    done = threading.Event()
    sampler = threading.Thread(target=sample, args=(psutil.Process(proc.pid), done))
    sampler.start()
    out, _ = proc.communicate()
    elapsed = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{command} failed with exit status {proc.returncode}")
    return elapsed, peaks[0], peaks[1], out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model (hidden 512, 4 layers)")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=16)
    parser.add_argument("--ffn-hidden-size", type=int, default=5632)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--num-query-groups", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each command; the fastest counts")
    args = parser.parse_args()
    if args.quick:
        args.hidden_size, args.num_layers, args.ffn_hidden_size, args.num_attention_heads = 512, 4, 1408, 8
        args.repeats = 1
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        hf = os.path.join(work, "hf")
        os.makedirs(hf)
        size = write_model(hf, args.hidden_size, args.num_layers, args.ffn_hidden_size, args.num_attention_heads,
                           args.num_query_groups, args.vocab_size, args.dtype)
        params = size // (2 if args.dtype == "bfloat16" else 4)
        print(f"model: {size / 1e9:.2f} GB ({args.dtype}), {params / 1e9:.2f}B parameters", flush=True)
        # Interleaved repeats, each figure the fastest of its runs: on a shared machine the slow runs measure the
        # neighbours, and interleaving gives every command the same chances.
        runs = {"read": [], "convert": [], "start-up": []}
        for repeat in range(args.repeats):
            out_dir = os.path.join(work, f"mcore{repeat}")
            runs["read"].append(run_measured([sys.executable, "-c", _READ, hf]))
            runs["convert"].append(run_measured([
                sys.executable, "-m", "megatron_patch.convert.cli", "hf-to-megatron", "--hf-dir", hf,
                "--save-dir", out_dir, "--no-verify", "--no-progress"]))
            runs["start-up"].append(run_measured([sys.executable, "-c", _START_UP]))
            shutil.rmtree(out_dir)
        (read_s, read_rss, read_anon), (convert_s, rss, anon), (start_up_s, _, _) = (
            (min(r[0] for r in runs[k]), max(r[1] for r in runs[k]), max(r[2] for r in runs[k]))
            for k in ("read", "convert", "start-up"))
        read_only = min(float(out.strip().splitlines()[-1]) for *_, out in runs["read"])
        print(f"read:     {read_s:.1f} s ({read_only:.1f} s of it reading), peak RSS {read_rss / 1e9:.2f} GB "
              f"(anonymous {read_anon / 1e9:.2f} GB)")
        print(f"convert:  {convert_s:.1f} s, peak RSS {rss / 1e9:.2f} GB (anonymous {anon / 1e9:.2f} GB)")
        print(f"start-up: {start_up_s:.1f} s (interpreter, torch, megatron-core)")
        shape = f"{params / 1e9:.2f}B {args.dtype} LLaMA-shaped, {size / 1e9:.2f} GB"
        print("RESULT " + json.dumps({
            "benchmark": "hf-to-megatron time vs reading the safetensors (convert / read, both with start-up)",
            "ratio": round(convert_s / read_s, 2), "target": "< 2",
            "note": f"{shape}; {convert_s:.1f} s vs {read_s:.1f} s ({convert_s / read_only:.1f}x the bare "
                    f"{read_only:.1f} s read)"}), flush=True)
        print("RESULT " + json.dumps({
            "benchmark": "hf-to-megatron time beyond library start-up vs the bare read",
            "ratio": round((convert_s - start_up_s) / read_only, 2), "target": "< 2",
            "note": f"{shape}; ({convert_s:.1f} - {start_up_s:.1f} s start-up) vs {read_only:.1f} s"}), flush=True)
        print("RESULT " + json.dumps({
            "benchmark": "hf-to-megatron peak RSS vs model size",
            "ratio": round(rss / size, 2), "target": "< 1.5",
            "note": f"{shape}; peak RSS {rss / 1e9:.2f} GB, anonymous {anon / 1e9:.2f} GB, reading alone "
                    f"{read_rss / 1e9:.2f} GB"}), flush=True)


if __name__ == "__main__":
    main()
