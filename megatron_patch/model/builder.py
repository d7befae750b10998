"""Build megatron-core models from a ModelConfig and a ParallelConfig: one chunk per virtual pipeline stage.

Example::

    initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model_config = get_model_config("tiny-llama")
    parallel = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    chunks = build_model_chunks(model_config, parallel, padded_vocab_size(128, 1, 2))

Model code never branches on the backend (that is ``specs``) nor on a model's name (that is the registry):
GPT-2, LLaMA, Mistral, Qwen2 and Qwen3 are all GPTModel with different TransformerConfig fields.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_patch import compat
from megatron_patch.model.bert import BertForSequenceClassification, BertModel
from megatron_patch.model.config import ModelConfig
from megatron_patch.model.gpt import GPTModel
from megatron_patch.model.parallel import ParallelConfig
from megatron_patch.model.specs import block_spec, mtp_block_spec, norm_module
# One padding rule for tokenizer, model and converter, or checkpoint shapes stop matching.
from megatron_patch.tokenizer.registry import padded_vocab_size as padded_vocab_size  # re-exported

# activation -> (activation_func, whether megatron-core's fused kernel computes the same); the gated ones
# (ModelConfig.gated_mlp) are megatron-core's gated_linear_unit.
# Its fused bias-GeLU is the tanh approximation (fusions/fused_bias_gelu.py), so erf-GeLU models never use it.
_ACTIVATIONS = {
    "gelu": (F.gelu, False),
    "gelu_tanh": (functools.partial(F.gelu, approximate="tanh"), True),
    "swiglu": (F.silu, True),
    # megatron-core's fused GeGLU is its own tanh formula (fusions/fused_bias_geglu.py), not F.gelu's.
    "geglu": (functools.partial(F.gelu, approximate="tanh"), False),
}


def to_transformer_config(model_config: ModelConfig, parallel_config: ParallelConfig) -> TransformerConfig:
    """megatron-core's TransformerConfig for this model under this layout (validates the layout first).

    Example::

        >>> from megatron_patch.model.config import get_model_config
        >>> to_transformer_config(get_model_config("tiny-llama"), ParallelConfig()).gated_linear_unit
        True
    """
    parallel_config.validate(model_config)
    m, p = model_config, parallel_config
    activation_func, fusable = _ACTIVATIONS[m.activation]
    interleaved = p.virtual_pipeline_model_parallel_size is not None
    config_class = MLATransformerConfig if m.uses("mla") else TransformerConfig
    return config_class(
        **m.settings("transformer"),
        gated_linear_unit=m.gated_mlp,
        activation_func=activation_func,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        context_parallel_size=p.context_parallel_size,
        recompute_granularity=p.recompute_granularity,
        recompute_method=p.recompute_method,
        recompute_num_layers=p.recompute_num_layers,
        fp16=p.precision == "fp16",
        bf16=p.precision == "bf16",
        params_dtype=p.params_dtype,
        pipeline_dtype=p.params_dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        **compat.pipeline_p2p_flags(interleaved),
        **compat.cuda_graph_fields(),
        bias_activation_fusion=p.fused_kernels and fusable,
        masked_softmax_fusion=False,  # our SDPA core attention does the softmax
        bias_dropout_fusion=p.fused_kernels,
        attention_backend=AttnBackend[p.attention_backend],
        transformer_impl="transformer_engine" if p.use_transformer_engine else "local",
        **_expert_parallel_fields(p) if m.uses("moe") else {},
        # MLATransformerConfig computes its RoPE itself; GPTModel computes the others' (_gpt).
        **dict(rotary_base=m.rotary_base) if m.uses("mla") else {},
    )


def _expert_parallel_fields(p: ParallelConfig) -> dict:
    """TransformerConfig's fields of how a mixture-of-experts model's experts are laid out and computed."""
    return dict(
        moe_token_dispatcher_type=p.moe_token_dispatcher_type,
        moe_grouped_gemm=p.moe_grouped_gemm,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
    )


def _check_parallel_state(parallel_config: ParallelConfig) -> None:
    expected = {
        "--tensor-model-parallel-size": (parallel_config.tensor_model_parallel_size,
                                         parallel_state.get_tensor_model_parallel_world_size()),
        "--pipeline-model-parallel-size": (parallel_config.pipeline_model_parallel_size,
                                           parallel_state.get_pipeline_model_parallel_world_size()),
        "--virtual-pipeline-model-parallel-size": (parallel_config.virtual_pipeline_model_parallel_size,
                                                   parallel_state.get_virtual_pipeline_model_parallel_world_size()),
        "--expert-model-parallel-size": (parallel_config.expert_model_parallel_size,
                                         parallel_state.get_expert_model_parallel_world_size()),
    }
    for flag, (wanted, initialized) in expected.items():
        if wanted != initialized:
            raise ValueError(f"{flag} is {wanted} but the process groups were initialized with {initialized}; "
                             "pass the same sizes to initialize_distributed")


def _build_chunks(parallel_config: ParallelConfig, build: Callable[..., MegatronModule]) -> list[MegatronModule]:
    """``build(pre_process=, post_process=, vp_stage=)`` for each virtual stage of this pipeline rank."""
    _check_parallel_state(parallel_config)
    vpp = parallel_config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        chunk = build(
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        # torch norms and plain Linear layers are created on the CPU; a chunk built on the meta device (a conversion's
        # names and shapes, convert/core.py build_reference_model) has no data to move.
        if torch.cuda.is_available() and not any(param.is_meta for param in chunk.parameters()):
            chunk.cuda(torch.cuda.current_device())
        if chunk.config.num_moe_experts:
            compat.detach_moe_dispatcher_state(chunk)
        chunks.append(chunk)
    return chunks


def _gpt(m: ModelConfig, config: TransformerConfig, p: ParallelConfig, vocab: int, **stage) -> GPTModel:
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(m, config, p, stage["vp_stage"]),
        mtp_block_spec=mtp_block_spec(m, config, p, stage["vp_stage"]),
        vocab_size=vocab,
        max_sequence_length=m.max_positions,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base,
        rope_scaling=m.rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor,
        rotary_base_local=m.rotary_base_local,
        scale_embeddings=m.scale_embeddings,
        **stage,
    )


def _bert_kwargs(m: ModelConfig, config: TransformerConfig, p: ParallelConfig, vocab: int, **stage) -> dict:
    return dict(
        norm=norm_module(m, p),
        embedding_layernorm=m.bert_layernorm_style == "post",
        num_tokentypes=m.num_tokentypes,
        transformer_layer_spec=block_spec(m, config, p, stage["vp_stage"]),
        vocab_size=vocab,
        max_sequence_length=m.max_positions,
        position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent,
        **stage,
    )


def _bert(m: ModelConfig, config: TransformerConfig, p: ParallelConfig, vocab: int, **stage) -> BertModel:
    return BertModel(
        config,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        add_binary_head=m.add_binary_head,
        **_bert_kwargs(m, config, p, vocab, **stage),
    )


_FAMILIES = {"gpt": _gpt, "bert": _bert}


def build_model_chunks(
    model_config: ModelConfig, parallel_config: ParallelConfig, padded_vocab_size: int, *, initialize: bool = True
) -> list[MegatronModule]:
    """This rank's model chunks (one per virtual pipeline stage): GPTModel or BertModel (LM + binary head).

    Example::

        chunks = build_model_chunks(get_model_config("tiny-gpt2"), ParallelConfig(), padded_vocab_size=128)
        per_token_loss = chunks[0](tokens, position_ids, None, labels=labels)

    megatron-core's process groups must already be initialised with the same sizes (``initialize_distributed``).
    ``initialize=False`` skips the random initialisation (megatron-core's ``perform_initialization``), for a model
    whose every tensor is overwritten or that lives on the meta device: on the meta device torch's initialisers still
    cost half a second of CPU for a 1B model, and import torch._dynamo.
    """
    config = to_transformer_config(model_config, parallel_config)
    if not initialize:
        config = dataclasses.replace(config, perform_initialization=False)
    build = _FAMILIES[model_config.family]
    return _build_chunks(
        parallel_config, functools.partial(build, model_config, config, parallel_config, padded_vocab_size)
    )


def build_sequence_classifier(
    model_config: ModelConfig,
    parallel_config: ParallelConfig,
    padded_vocab_size: int,
    num_labels: int,
    classifier_dropout: float | None = None,
) -> list[BertForSequenceClassification]:
    """BERT encoder + pooler + classifier chunks for fine-tuning (``BertForSequenceClassification``).

    Example::

        [model] = build_sequence_classifier(get_model_config("bert-base"), ParallelConfig(), 30592, num_labels=2)
        logits = model(tokens, padding_mask, tokentype_ids=types)
    """
    if model_config.family != "bert":
        raise ValueError(f"a sequence classifier is built on a BERT encoder, not on family {model_config.family!r}")
    config = to_transformer_config(model_config, parallel_config)

    def build(**stage):
        return BertForSequenceClassification(
            config, num_labels=num_labels, classifier_dropout=classifier_dropout,
            **_bert_kwargs(model_config, config, parallel_config, padded_vocab_size, **stage),
        )

    return _build_chunks(parallel_config, build)
