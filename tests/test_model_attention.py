"""SDPAttention (torch scaled_dot_product_attention) equals megatron-core's DotProductAttention, and the layer
specs pick it on machines without Transformer Engine (TE's attention where TE imports)."""


import pytest

from megatron_patch.testing import run_on_ranks


def compare_core_attention(rank, world_size, num_query_groups):
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.attention import SDPAttention

    initialize_distributed()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=num_query_groups,
                               attention_dropout=0.0, use_cpu_initialization=True)
    seq, batch, heads, dim = 16, 3, 4, 8
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(seq, batch, heads, dim, generator=gen)
    key, value = (torch.randn(seq, batch, num_query_groups, dim, generator=gen) for _ in range(2))
    lengths = torch.tensor([16, 11, 5])
    key_padding = torch.arange(seq)[None, :] >= lengths[:, None]  # True = padding, megatron's convention
    cases = {
        "causal": (AttnMaskType.causal, None, slice(None)),
        "causal-explicit-mask": (AttnMaskType.causal, torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1),
                                 slice(None)),
        "padding-b11s": (AttnMaskType.padding, key_padding[:, None, None, :], slice(None)),
        # Megatron's b1ss BERT mask also masks padded query rows; those rows are padding in either
        # implementation (megatron averages all values, we attend to all keys), so only real rows compare.
        "padding-b1ss": (AttnMaskType.padding, (key_padding[:, None, :] | key_padding[:, :, None])[:, None], "valid"),
    }
    errors = {}
    for name, (mask_type, mask, rows) in cases.items():
        outputs = []
        for cls in (DotProductAttention, SDPAttention):
            core = cls(config, layer_number=1, attn_mask_type=mask_type, attention_type="self")
            q, k, v = (t.clone().requires_grad_() for t in (query, key, value))
            out = core(q, k, v, mask, attn_mask_type=mask_type)  # [s, b, h*d]
            weight = (~key_padding).T[:, :, None].float() if rows == "valid" else torch.ones(1)
            (out * weight).square().sum().backward()
            outputs.append((out * weight, q.grad, k.grad, v.grad))
        errors[name] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(*outputs))
    return errors


@pytest.mark.parametrize("num_query_groups", [4, 2], ids=["mha", "gqa"])
def test_sdpa_matches_megatron_dot_product_attention(num_query_groups):
    [errors] = run_on_ranks(compare_core_attention, 1, args=(num_query_groups,))
    assert all(error < 1e-5 for error in errors.values()), errors


def compare_sliding_window(rank, world_size):
    """SDPAttention's window against megatron-core's DotProductAttention given transformers' sliding-window mask
    (``sliding_window_overlay`` and ``causal_mask_function`` evaluated over every query and key), in a window layer
    and in the full layer ``window_attn_skip_freq`` leaves; and a packed sequence against the same sequence alone."""
    import dataclasses

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.attention import SDPAttention

    initialize_distributed()
    window, seq, batch = 5, 16, 2
    plain = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                              attention_dropout=0.0, use_cpu_initialization=True)
    windowed = dataclasses.replace(plain, window_size=(window - 1, 0), window_attn_skip_freq=2)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(seq, batch, 4, 8, generator=gen)
    key, value = (torch.randn(seq, batch, 2, 8, generator=gen) for _ in range(2))
    sees = sliding_window_overlay(window)
    allowed = torch.tensor([[causal_mask_function(0, 0, q, k) and sees(0, 0, q, k) for k in range(seq)]
                            for q in range(seq)])
    reference = DotProductAttention(plain, 1, AttnMaskType.causal, "self")

    def sdpa(layer_number):
        return SDPAttention(windowed, layer_number, AttnMaskType.causal, "self")

    errors = {
        "window layer": sdpa(1)(query, key, value, None) - reference(query, key, value, ~allowed[None, None]),
        "full layer": sdpa(2)(query, key, value, None) - reference(query, key, value, None),
    }
    # Two sequences packed (thd): the second, 11 tokens, as if alone.
    bounds = torch.tensor([0, 5, 16], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=11,
                             max_seqlen_kv=11)
    thd = [t[:, 0] for t in (query, key, value)]  # [t, heads, d]
    alone = sdpa(1)(*(t[5:, :1] for t in (query, key, value)), None)
    errors["packed"] = sdpa(1)(*thd, None, packed_seq_params=packed)[5:] - alone[:, 0]
    return {name: float(error.abs().max()) for name, error in errors.items()}


def test_sliding_window_matches_transformers_mask():
    [errors] = run_on_ranks(compare_sliding_window, 1)
    assert all(error < 1e-5 for error in errors.values()), errors


@pytest.mark.parametrize("name,overrides,mask_type", [
    ("tiny-gpt2", {}, "causal"),
    ("tiny-llama", {}, "causal"),
    ("tiny-bert", {}, "padding"),
    ("tiny-bert", dict(bert_layernorm_style="pre"), "padding"),
])
def test_local_spec_uses_sdpa_core_attention(monkeypatch, name, overrides, mask_type):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_patch import compat
    from megatron_patch.model import get_model_config
    from megatron_patch.model.attention import SDPAttention
    from megatron_patch.model.layers import TorchNorm
    from megatron_patch.model.specs import LocalBackend, backend, layer_spec

    # What a machine without Transformer Engine sees, whether or not this one has it.
    monkeypatch.setattr(compat, "transformer_engine_available", lambda: False)
    assert isinstance(backend(), LocalBackend)
    spec = layer_spec(get_model_config(name, **overrides))
    attention = spec.submodules.self_attention
    # Not megatron-core's DotProductAttention with its unfused softmax.
    assert attention.submodules.core_attention is SDPAttention
    assert attention.params["attn_mask_type"] == AttnMaskType[mask_type]
    norms = ((spec.submodules.post_attention_layernorm, spec.submodules.post_mlp_layernorm)
             if spec.module.__name__ == "PostLNTransformerLayer"
             else (spec.submodules.input_layernorm, spec.submodules.pre_mlp_layernorm))
    assert all(norm is TorchNorm for norm in norms)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-bert"])
def test_transformer_engine_spec_when_it_imports(name):
    pytest.importorskip("transformer_engine.pytorch")
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    from megatron_patch.model import get_model_config
    from megatron_patch.model.specs import backend, layer_spec

    assert isinstance(backend(), TESpecProvider)
    spec = layer_spec(get_model_config(name))
    assert spec.submodules.self_attention.submodules.core_attention is TEDotProductAttention
