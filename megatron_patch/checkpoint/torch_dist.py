"""megatron-core's ``torch_dist`` format (``dist_checkpointing``) read and written as full (TP=1, PP=1) tensors.

Example::

    stream_dist(build_reference_model(config, padded, meta=True), "out/release", produce, info)  # one tensor at a time
    load_dist(chunks, "out/release")                  # into this rank's chunks at any TP/PP, resharded on load
    load_full_into_chunks(chunks, full)               # full tensors by name -> this rank's shards

A torch_dist checkpoint is written under megatron-core's sharded keys with Megatron-LM's common state (its
``args``, :func:`format.megatron_lm_common_state`) in common.pt, so ``dist_checkpointing.load(
model.sharded_state_dict(), dir)`` reshards it to any layout and Megatron-LM resumes it. The offsets of the
sharded state dict are also what :func:`load_full_into_chunks` cuts full tensors with.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from megatron_patch import compat
from megatron_patch.checkpoint.format import ARGS_FILE, CheckpointInfo, CheckpointMismatch, megatron_lm_common_state
from megatron_patch.checkpoint.read_into import reading_into_place
from megatron_patch.errors import first_problems
from megatron_patch.model.names import LAYER


def _sharded_tensors(sharded_state_dict, prefix=""):
    """(state-dict name, ShardedTensor) pairs, factories built (the swiglu fc1 factory yields two)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for name, value in sharded_state_dict.items():
        if isinstance(value, dict):
            yield from _sharded_tensors(value, f"{prefix}{name}.")
        elif isinstance(value, ShardedTensorFactory):
            built = value.build()
            for sharded in built.values() if isinstance(built, dict) else built:
                yield prefix + name, sharded
        elif isinstance(value, ShardedTensor):
            yield prefix + name, value


def _full_index(name: str, sharded) -> tuple[str, tuple[slice, ...]]:
    """The full (TP=1, PP=1) tensor a ShardedTensor is cut from, and where: its global offsets."""
    # Layers of one kind are stacked along a prepended axis (offset = global layer); where they differ (dense and
    # MoE layers, moe_layer_freq) megatron-core keys each layer by its number and only experts are stacked, whose
    # index the reference model's name (EP=1) already holds; so are a multi-token prediction layer's ("mtp.layers.K.").
    if sharded.prepend_axis_num and LAYER.match(name) and not LAYER.match(sharded.key):
        match = LAYER.match(name)
        name = f"{match.group(1)}{sharded.global_offset[0]}.{name[match.end():]}"
    offsets = sharded.global_offset[sharded.prepend_axis_num:]
    return name, tuple(slice(o, o + s) for o, s in zip(offsets, sharded.local_shape))


def check_dist_checkpoint(model, ckpt_dir: str) -> None:
    """Raise CheckpointMismatch naming each tensor the model needs that the checkpoint lacks or holds with
    another global shape (a checkpoint of another architecture), before megatron-core's own less direct errors."""
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(ckpt_dir)
    problems = []
    for _, sharded in _sharded_tensors(model.sharded_state_dict()):
        if sharded.key not in stored:
            problems.append(f"{sharded.key}: missing from the checkpoint (model expects {tuple(sharded.global_shape)})")
        elif tuple(stored[sharded.key].global_shape) != tuple(sharded.global_shape):
            problems.append(f"{sharded.key}: checkpoint has shape {tuple(stored[sharded.key].global_shape)}, "
                            f"model expects {tuple(sharded.global_shape)}")
    if problems:
        raise CheckpointMismatch(f"{ckpt_dir} does not fit the model its description ({ARGS_FILE} or Megatron-LM "
                                 "args) records: "
                                 f"{first_problems(sorted(set(problems)))}")


