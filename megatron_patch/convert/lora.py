"""LoRA checkpoints out to Hugging Face: a PEFT adapter directory, or the base with the adapters merged in.

Example::

    megatron-patch convert megatron-to-hf --load-dir lora-ckpt --save-dir llama-lora-peft      # PEFT adapters
    megatron-patch convert megatron-to-hf --load-dir lora-ckpt --save-dir llama-merged --merge-lora

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("llama-hf"), "llama-lora-peft")

The adapters go through the conversion table of the base's family: a fused layer's B has the rows of its weight,
so the weight's row transforms (``fuse_qkv``, ``fuse_gate_up``) split it into PEFT's q/k/v (gate/up) adapters,
which share the one A; ``(alpha / rank) B_q A`` is then exactly the fused adapter's q rows. PEFT writes its files
without the adapter's name (``base_model.model.<module>.lora_A.weight``), as ``adapter_model.safetensors`` with
``adapter_config.json`` beside it.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_patch.checkpoint.format import read_info, weights_dir
from megatron_patch.checkpoint.lora import adapters_only, base_only, is_adapter_key
from megatron_patch.convert.transforms import ROW_MOVES, apply_to_hf

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def settings_of(record: dict):
    """The ``model.lora.LoraSettings`` a LoRA checkpoint's record describes."""
    from megatron_patch.model.lora import LoraSettings

    return LoraSettings(rank=record["lora_rank"], alpha=record["lora_alpha"],
                        targets=tuple(record["lora_target_modules"].split(",")))


def load_lora_reference(model, load_dir: str, record: dict) -> None:
    """Fill a TP=1, PP=1 reference model (``core.build_reference_model``) with the base ``record`` names and the
    adapters of ``load_dir``."""
    from megatron_patch.checkpoint.load import load_into_reference_model
    from megatron_patch.checkpoint.torch_dist import load_dist
    from megatron_patch.model.lora import apply_lora

    apply_lora([model], settings_of(record), seed=0)
    base = record["lora_base"]
    with base_only([model]):
        load_into_reference_model(model, base, read_info(base))
    with adapters_only([model]):
        load_dist([model], weights_dir(load_dir))


def merge_adapters(state: dict[str, torch.Tensor], record: dict) -> dict[str, torch.Tensor]:
    """``state`` (a reference model's tensors by name) with each adapted weight ``W + (alpha / rank) B A`` and no
    adapter tensors: the model PEFT's ``merge_and_unload`` gives."""
    scaling = settings_of(record).scaling
    merged = {name: tensor for name, tensor in state.items() if not is_adapter_key(name)}
    for name in state:
        if name.endswith(".lora_A"):
            prefix = name.removesuffix("lora_A")
            delta = state[prefix + "lora_B"].float() @ state[name].float() * scaling
            weight = merged[prefix + "weight"]
            merged[prefix + "weight"] = (weight.float() + delta).to(weight.dtype)
    return merged


def write_peft_adapter(out_dir: str, state: dict[str, torch.Tensor], rules, shapes, record: dict,
                       base_model: str | None) -> None:
    """Write ``state``'s adapters as a PEFT LoRA directory, named by the base family's conversion ``rules``."""
    from safetensors.torch import save_file

    from megatron_patch.model.conversion import UnsupportedCheckpoint

    tensors, modules = {}, set()
    for rule in rules:
        if not rule.mcore.endswith(".weight"):
            continue
        prefix = rule.mcore.removesuffix("weight")
        if prefix + "lora_A" not in state:
            continue
        if not set(rule.transforms) <= ROW_MOVES:
            raise UnsupportedCheckpoint(f"{rule.mcore} reaches Hugging Face through {', '.join(rule.transforms)}, "
                                        "which PEFT's adapters cannot follow; export with --merge-lora instead")
        a = state[prefix + "lora_A"].contiguous()
        for hf_name, b in zip(rule.hf, apply_to_hf(rule.transforms, state[prefix + "lora_B"], shapes)):
            module = hf_name.removesuffix(".weight")
            modules.add(module.rsplit(".", 1)[-1])
            tensors[f"base_model.model.{module}.lora_A.weight"] = a.clone()
            tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    # PEFT's LoraConfig fields (peft/tuners/lora/config.py) that loading reads; the rest keep its defaults.
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": record["lora_rank"],
              "lora_alpha": record["lora_alpha"], "lora_dropout": 0.0, "target_modules": sorted(modules),
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "base_model_name_or_path": base_model}
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
