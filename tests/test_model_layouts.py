"""GPT-2, LLaMA (GQA), Qwen2 and BERT give the single-process loss and gradients under every parallel layout.

Each family runs once on one process (the oracle) and once on four processes that go through TP=2, PP=2,
TP=2 x PP=2, PP=2 x VPP=2, sequence parallelism and full/selective recompute in turn (data parallelism fills
the rest of the four ranks). Weights come from the same global tensors by checkpoint key at every layout.
"""

import numpy as np
import pytest

from megatron_patch.testing import run_on_ranks
from tests.model_oracles import loss_and_grads

LAYOUTS = [
    ("tp2", dict(tensor_model_parallel_size=2)),
    ("pp2", dict(pipeline_model_parallel_size=2)),
    ("tp2xpp2", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ("pp2xvpp2", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    ("tp2-sp", dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    ("tp2-recompute-full", dict(tensor_model_parallel_size=2, recompute_granularity="full")),
    ("pp2-recompute-full-block", dict(pipeline_model_parallel_size=2, recompute_granularity="full",
                                      recompute_method="block", recompute_num_layers=1)),
    ("tp2-sp-recompute-selective", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                        recompute_granularity="selective")),
    ("tp2-recompute-selective", dict(tensor_model_parallel_size=2, recompute_granularity="selective")),
]

FAMILIES = {
    "gpt2": ("tiny-gpt2", {}),
    "llama-gqa": ("tiny-llama", dict(num_query_groups=2)),
    "qwen2": ("tiny-qwen2", dict(num_query_groups=2)),
    "qwen3": ("tiny-qwen3", {}),
    "llama3.1": ("tiny-llama", dict(rope_scaling=True, rope_scaling_factor=8.0, rotary_base=500000)),
    "bert-post-ln": ("tiny-bert", {}),
    "bert-pre-ln": ("tiny-bert", dict(bert_layernorm_style="pre", untie_embeddings_and_output_weights=True)),
}


def _relative_difference(actual, expected):
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layouts_match_single_process(family):
    name, overrides = FAMILIES[family]
    [reference] = run_on_ranks(loss_and_grads, 1, args=(name, overrides, [("single", {})]))
    expected_loss, expected_grads = reference["single"]
    assert all(np.linalg.norm(g) > 0 for g in expected_grads.values()), "every parameter must get a gradient"
    results = run_on_ranks(loss_and_grads, 4, args=(name, overrides, LAYOUTS), timeout=300)[0]
    failures = []
    for label, (loss, grads) in results.items():
        if abs(loss - expected_loss) > 1e-5 * abs(expected_loss):
            failures.append(f"{label}: loss {loss} != {expected_loss}")
        assert grads.keys() == expected_grads.keys(), label
        for key, expected in expected_grads.items():
            diff = _relative_difference(grads[key], expected)
            if not diff < 1e-5:  # also catches NaN: a shard nobody filled
                failures.append(f"{label}: grad of {key} differs by {diff:.2e}")
    assert not failures, "\n".join(failures)
