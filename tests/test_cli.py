"""The megatron-patch command: its tools forward their flags (the quick start: tests/test_quickstart.py)."""

import json
import shlex
import subprocess
import sys

import pytest


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
    assert [line.split()[0].rstrip(":") for line in lines] == ["megatron_patch", "torch", "megatron-core",
                                                               "Transformer", "apex"]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "megatron.core" not in imported


@pytest.mark.parametrize("argv, meant", [
    (["train", "--task", "pretraining", "--micro-batch-szie", "4"],
     "--micro-batch-szie: did you mean --micro-batch-size?"),
    (["train", "--task", "pretraining", "--load-dri", "ckpt"], "--load-dri: did you mean --load?"),
    (["preprocess-data", "--input", "c.jsonl", "--ouput-prefix", "data/c"],
     "--ouput-prefix: did you mean --output-prefix?"),
    (["convert", "hf-to-megatron", "--hf-dri", "hf", "--save-dir", "ckpt"], "--hf-dri: did you mean --hf-dir?"),
    (["checkpoint", "reshard", "--load-dri", "a", "--save-dir", "b"], "--load-dri: did you mean --load-dir?"),
    (["make-corpus", "--ouptut", "c.jsonl"], "--ouptut: did you mean --output?"),
    (["quickstart", "--ouput-dir", "qs"], "--ouput-dir: did you mean --output-dir?"),
])
def test_a_misspelled_flag_names_the_flag_meant(capsys, monkeypatch, argv, meant):
    from megatron_patch.cli import main

    monkeypatch.setattr(sys, "argv", ["megatron-patch"])  # the tools name themselves after the subcommand there
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    error = str(exit_info.value.code) if isinstance(exit_info.value.code, str) else capsys.readouterr().err
    [line] = [line for line in error.splitlines() if "error:" in line]
    assert line.endswith(f"({meant})"), line


def test_rapidformer_prints_the_versions_and_opens_its_help_with_examples(capsys):
    from megatron_patch.cli import main as megatron_patch_main
    from megatron_patch.training.arguments import HELP_EXAMPLES, parse_flags
    from megatron_patch.training.launcher import main as rapidformer

    printed = []
    for command in (rapidformer, megatron_patch_main):
        with pytest.raises(SystemExit) as exit_info:
            command(["--version"])
        assert exit_info.value.code == 0
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and printed[0].startswith("megatron_patch ")
    with pytest.raises(SystemExit):
        rapidformer(["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: rapidformer (--task TASK | --user-script FILE) [FLAGS]"
    examples = [line for line in lines[:24] if line.startswith("  rapidformer ")]
    assert len(examples) == len(HELP_EXAMPLES) == 3
    for _, command in HELP_EXAMPLES:  # each example is a command line rapidformer accepts
        parse_flags(shlex.split(command))
