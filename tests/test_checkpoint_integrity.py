"""A damaged checkpoint never resumes silently: every file's length and CRC-32 is recorded at save time
(``checksums.json``) and checked on load, a missing, truncated or bit-flipped file is named (or skipped with
--load-fallback), --no-verify-checksums loads it anyway, and a checkpoint saved before checksums still loads.

The damage tests launch the trainer through ``megatron-patch train`` (2 processes; 1 to resume at another world
size), as a user would; one shared 2-process run saves the checkpoints they copy and damage."""

import glob
import json
import os
import shutil
import zlib

import pytest
from seed_scripts.assets import rapidformer_assets
from test_reliability import _records, _run
from test_trainer_megatron import _gpt_flags, train_gpt

from megatron_patch.testing import run_on_ranks
from megatron_patch.checkpoint.integrity import CorruptCheckpointError, verify_checkpoint

TRACKER = "latest_checkpointed_iteration.txt"
ITERS = 4
RNG_FILE = os.path.join("rng", "rank_00001.pt")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def _flags(assets, *extra):
    """Dropout on, so a rank that resumed on its seeded RNG instead of the saved one draws other masks."""
    return _gpt_flags(assets, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--micro-batch-size", "2",
                      "--global-batch-size", "4", *extra)


@pytest.fixture(scope="module")
def unbroken(assets, tmp_path_factory):
    """A 2-process run saving (asynchronously) after every iteration: its records and its checkpoints."""
    root = tmp_path_factory.mktemp("unbroken")
    save, logs = str(root / "ckpt"), str(root / "logs")
    status, output = _run(_flags(assets, "--train-iters", str(ITERS), "--save", save, "--save-interval", "1",
                                 "--async-save", "--log-dir", logs), nproc=2)
    assert status == 0, output
    return {"save": save, "records": _records(logs)}


def _copy(save, tmp_path) -> str:
    return shutil.copytree(save, str(tmp_path / "ckpt"))


def _iter_dir(save, iteration) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def _set_tracker(save, iteration) -> None:
    with open(os.path.join(save, TRACKER), "w") as f:
        f.write(str(iteration))


