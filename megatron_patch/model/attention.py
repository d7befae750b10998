"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for megatron-core's local layer spec.

Example::

    spec = SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=SDPAttention, ...)

megatron-core's local ``DotProductAttention`` materialises the [b, heads, s, s] score matrix and runs an unfused
softmax. ``SDPAttention`` has the same constructor and forward signature, so it drops into any layer spec, and
lets PyTorch pick a flash or memory-efficient kernel on GPUs (math kernel on CPUs). Masks follow megatron-core:
boolean, True where attention is *not* allowed, broadcastable to [b, heads, sq, sk] (BERT passes [b, 1, 1, s]
key-padding masks, HF's semantics); no mask with ``AttnMaskType.causal`` means causal. Packed sequences come in
megatron-core's ``thd`` format (``PackedSeqParams`` with ``cu_seqlens``): each sequence attends causally to itself
only, as if it were alone in its batch. A sliding window (``config.window_size``, in the layers megatron-core's
``is_layer_window_attention`` picks) narrows every causal mask to the last LEFT + 1 keys.
"""

from __future__ import annotations

import contextlib
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron_patch.model.gpt import is_sliding_window_layer


class SDPAttention(MegatronModule):
    """Drop-in for megatron-core's ``DotProductAttention`` (tensor-parallel heads, GQA, dropout, masks).

    Example::

        core = SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        context = core(query, key, value, attention_mask=None)   # [sq, b, np, hn] x3 -> [sq, b, np * hn]
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        # k_channels/v_channels: multi-latent attention's query/key and value head widths (DotProductAttention's
        # arguments); scaled_dot_product_attention takes them from the tensors, the scale comes as softmax_scale.
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention has no context parallelism; --context-parallel-size > 1 needs the "
                             "Transformer Engine layer spec")
        if config.softmax_type != "vanilla":
            raise ValueError("SDPAttention supports vanilla softmax only")
        self.window = config.window_size if is_sliding_window_layer(config, layer_number) else None
        if self.window is not None and (attn_mask_type != AttnMaskType.causal or self.window[1] != 0):
            raise ValueError(f"SDPAttention's sliding window looks back from a causal query only (--window-size "
                             f"LEFT,0), not {self.window} with {attn_mask_type.name} attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # apply_query_key_layer_scaling divides the scores by layer_number and multiplies them back inside the
        # fp32 softmax (DotProductAttention.__init__): the product is the plain scale, which is what we use.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention takes no attention bias; use the Transformer Engine layer spec")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        seq_q, batch = query.shape[:2]
        # [s, b, heads, d] -> [b, heads, s, d], the layout SDPA expects.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask
        if self.window is not None:
            in_window = self._in_window(seq_q, key.shape[0], query.device)
            allowed = in_window if allowed is None else allowed & in_window
        if allowed is not None:
            # A query row with every key masked (padding rows of a [b,1,s,s] BERT mask) would give NaN; let it
            # attend everywhere instead. Its output is padding either way and never reaches a real token.
            allowed = allowed | ~allowed.any(dim=-1, keepdim=True)
        dropout_p = self.dropout_p if self.training else 0.0
        with self._rng():
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v,
                attn_mask=allowed,
                dropout_p=dropout_p,
                is_causal=allowed is None and mask_type == AttnMaskType.causal and seq_q > 1,
                scale=self.softmax_scale,
                enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
            )
        # [b, heads, sq, d] -> [sq, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(seq_q, batch, -1)

    def _in_window(self, seq_q: int, seq_k: int, device) -> torch.Tensor:
        """[sq, sk] booleans: key j is at most LEFT before query i and not after it (queries are the last sq keys,
        as in megatron-core's causal masks). transformers' sliding mask is the same: ``kv_idx > q_idx - window``."""
        query = torch.arange(seq_k - seq_q, seq_k, device=device)[:, None]
        key = torch.arange(seq_k, device=device)[None, :]
        return (key <= query) & (key >= query - self.window[0])

    def _rng(self):
        # Megatron forks the model-parallel RNG for attention dropout unless activations are sequence-parallel
        # (DotProductAttention.forward, core_v0.16.1), so TP ranks drop different heads.
        if self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """Causal attention within each sequence of a ``thd`` pack: [t, heads, d] x3 -> [t, heads * d].

        One SDPA call per sequence computes what the sequence alone would (a block-diagonal mask over the pack
        would cost t^2 for sum of its lengths squared)."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention takes packed sequences in the thd format, not {params.qkv_format}")
        bounds = params.cu_seqlens_q.tolist()
        dropout_p = self.dropout_p if self.training else 0.0
        context = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
        with self._rng():
            for start, end in zip(bounds[:-1], bounds[1:]):
                if end == start:
                    continue
                # [s, heads, d] -> [1, heads, s, d]
                q, k, v = (t[start:end].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
                in_window = None if self.window is None else self._in_window(end - start, end - start, q.device)
                context[start:end] = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=in_window, dropout_p=dropout_p,
                    is_causal=in_window is None and end - start > 1, scale=self.softmax_scale,
                    enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
                )[0].permute(1, 0, 2)
        return context.reshape(query.shape[0], -1)

