"""Hugging Face directories, tensor by tensor: a lazy reader over safetensors shards and a sharding writer.

Example::

    reader = HFReader("llama-dir")                    # opens headers only
    reader.shape("model.norm.weight")                 # torch.Size([2048]) without reading data
    tensor = reader.get("model.norm.weight")          # reads this one tensor
    qkv = reader.read_runs(names, row_runs(("fuse_qkv",), hf_shapes, sizes), qkv_shape)  # rows read into place

    with ShardedSafetensorsWriter("out-dir", max_shard_bytes=2 << 30) as writer:
        writer.add("model.norm.weight", tensor)       # flushed to model-0000k-of-0000n.safetensors as shards fill

Safetensors files are read one tensor at a time (``pread``, no memory map), so a conversion holds the tensors of
one mapping rule, not the model. ``pytorch_model*.bin`` files are a fallback, loaded with ``weights_only=True`` (no
pickled code runs) and memory-mapped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from typing import Sequence

import torch
from safetensors.torch import save_file

from megatron_patch.convert.transforms import RowRun
from megatron_patch.errors import UserError, read_json

# Files a tokenizer may consist of; copied along with a conversion so the exported directory is complete.
# chat_template.jinja: transformers >= 4.43 saves a tokenizer's chat template there, not in tokenizer_config.json
# (utils/hub.py CHAT_TEMPLATE_FILE); chat_template.json is the older processors' file.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "vocab.txt", "tokenizer.model", "added_tokens.json", "generation_config.json", "chat_template.jinja",
    "chat_template.json",
)
# Named templates beside the default one (utils/hub.py CHAT_TEMPLATE_DIR).
CHAT_TEMPLATE_DIR = "additional_chat_templates"


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{hf_dir} has no config.json; --hf-dir must be a Hugging Face model directory")
    config = read_json(path, "restore the model's config.json (save_pretrained writes it)")
    if not isinstance(config, dict):
        raise UserError(f"{path} holds a JSON {type(config).__name__}, not a model's config; restore the model's "
                        "config.json (save_pretrained writes it)")
    return config


class HFReader:
    """Lazy access to the tensors of a Hugging Face directory (safetensors preferred, ``.bin`` fallback)."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        self._entries: dict[str, _Entry] = {}
        self._bin: dict[str, torch.Tensor] = {}
        safetensors_files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
        if safetensors_files:
            for name in safetensors_files:
                self._entries.update(_read_header(os.path.join(hf_dir, name)))
            return
        bin_files = sorted(f for f in os.listdir(hf_dir) if f.startswith("pytorch_model") and f.endswith(".bin"))
        if not bin_files:
            raise FileNotFoundError(f"{hf_dir} holds no *.safetensors or pytorch_model*.bin weights")
        for name in bin_files:
            self._bin.update(torch.load(os.path.join(hf_dir, name), map_location="cpu", weights_only=True, mmap=True))

    def names(self) -> list[str]:
        return sorted(self._bin or self._entries)

    def shape(self, name: str) -> torch.Size:
        return self._bin[name].shape if name in self._bin else self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._bin[name].dtype if name in self._bin else self._entries[name].dtype

    def nbytes(self, name: str) -> int:
        return self.shape(name).numel() * self.dtype(name).itemsize

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read with ``pread`` into its own memory: no mapping of the file stays behind, so the
        process holds only the tensors in use (a memory map would count every page read in its RSS)."""
        if name in self._bin:
            return self._bin[name]
        data = torch.empty(self.shape(name), dtype=self.dtype(name))
        self.read_rows(name, 0, data)
        return data

    def read_runs(self, names: Sequence[str], runs: Sequence[RowRun], shape: torch.Size) -> torch.Tensor:
        """The tensor of ``shape`` whose rows come from ``names`` as ``runs`` (:func:`transforms.row_runs`) say,
        each read into place: what the row-moving transforms make of the tensors, without intermediate copies."""
        out = torch.empty(shape, dtype=self.dtype(names[0]))
        for run in runs:
            rows = out[run.start:run.start + run.rows]
            if run.source is None:
                rows.zero_()
            else:
                self.read_rows(names[run.source], run.source_start, rows)
        return out

    def read_rows(self, name: str, first: int, out: torch.Tensor) -> None:
        """Rows (dim 0) ``first ...`` of the tensor into ``out``, a contiguous tensor of as many rows: a
        transform that only places rows reads each where it belongs (:func:`transforms.row_runs`)."""
        if name in self._bin:
            out.copy_(self._bin[name][first:first + out.shape[0]])
            return
        entry = self._entries[name]
        if entry.end - entry.begin != entry.shape.numel() * entry.dtype.itemsize:
            raise OSError(f"{entry.path}: tensor {name} has {entry.end - entry.begin} bytes of data, its shape "
                          f"{tuple(entry.shape)} needs {entry.shape.numel() * entry.dtype.itemsize}; the file is "
                          "damaged: download it again")
        row_bytes = entry.shape[1:].numel() * entry.dtype.itemsize
        view, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
        begin = entry.begin + first * row_bytes
        if begin + len(view) > entry.end:
            raise ValueError(f"{name}: rows {first}..{first + out.shape[0]} are outside its {entry.shape[0]} rows")
        with open(entry.path, "rb", buffering=0) as f:
            while done < len(view):  # one read returns at most ~2 GiB on Linux
                count = os.preadv(f.fileno(), [view[done:]], begin + done)
                if count == 0:
                    raise OSError(f"{entry.path}: file ends inside tensor {name}")
                done += count


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: str
    dtype: torch.dtype
    shape: torch.Size
    begin: int
    """Absolute byte offsets of the tensor's data in the file."""
    end: int


def _read_header(path: str) -> dict[str, _Entry]:
    """The tensors of a safetensors file: an 8-byte little-endian header length, a JSON header
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` (offsets after the header), then the data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    start = 8 + length
    return {name: _Entry(path, _SAFETENSORS_DTYPES[e["dtype"]], torch.Size(e["shape"]), start + e["data_offsets"][0],
                         start + e["data_offsets"][1]) for name, e in header.items()}


class ShardedSafetensorsWriter:
    """Write tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_shard_bytes`` (one
    tensor may exceed it) plus ``model.safetensors.index.json``, the layout ``from_pretrained`` reads."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 5 << 30):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        index = len(self._shards)
        save_file(self._pending, os.path.join(self.out_dir, f"shard-{index}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        weight_map = {}
        for index, names in enumerate(self._shards):
            final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(os.path.join(self.out_dir, f"shard-{index}.tmp"), os.path.join(self.out_dir, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                      f, indent=2)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()


def copy_tokenizer_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy whichever tokenizer files ``src_dir`` has (chat templates included); return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src_dir, name)):
            os.makedirs(dst_dir, exist_ok=True)
            shutil.copy2(os.path.join(src_dir, name), os.path.join(dst_dir, name))
            copied.append(name)
    if os.path.isdir(os.path.join(src_dir, CHAT_TEMPLATE_DIR)):
        shutil.copytree(os.path.join(src_dir, CHAT_TEMPLATE_DIR), os.path.join(dst_dir, CHAT_TEMPLATE_DIR),
                        dirs_exist_ok=True)
        copied.append(CHAT_TEMPLATE_DIR)
    return copied
