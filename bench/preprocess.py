"""Benchmark preprocess_data against the tokenizer's own ceiling, Megatron-LM's tool, and corpus size.

    PYTHONPATH=. python bench/preprocess.py --mb 30 --workers 1 2 8
    PYTHONPATH=. python bench/preprocess.py --quick     # 2 MB in 1 MB slices, one round: checks that it runs

(At `--quick` sizes start-up outweighs the work, so the ratios say nothing about throughput.)

Builds a stdlib corpus of `--mb` MB and GPT-2 BPE / HuggingFace tokenizers trained on it, then
times these methods at each of `--workers` N, each in a fresh forked process:
- ceiling: the tokenizer's fastest batch encode (`tokenize_batch_flat`, ids straight into the
  `.bin` dtype) over the same texts, already decoded in memory, no JSON, no writing: the better of
  its Rust thread pool with N threads and N processes each encoding a shard;
- ours: the `toolkits/preprocess_data.py` command (its `main()`) with `--workers N`, end to end:
  tokenizer loading and worker start-up (in every slice) included, interpreter start-up not;
- Megatron-LM (GPT-2 BPE only): a re-creation of Megatron-LM's `tools/preprocess_data.py` with N
  workers: its `Encoder` under `multiprocessing.Pool.imap(..., 32)`, one `add_document` per line,
  and its pure-Python GPT-2 BPE; the files it writes are checked equal to ours.
The corpus is cut into `--slice-mb` slices and, `--rounds` times over, every method runs on each
slice, back to back and each time in another order, so that the load other jobs put on a shared
machine falls on the methods alike. Each ratio is the median over those (round, slice) samples of
the two methods' MB/s in the same sample; MB per CPU-second, which load moves less, is printed
beside it as a cross-check.
N above this machine's cores is simulated: N processes share the cores, so wall time says nothing
and the ratio is of MB per CPU-second over the whole process tree, which is the wall ratio on N
free cores as long as ours' main process (reading, dispatching, writing) keeps up with N workers;
the note gives its CPU time as a share of one worker's, which must stay under 100%. The ceiling
there is the N processes alone (see `ceiling` in `run`).
Memory: peak RSS of the command's whole process tree on a 1/10 corpus and on the full one, each
run as a subprocess.
"""

import argparse
import io
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest_data import ReferenceGPT2BPE  # noqa: E402
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

from megatron_patch.data.corpus import write_stdlib_corpus  # noqa: E402
from megatron_patch.data.preprocess import main as preprocess_main  # noqa: E402
from megatron_patch.data.train_tokenizer import train_tokenizer  # noqa: E402
from megatron_patch.tokenizer import build_tokenizer  # noqa: E402

CEILING_BATCH = 4096  # texts per tokenizer call in the ceiling: large batches are the backend's fastest path
CEILING_TARGET = 0.95
MEGATRON_LM_TARGET = 4.0


def _in_child(function, *args):
    """Run `function(*args)` in a forked process; return (wall seconds, CPU seconds of that process,
    CPU seconds of the processes it waited for). Every method starts from the same state this way."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def target():
        start = time.perf_counter()
        try:
            function(*args)
        except BaseException:
            send.send(("error", traceback.format_exc()))
            return
        wall = time.perf_counter() - start
        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        send.send(("ok", wall, *(u.ru_utime + u.ru_stime for u in usage)))

    process = context.Process(target=target)
    process.start()
    send.close()  # so that a child that dies without answering reads as EOF here
    try:
        message = receive.recv()
    except EOFError:
        message = ("error", "the process died")
    process.join()
    if message[0] != "ok":
        raise RuntimeError(f"{getattr(function, '__name__', function)} failed:\n{message[1]}")
    return message[1:]


def _encode_all(tokenizer, texts):
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    for i in range(0, len(texts), CEILING_BATCH):
        tokenizer.tokenize_batch_flat(texts[i : i + CEILING_BATCH], dtype)


def ceiling_threads(tokenizer, texts, workers):
    """The batch encode on the backend's own thread pool of `workers` threads."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    os.environ["RAYON_NUM_THREADS"] = str(workers)  # read when the pool starts, in this fresh fork
    _encode_all(tokenizer, texts)