def _flip_distcp(path) -> str:
    """Invert 256 bytes in the middle of the largest ``.distcp`` (tensor data; its length stays); its name."""
    file = max(glob.glob(os.path.join(path, "*.distcp")), key=os.path.getsize)
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        flipped = bytes(b ^ 0xFF for b in f.read(256))
        f.seek(os.path.getsize(file) // 2)
        f.write(flipped)
    return os.path.basename(file)


def _truncate(file) -> None:
    os.truncate(file, os.path.getsize(file) // 2)


def _file_checksums(path) -> dict:
    """Every file under ``path`` but checksums.json, with its length and CRC-32 computed here from its bytes."""
    found = {}
    for directory, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
            found[os.path.relpath(os.path.join(directory, name), path)] = {"bytes": len(data),
                                                                           "crc32": f"{zlib.crc32(data):08x}"}
    found.pop("checksums.json")
    return found


def _recorded_checksums(path) -> dict:
    with open(os.path.join(path, "checksums.json")) as f:
        return json.load(f)["files"]


@pytest.mark.parametrize("saving", ["async", "sync"])
def test_every_file_of_a_checkpoint_has_its_checksum(assets, unbroken, tmp_path, saving):
    if saving == "async":
        path = _iter_dir(unbroken["save"], 1)
    else:
        save = str(tmp_path / "ckpt")
        run_on_ranks(train_gpt, 1, args=(_flags(assets, "--train-iters", "1", "--save", save),), timeout=300)
        path = _iter_dir(save, 1)
    assert _recorded_checksums(path) == _file_checksums(path)


def test_damaged_checkpoints_are_named_and_fallback_resumes_exactly_from_the_intact_one(assets, unbroken, tmp_path):
    save = _copy(unbroken["save"], tmp_path)
    os.remove(os.path.join(_iter_dir(save, 2), RNG_FILE))
    _truncate(os.path.join(_iter_dir(save, 3), RNG_FILE))
    flipped = _flip_distcp(_iter_dir(save, 4))
    damage = {4: f"{flipped} does not match its CRC-32", 3: f"{RNG_FILE} is truncated", 2: f"{RNG_FILE} is missing"}
    for iteration, problem in damage.items():
        _set_tracker(save, iteration)
        # The run's schedule, so that the launcher's check of it passes and the ranks' load meets the damage.
        status, output = _run(_flags(assets, "--train-iters", str(ITERS), "--load", save), nproc=2)
        assert status != 0, output
        assert "CorruptCheckpointError" in output and f"{_iter_dir(save, iteration)} is " in output, output
        assert problem in output and "--load-fallback" in output, output

    _set_tracker(save, ITERS)
    logs = str(tmp_path / "logs")
    status, output = _run(_flags(assets, "--train-iters", str(ITERS), "--load", save, "--load-fallback",
                                 "--log-dir", logs), nproc=2)
    assert status == 0, output
    assert all(problem in output for problem in damage.values()), output
    assert "--load-fallback: loading iteration 1 instead" in output
    assert _records(logs) == unbroken["records"][1:]


def test_no_verify_checksums_loads_a_bit_flipped_checkpoint(assets, unbroken, tmp_path):
    """Also at another world size, where no RNG state was saved: the seeded RNG stays, as before checksums."""
    save = _copy(unbroken["save"], tmp_path)
    _flip_distcp(_iter_dir(save, ITERS))
    logs = str(tmp_path / "logs")
    status, output = _run(_flags(assets, "--train-iters", str(ITERS), "--load", save, "--no-verify-checksums",
                                 "--log-dir", logs), nproc=1)
    assert status == 0, output
    assert "no RNG state for this world size; keeping the seeded RNG" in output
    assert not os.path.exists(os.path.join(logs, "iterations.jsonl")) or not _records(logs)  # resumed at ITERS


def test_a_checkpoint_saved_before_checksums_resumes_exactly(assets, unbroken, tmp_path):
    save = _copy(unbroken["save"], tmp_path)
    os.remove(os.path.join(_iter_dir(save, 2), "checksums.json"))
    _set_tracker(save, 2)
    logs = str(tmp_path / "logs")
    status, output = _run(_flags(assets, "--train-iters", str(ITERS), "--load", save, "--log-dir", logs), nproc=2)
    assert status == 0, output
    assert f"{_iter_dir(save, 2)} has no checksums.json (saved before checksums were recorded)" in output
    assert _records(logs) == unbroken["records"][2:]


@pytest.mark.parametrize("damage", ["remove", "truncate"])
def test_without_checksums_a_missing_or_truncated_rng_file_is_still_named(unbroken, tmp_path, damage):
    path = shutil.copytree(_iter_dir(unbroken["save"], 1), str(tmp_path / "iter_0000001"))
    os.remove(os.path.join(path, "checksums.json"))
    (os.remove if damage == "remove" else _truncate)(os.path.join(path, RNG_FILE))
    with pytest.raises(CorruptCheckpointError, match=f"{path} is .*: {RNG_FILE} is "):
        verify_checkpoint(path, megatron=True)


def _save_and_load_hf_model(rank, world_size, save):
    """Save a tiny Hugging Face model through the plain path, invert a byte of its weights file, load it back."""
    import torch
    import transformers

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.checkpoint.plain import load_plain_checkpoint, save_plain_checkpoint

    initialize_distributed(seed=1)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    optimizer.step()
    path = save_plain_checkpoint(save, 1, model, optimizer, None)
    recorded, found = _recorded_checksums(path), _file_checksums(path)
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        last = f.read(1)
        f.seek(-4, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    try:
        load_plain_checkpoint(save, model, optimizer, None)
    except CorruptCheckpointError as error:
        return recorded, found, str(error)
    return recorded, found, None


def test_plain_model_checkpoints_are_checksummed_too(tmp_path):
    save = str(tmp_path / "ckpt")
    [(recorded, found, error)] = run_on_ranks(_save_and_load_hf_model, 1, args=(save,), timeout=300)
    assert recorded == found and "model.safetensors" in found
    assert error is not None and "model.safetensors does not match its CRC-32" in error


class _RunsCode:
    """Pickled as a call of ``os.system``: what a checkpoint shared by someone else could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(path, name, obj) -> None:
    """Replace ``path``'s file ``name`` by ``obj`` saved with torch.save, its checksum recorded as a save would."""
    import torch

    torch.save(obj, os.path.join(path, name))
    _record_checksums(path, name)


def _record_checksums(path, *names) -> None:
    checksums = json.load(open(os.path.join(path, "checksums.json")))
    found = _file_checksums(path)
    checksums["files"].update({name: found[name] for name in names})
    with open(os.path.join(path, "checksums.json"), "w") as f:
        json.dump(checksums, f)


def _load_planted_checkpoints(rank, world_size, root):
    """Save a tiny Hugging Face model's checkpoint; load copies of it whose RNG file and trainer_state.pt would run
    code, and one whose RNG file NumPy's state is an array (as saved before it was a tensor). Returns each load's
    error (None when it loaded) and whether NumPy's generator came back to the saved state."""
    import numpy
    import torch
    import transformers

    from megatron_patch.checkpoint.plain import load_plain_checkpoint, save_plain_checkpoint
    from megatron_patch.distributed import initialize_distributed

    initialize_distributed(seed=1)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16,
                                                                 n_positions=8))
    optimizer = torch.optim.Adam(model.parameters())
    saved = numpy.random.get_state()
    path = save_plain_checkpoint(os.path.join(root, "ckpt"), 1, model, optimizer, None)
    errors = {}
    for name in (RNG_FILE.replace("00001", "00000"), "trainer_state.pt", "old numpy state"):
        copy = shutil.copytree(os.path.dirname(path), os.path.join(root, name.replace("/", "_")))
        planted = _iter_dir(copy, 1)
        if name == "old numpy state":
            state = torch.load(os.path.join(planted, "rng", "rank_00000.pt"), weights_only=True)
            _plant(planted, os.path.join("rng", "rank_00000.pt"), {**state, "numpy": saved})
        else:
            _plant(planted, name, _RunsCode(os.path.join(root, "marker")))
        numpy.random.seed(0)
        try:
            load_plain_checkpoint(copy, model, optimizer, None)
            errors[name] = None
        except CorruptCheckpointError as error:
            errors[name] = str(error)
    restored = numpy.random.get_state()
    return errors, bool((restored[1] == saved[1]).all() and restored[2:] == saved[2:])


def test_a_checkpoint_file_that_would_run_code_is_refused_by_name_and_runs_nothing(tmp_path):
    [(errors, numpy_restored)] = run_on_ranks(_load_planted_checkpoints, 1, args=(str(tmp_path),), timeout=300)
    for name in ("rng/rank_00000.pt", "trainer_state.pt"):
        assert errors[name] is not None and f"{name} would call posix.system when loaded" in errors[name], errors
    assert not os.path.exists(tmp_path / "marker")
    assert errors["old numpy state"] is None and numpy_restored


def _plant_metadata(path, obj) -> None:
    """Replace DCP's ``.metadata`` (a plain pickle, not a torch.save file) by ``obj`` pickled."""
    import pickle

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(obj, f)
    _record_checksums(path, ".metadata")


def _plant_stored_objects(path, obj) -> str:
    """Point every object DCP's ``.metadata`` indexes (its BYTE_IO items: megatron-core's ShardedObjects) at ``obj``'s
    torch.save bytes, appended to ``__0_0.distcp``; returns that file."""
    import dataclasses
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # the index this test's own run saved
    planted = io.BytesIO()
    torch.save(obj, planted)
    name = "__0_0.distcp"
    offset = os.path.getsize(os.path.join(path, name))
    with open(os.path.join(path, name), "ab") as f:
        f.write(planted.getvalue())
    objects = {fqn for fqn, item in metadata.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)}
    assert objects
    for index, info in metadata.storage_data.items():
        if index.fqn in objects:
            metadata.storage_data[index] = dataclasses.replace(info, relative_path=name, offset=offset,
                                                               length=len(planted.getvalue()))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    _record_checksums(path, name, ".metadata")
    return os.path.join(path, name)


