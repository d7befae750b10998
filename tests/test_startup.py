"""Start-up: the commands' ``--help`` (and a flag error) import none of torch, megatron-core and transformers.

Example::

    python -m pytest -q tests/test_startup.py

Each command runs in a fresh interpreter, as its console script would, and reports the modules it ended with
(``sys.modules``); importing any of the three costs seconds (bench/startup.py measures them).
"""

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "megatron.core", "transformers")

# Runs `module` as __main__ with `argv` and prints which of HEAVY are in sys.modules afterwards, whatever the exit.
PROBE = """
import json, runpy, sys
module, heavy, argv = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.argv = [module, *argv]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print("IMPORTED " + json.dumps(sorted(name for name in heavy if name in sys.modules)))
"""


def imported_heavy_modules(module: str, *argv: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module, json.dumps(HEAVY), json.dumps(list(argv))],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("IMPORTED ")]
    assert lines, result.stdout + result.stderr
    return json.loads(lines[-1][len("IMPORTED "):])


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["preprocess-data", "--help"],
    ["preprocess-data", "--tokenizer-type", "GPT2BPETokenizer"],  # a flag error: --input and more are missing
    ["make-corpus", "--help"],
    ["convert", "--help"],
    ["convert", "hf-to-megatron", "--help"],
])
def test_help_imports_no_heavy_library(argv):
    assert imported_heavy_modules("megatron_patch.cli", *argv) == []


def test_rapidformer_help_imports_no_heavy_library():
    assert imported_heavy_modules("megatron_patch.training.launcher", "--help") == []


def test_the_probe_sees_an_import():
    # The checks above would pass on a probe that sees nothing: building a tokenizer does import megatron-core
    # (the base class of ours) and torch with it.
    assert {"torch", "megatron.core"} <= set(imported_heavy_modules("megatron_patch.tokenizer.base"))
