"""SDPAttention (torch scaled_dot_product_attention) equals megatron-core's DotProductAttention."""


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
        "causal-explicit-mask": (AttnMaskType.causal, torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1), slice(None)),
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
