"""Benchmark each command's start-up against the interpreter's own and the imports it cannot avoid.

    PYTHONPATH=. python bench/startup.py             # best of 3 runs each
    PYTHONPATH=. python bench/startup.py --quick     # best of 1, to check that it runs

Times, each in a fresh process and as the best of `--repeats` runs (the one the machine's other load disturbed
least): the floors ``python -c pass``, ``python -c "import argparse"`` (an argparse CLI that imports nothing else),
``python -c "import torch"`` and ``python -c "import megatron.core"``; then ``--help`` of ``megatron-patch``, of
its ``preprocess-data``, ``make-corpus`` and ``convert`` and of ``rapidformer``, a whole ``preprocess-data`` run
(200 stdlib documents, GPT2BPETokenizer, 1 worker), and a whole tiny ``train`` job on its output (the launcher,
torchrun's agent and one rank: two iterations and a save). A ``--help`` row's ratio is its time over
``import argparse``'s, target <= 10 (about 1 s on a machine where the interpreter starts in 0.1 s) with none of
torch, megatron-core and transformers imported; the real run needs megatron-core (its IndexedDatasetBuilder writes
the files, its tokenizer base is ours'), so its ratio is over ``import megatron.core``'s, target <= 1.5; so is the
training job's (no target: its rank imports megatron-core after the launcher imported torch). Each note says which
of the three the command imported (from one more run under ``python -X importtime``: the launcher's own, for
``train``).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_patch.data.corpus import write_stdlib_corpus  # noqa: E402

HEAVY = ("torch", "megatron.core", "transformers")
# What the console scripts run (setup.py's entry points): megatron-patch and rapidformer.
CLI = ["-m", "megatron_patch.cli"]
RAPIDFORMER = ["-m", "megatron_patch.training.launcher"]
HELP_TARGET = 10
RUN_TARGET = 1.5


def _run(arguments: list[str], importtime: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONWARNINGS="ignore")
    flags = ["-X", "importtime"] if importtime else []
    result = subprocess.run([sys.executable, *flags, *arguments], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result


def best_seconds(arguments: list[str], repeats: int, fresh: str | None = None) -> float:
    """The best time of ``repeats`` runs, each without the directory ``fresh`` (what a run before it wrote)."""
    times = []
    for _ in range(repeats):
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)
        start = time.perf_counter()
        _run(arguments)
        times.append(time.perf_counter() - start)
    return min(times)


def imported(arguments: list[str]) -> list[str]:
    """Those of HEAVY that a run of `arguments` imports (each -X importtime line ends in a module's name)."""
    lines = _run(arguments, importtime=True).stderr.splitlines()
    modules = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    return [name for name in HEAVY if name in modules]


def preprocess_run(work: str) -> list[str]:
    """The arguments of a small whole preprocess-data run, its inputs written under `work`."""
    from megatron_patch.data.train_tokenizer import train_tokenizer

    corpus = os.path.join(work, "corpus.jsonl")
    write_stdlib_corpus(corpus, max_docs=200, max_doc_chars=1500)
    tokenizer = os.path.join(work, "gpt2-bpe")
    train_tokenizer("gpt2-bpe", corpus, tokenizer, vocab_size=1000)
    return CLI + ["preprocess-data", "--input", corpus, "--output-prefix", os.path.join(work, "out", "corpus"),
                  "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(tokenizer, "vocab.json"),
                  "--merge-file", os.path.join(tokenizer, "merges.txt"), "--append-eod", "--workers", "1"]


def train_run(work: str) -> list[str]:
    """The arguments of a tiny whole training job on what ``preprocess_run`` wrote: one rank, two iterations and a
    save under ``work/train``, as the suite's CLI tests and a first try of a recipe run it."""
    tokenizer = os.path.join(work, "gpt2-bpe")
    return CLI + ["train", "--task", "pretraining", "--nproc-per-node", "1", "--num-layers", "2", "--hidden-size", "32",
                  "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
                  "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(tokenizer, "vocab.json"),
                  "--merge-file", os.path.join(tokenizer, "merges.txt"), "--split", "98,2,0",
                  "--data-path", os.path.join(work, "out", "corpus_text_document"), "--micro-batch-size", "2",
                  "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
                  "--save", os.path.join(work, "train", "checkpoints"), "--save-interval", "2",
                  "--log-dir", os.path.join(work, "train", "logs")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per command; the best counts")
    parser.add_argument("--quick", action="store_true", help="one run per command")
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as work:
        floors = {name: best_seconds(["-c", code], repeats) for name, code in [
            ("pass", "pass"), ("argparse", "import argparse"), ("torch", "import torch"),
            ("megatron.core", "import megatron.core"),
        ]}
        print("floors (best of {}): {}".format(
            repeats, ", ".join(f"import {n}: {s:.2f} s" if n != "pass" else f"python -c pass: {s:.2f} s"
                               for n, s in floors.items())), flush=True)
        helps = {"megatron-patch --help": CLI + ["--help"], "rapidformer --help": RAPIDFORMER + ["--help"]}
        for command in ("preprocess-data", "make-corpus", "convert"):
            helps[f"megatron-patch {command} --help"] = CLI + [command, "--help"]
        rows = [(name, arguments, "argparse", HELP_TARGET, None) for name, arguments in helps.items()]
        rows.append(("megatron-patch preprocess-data, 200 documents, GPT2BPETokenizer, 1 worker",
                     preprocess_run(work), "megatron.core", RUN_TARGET, None))
        # After the preprocessing row, whose output it trains on.
        rows.append(("megatron-patch train, tiny GPT, 1 rank, 2 iterations and a save", train_run(work),
                     "megatron.core", "lower is better", os.path.join(work, "train")))
        for name, arguments, floor, target, fresh in rows:
            seconds = best_seconds(arguments, repeats, fresh)
            heavy = imported(arguments)
            print(f"{name}: {seconds:.2f} s, imports {', '.join(heavy) or 'none of ' + ', '.join(HEAVY)}",
                  flush=True)
            print("RESULT " + json.dumps({
                "benchmark": f"start-up: {name} vs python -c 'import {floor}' (time ratio)",
                "ratio": round(seconds / floors[floor], 2),
                "target": target if isinstance(target, str) else f"<= {target}" + (
                    ", none of " + "/".join(HEAVY) + " imported" if floor == "argparse" else ""),
                "note": f"{seconds:.2f} s vs {floors[floor]:.2f} s; python -c pass {floors['pass']:.2f} s, "
                        f"import torch {floors['torch']:.2f} s; imports: {', '.join(heavy) or 'none of them'}",
            }), flush=True)


if __name__ == "__main__":
    main()
