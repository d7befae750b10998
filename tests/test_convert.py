"""HF -> Megatron -> HF for GPT-2, LLaMA (GQA), Qwen2 and BERT (three kinds): megatron-core's forward equals
transformers' at TP=1, TP=2, PP=2 and TP=2 x PP=2, and every tensor comes back bit for bit, through both
checkpoint formats and after a resharded save."""

import pytest

from megatron_patch.testing import run_on_ranks
from tests.convert_oracles import HF_MODELS, assert_bit_exact, cli, make_hf_model, verify_layouts

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
