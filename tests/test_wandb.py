"""``--wandb-project`` through ``megatron-patch train``: Weights & Biases gets the scalars tensorboard gets, from the
last rank only (Megatron-LM's _set_wandb_writer), in W&B's offline mode (the run's ``.wandb`` file under
``--wandb-save-dir``, read back here record by record).

Failed before: ``--wandb-project`` was an unrecognized argument.
"""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest


def wandb_history(run_file: str) -> dict[int, dict[str, float]]:
    """The history (``run.log``) records of an offline W&B run file, by step. The file is a LevelDB-style log (a
    7-byte ``:W&B`` header, then 32 KiB blocks of records, each ``crc32, length, type`` and a piece of a protobuf
    ``Record``), the format of wandb's own datastore (wandb/sdk/internal/datastore.py before wandb 0.2x)."""
    from wandb.proto import wandb_internal_pb2

    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, position, pending, history = 32768, 7, b"", {}
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a record header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                history.setdefault(record.history.step.num, {}).update(
                    {k: v for k, v in items.items() if not k.startswith("_")})
    return history


def test_wandb_gets_the_tensorboard_scalars_from_the_last_rank(tmp_path):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, runs = tmp_path / "tb", tmp_path / "wandb"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_patch.cli", "train", "--task", "pretraining", "--mock-data",
         "--nproc-per-node", "2", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "64", "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1",
         "--tensorboard-dir", str(board), "--wandb-project", "tiny", "--wandb-exp-name", "mock",
         "--wandb-save-dir", str(runs)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline"})
    assert result.returncode == 0, result.stderr[-3000:]
    [run_file] = glob.glob(str(runs / "wandb" / "offline-run-*" / "run-*.wandb"))  # one run: the last rank's
    history = wandb_history(run_file)
    events = EventAccumulator(str(board))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert {"lm loss", "learning-rate", "grad-norm", "loss-scale", "validation lm loss"} <= set(scalars)
    wandb_scalars = {}
    for step, items in history.items():
        for tag, value in items.items():
            wandb_scalars.setdefault(tag, {})[step] = value
    assert set(wandb_scalars) == set(scalars)
    for tag, steps in scalars.items():  # tensorboard keeps float32, W&B the float64
        assert wandb_scalars[tag] == {step: pytest.approx(value, rel=1e-6) for step, value in steps.items()}, tag


def test_wandb_project_without_wandb_is_refused_in_one_line(monkeypatch, tmp_path):
    """wandb is a test extra, not an install requirement: without it the flag is refused before launch."""
    import importlib.util

    from megatron_patch.training.arguments import parse_args

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(SystemExit, match="^rapidformer: error: --wandb-project needs the wandb package "
                                         r"\(pip install wandb\)$"):
        parse_args(["--wandb-project", "p", "--wandb-save-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--wandb-project writes its run under --wandb-save-dir DIR"):
        monkeypatch.undo()
        parse_args(["--wandb-project", "p"])
