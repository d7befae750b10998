"""PEFT LoRA adapters in: a Hugging Face model's adapter directory as a LoRA checkpoint on that model converted.

Example::

    megatron-patch convert peft-to-megatron --peft-dir llama-lora-peft --base-dir llama-mcore --save-dir llama-lora

The way out, a LoRA checkpoint to PEFT's files, is ``convert.lora``'s, whose file names this reads.
"""

from __future__ import annotations

import json
import os

import torch

from megatron_patch.checkpoint.format import DTYPES, megatron_lm_common_state, read_info, write_info
from megatron_patch.checkpoint.lora import adapters_only, lora_record
from megatron_patch.convert.core import atomic_directory, build_reference_model, shapes_of
from megatron_patch.model.conversion import family_for
from megatron_patch.convert.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megatron_patch.convert.transforms import apply_to_mcore
from megatron_patch.distributed import one_rank_world
from megatron_patch.errors import UserError


@one_rank_world()
def peft_to_megatron(peft_dir: str, base_dir: str, save_dir: str, overwrite: bool = False):
    """Convert a PEFT LoRA adapter directory for a Hugging Face model into a LoRA checkpoint on ``base_dir`` (that
    model converted by ``hf-to-megatron``); return its ``LoraSettings`` (the flags to train it with).

    Example::

        settings = peft_to_megatron("llama-lora-peft", "llama-mcore", "llama-lora")
        # rapidformer --load llama-lora --finetune --lora-rank {settings.rank} --lora-alpha {settings.alpha} ...

    PEFT keeps one adapter per Hugging Face module; megatron-core fuses q/k/v (gate/up) into one layer. Their
    adapters become one of rank k x r there: A stacks the parts' A, B puts each part's B in its own columns and
    the weight's rows (a part PEFT did not adapt has zero rows), so ``B A`` is exactly PEFT's per part. Every layer
    gets the run's one rank, the largest needed (zero rows of A and columns of B fill the others: they add
    nothing), and alpha grows with it so that ``alpha / rank`` is PEFT's scaling.
    """
    from safetensors.torch import load_file

    from megatron_patch.model.lora import LoraSettings, apply_lora

    config = _read_peft_config(peft_dir)
    weights = os.path.join(peft_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise UserError(f"--peft-dir {peft_dir}: no {ADAPTER_WEIGHTS} (save the adapter with safe_serialization)")
    # PEFT's names without the wrapper's prefix: model.layers.0.self_attn.q_proj -> (lora_A, lora_B)
    peft = {}
    for key, tensor in load_file(weights).items():
        module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        peft.setdefault(module, {})[part.removesuffix(".weight")] = tensor.float()
    info = read_info(base_dir)
    m = info.model_config
    family = family_for(dict(info.hf_config or {}, **({} if info.hf_config else {"model_type": "llama"})))
    rules = family.table(m, info.hf_architecture or family.architectures[0]).expanded(m.num_layers)
    shapes, r = shapes_of(m, info.padded_vocab_size), config["r"]
    adapters, used = {}, set()
    for rule in rules:
        modules = [name.removesuffix(".weight") for name in rule.hf]
        parts = [peft.get(module) for module in modules]
        if not rule.mcore.endswith(".weight") or not any(parts):
            continue
        used.update(module for module, part in zip(modules, parts) if part)
        a_parts = [part["A"] for part in parts if part]
        shared = len(a_parts) == len(parts) and all(torch.equal(a, a_parts[0]) for a in a_parts)
        if shared:  # one A already (our own export, or a model without fused layers)
            a = a_parts[0]
            [b] = apply_to_mcore(rule.transforms, [part["B"] for part in parts], shapes)
        else:
            a = torch.cat(a_parts)
            columns, b_parts = 0, []
            for part, module in zip(parts, modules):
                rows = _rows_of(rule, modules, module, peft, m)
                block = torch.zeros(rows, len(a))
                if part:
                    block[:, columns:columns + r] = part["B"]
                    columns += r
                b_parts.append(block)
            [b] = apply_to_mcore(rule.transforms, b_parts, shapes)
        adapters[rule.mcore.removesuffix("weight")] = (a, b)
    unused = sorted(set(peft) - used)
    if unused:
        raise UserError(f"--peft-dir {peft_dir}: adapters of {', '.join(unused[:3])} have no megatron-core layer to "
                        "go to (only attention and dense MLP linears are adapted here)")
    if not adapters:
        raise UserError(f"--peft-dir {peft_dir}: no LoRA adapter of a module of {base_dir}'s model")
    rank = max(len(a) for a, _ in adapters.values())
    targets = tuple(t for t in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
                    if any(prefix.endswith(f".{t}.") for prefix in adapters))
    settings = LoraSettings(rank=rank, alpha=config["lora_alpha"] * rank / r, targets=targets)
    # On the meta device: the base's weights are not needed, only the adapters' names, shapes and sharding.
    model = build_reference_model(m, info.padded_vocab_size, DTYPES[info.dtype].torch, meta=True)
    apply_lora([model], settings, seed=0)
    for name, module in model.named_modules():
        if hasattr(module, "lora_A"):
            a, b = adapters.get(name + ".", (torch.zeros(0, 0), torch.zeros(0, 0)))
            # Zero rows of A and columns of B fill up to the rank (and a layer PEFT left out: layers_to_transform).
            module.lora_A = _filled(module.lora_A, a)
            module.lora_B = _filled(module.lora_B, b)
    with atomic_directory(save_dir, overwrite) as tmp:
        from megatron.core import dist_checkpointing

        weights_dir_ = os.path.join(tmp, "release")
        os.makedirs(weights_dir_)
        common = megatron_lm_common_state(info, 0, **lora_record(settings, base_dir))
        with adapters_only([model]):
            dist_checkpointing.save({**common, **model.sharded_state_dict()}, weights_dir_)
        write_info(tmp, info)
    return settings


def _filled(param: torch.nn.Parameter, values: torch.Tensor) -> torch.nn.Parameter:
    """A CPU parameter of ``param``'s shape, dtype and megatron attributes, zeros but for ``values`` at its start."""
    data = torch.zeros(param.shape, dtype=param.dtype)
    data[:values.shape[0], :values.shape[1]] = values
    filled = torch.nn.Parameter(data, requires_grad=False)
    vars(filled).update({k: v for k, v in vars(param).items() if not k.startswith("_")})
    return filled


def _rows_of(rule, modules, module, peft, m) -> int:
    """Output rows of Hugging Face ``module`` (one part of a fused rule): from its B when PEFT adapted it, else
    from the model's shape (a part PEFT left out)."""
    if peft.get(module):
        return peft[module]["B"].shape[0]
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    name = module.rsplit(".", 1)[-1]
    return {"q_proj": m.num_attention_heads * d, "k_proj": m.num_query_groups * d, "v_proj": m.num_query_groups * d,
            "gate_proj": m.ffn_hidden_size, "up_proj": m.ffn_hidden_size}[name]


def _read_peft_config(peft_dir: str) -> dict:
    """``adapter_config.json``, refused in one line where its adapters are not plain LoRA on linear layers."""
    path = os.path.join(peft_dir, ADAPTER_CONFIG)
    if not os.path.isfile(path):
        raise UserError(f"--peft-dir {peft_dir}: no {ADAPTER_CONFIG} (a PEFT adapter directory holds it)")
    with open(path) as f:
        config = json.load(f)
    refused = [(config.get("peft_type") != "LORA", f"peft_type {config.get('peft_type')}"),
               (config.get("use_dora"), "use_dora"), (config.get("use_rslora"), "use_rslora"),
               (config.get("fan_in_fan_out"), "fan_in_fan_out (GPT-2's Conv1D)"),
               (config.get("bias", "none") != "none", f"bias {config.get('bias')}"),
               (config.get("modules_to_save"), "modules_to_save"),
               (config.get("rank_pattern") or config.get("alpha_pattern"), "rank_pattern/alpha_pattern")]
    named = [what for wrong, what in refused if wrong]
    if named:
        raise UserError(f"--peft-dir {peft_dir}: {ADAPTER_CONFIG} asks for {', '.join(named)}; only plain LoRA "
                        "adapters (one rank and alpha) convert")
    return config
