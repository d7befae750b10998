"""HF -> Megatron -> HF for GPT-2, LLaMA (GQA, LLaMA 3.1's scaled RoPE), Mistral, Qwen2, Qwen3, Phi-3, Gemma 3 and
BERT (three kinds): megatron-core's forward equals transformers' at TP=1, TP=2, PP=2 and TP=2 x PP=2, every tensor
comes back bit for bit, through both checkpoint formats and after a resharded save, and the decoders' greedy tokens
at TP=2 are transformers' own; Hugging Face options our model cannot compute are refused by name."""

import pytest

from megatron_patch.model.conversion import UnsupportedCheckpoint, family_for
from megatron_patch.testing import run_on_ranks
from tests.convert_oracles import (
    HF_MODELS, assert_bit_exact, cli, hf_greedy, make_hf_model, megatron_greedy_at, training_sequences,
    verify_layouts,
)

LAYOUTS = [(2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every model converted to torch_dist (verified at TP=1 by the CLI) and to torch at TP=2 x PP=2."""
    root = tmp_path_factory.mktemp("convert")
    dirs = {}
    for name in HF_MODELS:
        hf = make_hf_model(name, str(root / f"{name}-hf"))
        dist, legacy = str(root / f"{name}-dist"), str(root / f"{name}-legacy")
        [status] = run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", dist,
                                               "--no-progress"],))
        assert status == 0, f"{name}: verification at TP=1 failed"
        [status] = run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", legacy,
                                               "--ckpt-format", "torch", "--target-tensor-parallel-size", "2",
                                               "--target-pipeline-parallel-size", "2", "--no-verify",
                                               "--no-progress"],))
        assert status == 0
        dirs[name] = (hf, dist, legacy, root)
    return dirs


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_forward_matches_transformers_at_every_layout(converted, name):
    hf, dist, legacy, root = converted[name]
    resharded = str(root / f"{name}-resharded")
    [results] = [r for r in run_on_ranks(verify_layouts, 4, args=(hf, dist, LAYOUTS, resharded), timeout=300)
                 if r is not None]
    # The legacy files: at the layout they were written for, and merged and cut to another.
    [legacy_results] = [r for r in run_on_ranks(verify_layouts, 4, args=(hf, legacy, [(2, 2), (1, 2)]),
                                                timeout=300) if r is not None]
    failures = []
    for label, res in (("torch_dist", results), ("torch", legacy_results)):
        for layout, comparisons in res.items():
            for c in comparisons:
                if not (c.passed and c.max_rel_diff <= 1e-4):
                    failures.append(f"{label} TP{layout[0]}xPP{layout[1]}: {c.line()}")
    assert set(results) == set(LAYOUTS)
    assert not failures, "\n".join(failures)

    # HF -> Megatron -> HF is bit-exact from both formats and after the resharded save.
    for source in (dist, legacy, resharded):
        out = f"{source}-exported"
        [status] = run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", source, "--save-dir", out,
                                               "--no-progress"],))
        assert status == 0
        assert_bit_exact(hf, out)


DECODERS = ["llama-gqa", "llama3.1", "mistral", "qwen2", "qwen3", "phi3", "gemma3"]


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_tokens_match_transformers_at_tp2(converted, name):
    hf, dist, _, root = converted[name]
    out = str(root / f"{name}-greedy-exported")
    export = ["megatron-to-hf", "--load-dir", dist, "--save-dir", out, "--no-progress"]
    assert run_on_ranks(cli, 1, args=(export,)) == [0]
    prompt, new_tokens = training_sequences()[0][:6], 10
    ranks = run_on_ranks(megatron_greedy_at, 2, args=(dist, 2, prompt, new_tokens), timeout=300)
    [source] = run_on_ranks(hf_greedy, 1, args=(hf, prompt, new_tokens))
    [exported] = run_on_ranks(hf_greedy, 1, args=(out, prompt, new_tokens))
    assert ranks[0] == ranks[1] == source == exported, (ranks, source, exported)


_LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
_LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              max_position_embeddings=64, vocab_size=100)
_GEMMA3 = dict(model_type="gemma3_text", sliding_window=4)


@pytest.mark.parametrize("fields,message", [
    (dict(model_type="mistral", sliding_window=16), "sliding_window=16"),
    (dict(model_type="qwen3", use_sliding_window=True), "use_sliding_window=True"),
    (dict(model_type="qwen3", attention_bias=True), "attention_bias=True"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0)), "RoPE scaling 'yarn'"),
    (dict(rope_parameters={**_LLAMA3, "original_max_position_embeddings": 32}), "original_max_position_embeddings=32"),
    (dict(rope_parameters={**_LLAMA3, "high_freq_factor": 2.0}), "high_freq_factor=2.0"),
    (dict(rope_parameters={k: v for k, v in _LLAMA3.items() if k != "factor"}), "factor=None"),
    (dict(rope_scaling=dict(type="linear", factor=2.0)), "RoPE scaling 'linear'"),
    (dict(model_type="phi3", sliding_window=47), "sliding_window=47"),
    (dict(model_type="phi3", rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4,
                                                  long_factor=[1.0] * 4)), "RoPE scaling 'longrope'"),
    (dict(_GEMMA3, final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(_GEMMA3, use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(_GEMMA3, rope_parameters=dict(full_attention=dict(rope_type="yarn", rope_theta=1e6))),
     "full_attention RoPE is 'yarn'"),
    (dict(_GEMMA3, layer_types=["sliding_attention", "chunked_attention"]), "chunked_attention"),
    (dict(_GEMMA3, sliding_window=None), "sliding_window=None"),
])
def test_options_our_model_cannot_compute_are_refused_by_name(fields, message):
    config = {**_LLAMA, **fields}
    with pytest.raises(UnsupportedCheckpoint, match=message):
        family_for(config).config_from_hf(config)


@pytest.mark.parametrize("fields,expected", [
    (dict(model_type="mistral", sliding_window=None), dict(rope_scaling=False, qk_layernorm=False)),
    (dict(model_type="mistral", sliding_window=64), dict(rope_scaling=False)),
    (dict(model_type="qwen3", head_dim=16), dict(qk_layernorm=True, kv_channels=16, add_qkv_bias=False)),
    (dict(rope_parameters=_LLAMA3), dict(rope_scaling=True, rope_scaling_factor=8.0, rotary_base=500000)),
    # Files written before transformers 5: a top-level rope_theta and rope_scaling.
    (dict(rope_theta=500000.0, rope_scaling={k: v for k, v in _LLAMA3.items() if k != "rope_theta"}),
     dict(rope_scaling=True, rotary_base=500000)),
    # Gemma 3 as its hub files were first written: top-level RoPE keys and a window pattern instead of layer_types.
    (dict(model_type="gemma3_text", num_hidden_layers=12, sliding_window=512, sliding_window_pattern=6,
          rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling=dict(rope_type="linear", factor=8.0),
          query_pre_attn_scalar=256),
     dict(window_size=(511, 0), window_attn_skip_freq=6, rotary_base=1000000, rotary_base_local=10000,
          rotary_seq_len_interpolation_factor=8.0, softmax_scale=1 / 16, sandwich_norm=True)),
    (dict(_GEMMA3, layer_types=["full_attention", "sliding_attention"]),
     dict(window_size=(3, 0), window_attn_skip_freq=[0, 1], rotary_seq_len_interpolation_factor=None)),
])
def test_config_fields_from_hugging_face(fields, expected):
    config = {**_LLAMA, **fields}
    model_config = family_for(config).config_from_hf(config)
    assert {k: getattr(model_config, k) for k in expected} == expected
