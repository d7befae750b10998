"""The one place that picks the modules of a transformer layer: Transformer Engine when it imports (unless
``--transformer-impl local``), else local.

Example::

    spec = layer_spec(get_model_config("tiny-llama"), ParallelConfig())
    spec.submodules.self_attention.submodules.core_attention     # SDPAttention on a machine without TE

Both backends go through megatron-core's ``BackendSpecProvider`` interface. The local one is megatron-core's
``LocalSpecProvider`` with two swaps: core attention on ``scaled_dot_product_attention`` (``SDPAttention``) instead
of the unfused softmax, and ``TorchNorm``, which unlike ``WrappedTorchNorm`` allows sequence parallelism.
The layer is pre-LN (GPT, Megatron's BERT) or post-LN (``PostLNTransformerLayer``, original BERT), by config.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec_for_backend
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer, TransformerLayerSubmodules, get_transformer_layer_offset,
)

from megatron_patch.compat import dense_mlp_submodule
from megatron_patch.model.attention import SDPAttention
from megatron_patch.model.config import ModelConfig
from megatron_patch.model.gpt import LayerKindSelfAttention
from megatron_patch.model.layers import (
    PostLNTransformerLayer, PostLNTransformerLayerSubmodules, TorchNorm, with_post_norm,
)
from megatron_patch.model.names import FUSED_NORM_NAMES
from megatron_patch.model.parallel import ParallelConfig

# GPT attends causally; BERT to every non-padding token.
_ATTN_MASK_TYPE = {"gpt": AttnMaskType.causal, "bert": AttnMaskType.padding}


class LocalBackend(LocalSpecProvider):
    """megatron-core's local modules with SDPA core attention and a sequence-parallel-safe norm."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return TorchNorm  # LayerNorm or RMSNorm per config.normalization, like WrappedTorchNorm

    def core_attention(self) -> type:
        return SDPAttention


def backend(parallel_config: ParallelConfig | None = None) -> BackendSpecProvider:
    """Transformer Engine's provider when TE imports and ``--transformer-impl`` is ``transformer_engine`` (the
    default), otherwise ``LocalBackend``."""
    if (parallel_config or ParallelConfig()).use_transformer_engine:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    return LocalBackend()


def norm_module(model_config: ModelConfig, parallel_config: ParallelConfig | None = None) -> type:
    """The norm class every norm of the model is built from (also BERT's LM head and embedding norm)."""
    return backend(parallel_config).layer_norm(rms_norm=model_config.normalization == "RMSNorm")


def _mla_attention(model_config: ModelConfig, provider: BackendSpecProvider) -> ModuleSpec:
    """megatron-core's multi-latent attention (its local spec's modules, get_gpt_layer_local_spec at
    core_v0.16.1); with ``qk_layernorm`` the norms on the query and key/value latents (DeepSeek's
    ``q_a_layernorm``/``kv_a_layernorm``). Every projection is column-parallel as there: the down projections'
    outputs are gathered over TP before their norms."""
    latent_norm = (provider.layer_norm(rms_norm=model_config.normalization == "RMSNorm", for_qk=True)
                   if model_config.qk_layernorm else IdentityOp)
    linear = provider.column_parallel_linear()
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=linear, linear_q_down_proj=linear, linear_q_up_proj=linear, linear_kv_down_proj=linear,
            linear_kv_up_proj=linear, core_attention=provider.core_attention(),
            linear_proj=provider.row_parallel_linear(), q_layernorm=latent_norm, kv_layernorm=latent_norm,
        ),
    )


