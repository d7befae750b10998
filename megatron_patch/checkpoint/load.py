"""A checkpoint's model weights, in either format, into a model built at any layout.

Example::

    info = read_info("llama-mcore")
    load_into_chunks(chunks, "llama-mcore", info)     # this rank's chunks at any TP/PP/VPP; every rank calls it
    load_into_reference_model(model, "llama-mcore", info)  # one process's TP=1, PP=1 model, names and shapes checked

torch_dist is resharded by ``dist_checkpointing`` (:mod:`torch_dist`); the legacy per-rank files are merged into
full tensors and cut to the layout wanted (:mod:`legacy`). The trainer loads a converted or Megatron-LM
checkpoint's model with :func:`load_into_chunks`, a conversion its reference model with
:func:`load_into_reference_model`.
"""

from __future__ import annotations

import torch

from megatron_patch.checkpoint.format import CheckpointInfo, partition_dims, weights_dir
from megatron_patch.checkpoint.legacy import load_legacy, merge_legacy
from megatron_patch.checkpoint.torch_dist import load_dist, load_full_into_chunks


def load_into_chunks(chunks, megatron_dir: str, info: CheckpointInfo) -> None:
    """Fill this rank's chunks (built at any TP/PP with ``info.padded_vocab_size``) from a converted or
    Megatron-LM checkpoint; every rank of the world calls it. dist_checkpointing reshards torch_dist; the legacy
    format is merged to full tensors and cut to this layout.

    Example::

        info = read_info("llama-mcore")
        chunks = build_model_chunks(info.model_config, ParallelConfig(tensor_model_parallel_size=2),
                                    info.padded_vocab_size)
        load_into_chunks(chunks, "llama-mcore", info)
    """
    if info.format == "torch_dist":
        load_dist(chunks, weights_dir(megatron_dir))
        return
    # Every rank merges the per-rank files into full tensors and cuts out its own shards; the split
    # dimensions come from all ranks' parameters (a stage sees only its own).
    dims = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(dims, {k: v for c in chunks for k, v in partition_dims(c).items()})
    merged = merge_legacy(weights_dir(megatron_dir), info, {k: v for d in dims for k, v in d.items()})
    load_full_into_chunks(chunks, merged)


def load_into_reference_model(model, megatron_dir: str, info: CheckpointInfo) -> None:
    """Fill a TP=1, PP=1 model of one process from ``megatron_dir``'s checkpoint, either format.

    Example::

        model = build_reference_model(info.model_config, info.padded_vocab_size)
        load_into_reference_model(model, "llama-mcore", info)
    """
    _LOADERS[info.format](model, weights_dir(megatron_dir), info)


_LOADERS = {
    "torch_dist": lambda model, path, info: load_dist([model], path),
    "torch": load_legacy,
}
