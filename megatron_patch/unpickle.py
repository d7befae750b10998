"""What a checkpoint load unpickles: tensors and plain values, and DCP's index of them; a file whose pickle would
call anything else is refused in one line naming the file and the call, and nothing of it runs.

Example::

    load_plain_values("ckpt/iter_0000100/trainer_state.pt")["iteration"]            # 100
    with open("ckpt/iter_0000100/.metadata", "rb") as f:
        load_dcp_metadata(f, "ckpt/iter_0000100/.metadata").storage_data

Our own readers call these; ``compat.read_checkpoints_running_no_code`` makes torch DCP's and megatron-core's
readers call them too. On the ground floor, beside compat, for that reason.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pathlib
import pickle

import torch

from megatron_patch.errors import CorruptCheckpointError


def load_plain_values(file, name: str | None = None, *, map_location="cpu"):
    """Read a ``torch.save`` file of tensors and plain values with ``weights_only=True``, so that a checkpoint from
    elsewhere runs no code when it loads: our ``rng/rank_*.pt`` and ``trainer_state.pt``, megatron-core's common.pt
    and the objects a ``.distcp`` stores (``compat.read_checkpoints_running_no_code``).

    Example::

        load_plain_values("ckpt/iter_0000100/rng/rank_00000.pt")["world_size"]     # 2

    ``file``: a path, or a file object that ``name`` names in the error. Besides tensors, only the types
    megatron-core's ``register_safe_globals`` admits (megatron/core/safe_globals.py, 0.16 and 0.19: Megatron-LM's
    ``args`` Namespace and enums, NumPy arrays, as an RNG file saved before NumPy's state was a tensor holds it);
    a pickle that would call anything else is refused, naming the file and the call.
    """
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise unsafe_pickle(file, name) from None


def unsafe_pickle(file, name: str | None = None) -> CorruptCheckpointError:
    """The refusal of the ``torch.save`` file ``file`` (a path or a file object; ``name`` names it), whose pickle
    calls what the weights-only unpickler does not admit, naming the calls.

    Example::

        raise unsafe_pickle("ckpt/iter_0000100/mp_rank_00/model_optim_rng.pt")   # ... would call posix.system ...
    """
    if hasattr(file, "seek"):
        file.seek(0)
    # Named from the pickle's opcodes, which torch reads without running any of them.
    return _refusal(name or file, ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(file)))


def _refusal(name: str, calls: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint file {name} would call {calls} when loaded, where a checkpoint holds "
                                  "tensors and plain values only; not loaded: use a checkpoint from a source you trust")


# The modules whose dataclasses and enums DCP's .metadata pickles: its Metadata, the MetadataIndex, storage and
# tensor properties it indexes, each item's _StorageInfo (filesystem.py) and, with torch 2.13, the savers' SavePlans
# and WriteItems (planner.py). Any of their classes: building one sets its fields and runs nothing else.
_DCP_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                         "torch.distributed.checkpoint.filesystem")


class _Refused(pickle.UnpicklingError):
    """A global :class:`_DcpMetadataUnpickler` does not resolve (a damaged pickle raises UnpicklingError too)."""


class _DcpMetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata``: a plain pickle (``FileSystemWriter.finish``'s ``pickle.dump``), not a ``torch.save``
    file, so torch's weights-only unpickler does not read it. Resolves only what such a pickle holds: the classes of
    :data:`_DCP_METADATA_MODULES`, ``torch.Size``, dtypes and layouts (``torch.serialization._get_layout``, by
    name), ``pathlib`` paths; anything else raises with its name.

    Example::

        _DcpMetadataUnpickler(open("ckpt/iter_0000100/.metadata", "rb")).load().storage_data
    """

    def find_class(self, module: str, name: str):
        if module in _DCP_METADATA_MODULES:
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        elif module.split(".")[0] == "pathlib":  # StorageMeta.checkpoint_id of a save given a Path (conversions')
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and issubclass(found, pathlib.PurePath):
                return found
        raise _Refused(f"{module}.{name}")


def load_dcp_metadata(file, name: str):
    """DCP's ``Metadata`` from the ``.metadata`` file object ``file`` (``name`` names it), read by
    :class:`_DcpMetadataUnpickler`; a pickle that would call anything else is refused, naming the file and the call.

    Example::

        with open("ckpt/iter_0000100/.metadata", "rb") as f:
            load_dcp_metadata(f, "ckpt/iter_0000100/.metadata").storage_data
    """
    try:
        return _DcpMetadataUnpickler(file).load()
    except _Refused as refused:
        raise _refusal(name, str(refused)) from None
