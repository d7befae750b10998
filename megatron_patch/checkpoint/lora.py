"""LoRA checkpoints: the adapters, their optimizer state and the scheduler, naming the base they were trained on.

Example::

    rapidformer ... --load llama-mcore --finetune --lora-rank 8 --save lora-ckpt   # adapters on llama-mcore
    rapidformer ... --load lora-ckpt --lora-rank 8 --save lora-ckpt                # resumes: base, then adapters

A LoRA run's save holds only the adapter tensors (``...lora_A``, ``...lora_B``) and the optimizer state of those
(the only parameters the optimizer has), written by ``checkpoint.megatron`` as any save is (torch_dist, checksums,
staging); its Megatron-LM ``args`` (common.pt) record the adapters' shape and the base: its directory and a
digest of the base's files (``base_digest``). Loading one loads that base first (refused in one line when it is
missing or its files changed), then the adapters with their optimizer, so a resume continues exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import torch

from megatron_patch import compat
from megatron_patch.checkpoint.format import read_args_state, read_info, read_tracker, weights_dir
from megatron_patch.checkpoint.integrity import CHECKSUMS
from megatron_patch.checkpoint.megatron import load_megatron_checkpoint, save_megatron_checkpoint
from megatron_patch.errors import UserError

_ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def is_adapter_key(key: str) -> bool:
    """Whether a megatron-core tensor name or checkpoint key is an adapter's.

    Example::

        >>> is_adapter_key("decoder.layers.0.self_attention.linear_qkv.lora_B")
        True
    """
    return key.endswith(_ADAPTER_SUFFIXES)


def base_digest(root: str) -> str:
    """A digest of ``root``'s latest checkpoint files: the CRC-32s its ``checksums.json`` lists when it has one
    (what every save here writes), else each file's name and size with the bytes of its small index files (a
    conversion's), so that a replaced base is told apart without reading its weights again."""
    path = weights_dir(root)
    digest = hashlib.sha256()
    listed = os.path.join(path, CHECKSUMS)
    if os.path.isfile(listed):
        with open(listed) as f:
            digest.update(json.dumps(json.load(f)["files"], sort_keys=True).encode())
        return digest.hexdigest()
    for directory, _, names in sorted(os.walk(path)):
        for name in sorted(names):
            file = os.path.join(directory, name)
            digest.update(f"{os.path.relpath(file, path)}:{os.path.getsize(file)}".encode())
            if name.endswith((".json", ".metadata", ".pt")) and os.path.getsize(file) < 1 << 20:
                with open(file, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


def lora_record(settings, base: str) -> dict:
    """What a LoRA save's ``args`` carry besides the run's: the adapters' shape and the base they adapt."""
    return dict(lora_rank=settings.rank, lora_alpha=settings.alpha, lora_target_modules=",".join(settings.targets),
                lora_base=os.path.abspath(base), lora_base_digest=base_digest(base))


def read_lora_record(root: str) -> dict | None:
    """The LoRA record of ``root``'s latest checkpoint (``lora_record``'s fields); None for any other checkpoint."""
    if read_tracker(root) is None:
        return None
    path = weights_dir(root)
    source = compat.common_state_source(path)
    if not os.path.isfile(source):
        return None
    args = read_args_state(source).get("args")
    if getattr(args, "lora_base", None) is None:
        return None
    return {key: getattr(args, key) for key in ("lora_rank", "lora_alpha", "lora_target_modules", "lora_base",
                                                "lora_base_digest")}


@contextlib.contextmanager
def _state_of(chunks: list, keep):
    """Within it the model chunks' sharded state holds only the tensors whose key ``keep`` accepts, and loading a
    state of those leaves the others as they are, so ``checkpoint.megatron`` and ``checkpoint.load`` save and load
    a part of the model unchanged."""
    from megatron.core.utils import unwrap_model

    # The model under DDP and Float16Module (whose state methods call it): where a state filter must sit for every
    # loader, those that unwrap the chunk as well as those that do not.
    modules = unwrap_model(list(chunks))

    def sharded_state_dict(module, *args, **kwargs):
        state = type(module).sharded_state_dict(module, *args, **kwargs)
        return {key: value for key, value in state.items() if keep(key)}

    def load_state_dict(module, state, strict=True):
        missing, unexpected = torch.nn.Module.load_state_dict(module, state, strict=False)
        missing = [key for key in missing if keep(key) and not key.endswith("_extra_state")]
        if strict and (missing or unexpected):
            raise RuntimeError(f"loading a part of the model: missing {missing}, unexpected {unexpected}")
        return missing, unexpected

    for module in modules:
        module.sharded_state_dict = sharded_state_dict.__get__(module)
        module.load_state_dict = load_state_dict.__get__(module)
    try:
        yield
    finally:
        for module in modules:
            del module.sharded_state_dict, module.load_state_dict


def adapters_only(chunks: list):
    """The adapters alone: what a LoRA save writes and its load reads back."""
    return _state_of(chunks, is_adapter_key)


def base_only(chunks: list):
    """Everything but the adapters: the base a LoRA model loads (which has no adapters)."""
    return _state_of(chunks, lambda key: not is_adapter_key(key))


def save_lora_checkpoint(root: str, iteration: int, chunks: list, optimizer, scheduler, info, settings, base: str,
                         **options) -> str:
    """``save_megatron_checkpoint`` of the adapters (and their optimizer), ``base`` named in its args.

    Example::

        save_lora_checkpoint("lora-ckpt", 100, chunks, optimizer, scheduler, info, settings, base="llama-mcore")
    """
    if base is None:
        raise UserError(f"--save {root}: no base model was loaded (--load had no checkpoint); LoRA adapters are "
                        "saved against their base: give --load BASE --finetune")
    run_args = {**(options.pop("run_args", None) or {}), **lora_record(settings, base)}
    with adapters_only(chunks):
        return save_megatron_checkpoint(root, iteration, chunks, optimizer, scheduler, info or read_info(base),
                                        run_args=run_args, **options)


def load_lora_checkpoint(root: str, chunks: list, optimizer, scheduler, settings, **options) -> tuple[int, str]:
    """Load ``root`` into a LoRA model: a base (with ``--finetune``: its model alone, the adapters initialised) or a
    LoRA checkpoint (its base, then its adapters, optimizer and scheduler); return the iteration to resume from and
    the base's directory.

    Example::

        iteration, base = load_lora_checkpoint("lora-ckpt", chunks, optimizer, scheduler, settings)
    """
    record = read_lora_record(root)
    if record is None:
        if not options.get("finetune"):
            raise UserError(f"--load {root} is not a LoRA checkpoint: to train adapters on it as the base, add "
                            "--finetune")
        with base_only(chunks):
            return load_megatron_checkpoint(root, chunks, optimizer, scheduler, **options), root
    _check_record(root, record, settings)
    base = record["lora_base"]
    with base_only(chunks):
        load_megatron_checkpoint(base, chunks, optimizer, scheduler,
                                 **{**options, "finetune": True, "load_optim": False, "load_rng": False})
    with adapters_only(chunks):
        iteration = load_megatron_checkpoint(root, chunks, optimizer, scheduler, **options)
    return iteration, base


def _check_record(root: str, record: dict, settings) -> None:
    """Refuse, in one line, adapters of another shape than the flags' or a base that is gone or changed."""
    given = dict(lora_rank=settings.rank, lora_alpha=settings.alpha,
                 lora_target_modules=",".join(settings.targets))
    for key, value in given.items():
        if record[key] != value:
            flag = "--" + key.replace("_", "-")
            raise UserError(f"--load {root}: its adapters were trained with {flag} {record[key]}, this run gives "
                            f"{value}; give {flag} {record[key]}")
    base = record["lora_base"]
    if read_tracker(base) is None:
        raise UserError(f"--load {root}: its base checkpoint {base} is missing; put the base it was trained on back "
                        "there")
    if base_digest(base) != record["lora_base_digest"]:
        raise UserError(f"--load {root}: its base checkpoint {base} is not the one the adapters were trained on (its "
                        "files differ); put that base back there")
