"""Checkpoint tensors read straight into the tensors they load into (checkpoint/read_into.py): what PyTorch DCP's own
reader loads, for every kind of stored item and destination; and a synchronous save that writes the parameters
where they are (no copy), which loads back exactly."""

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import LoadItemType

from megatron_patch.checkpoint import read_into
from megatron_patch.testing import run_on_ranks


def _saved(tmp_path):
    generator = torch.Generator().manual_seed(0)
    state = {
        "weight": torch.randn(300, 37, generator=generator),
        "bf16": torch.randn(64, 5, generator=generator).bfloat16(),
        "step": torch.tensor(7),
        "ids": torch.arange(1000),
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(6, 4, generator=generator).t(),  # stored with its strides: left to DCP
        "note": "saved by a test",  # an object (BYTE_IO): left to DCP
    }
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path, thread_count=2), no_dist=True)
    return state


def _targets(state):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else "" for k, v in state.items()}


def _recording_what_is_left(left: list, read_file=read_into._read_file):
    """``read_into._read_file`` that also appends to ``left`` the requests each file leaves to DCP's reader."""

    def read_file_recording(*args):
        rest = read_file(*args)
        left.extend(rest)
        return rest

    return read_file_recording


def test_tensors_read_in_place_equal_what_dcp_reads(tmp_path, monkeypatch):
    state = _saved(tmp_path)
    left = []
    monkeypatch.setattr(read_into, "_read_file", _recording_what_is_left(left))
    ours, theirs = _targets(state), _targets(state)
    dcp.load(ours, storage_reader=read_into.read_in_place(FileSystemReader(tmp_path)), no_dist=True)
    dcp.load(theirs, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
            assert torch.equal(ours[name], value), name
    assert ours["note"] == theirs["note"] == state["note"]
    assert sorted(r.dest_index.fqn for r in left) == ["note", "transposed"]
    assert [r.type for r in left if r.dest_index.fqn == "note"] == [LoadItemType.BYTE_IO]


def test_another_dtype_and_a_strided_destination_are_copied_as_dcp_copies(tmp_path):
    state = _saved(tmp_path)
    destinations = {"weight": torch.zeros(37, 300).t(), "bf16": torch.zeros(64, 5), "ids": torch.zeros(1000)}
    theirs = {k: torch.zeros_like(v) for k, v in destinations.items()}
    dcp.load(destinations, storage_reader=read_into.read_in_place(FileSystemReader(tmp_path)), no_dist=True)
    dcp.load(theirs, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    for name in destinations:
        assert torch.equal(destinations[name], theirs[name]), name
    assert torch.equal(destinations["weight"], state["weight"])
    assert torch.equal(destinations["bf16"], state["bf16"].float())


def save_and_load_recording_copies(rank, world_size, save_dir):
    """A synchronous save of a tiny GPT after one step (distributed optimizer: its parameters are views of DDP's
    buffer) with every ``Tensor.clone`` recorded, then a load into a model changed since, recording what the load
    left to DCP's reader: (shapes cloned, the parameters' shapes, state equal after the load, items left)."""
    from megatron_patch.checkpoint import megatron
    from megatron_patch.testing import recorded_clones, tiny_gpt_after_one_step

    chunks, optimizer = tiny_gpt_after_one_step(True)
    saved = {k: v.clone() for k, v in chunks[0].module.state_dict().items() if isinstance(v, torch.Tensor)}
    with recorded_clones() as cloned:
        megatron.save_megatron_checkpoint(save_dir, 1, chunks, optimizer, None)
    with torch.no_grad():
        for param in chunks[0].module.parameters():
            param.add_(1.0)
    left, read_file = [], read_into._read_file
    read_into._read_file = _recording_what_is_left(left, read_file)
    try:
        megatron.load_megatron_checkpoint(save_dir, chunks, optimizer, None)
    finally:
        read_into._read_file = read_file
    loaded = chunks[0].module.state_dict()
    return (cloned, [tuple(p.shape) for p in chunks[0].module.parameters()],
            all(torch.equal(saved[k], loaded[k]) for k in saved), sorted({r.type.name for r in left}))


def test_a_synchronous_save_writes_the_parameters_without_copies_and_loads_them_back(tmp_path):
    """Failed before: megatron-core's writer cloned every parameter (a view of DDP's buffer) at each save."""
    [(cloned, shapes, equal, left)] = run_on_ranks(save_and_load_recording_copies, 1, args=(str(tmp_path / "c"),))
    # A layer's parameter is written with the layer axis megatron-core prepends: (1, *shape).
    assert shapes and not {shape[1:] if shape[:1] == (1,) else shape for shape in cloned} & set(shapes), cloned
    assert equal
    assert left == ["BYTE_IO"]  # every tensor was read in place; objects by DCP
