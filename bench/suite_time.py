"""The test suite's pytest time from a fresh clone, against the 15 minutes CI may spend on it.

    PYTHONPATH=. python bench/suite_time.py          # ~30 min on 2 cores: clones HEAD and runs the README's command
    PYTHONPATH=. python bench/suite_time.py --quick  # the same on one small test file, to check that it runs

Clones the repository's committed HEAD into a temporary directory (what CI checks out: nothing untracked, no
build outputs, no caches) and runs the README's test command there with this interpreter (its environment has
the package's requirements; CI's own ``.ci/run`` makes a new venv first, which this does not time). Prints
``RESULT {json}`` with ratio = pytest's wall time / 900 s (target <= 1) and, in the note, the pass/fail line and
the slowest tests (``--durations``). Slow by nature, so ``run_all.py`` runs it only when asked (``--suite``).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_SECONDS = 15 * 60


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small test file instead of the whole suite")
    parser.add_argument("--durations", type=int, default=10, help="how many of the slowest tests to name")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_suite_")
    try:
        clone = os.path.join(work, "clone")
        subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--durations={args.durations}"]
        if args.quick:
            command.append("tests/test_readme.py::test_readme_opens_with_two_commands")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        start = time.perf_counter()
        done = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = next((line for line in reversed(done.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
                   "no summary")
    slowest = re.findall(r"^\s*([\d.]+)s (?:call|setup)\s+(\S+)", done.stdout, re.M)[:3]
    note = f"{seconds / 60:.1f} min; {summary.strip('= ')}"
    if slowest:
        note += "; slowest: " + ", ".join(f"{name.split('::')[-1]} {float(s):.0f}s" for s, name in slowest)
    print(done.stdout[-3000:])
    print("RESULT " + json.dumps({"benchmark": "test suite from a fresh clone, pytest wall time / 15 min",
                                  "ratio": round(seconds / TARGET_SECONDS, 3), "target": 1.0, "note": note}),
          flush=True)
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
