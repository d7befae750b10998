"""Start-up: the commands' ``--help`` (and a flag error) import none of torch, megatron-core and transformers; the
libraries are imported with the garbage collector paused.

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

# Runs `module` as __main__ with `argv` and prints which of HEAVY are in sys.modules afterwards, whatever the exit
# (and an exit's message, as the interpreter would).
PROBE = """
import json, runpy, sys
module, heavy, argv = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
sys.argv = [module, *argv]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as exit:
    if isinstance(exit.code, str):  # the message the interpreter would print
        print(exit.code, file=sys.stderr)
print("IMPORTED " + json.dumps(sorted(name for name in heavy if name in sys.modules)))
"""


def imported_heavy_modules(module: str, *argv: str, output: str = "") -> list[str]:
    """Which of HEAVY ``python -m module *argv`` imported; its output must contain ``output``."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module, json.dumps(HEAVY), json.dumps(list(argv))],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("IMPORTED ")]
    assert lines and output in result.stdout + result.stderr, result.stdout + result.stderr
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


def test_the_launcher_checks_a_job_without_megatron_core(tmp_path):
    """``train`` checks the flags, the data and the layout in the launcher's process, before torchrun starts, without
    importing megatron-core (~3 s of every job's start-up): torchrun's agent needs torch only. The refused layout
    is checked after the data, which must be an index megatron-core reads (written here by its own builder)."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp_path / "corpus.bin"), dtype=numpy.uint16)
    builder.add_document(torch.tensor([5, 6, 7]), [3])
    builder.finalize(str(tmp_path / "corpus.idx"))
    imported = imported_heavy_modules(
        "megatron_patch.cli", "train", "--task", "pretraining", "--data-path", str(tmp_path / "corpus"),
        "--nproc-per-node", "2", "--tensor-model-parallel-size", "4", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
        output="world size 2 is not divisible by --tensor-model-parallel-size 4")
    assert "megatron.core" not in imported


def test_rapidformer_help_imports_no_heavy_library():
    assert imported_heavy_modules("megatron_patch.training.launcher", "--help") == []


def test_the_probe_sees_an_import():
    # The checks above would pass on a probe that sees nothing: the model builder does import megatron-core and
    # torch with it (the tokenizers no longer do: they stand on their own since megatron-core 0.17 dropped their base).
    assert {"torch", "megatron.core"} <= set(imported_heavy_modules("megatron_patch.model.builder"))


# megatron-core imported as our processes import it, and then one of its fusions called twice, with torch.compile
# recorded: what is imported before the call, when torch.compile runs and what the calls return.
FUSION_PROBE = """
import json, sys
import torch
import megatron_patch
from megatron_patch import compat
compat.apply()
import megatron.core.models.gpt
from megatron.core.fusions import fused_bias_gelu
before = "torch._dynamo" in sys.modules
compiled = []
torch.compile = lambda fn: compiled.append(fn.__name__) or fn
x, bias = torch.linspace(-3, 3, 7), torch.full((7,), 0.5)
first = fused_bias_gelu.bias_gelu(bias, x)
second = fused_bias_gelu.bias_gelu(bias, x)
eager = (x + bias) * 0.5 * (1.0 + torch.tanh(0.79788456 * (x + bias) * (1 + 0.044715 * (x + bias) * (x + bias))))
print("FUSION " + json.dumps({"dynamo_at_import": before, "compiled": compiled,
                              "equal": torch.equal(first, eager) and torch.equal(second, eager)}))
"""


def test_megatron_cores_fusions_compile_at_their_first_call_not_at_import():
    result = subprocess.run([sys.executable, "-c", FUSION_PROBE], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    lines = [line for line in result.stdout.splitlines() if line.startswith("FUSION ")]
    assert lines, result.stdout + result.stderr
    probe = json.loads(lines[-1][len("FUSION "):])
    assert probe == {"dynamo_at_import": False, "compiled": ["bias_gelu"], "equal": True}


GARBAGE_PROBE = """
import gc, json, sys
count = lambda: sum(s['collections'] for s in gc.get_stats())
{imports}
before = count()
{call}
during = count() - before
young = len(gc.get_objects(0)) + len(gc.get_objects(1))
print(json.dumps([during, gc.isenabled(), {module!r} in sys.modules, young, len(gc.get_objects())]))
"""
TINY_JOB = ["--task", "pretraining", "--nproc-per-node", "1", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size",
            "1", "--global-batch-size", "1", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100"]


@pytest.mark.parametrize("imports, call, module", [
    ("from megatron_patch.startup import import_libraries", "import_libraries()", "megatron.core"),
    # The launcher's first import of torch, checking for CUDA while it validates the flags.
    ("from megatron_patch.training.launcher import launch_command", f"launch_command({TINY_JOB!r})", "torch"),
], ids=["rank-and-worker-libraries", "launcher"])
def test_the_libraries_are_imported_without_a_garbage_collection(imports, call, module):
    """Failed before: importing torch and megatron-core ran the cyclic collector over their ~700,000 new objects
    again and again (0.2-0.75 s of a rank's, a conversion's and a test worker's start-up); after the imports it
    collects as before. Also failed before: the imported objects were left in the collector's young generations,
    which its next runs walk whole (another 0.25-0.3 s of a rank's start-up); they now start in the oldest one."""
    probe = GARBAGE_PROBE.format(imports=imports, call=call, module=module)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr
    during, enabled, imported, young, tracked = json.loads(result.stdout.splitlines()[-1])
    # Plain imports ran 665 collections here (the launcher's, 339); the one allowed is the collector's first run
    # when it resumes.
    assert during <= 1 and enabled and imported, result.stdout
    # Before: 272,813 young of 288,169 tracked.
    assert young < tracked / 100, result.stdout
