"""The megatron-patch command: its tools forward their flags (the quick start: tests/test_quickstart.py)."""

import json
import subprocess
import sys


def megatron_patch(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "megatron_patch.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_tool_subcommand_forwards_its_flags(tmp_path):
    out = tmp_path / "corpus.jsonl"
    result = megatron_patch("make-corpus", "--output", str(out), "--max-docs", "3")
    assert result.returncode == 0, result.stderr
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(docs) == 3 and all(doc["text"] for doc in docs)


def test_unknown_subcommand_is_refused():
    result = megatron_patch("no-such-command")
    assert result.returncode != 0 and "invalid choice: 'no-such-command'" in result.stderr



def test_version_names_what_the_package_runs_on_without_importing_torch():
    import importlib.metadata

    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_patch.cli", "--version"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == f"torch {importlib.metadata.version('torch')}"
    assert lines[2].startswith(f"megatron-core {importlib.metadata.version('megatron-core')} (tested: >=0.16.1,")
    assert [line.split()[0].rstrip(":") for line in lines] == ["megatron_patch", "torch", "megatron-core", "Transformer", "apex"]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "megatron.core" not in imported