def layer_spec(model_config: ModelConfig, parallel_config: ParallelConfig | None = None, layer: int = 0
               ) -> ModuleSpec:
    """The ModuleSpec of transformer layer ``layer`` (0-based, counted over all pipeline stages; it decides
    between experts and a dense MLP by ``moe_layer_freq``) of ``model_config`` on this machine's backend.

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> layer_spec(get_model_config("tiny-bert")).module.__name__
        'PostLNTransformerLayer'
    """
    provider = backend(parallel_config)
    norm = norm_module(model_config, parallel_config)
    post_ln = model_config.family == "bert" and model_config.bert_layernorm_style == "post"
    # TE fuses a pre-norm into the linear layer after it; a post-norm has no linear layer after it to fuse into.
    fuse_norm = provider.fuse_layernorm_and_linear() and not post_ln
    norm_linear = provider.column_parallel_layer_norm_linear() if fuse_norm else provider.column_parallel_linear()
    # Qwen3's per-head query/key norms; megatron-core applies them before RoPE (Attention.forward), as
    # transformers' Qwen3Attention does.
    qk_norm = (provider.layer_norm(rms_norm=model_config.normalization == "RMSNorm", for_qk=True)
               if model_config.qk_layernorm else IdentityOp)
    mla = model_config.multi_latent_attention
    # Gemma's sandwich norms: a norm on the output of each sublayer's last projection, before the residual add.
    row_linear = (with_post_norm(provider.row_parallel_linear(), norm) if model_config.sandwich_norm
                  else provider.row_parallel_linear())
    self_attention = _mla_attention(model_config, provider) if mla else ModuleSpec(
        # A RoPE base per layer kind comes as a pair of tables, of which each layer takes its own.
        module=LayerKindSelfAttention if model_config.rotary_base_local is not None else SelfAttention,
        params={"attn_mask_type": _ATTN_MASK_TYPE[model_config.family]},
        submodules=SelfAttentionSubmodules(
            linear_qkv=norm_linear,
            core_attention=provider.core_attention(),
            linear_proj=row_linear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )
    moe = model_config.is_moe_layer(layer)
    if moe:
        # megatron-core's MoELayer (router, experts, shared expert) from the same provider; its experts are a loop
        # of local MLPs (SequentialMLP) unless grouped GEMM is asked for. Nothing fuses into a router, so the MLP's
        # norm stays a module of its own, as in megatron-core's TE spec for experts.
        mlp = get_moe_module_spec_for_backend(
            provider, num_experts=model_config.num_moe_experts,
            moe_grouped_gemm=parallel_config is not None and parallel_config.moe_grouped_gemm,
        )
    else:
        mlp = dense_mlp_submodule(
            MLPSubmodules(linear_fc1=norm_linear, linear_fc2=row_linear))
    common = dict(self_attention=self_attention, self_attn_bda=get_bias_dropout_add, mlp=mlp,
                  mlp_bda=get_bias_dropout_add)
    if post_ln:
        return ModuleSpec(
            module=PostLNTransformerLayer,
            submodules=PostLNTransformerLayerSubmodules(
                **common, post_attention_layernorm=norm, post_mlp_layernorm=norm
            ),
        )
    pre_norm = IdentityOp if fuse_norm else norm
    # Checkpoint keys as with TE's fused norm+linear, so local and TE checkpoints load into each other (as
    # megatron-core's own local spec does); a MoE layer's MLP norm is unfused in both, and so is the norm before
    # multi-latent attention, whose first projections are two (query and key/value latents).
    unfused = {"pre_mlp_layernorm."} if moe else set()
    unfused |= {"input_layernorm."} if mla else set()
    keys_map = {} if fuse_norm else {local: fused for local, fused in FUSED_NORM_NAMES.items() if local not in unfused}
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            **common,
            input_layernorm=norm if mla else pre_norm,
            pre_mlp_layernorm=norm if moe else pre_norm,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def block_spec(
    model_config: ModelConfig,
    transformer_config: TransformerConfig,
    parallel_config: ParallelConfig | None = None,
    vp_stage: int | None = None,
) -> TransformerBlockSubmodules:
    """The layers of this pipeline rank's chunk ``vp_stage``, and the final norm (none for post-LN BERT).

    Passing the block rather than a layer spec keeps megatron-core from building its final norm from its own
    ``LayerNormImpl`` global (transformer_block.py's ``_get_block_submodules``), which refuses sequence parallelism
    without apex.
    """
    post_ln = model_config.family == "bert" and model_config.bert_layernorm_style == "post"
    num_layers = get_num_layers_to_build(transformer_config, vp_stage=vp_stage)
    offset = get_transformer_layer_offset(transformer_config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(model_config, parallel_config, offset + i) for i in range(num_layers)],
        layer_norm=None if post_ln else norm_module(model_config, parallel_config),
    )


def mtp_block_spec(
    model_config: ModelConfig,
    transformer_config: TransformerConfig,
    parallel_config: ParallelConfig | None = None,
    vp_stage: int | None = None,
):
    """The multi-token prediction modules of this pipeline rank's chunk ``vp_stage`` (megatron-core builds them all
    on the last stage), each around a layer of the model's last layer's kind; None without them or elsewhere.

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> mtp_block_spec(get_model_config("tiny-llama"), None) is None
        True
    """
    if not model_config.mtp_num_layers:
        return None
    # The last layer's spec, whichever stage this is (megatron-core takes block.layer_specs[-1]).
    last = TransformerBlockSubmodules(layer_specs=[layer_spec(model_config, parallel_config,
                                                              model_config.num_layers - 1)])
    return get_gpt_mtp_block_spec_for_backend(transformer_config, last, backend(parallel_config), vp_stage=vp_stage)
