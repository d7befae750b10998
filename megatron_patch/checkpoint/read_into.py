"""Read a torch_dist checkpoint's tensors from their files straight into the tensors they load into.

Example::

    with reading_into_place():
        loaded = dist_checkpointing.load(state, "ckpt/iter_0000100")   # megatron-core's load, its strategy and planner

PyTorch DCP's ``FileSystemReader.read_data`` (torch/distributed/checkpoint/filesystem.py, ``read_data``) reads each
stored tensor with ``torch.load``: into new memory, through the weights-only unpickler, then ``copy_`` into the tensor
it loads into. Here a stored tensor's bytes go from the file into that tensor with one ``preadv``, as a plain read
of the file would (bench/checkpoint_io.py's 406 MB checkpoint loads from the page cache in 0.15 s instead of 0.29 s).
Where the bytes lie comes from the tensor's zip entry (``PyTorchFileReader.get_record_offset``) and its dtype,
shape and strides from its ``data.pkl``, read by an unpickler that accepts only what ``torch.save`` writes for
one plain tensor (anything else is refused as by the weights-only unpickler, and read by DCP's own code).

Read as DCP reads, by its own code: objects (``BYTE_IO``), items with storage transforms, tensors stored with
another layout than a contiguous one from their storage's start. Read into a new tensor and copied (as DCP does):
a part of a stored tensor (a load at another tensor-parallel size), another dtype, a destination that is not a
contiguous CPU tensor (a GPU's).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import io
import os
import pickle
import sys
from typing import NamedTuple

import torch

from megatron_patch import compat

_STORAGE_DTYPES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


class _NotPlain(Exception):
    """A stored item this module leaves to DCP's own reading."""


class _Stored(NamedTuple):
    """What a ``torch.save`` of one tensor records: its storage's key, dtype and elements, and the view on it."""

    key: str
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple
    stride: tuple


def _rebuild(storage, storage_offset, size, stride, *_):
    """Stands in for ``torch._utils._rebuild_tensor_v2``: the view's description, no tensor built."""
    dtype, key, numel = storage
    return _Stored(key, dtype, numel, storage_offset, tuple(size), tuple(stride))


class _TensorPickle(pickle.Unpickler):
    """``data.pkl`` of a ``torch.save(tensor)``, read as a :class:`_Stored`. Only the names such a pickle holds
    resolve (``_rebuild_tensor_v2``, ``OrderedDict`` for its hooks, the typed storage classes), so like torch's
    weights-only unpickler it runs no other code."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid  # torch/serialization.py _save's persistent_id
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise _NotPlain(pid)
        return dtype, key, numel


def _describe(stream, info) -> tuple[_Stored, int]:
    """The stored tensor at ``info`` (DCP's ``_StorageInfo``: its zip's offset and length in ``stream``'s file)
    and the file offset of its bytes; raises _NotPlain for one to leave to DCP."""
    from torch.distributed.checkpoint.filesystem import _create_file_view

    archive = torch._C.PyTorchFileReader(_create_file_view(stream, info.offset, info.length))
    if archive.has_record("byteorder") and archive.get_record("byteorder").decode() != sys.byteorder:
        raise _NotPlain("byte order")
    try:
        stored = _TensorPickle(io.BytesIO(archive.get_record("data.pkl"))).load()
    except (pickle.UnpicklingError, TypeError, ValueError) as error:
        raise _NotPlain(error) from None
    if not isinstance(stored, _Stored):
        raise _NotPlain(type(stored))
    record = f"data/{stored.key}"
    numel = torch.Size(stored.size).numel()
    # The storage's bytes are its record's, as torch.load reads them (``get_storage_from_record(name, numel, ...)``).
    if (stored.storage_offset != 0 or numel != stored.storage_numel
            or stored.stride != torch.empty(stored.size, device="meta").stride()):
        raise _NotPlain("not contiguous from its storage's start")
    return stored, info.offset + archive.get_record_offset(record)


def _read_exactly(fd: int, tensor: torch.Tensor, at: int, path: str) -> None:
    """Fill the contiguous CPU ``tensor`` with the file's bytes from ``at``."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return
    view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        read = os.preadv(fd, [view[done:]], at + done)
        if read == 0:
            raise EOFError(f"{path} ends at byte {at + done}, inside a tensor of {nbytes} bytes from byte {at}")
        done += read


def _read_file(reader, path: str, requests: list, planner) -> list:
    """Read ``requests`` (ReadItems of one file) into the planner's tensors; returns those left to DCP."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType

    left = []
    requests = sorted(requests, key=lambda request: reader.storage_data[request.storage_index].offset)
    with open(path, "rb") as stream:
        fd = stream.fileno()
        for request in requests:
            info = reader.storage_data[request.storage_index]
            if request.type == LoadItemType.BYTE_IO or info.transform_descriptors:
                left.append(request)
                continue
            try:
                stored, at = _describe(stream, info)
            except _NotPlain:
                left.append(request)
                continue
            target = planner.resolve_tensor(request).detach()
            whole = (all(o == 0 for o in request.storage_offsets) and tuple(request.lengths) == stored.size)
            if (whole and target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous()
                    and tuple(target.shape) == stored.size):
                _read_exactly(fd, target, at, path)
            else:
                tensor = torch.empty(stored.size, dtype=stored.dtype)
                _read_exactly(fd, tensor, at, path)
                tensor = narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)
                if target.size() != tensor.size():  # as DCP's read_data checks
                    raise AssertionError(f"req {request.storage_index} mismatch sizes {target.size()} vs "
                                         f"{tensor.size()}")
                target.copy_(tensor)
            planner.commit_tensor(request, target)
    return left


def _read_data(reader, dcp_read_data, plan, planner):
    """``FileSystemReader.read_data`` of ``reader``: this module's reading, DCP's (``dcp_read_data``) for the rest."""
    per_file: dict[str, list] = {}
    for request in plan.items:
        per_file.setdefault(reader.storage_data[request.storage_index].relative_path, []).append(request)
    left = []
    for relative_path, requests in per_file.items():
        left += _read_file(reader, os.path.join(reader.path, relative_path), requests, planner)
    return dcp_read_data(dataclasses.replace(plan, items=left), planner)


def read_in_place(reader):
    """``reader`` (a ``FileSystemReader``) reading its tensors with :func:`_read_data` when its files are local
    (not MSC's or another storage's); returned, the same object.

    Example::

        dcp.load(state, storage_reader=read_in_place(FileSystemReader("ckpt/iter_0000100")))
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    if isinstance(reader, FileSystemReader) and type(reader.fs) is FileSystem:
        reader.read_data = functools.partial(_read_data, reader, reader.read_data)
    return reader


@contextlib.contextmanager
def reading_into_place():
    """Let the ``dist_checkpointing.load`` calls in the block read through :func:`read_in_place`
    (``compat.torch_dist_readers_through``).

    Example::

        with reading_into_place():
            loaded = dist_checkpointing.load(state, path, **compat.dist_load_options())
    """
    with compat.torch_dist_readers_through(read_in_place):
        yield
