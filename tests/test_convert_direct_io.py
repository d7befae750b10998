"""The O_DIRECT stream under hf-to-megatron's torch_dist writer: the same bytes as an ordinary file, and the same
DCP checkpoint as PyTorch's own FileSystemWriter, also where the file system refuses O_DIRECT writes; a swiglu fc1
written without a copy."""

import errno
import json
import os
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from megatron_patch.checkpoint import direct_io


def _chunks(seed: int) -> list[bytes]:
    """Writes of awkward sizes: tiny, unaligned, one spanning several buffers, and an unaligned tail."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [1, 4095, 4097, 3 * direct_io._BUFFER_BYTES + 17, 12345, 0, 333]
    return [torch.randint(0, 256, (n,), generator=generator, dtype=torch.uint8).numpy().tobytes() for n in sizes]


def _write(path, chunks) -> list[int]:
    positions = []
    with direct_io._DirectFileSystem().create_stream(path, "wb") as stream:
        for chunk in chunks:
            stream.write(chunk)
            positions.append(stream.tell())
    return positions


def test_direct_stream_writes_exactly_the_bytes_given(tmp_path):
    chunks = _chunks(0)
    path = tmp_path / "__0_0.distcp"
    positions = _write(path, chunks)
    assert path.read_bytes() == b"".join(chunks)
    assert positions == [sum(map(len, chunks[:i + 1])) for i in range(len(chunks))]


class _RefusingOs(types.SimpleNamespace):
    """``os`` as seen by direct_io on a file system that opens with O_DIRECT but refuses such writes."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        import fcntl

        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return os.write(fd, data)


def test_refused_direct_writes_fall_back_to_the_page_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_io, "os", _RefusingOs())
    chunks = _chunks(1)
    path = tmp_path / "__0_0.distcp"
    _write(path, chunks)
    assert path.read_bytes() == b"".join(chunks)


def test_dcp_checkpoint_equals_pytorch_file_system_writer(tmp_path):
    generator = torch.Generator().manual_seed(2)
    state = {"w": torch.randn(1000, 37, generator=generator), "b": torch.randn(5, generator=generator).bfloat16(),
             "step": torch.tensor(3)}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "plain", thread_count=1), no_dist=True)
    dcp.save(state, storage_writer=direct_io.DirectFileSystemWriter(tmp_path / "direct"), no_dist=True)
    data = sorted(p.name for p in (tmp_path / "plain").iterdir() if p.suffix == ".distcp")
    assert data and data == sorted(p.name for p in (tmp_path / "direct").iterdir() if p.suffix == ".distcp")
    for name in data:
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "direct" / name).read_bytes()
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=tmp_path / "direct", no_dist=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


class _FailingOs(types.SimpleNamespace):
    """``os`` as seen by direct_io on a device that fails every data write (EIO)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        raise OSError(errno.EIO, "Input/output error")


def test_a_failed_write_in_the_background_is_raised_to_the_writer(tmp_path, monkeypatch):
    """Full buffers are written by a helper thread; its error must reach the caller, not vanish with the thread."""
    monkeypatch.setattr(direct_io, "os", _FailingOs())
    with pytest.raises(OSError, match="Input/output error"):
        _write(tmp_path / "__0_0.distcp", _chunks(3))


def convert_recording_copies(rank, world_size, hf_dir, save_dir):
    """hf_to_megatron with every ``Tensor.clone`` recorded: the shapes cloned."""
    from megatron_patch import compat
    from megatron_patch.convert.core import hf_to_megatron
    from megatron_patch.testing import recorded_clones

    compat.apply()
    with recorded_clones() as cloned:
        hf_to_megatron(hf_dir, save_dir, progress=False)
    return cloned


def test_a_swiglu_fc1_is_written_without_a_copy(tmp_path):
    """Failed before: megatron-core saves a swiglu ``linear_fc1`` as its gate and up halves, each a part of the one
    tensor the conversion reads, and DCP's writer cloned every such part so as not to save the rest of its storage
    (over 40% of a LLaMA-shaped model's bytes copied once more). The checkpoint's bytes are test_convert.py's."""
    from megatron_patch.testing import run_on_ranks
    from tests.convert_oracles import make_hf_model

    hf = make_hf_model("llama-gqa", str(tmp_path / "hf"))
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    half = (config["intermediate_size"], config["hidden_size"])
    [cloned] = run_on_ranks(convert_recording_copies, 1, args=(hf, str(tmp_path / "out")))
    assert not [shape for shape in cloned if shape[-2:] == half], cloned
