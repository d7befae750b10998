"""LoRA adapters (Hu et al. 2021, https://arxiv.org/abs/2106.09685) on megatron-core's tensor-parallel linears,
the base frozen, so that the optimizer holds (and the distributed optimizer shards) the adapters alone.

Example::

    rapidformer --task pretraining --load llama-mcore --finetune --lora-rank 8 --lora-alpha 16 ...

    chunks = build_model_chunks(model_config, parallel_config, padded_vocab)
    apply_lora(chunks, LoraSettings(rank=8, alpha=16.0), seed=1234)      # before DDP and the optimizer

Each adapted layer adds ``(alpha / rank) * B(A(dropout(x)))`` to its output, as PEFT's ``LoraLayer`` does. The
adapters follow the layer's tensor parallelism (the split megatron-core 0.16.1 has no PEFT code of its own for):
on a column-parallel layer (``linear_qkv``, ``linear_fc1``) A is replicated and B split like the layer's output
rows; on a row-parallel layer (``linear_proj``, ``linear_fc2``) A is split like the layer's input columns and B
replicated. The rank-r activation between them crosses the tensor-parallel group (all-reduce, or with sequence
parallelism all-gather / reduce-scatter along the sequence, as the layer's own input and output do). The layer's
class is swapped for a subclass that adds the adapter, so the base weights keep their checkpoint keys
(``...linear_qkv.weight``) and the adapters sit beside them (``...linear_qkv.lora_A``, ``...linear_qkv.lora_B``).

A fused ``linear_qkv`` has one adapter for q, k and v together (one A, B's rows in the weight's per-group
[q, k, v] order), which PEFT writes as three adapters sharing A; likewise ``linear_fc1`` for SwiGLU's gate and up.
A mixture of experts' routed and shared experts are not adapted (attention and dense MLP layers are).
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch

from megatron_patch.errors import UserError

# megatron-core's layer names and the PEFT (Hugging Face) module names each one fuses.
MCORE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
PEFT_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
_FUSED = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """The adapters a run adds: rank, alpha (scaling alpha / rank), dropout and megatron-core target layers.

    Example::

        LoraSettings(rank=8, alpha=16.0, targets=("linear_qkv", "linear_proj")).scaling     # 2.0
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = MCORE_TARGETS
    named: tuple[str, ...] = ()
    """The modules the user named (``--lora-target-modules``): each must exist in the model. Without any, the
    targets the model has are adapted (a mixture of experts' attention alone, its MLPs being experts)."""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def resolve_targets(names, flag: str = "--lora-target-modules") -> tuple[str, ...]:
    """megatron-core layer names for PEFT's or megatron-core's ``names``; a fused layer needs all its PEFT parts.

    Example::

        >>> resolve_targets(["q_proj", "k_proj", "v_proj", "down_proj"])
        ('linear_qkv', 'linear_fc2')
    """
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in PEFT_TARGETS and n not in MCORE_TARGETS]
    if unknown:
        raise UserError(f"{flag} {','.join(unknown)}: unknown module; give PEFT's names "
                        f"({','.join(PEFT_TARGETS)}) or megatron-core's ({','.join(MCORE_TARGETS)})")
    for fused, parts in _FUSED.items():
        given = [p for p in parts if p in names]
        # gate_proj alone has no meaning either; up_proj alone is a non-gated MLP's whole linear_fc1.
        if given and len(given) < len(parts) and given != ["up_proj"]:
            raise UserError(f"{flag} {','.join(given)}: megatron-core fuses {', '.join(parts)} into one {fused} "
                            f"layer with one adapter; give all of {','.join(parts)} (or {fused})")
    return tuple(t for t in MCORE_TARGETS if t in {PEFT_TARGETS.get(n, n) for n in names})


class _LoraLinear:
    """Mixed into the adapted layer's own class (``_adapted_class``): its forward adds the adapter's output, its
    sharded state splits the adapter like the layer."""

    lora_column: bool  # column-parallel (B split by rows) or row-parallel (A split by columns)

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output + self.lora_delta(input_), bias

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        sequence_parallel = self.sequence_parallel and self.tp_group.size() > 1
        hidden = torch.nn.functional.linear(self.lora_dropout(x), self.lora_A)
        if self.lora_column:
            # A is replicated: the activation is complete here; B's rows need all of it, and its gradient is the
            # sum of every rank's part of B (the copy's backward all-reduces it).
            hidden = (mappings.gather_from_sequence_parallel_region(hidden, group=self.tp_group)
                      if sequence_parallel else mappings.copy_to_tensor_model_parallel_region(hidden, self.tp_group))
        else:
            # A holds this rank's input columns: the activation is a partial sum, reduced as the layer's output is.
            hidden = (mappings.reduce_scatter_to_sequence_parallel_region(hidden, group=self.tp_group)
                      if sequence_parallel
                      else mappings.reduce_from_tensor_model_parallel_region(hidden, self.tp_group))
        return torch.nn.functional.linear(hidden, self.lora_B) * self.lora_scaling

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        axes = {"weight": 0, "bias": 0, "lora_B": 0} if self.lora_column else {"weight": 1, "lora_A": 1}
        state = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                    sharded_offsets, tp_group=self.tp_group,
                                                    dp_cp_group=metadata["dp_cp_group"])
        if self.lora_gated:
            # Each rank's rows of a SwiGLU linear_fc1 are [its gate rows; its up rows]; B's rows follow them, and are
            # checkpointed as the weight is (MLP.sharded_state_dict), so the saved B is [gate; up] as at TP=1.
            key = f"{prefix}lora_B"
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets,
                                                      metadata.get("singleton_local_shards", False))
        return state


