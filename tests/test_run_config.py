"""
    python -m pytest -q tests/test_run_config.py

The typed run configuration (training/config.py): the flags are parsed once per process (in a rank, the engine
the task or the user script creates takes the launcher's parse), everything below the entry point reads the frozen
``RunConfig`` (no ``argparse.Namespace`` there; ``get_args()`` is the user scripts' view of the same values), and
the derived quantities match Megatron-LM's arithmetic.
"""

import ast
import dataclasses
import pathlib

import pytest

from megatron_patch.testing import run_on_ranks

TRAINING = pathlib.Path(__file__).resolve().parent.parent / "megatron_patch" / "training"
# The entry points, which parse flags into the RunConfig and keep Megatron-LM's view of them for user scripts.
ENTRY_POINTS = {"arguments.py", "engine.py", "launcher.py", "plan.py"}

USER_SCRIPT = """
from rapidformer import RapidformerEngine, get_args

engine = RapidformerEngine()
assert get_args() is engine.args and engine.config.training.micro_batch_size == 2
"""


def parses_per_rank(rank, world_size, script):
    import argparse
    import sys
    from unittest import mock

    from megatron_patch.training import arguments, launcher, tasks

    calls = []
    parse = argparse.ArgumentParser.parse_known_args

    def counted(self, *args, **kwargs):
        if self.prog == "rapidformer":
            calls.append(self.prog)
        return parse(self, *args, **kwargs)

    tasks_seen = []
    saved = sys.argv, sys.modules["__main__"], list(sys.path)
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_known_args", counted), \
                mock.patch.object(tasks, "run_task", lambda engine: tasks_seen.append(engine.config.task)):
            launcher._run_rank(["--user-script", script, "--micro-batch-size", "2"])
            user_script = len(calls)
            calls.clear()
            launcher._run_rank(["--task", "pretraining", "--micro-batch-size", "2", "--mock-data"])
            task = len(calls)
    finally:
        sys.argv, sys.modules["__main__"], sys.path[:] = saved
        arguments._HANDED_OVER = None
    return user_script, task, tasks_seen


def test_a_rank_parses_its_flags_once(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(USER_SCRIPT)
    [(user_script, task, tasks_seen)] = run_on_ranks(parses_per_rank, 1, args=(str(script),))
    assert (user_script, task) == (1, 1)
    assert tasks_seen == ["pretraining"]


def _reads_of_args(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"
            or isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name)
            and node.value.id == "self"]


def test_no_namespace_below_the_entry_point():
    found = {}
    for path in sorted(TRAINING.rglob("*.py")):
        if path.name in ENTRY_POINTS:
            continue
        tree = ast.parse(path.read_text())
        imports = [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   and any(alias.name == "argparse" for alias in n.names)]
        reads = _reads_of_args(tree)
        if imports or reads:
            found[str(path.relative_to(TRAINING))] = imports + reads
    # trainers.py sets self.args once, for the user's hooks; nothing of ours reads it.
    assert list(found) == ["trainers.py"] and len(found["trainers.py"]) == 1, found


def test_the_configuration_is_frozen_and_derived_once():
    from megatron_patch.training.arguments import parse_run

    config, args = parse_run(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
                              "--tensor-model-parallel-size", "2", "--rampup-batch-size", "4", "4", "48",
                              "--train-samples", "256"], world_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training.lr = 1.0
    # 4 ranks / TP 2 = 2 data-parallel ranks; 16 / (2 x 2) = 4 microbatches at the full batch.
    assert (config.training.data_parallel_size, config.training.num_microbatches) == (2, 4)
    # Megatron-LM's update_train_iters: the ramp-up's iterations (4,4,4,4,8,8,12,12 = 56 samples, the ramp lasting
    # 48 samples), then (256 - 56) // 16 = 12 full ones.
    assert config.training.train_iters == 8 + 12
    assert (args.train_iters, args.num_microbatches, args.data_parallel_size) == (20, 4, 2)
    assert config.data.seq_length == 32 and config.model.build("gpt", 100).num_layers == 4


def test_a_bad_batch_is_refused_before_any_process_group():
    from megatron_patch.training.arguments import parse_run

    with pytest.raises(SystemExit, match="--global-batch-size 6 is not divisible by --micro-batch-size 2 x "
                                         "data-parallel size 2"):
        parse_run(["--micro-batch-size", "2", "--global-batch-size", "6"], world_size=2)
