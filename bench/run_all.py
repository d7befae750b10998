"""Every CPU benchmark in one run, one table of ratios.

Example::

    python bench/run_all.py              # full sizes (minutes)
    python bench/run_all.py --quick      # small sizes, to check that everything runs
    python bench/run_all.py --suite      # and the test suite's time from a fresh clone (~30 min more)

Each benchmark is a script in this folder that prints ``RESULT {"benchmark", "ratio", "target", "note"}`` lines;
they run one after another (never concurrently: they would time each other) and their ratios, each measured
within its own run, are collected into one Markdown table. Ratios, not absolute times, because these machines
are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# script -> (full-size arguments, quick arguments)
BENCHMARKS = {
    "startup.py": ([], ["--quick"]),
    "preprocess.py": (["--mb", "30"], ["--quick"]),
    "train_overhead.py": ([], ["--quick"]),
    "data_loading.py": (["--iters", "60"], ["--iters", "6"]),
    "convert.py": ([], ["--quick"]),
    "checkpoint_io.py": ([], ["--hidden-size", "128", "--num-layers", "2", "--repeats", "1"]),
}
# Run only with --suite (or --only suite_time.py): the whole test suite, ~30 minutes on 2 cores.
SLOW = {"suite_time.py": ([], ["--quick"])}


def run_benchmark(script: str, arguments: list[str]) -> tuple[list[dict], str]:
    """Run one benchmark script; return its RESULT rows and, when it failed, the tail of its output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(HERE),
                                                                   os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, os.path.join(HERE, script), *arguments], capture_output=True,
                            text=True, env=env)
    rows = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    failure = "" if result.returncode == 0 and rows else (result.stdout + result.stderr)[-2000:]
    return rows, failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks that every benchmark runs")
    parser.add_argument("--only", nargs="*", help="run only these scripts (e.g. preprocess.py)")
    parser.add_argument("--suite", action="store_true", help="also time the test suite from a fresh clone (slow)")
    args = parser.parse_args(argv)
    table = ["| benchmark | ratio | target | note |", "|---|---|---|---|"]
    failed = []
    for script, (full, quick) in {**BENCHMARKS, **SLOW}.items():
        if (args.only and script not in args.only) or (not args.only and script in SLOW and not args.suite):
            continue
        print(f"running {script} ...", flush=True)
        rows, failure = run_benchmark(script, quick if args.quick else full)
        if failure:
            failed.append(script)
            print(f"{script} FAILED:\n{failure}", file=sys.stderr)
        table += [f"| {r['benchmark']} | {r['ratio']} | {r['target']} | {r.get('note', '')} |" for r in rows]
    print("\n".join(table))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