def save_dist(model, ckpt_dir: str, info: CheckpointInfo) -> None:
    """Write ``model`` as a torch_dist checkpoint with Megatron-LM's common state (:func:`megatron_lm_common_state`)."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save({**megatron_lm_common_state(info, 0), **model.sharded_state_dict()}, ckpt_dir)


def stream_dist(model, ckpt_dir: str, materialise: Callable[[str], torch.Tensor], info: CheckpointInfo) -> None:
    """Write a torch_dist checkpoint of ``model`` (a meta-device reference model: it only lends names, shapes
    and megatron-core's sharding) whose tensors come from ``materialise(name)``, one at a time.

    Example::

        stream_dist(build_reference_model(config, padded, meta=True), "out/release",
                    lambda name: read_and_transform(name), info)  # full (TP=1) tensor by megatron-core name

    megatron-core's own ``dist_checkpointing.save`` writes metadata.json, common.pt (the state dict's non-tensor
    entries: Megatron-LM's ``args``, from ``info``) and the DCP metadata; only
    the tensor writing is replaced: synchronously, by PyTorch DCP's ``FileSystemWriter`` with one thread (its data
    file written around the page cache, :mod:`megatron_patch.checkpoint.direct_io`), whose planner asks for each
    tensor as the file reaches it. So one tensor group is in memory at a time (megatron's
    default strategy holds all of them and copies them to writer processes), and the files are those of its
    torch_dist format, which ``dist_checkpointing.load`` reshards to any TP/PP.
    """
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    sharded_state = model.sharded_state_dict()
    sources = {(sharded.key, tuple(sharded.global_offset)): _full_index(name, sharded)
               for name, sharded in _sharded_tensors(sharded_state)}
    dist_checkpointing.save({**megatron_lm_common_state(info, 0), **sharded_state}, ckpt_dir,
                            sharded_strategy=_streaming_strategy(sources, materialise))


def _streaming_strategy(sources: dict, materialise: Callable[[str], torch.Tensor]):
    """megatron-core's torch_dist save strategy with the writing done lazily (see :func:`stream_dist`)."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.planner import WriteItemType

    from megatron_patch.checkpoint.direct_io import DirectFileSystemWriter

    class LazyPlanner(MCoreSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False)
            self.current: tuple[str | None, torch.Tensor | None] = (None, None)

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            name, index = sources[(write_item.index.fqn, tuple(write_item.index.offset))]
            if self.current[0] != name:  # items come in state-dict order: a swiglu fc1's halves follow each other
                self.current = (None, None)  # drop the previous group before making the next
                self.current = (name, materialise(name))
            chunk = write_item.tensor_data.chunk
            tensor = self.current[1][index].reshape(chunk.sizes)  # with the prepended layer axis
            expected = write_item.tensor_data.properties.dtype
            if tensor.dtype != expected:
                raise CheckpointMismatch(f"{name}: produced {tensor.dtype}, the model holds {expected}")
            return exact_storage(tensor)

    class StreamingStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state = compat.by_sharded_key(sharded_state_dict)
            dcp_save(mcore_to_pyt_state_dict(state, is_loading=False), planner=LazyPlanner(),
                     storage_writer=DirectFileSystemWriter(checkpoint_dir))

    return StreamingStrategy("torch_dist", 1)


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` over a storage of exactly its own bytes, sharing them (the slice keeps the whole alive).

    Example::

        fc1 = torch.zeros(4, 2)
        exact_storage(fc1[:2]).untyped_storage().nbytes()     # 16, where fc1[:2]'s storage holds 32

    PyTorch DCP's writer copies a tensor whose storage is larger than it (filesystem.py, ``_SerialCpuLoader.values``),
    so as not to save the rest; a swiglu ``linear_fc1``'s gate and up halves, which megatron-core's factory saves as
    two tensors, are each a contiguous part of one: copying them cost a conversion over 40% of a LLaMA-shaped
    model's bytes.
    """
    storage = tensor.untyped_storage()
    if storage.nbytes() == tensor.nbytes or not tensor.is_contiguous():
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype).set_(storage[start:start + tensor.nbytes], 0, tensor.shape)


def load_dist(chunks, ckpt_dir: str) -> None:
    """Load a torch_dist checkpoint into this rank's model chunks at whatever layout they were built."""
    from megatron.core import dist_checkpointing

    for chunk in chunks:
        check_dist_checkpoint(chunk, ckpt_dir)
    # All chunks in one load, as Megatron-LM's "model0", "model1", ...: dist_checkpointing checks that the ranks of
    # a load cover each tensor whole, and under virtual pipelining one chunk per rank holds only some of the layers.
    sharded = {f"model{index}": chunk.sharded_state_dict() for index, chunk in enumerate(chunks)}
    with reading_into_place(), compat.refusals_raised():
        state = dist_checkpointing.load(sharded, ckpt_dir, **compat.dist_load_options())
    for index, chunk in enumerate(chunks):
        chunk.load_state_dict(state[f"model{index}"], strict=False)


def load_full_into_chunks(chunks, full: dict[str, torch.Tensor]) -> None:
    """Fill this rank's chunks (any TP/PP/VPP) from full tensors, using the offsets of megatron-core's sharded
    state dict (the mapping dist_checkpointing reshards with)."""
    with torch.no_grad():
        for chunk in chunks:
            for name, sharded in _sharded_tensors(chunk.sharded_state_dict()):
                name, index = _full_index(name, sharded)
                if name == "output_layer.weight" and name not in full:
                    name = "embedding.word_embeddings.weight"  # the last stage's copy of tied embeddings
                sharded.data.copy_(full[name][index])