def _resume_and_read_metadata(rank, world_size, argv, path):
    """The error of a resume with ``argv`` and of torch DCP's own reading of ``path``'s .metadata (None: loaded)."""
    from torch.distributed.checkpoint import FileSystemReader

    errors = []
    for load in (lambda: train_gpt(rank, world_size, argv), lambda: FileSystemReader(path).read_metadata()):
        try:
            load()
            errors.append(None)
        except CorruptCheckpointError as error:
            errors.append(str(error))
    return errors


def test_a_torch_dist_file_that_would_run_code_is_refused_by_name_and_runs_nothing(assets, tmp_path):
    """DCP's .metadata (unpickled by torch's reader with pickle.load), an object stored in a .distcp (read by
    DCP's load_bytes with weights_only=False) and common.pt (megatron-core's), each planted with a pickle calling
    os.system: the resume refuses it naming the file, torch DCP's own reader of .metadata too, and nothing runs."""
    save = str(tmp_path / "ckpt")
    run_on_ranks(train_gpt, 1, args=(_flags(assets, "--train-iters", "1", "--save", save),), timeout=300)
    marker = str(tmp_path / "marker")
    for plant in (".metadata", "stored object", "common.pt"):
        copy = shutil.copytree(save, str(tmp_path / plant.replace(".", "")))
        path = _iter_dir(copy, 1)
        if plant == ".metadata":
            _plant_metadata(path, _RunsCode(marker))
            file = os.path.join(path, ".metadata")
        elif plant == "stored object":
            file = _plant_stored_objects(path, _RunsCode(marker))
        else:
            _plant(path, "common.pt", _RunsCode(marker))
            file = os.path.join(path, "common.pt")
        [(resumed, read)] = run_on_ranks(_resume_and_read_metadata, 1,
                                         args=(_flags(assets, "--train-iters", "1", "--load", copy), path),
                                         timeout=300)
        assert resumed is not None and f"checkpoint file {file}" in resumed, (plant, resumed)
        assert "would call posix.system when loaded" in resumed and "\n" not in resumed, resumed
        if plant == ".metadata":
            assert read is not None and read in resumed, read
        else:
            assert read is None, read
    assert not os.path.exists(marker)