def ceiling_processes(tokenizer, texts, workers):
    """The batch encode in `workers` forked processes, each over every `workers`-th text."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    children = []
    for shard in range(workers):
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                _encode_all(tokenizer, texts[shard::workers])
                status = 0
            finally:
                os._exit(status)
        children.append(pid)
    # Waiting reaps them, which adds their CPU time to RUSAGE_CHILDREN.
    if any(os.waitpid(pid, 0)[1] != 0 for pid in children):
        raise RuntimeError("a ceiling process failed")


def ours(argv):
    """`toolkits/preprocess_data.py argv`, its progress and summary kept for an error message."""
    sys.stderr = io.StringIO()
    if preprocess_main(argv) != 0:
        raise RuntimeError(sys.stderr.getvalue())


class MegatronLMGPT2(ReferenceGPT2BPE):
    """The per-call work of Megatron-LM's `gpt2_tokenization.GPT2Tokenizer.encode` over the same
    BPE: each pre-token becomes byte symbols through a join, its merged form is cached as one
    space-separated string that is split again on every occurrence, and each piece is looked up
    in the special tokens, then the vocab."""

    def __init__(self, vocab_file, merge_file):
        super().__init__(vocab_file, merge_file)
        self.merged: dict[str, str] = {}
        self.special_tokens: dict[str, int] = {}

    def encode(self, text):
        pieces = []
        for token in self.PATTERN.findall(text):
            symbols = "".join(self.byte_symbol[b] for b in token.encode("utf-8"))
            if symbols not in self.merged:
                self.merged[symbols] = " ".join(self.bpe(list(symbols)))
            pieces.extend(self.merged[symbols].split(" "))
        return [self.special_tokens[p] if p in self.special_tokens else self.vocab.get(p, 0) for p in pieces]


class MegatronLMEncoder:
    """Megatron-LM's `Encoder` for one json key, no sentence splitting, `--append-eod`: each pool
    worker builds its own tokenizer, then turns one JSON line into ids and sentence lengths."""

    tokenizer: MegatronLMGPT2

    def __init__(self, vocab_file, merge_file):
        self.files = (vocab_file, merge_file)

    def initializer(self):
        MegatronLMEncoder.tokenizer = MegatronLMGPT2(*self.files)

    def encode(self, line):
        ids = MegatronLMEncoder.tokenizer.encode(json.loads(line)["text"])
        lengths = [len(ids)] if ids else []
        if ids:
            ids.append(MegatronLMEncoder.tokenizer.vocab["<|endoftext|>"])
            lengths[-1] += 1
        return ids, lengths, len(line)


def megatron_lm(corpus, prefix, vocab_file, merge_file, workers):
    """Megatron-LM's `Partition.process_json_file` with one partition: lines to the pool in chunks
    of 32, results added in order, one `add_document` each."""
    encoder = MegatronLMEncoder(vocab_file, merge_file)
    vocab_size = len(MegatronLMGPT2(vocab_file, merge_file).vocab)
    pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    with open(corpus, encoding="utf-8") as f:
        for ids, lengths, _ in pool.imap(encoder.encode, f, 32):
            builder.add_document(ids, lengths)
    builder.finalize(prefix + ".idx")
    pool.close()
    pool.join()


def run_command(corpus, prefix, tokenizer_args, workers):
    """Run the command in a subprocess; return (the peak RSS of its process tree in MB, wall
    seconds including interpreter start-up and imports)."""
    command = [sys.executable, os.path.join(ROOT, "toolkits", "preprocess_data.py"), "--input", corpus,
               "--output-prefix", prefix, "--workers", str(workers), "--append-eod", "--log-interval", "100000000",
               *tokenizer_args]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    parent, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)]))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    err = process.stderr.read()
    if process.returncode != 0:
        raise RuntimeError(err)
    return peak / 1e6, seconds


def _same_files(a, b):
    for suffix in (".bin", ".idx"):
        with open(a + suffix, "rb") as fa, open(b + suffix, "rb") as fb:
            if fa.read() != fb.read():
                return False
    return True


def _write_slices(corpus, directory, slice_bytes):
    """Cut `corpus` at line ends into files of about `slice_bytes`; return [(path, texts, bytes)]."""
    slices, lines, size = [], [], 0

    def flush():
        path = os.path.join(directory, f"slice{len(slices)}.jsonl")
        with open(path, "wb") as f:
            f.writelines(lines)
        slices.append((path, [json.loads(line)["text"] for line in lines], size))
        lines.clear()

    with open(corpus, "rb") as f:
        for line in f:
            lines.append(line)
            size += len(line)
            if size >= slice_bytes:
                flush()
                size = 0
    if lines:
        flush()
    return slices


def _result(benchmark, ratio, target, note):
    print("RESULT " + json.dumps({"benchmark": benchmark, "ratio": round(ratio, 2), "target": target,
                                  "note": note}), flush=True)


def run(args, work) -> None:
    """Build the corpus and tokenizers under `work`, time every method, print the figures."""
    corpus, small = os.path.join(work, "corpus.jsonl"), os.path.join(work, "small.jsonl")
    write_stdlib_corpus(corpus, max_bytes=int(args.mb * 1e6), max_doc_chars=4000)
    write_stdlib_corpus(small, max_bytes=int(args.mb * 1e5), max_doc_chars=4000)
    for kind in ("gpt2-bpe", "huggingface"):
        train_tokenizer(kind, small, os.path.join(work, kind), args.vocab_size)
    slices = _write_slices(corpus, work, args.slice_mb * 1e6)
    nbytes = os.path.getsize(corpus)
    cores = os.cpu_count() or 1
    print(f"corpus: {nbytes / 1e6:.1f} MB, {sum(len(t) for _, t, _ in slices)} documents in {len(slices)} slices; "
          f"workers={args.workers}, cores={cores}, rounds={args.rounds}, load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)

    gpt2 = {"vocab_file": os.path.join(work, "gpt2-bpe", "vocab.json"),
            "merge_file": os.path.join(work, "gpt2-bpe", "merges.txt")}
    cases = {
        "GPT2BPETokenizer": (gpt2, ["--vocab-file", gpt2["vocab_file"], "--merge-file", gpt2["merge_file"]]),
        "HuggingFaceTokenizer": ({"tokenizer_model": os.path.join(work, "huggingface")},
                                 ["--tokenizer-model", os.path.join(work, "huggingface")]),
    }
    tokenizers = {name: build_tokenizer(name, **options) for name, (options, _) in cases.items()}

    def methods(path, texts, workers):
        """(tokenizer, method) -> the call that runs it on one slice with `workers` workers."""
        calls = {}
        for name, (_, flags) in cases.items():
            argv = ["--input", path, "--output-prefix", os.path.join(work, f"ours_{name}"), "--tokenizer-type", name,
                    *flags, "--workers", str(workers), "--append-eod", "--log-interval", "100000000"]
            calls[(name, "threads")] = (ceiling_threads, tokenizers[name], texts, workers)
            calls[(name, "processes")] = (ceiling_processes, tokenizers[name], texts, workers)
            calls[(name, "ours")] = (ours, argv)
        calls[("GPT2BPETokenizer", "megatron-lm")] = (
            megatron_lm, path, os.path.join(work, "megatron_lm"), gpt2["vocab_file"], gpt2["merge_file"], workers)
        return calls

    # One sample per (round, slice, workers): {method: (MB/s, MB per CPU-second, main CPU s, children CPU s)}.
    # Within a sample the methods run back to back, each time in another order, so that paired ratios see the
    # same load.
    samples: dict[int, list[dict]] = {workers: [] for workers in args.workers}
    for round_index in range(args.rounds):
        for slice_index, (path, texts, size) in enumerate(slices):
            for workers in args.workers:
                calls = methods(path, texts, workers)
                keys = list(calls)
                shift = (round_index * len(slices) + slice_index) % len(keys)
                sample = {}
                for key in keys[shift:] + keys[:shift]:
                    wall, cpu_self, cpu_children = _in_child(*calls[key])
                    sample[key] = (size / wall / 1e6, size / (cpu_self + cpu_children) / 1e6, cpu_self, cpu_children)
                samples[workers].append(sample)
                if not _same_files(os.path.join(work, "ours_GPT2BPETokenizer_text_document"),
                                   os.path.join(work, "megatron_lm")):
                    raise RuntimeError(f"{path}: the Megatron-LM re-creation and preprocess_data wrote different files")
        print(f"round {round_index + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.1f}", flush=True)

    note = f"{nbytes / 1e6:.0f} MB corpus"
    for workers in args.workers:
        rows = samples[workers]
        simulated = workers > cores
        # Simulated: wall time is shared out among more processes than cores, so MB per CPU-second decides.
        column = 1 if simulated else 0
        measure = "MB per CPU-second" if simulated else "MB/s"

        def median(key, column=0):
            return statistics.median(sample[key][column] for sample in rows)

        def paired(numerator, denominator, column=0):
            """The median over samples of numerator / denominator, measured back to back."""
            return statistics.median(numerator(s, column) / denominator(s, column) for s in rows)

        def method(name, kind):
            return lambda sample, column: sample[(name, kind)][column]

        def ceiling(name):
            if simulated:
                # A thread pool's CPU-seconds say nothing of its speed on N cores (GPT-2 BPE's is mostly
                # Python, which the GIL serialises): N processes are the ceiling there.
                return method(name, "processes")
            return lambda sample, column: max(sample[(name, "threads")][column],
                                              sample[(name, "processes")][column])

        label = f"{workers} workers" + (f" (simulated on {cores} cores)" if simulated else "")
        how = f"median of {len(rows)} back-to-back pairs"
        if simulated:
            # The main process keeps N workers fed if its CPU time is below one worker's share.
            main_share = paired(lambda s, c: s[("GPT2BPETokenizer", "ours")][2],
                                lambda s, c: s[("GPT2BPETokenizer", "ours")][3] / workers)
            how += f"; ratio of MB per CPU-second; ours' main process used {main_share:.0%} of one worker's CPU"
        for name in cases:
            ratio = paired(method(name, "ours"), ceiling(name), column)
            cpu_ratio = paired(method(name, "ours"), method(name, "processes"), column=1)
            print(f"{name}, {label}: ceiling {median((name, 'threads'), column):.2f} {measure} with threads, "
                  f"{median((name, 'processes'), column):.2f} with processes | preprocess_data "
                  f"{median((name, 'ours'), column):.2f} | ratio {ratio:.2f} (target >= {CEILING_TARGET}) | "
                  f"MB per CPU-second ratio to the processes {cpu_ratio:.2f}", flush=True)
            _result(f"preprocess_data {name}, {label} vs tokenizer ceiling ({measure} ratio)", ratio,
                    f">= {CEILING_TARGET}", f"{note}, {how}; MB per CPU-second ratio {cpu_ratio:.2f}")
        baseline = ("GPT2BPETokenizer", "megatron-lm")
        speedup = paired(method("GPT2BPETokenizer", "ours"), method(*baseline), column)
        cpu_speedup = paired(method("GPT2BPETokenizer", "ours"), method(*baseline), column=1)
        print(f"Megatron-LM's tool re-created (Encoder + Pool.imap, pure-Python GPT-2 BPE), {label}: "
              f"{median(baseline, column):.2f} {measure} | preprocess_data {speedup:.2f}x (target >= "
              f"{MEGATRON_LM_TARGET}), {cpu_speedup:.2f}x per CPU-second", flush=True)
        _result(f"preprocess_data GPT2BPETokenizer vs Megatron-LM's tool re-created, {label} each (speed-up)",
                speedup, f">= {MEGATRON_LM_TARGET}",
                f"{note}, {how}, identical output files; per CPU-second {cpu_speedup:.2f}x")

    workers = min(max(args.workers), cores)
    flags = ["--tokenizer-type", "GPT2BPETokenizer", *cases["GPT2BPETokenizer"][1]]
    small_peak, _ = run_command(small, os.path.join(work, "mem_small"), flags, workers)
    large_peak, seconds = run_command(corpus, os.path.join(work, "mem_large"), flags, workers)
    print(f"memory, {workers} workers: {os.path.getsize(small) / 1e6:.1f} MB corpus -> peak {small_peak:.0f} MB; "
          f"{nbytes / 1e6:.1f} MB corpus -> peak {large_peak:.0f} MB; ratio {large_peak / small_peak:.2f} for "
          f"{nbytes / os.path.getsize(small):.0f}x the data | that run end to end, interpreter start-up "
          f"included: {nbytes / seconds / 1e6:.2f} MB/s", flush=True)
    _result("preprocess_data peak memory, 10x corpus vs 1x (ratio)", large_peak / small_peak, "far below 10",
            f"{small_peak:.0f} -> {large_peak:.0f} MB, {workers} workers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=30, help="corpus size in MB")
    parser.add_argument("--slice-mb", type=float, default=10, help="the methods take turns on slices of this size")
    parser.add_argument("--rounds", type=int, default=2, help="times every method runs on every slice")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 8],
                        help="worker counts; those above the machine's cores are simulated (see above)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--quick", action="store_true", help="--mb 2 --slice-mb 1 --rounds 1: checks that it runs")
    args = parser.parse_args()
    if args.quick:
        args.mb, args.slice_mb, args.rounds = 2, 1, 1
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as work:
        run(args, work)


if __name__ == "__main__":
    main()
