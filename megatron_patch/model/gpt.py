"""megatron-core's GPTModel with what Gemma 3 adds to a decoder: word embeddings scaled by sqrt(hidden), and a RoPE
table per kind of layer (sliding-window layers have a base of their own).

Example::

    model = GPTModel(config, transformer_layer_spec=block, vocab_size=256, max_sequence_length=32,
                     position_embedding_type="rope", rotary_base=1000000, rotary_base_local=10000,
                     scale_embeddings=True)

GPTModel computes one RoPE table and hands it to every layer. With ``rotary_base_local`` it hands them a pair,
[sliding, full] (``LayerKindRotaryEmbedding``), and each layer's ``LayerKindSelfAttention`` takes its own, by
megatron-core's rule for which layers have the window (``is_layer_window_attention``, which its core attention
modules follow too). Without either option this is GPTModel as it is.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel as _GPTModel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention


class LayerKindRotaryEmbedding(torch.nn.Module):
    """Two RoPE tables as one, stacked [sliding, full] along a new first dimension.

    Example::

        rope = LayerKindRotaryEmbedding(full=model.rotary_pos_emb, sliding=RotaryEmbedding(16, 1.0, rotary_base=10000))
        rope(32).shape        # [2, 32, 1, 1, 16]
    """

    def __init__(self, full: RotaryEmbedding, sliding: RotaryEmbedding):
        super().__init__()
        self.full, self.sliding = full, sliding

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.full.get_rotary_seq_len(*args, **kwargs)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.stack([self.sliding(*args, **kwargs), self.full(*args, **kwargs)])


def is_sliding_window_layer(config: TransformerConfig, layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based, over the whole model) attends through the window."""
    return is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)


class LayerKindSelfAttention(SelfAttention):
    """SelfAttention that takes its layer kind's table from a ``LayerKindRotaryEmbedding`` pair."""

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[0 if is_sliding_window_layer(self.config, self.layer_number) else 1]
        return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)


def _times_sqrt_hidden(embedding: torch.nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    # transformers' Gemma3TextScaledWordEmbedding rounds the scale to the weights' dtype first (48.0 stays 48.0,
    # sqrt(1152) does not), then multiplies. The rounded value as a Python number: no tensor to copy to the device.
    scale = torch.tensor(embedding.config.hidden_size ** 0.5, dtype=embedding.word_embeddings.weight.dtype).item()
    return output * scale


class GPTModel(_GPTModel):
    """megatron-core's GPTModel; ``scale_embeddings`` multiplies the word embeddings by sqrt(hidden_size),
    ``rotary_base_local`` gives sliding-window layers a RoPE of that base (without the interpolation factor of the
    full layers', as Gemma 3's local RoPE has no scaling)."""

    def __init__(self, config: TransformerConfig, *, rotary_base_local: int | None = None,
                 scale_embeddings: bool = False, **kwargs):
        super().__init__(config, **kwargs)
        if scale_embeddings and self.pre_process:
            self.embedding.register_forward_hook(_times_sqrt_hidden)
        if rotary_base_local is not None:
            sliding = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
                rotary_interleaved=config.rotary_interleaved, rotary_base=rotary_base_local,
                use_cpu_initialization=config.use_cpu_initialization, cp_group=self.rotary_pos_emb.cp_group,
            )
            self.rotary_pos_emb = LayerKindRotaryEmbedding(full=self.rotary_pos_emb, sliding=sliding)