_CLASSES: dict[type, type] = {}


def _adapted_class(cls: type) -> type:
    if cls not in _CLASSES:
        if hasattr(cls, "unnormed"):
            # A sandwich norm's linear layer (layers.with_post_norm): the adapter adds to the projection, before the
            # norm, as PEFT's does to o_proj and down_proj, which the norm follows as a module of its own.
            from megatron_patch.model.layers import with_post_norm

            _CLASSES[cls] = with_post_norm(_adapted_class(cls.unnormed), cls.post_norm)
        else:
            _CLASSES[cls] = type(f"Lora{cls.__name__}", (_LoraLinear, cls), {})
    return _CLASSES[cls]


def _layers(chunk: torch.nn.Module, targets: tuple[str, ...]):
    """``(layer_key, name, module)`` of each target layer of ``chunk``: the key names the layer by its global
    layer number, the same at every pipeline layout."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for layer in chunk.modules():
        if not isinstance(layer, TransformerLayer):
            continue
        for name, module in layer.named_modules():
            if name.rsplit(".", 1)[-1] in targets and "experts" not in name:
                yield f"{layer.layer_number}.{name}", name, module


def apply_lora(chunks: list[torch.nn.Module], settings: LoraSettings, seed: int) -> int:
    """Add adapters to ``settings.targets`` of every chunk and freeze everything else; return the number of
    adapter parameters on this rank. A is initialised as PEFT initialises it (Kaiming-uniform, a=sqrt(5)) from a
    generator seeded by ``seed`` and the layer, then cut to this rank's part, so every layout starts alike; B is
    zero, so the adapted model starts as the base.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    found, count = set(), 0
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        for key, name, module in _layers(chunk, settings.targets):
            if getattr(type(module), "unnormed", type(module)) not in (ColumnParallelLinear, RowParallelLinear):
                raise UserError(f"--lora-rank: {name} is a {type(module).__name__}; adapters wrap megatron-core's "
                                "local ColumnParallelLinear/RowParallelLinear only: give --transformer-impl local")
            column = isinstance(module, ColumnParallelLinear)
            if "gate_proj" in settings.named and name.endswith("linear_fc1") and not module.config.gated_linear_unit:
                raise UserError(f"--lora-target-modules {','.join(settings.named)}: the model's MLP has no gate_proj "
                                "(it is not gated, e.g. SwiGLU); its linear_fc1 is up_proj: drop gate_proj")
            found.add(name.rsplit(".", 1)[-1])
            weight = module.weight
            out_local, in_local = weight.shape
            tp, rank = module.tp_group.size(), module.tp_group.rank()
            in_full = in_local if column else in_local * tp
            generator = torch.Generator().manual_seed(seed + zlib.crc32(key.encode()))
            a_full = torch.empty(settings.rank, in_full)
            # PEFT's LoraLayer.reset_lora_parameters: nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5)).
            bound = 1.0 / math.sqrt(in_full)
            a_full.uniform_(-bound, bound, generator=generator)
            a = a_full if column else a_full[:, rank * in_local:(rank + 1) * in_local]
            b = torch.zeros(out_local, settings.rank)
            module.__class__ = _adapted_class(type(module))
            module.lora_column, module.lora_scaling = column, settings.scaling
            module.lora_gated = column and name.endswith("linear_fc1") and module.config.gated_linear_unit
            module.lora_dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
            module.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype).contiguous())
            module.lora_B = torch.nn.Parameter(b.to(device=weight.device, dtype=weight.dtype))
            split, replicated = (module.lora_B, module.lora_A) if column else (module.lora_A, module.lora_B)
            set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
            # A replicated adapter's gradient is summed over the sequence shards under sequence parallelism;
            # megatron-core's finalize_model_grads all-reduces parameters marked so (as it does the norms').
            setattr(replicated, "sequence_parallel", module.sequence_parallel)
            count += module.lora_A.numel() + module.lora_B.numel()
        _require_input_grad(chunk)
    missing = _missing_everywhere(settings.targets, found)
    if missing == list(settings.targets) or (missing and settings.named):
        raise UserError(f"--lora-target-modules {','.join(settings.named or settings.targets)}: the model has no "
                        f"{', '.join(missing)} layer outside its experts (adapted here: attention and dense MLP "
                        f"linears); drop {', '.join(missing)}")
    return count


def _missing_everywhere(targets: tuple[str, ...], found: set[str]) -> list[str]:
    """The ``targets`` no rank found (a pipeline stage may lack what another has, e.g. a dense first layer)."""
    present = torch.tensor([float(t in found) for t in targets])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(present, op=torch.distributed.ReduceOp.MAX)
    return [t for t, here in zip(targets, present.tolist()) if not here]


def _require_input_grad(chunk: torch.nn.Module) -> None:
    """With the embedding frozen its output needs no gradient, and megatron-core's activation recompute
    (``tensor_parallel.checkpoint``, an autograd Function) then gives its layers none: the adapters inside would
    never learn. Marking the embedding's output as needing one keeps the backward going (HF's
    ``enable_input_require_grads`` for the same reason)."""
    embedding = getattr(chunk, "embedding", None)
    if embedding is not None:
        embedding.register_forward_hook(lambda module, inputs, output: output.requires_grad_(True))