def test_a_legacy_rank_file_that_would_run_code_is_refused_by_name_and_runs_nothing(tmp_path):
    """Megatron-LM's per-rank ``model_optim_rng.pt`` (``--ckpt-format torch``), read for its args."""
    from megatron_patch.checkpoint.format import find_info

    import torch

    root = tmp_path / "legacy"
    os.makedirs(root / "iter_0000001" / "mp_rank_00")
    _set_tracker(str(root), 1)
    file = str(root / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    torch.save(_RunsCode(str(tmp_path / "marker")), file)
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint file {file} would call posix.system when loaded"):
        find_info(str(root))
    assert not os.path.exists(tmp_path / "marker")


def test_an_unverified_load_reads_its_files_ahead_in_name_order_until_it_ends(tmp_path, monkeypatch):
    """--no-verify-checksums: a thread reads the files into the page cache as the verified load's checksums do
    (in the order the load reads them), and stops when the load has ended."""
    import threading
    import time

    from megatron_patch.checkpoint import integrity

    for name, size in (("__1_0.distcp", 3000), ("__0_0.distcp", 5000), (".metadata", 10)):
        (tmp_path / name).write_bytes(b"x" * size)
    opened, reading = [], threading.Event()

    def recording_open(file, *args, **kwargs):
        opened.append(os.path.basename(file))
        reading.set()
        time.sleep(0.2)  # the load is still reading the first file when it ends
        return open(file, *args, **kwargs)

    monkeypatch.setattr(integrity, "_READ_AHEAD_CHUNK", 1000)
    monkeypatch.setattr(integrity, "open", recording_open, raising=False)
    stop = integrity.read_ahead_meanwhile(str(tmp_path))
    reading.wait(10)
    stop()
    time.sleep(0.5)
    assert opened == [".metadata"]
    opened.clear()
    integrity.read_ahead_meanwhile(str(tmp_path))
    deadline = time.monotonic() + 10
    while len(opened) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert opened == [".metadata", "__0_0.distcp", "__1_0.distcp"]
