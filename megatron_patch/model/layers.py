"""Small modules the layer specs need beyond megatron-core's: a sequence-parallel-safe torch norm, the post-LN
transformer layer of the original BERT, and the linear layers with a norm on their output of Gemma's sandwich norms.

Example::

    spec = ModuleSpec(module=PostLNTransformerLayer, submodules=PostLNTransformerLayerSubmodules(
        self_attention=..., self_attn_bda=get_bias_dropout_add, post_attention_layernorm=TorchNorm,
        mlp=..., mlp_bda=get_bias_dropout_add, post_mlp_layernorm=TorchNorm))
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

class ZeroCenteredNorm:
    """A torch norm whose ``weight`` holds gamma - 1, initialised to 0 (megatron-core's
    ``layernorm_zero_centered_gamma``, Megatron-LM's ``--apply-layernorm-1p``): weight decay then pulls gamma
    towards 1 instead of 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight + 1)


class ZeroCenteredLayerNorm(ZeroCenteredNorm, torch.nn.LayerNorm):
    def _norm(self, x, weight):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)


class ZeroCenteredRMSNorm(ZeroCenteredNorm, torch.nn.RMSNorm):
    def _norm(self, x, weight):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, weight, self.eps)


# (normalization, zero-centered gamma) -> the torch module.
_NORMS = {
    ("LayerNorm", False): torch.nn.LayerNorm, ("RMSNorm", False): torch.nn.RMSNorm,
    ("LayerNorm", True): ZeroCenteredLayerNorm, ("RMSNorm", True): ZeroCenteredRMSNorm,
}


class TorchNorm:
    """``torch.nn.LayerNorm`` / ``RMSNorm`` (per ``config.normalization``) that also works with sequence
    parallelism: its parameters carry ``sequence_parallel`` so ``finalize_model_grads`` all-reduces their
    gradients over the TP group (each TP rank saw only its slice of the sequence).

    Example::

        >>> from megatron_patch.model.builder import to_transformer_config
        >>> from megatron_patch.model.config import get_model_config
        >>> from megatron_patch.model.parallel import ParallelConfig
        >>> config = to_transformer_config(get_model_config("tiny-gpt2"), ParallelConfig())
        >>> type(TorchNorm(config, hidden_size=64, eps=1e-5)).__name__
        'LayerNorm'

    megatron-core's ``WrappedTorchNorm`` (its fallback without apex or TE) asserts ``not config.sequence_parallel``
    and ``not config.layernorm_zero_centered_gamma`` (``WrappedTorchNorm.__new__``, transformer/torch_norm.py) although
    nothing in the maths forbids either; this is the same constructor signature without those assertions.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused) -> torch.nn.Module:
        norm = _NORMS[config.normalization, config.layernorm_zero_centered_gamma](
            hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


@dataclasses.dataclass
class PostLNTransformerLayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayer's submodules plus the two norms the original BERT applies after each residual add."""

    post_attention_layernorm: ModuleSpec | type = IdentityOp
    post_mlp_layernorm: ModuleSpec | type = IdentityOp


class PostLNTransformerLayer(TransformerLayer):
    """``LayerNorm(x + attention(x))`` then ``LayerNorm(h + mlp(h))``: Hugging Face ``BertLayer`` on
    megatron-core's attention, MLP, bias-dropout-add and recompute machinery.

    Example::

        layer = build_module(post_ln_spec, config=config, layer_number=1)
        output, _ = layer(hidden_states, attention_mask=mask)

    The pre-LN slots (``input_layernorm``, ``pre_mlp_layernorm``) stay ``IdentityOp``; everything between
    them is TransformerLayer's own code, so TP, SP and both recompute granularities behave as for pre-LN.
    """

    def __init__(self, config: TransformerConfig, submodules: PostLNTransformerLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        norm_kwargs = dict(config=self.config, hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_attention_layernorm = build_module(submodules.post_attention_layernorm, **norm_kwargs)
        self.post_mlp_layernorm = build_module(submodules.post_mlp_layernorm, **norm_kwargs)

    def _forward_attention(self, *args, **kwargs):
        hidden_states, context = super()._forward_attention(*args, **kwargs)
        return self.post_attention_layernorm(hidden_states), context

    def _forward_post_mlp(self, mlp_output_with_bias, residual):
        return self.post_mlp_layernorm(super()._forward_post_mlp(mlp_output_with_bias, residual))


class _PostNorm:
    """Mixed into a row-parallel linear layer by :func:`with_post_norm`."""

    post_norm: type
    unnormed: type
    """The linear layer's own class (LoRA adapts it below the norm)."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = build_module(self.post_norm, config=config, hidden_size=output_size,
                                           eps=config.layernorm_epsilon)

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        # The bias a layer hands to the fused bias-dropout-add belongs before the norm.
        return self.post_layernorm(output if bias is None else output + bias), None


@functools.cache
def with_post_norm(linear: type, norm: type) -> type:
    """``linear`` (a row-parallel layer: attention's ``linear_proj``, the MLP's ``linear_fc2``) whose output passes
    through a ``norm`` before the residual add: Gemma 2/3's ``post_attention_layernorm`` and
    ``post_feedforward_layernorm``.

    Example::

        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=with_post_norm(RowParallelLinear, TorchNorm))

    The norm is the submodule ``post_layernorm`` (``...linear_proj.post_layernorm.weight``, Megatron-Bridge's name).
    The output is whole again after the row-parallel reduction (or one sequence slice of it with sequence
    parallelism, and a norm works per token), so TP needs nothing more; the norm's weight is replicated.
    """
    return type(f"PostNorm{linear.__name__}", (_PostNorm, linear), {"post_norm": norm, "unnormed": linear})
