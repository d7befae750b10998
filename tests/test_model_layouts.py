"""GPT-2, LLaMA (GQA), Qwen2, Gemma 3, BERT and the mixture-of-experts models give the single-process loss and
gradients under every parallel layout.

Each family runs once on one process (the oracle) and once on four processes that go through TP=2, PP=2,
TP=2 x PP=2, PP=2 x VPP=2, sequence parallelism and full/selective recompute in turn (data parallelism fills
the rest of the four ranks); the MoE families go through EP=2, TP=2 x EP=2 and PP=2 x EP=2 with both token
dispatchers. Weights come from the same global tensors by checkpoint key at every layout.

Why the MoE oracle is exact, with the dense layouts' tolerance:

- Dropless routing (no ``moe_expert_capacity_factor``, the registry's default): every layout computes every token.
- The load-balancing loss ("aux_loss") enters backward through megatron-core's ``MoEAuxLossAutoScaler``, whose
  scale the pipeline schedule sets from the microbatch count (``forward_step_calc_loss`` in
  ``pipeline_parallel/schedules.py``: 1 / num_microbatches, no grad scaler here). The oracle and the layouts run
  the same schedule and DDP averages over data parallelism, so a microbatch's load-balancing loss weighs
  1 / GLOBAL_BATCH everywhere, as its LM loss does; nothing sets the scale by hand.
- "aux_loss" statistics are per microbatch, over the tokens of the TP x CP group (``router.py``
  ``_apply_aux_loss`` sums the expert counts over ``tp_cp_group``, and each sequence-parallel rank adds its
  tokens' share). A microbatch is one sequence at every layout: TP splits it and the counts are summed back, EP and
  PP do not change which tokens a router sees, DP only which microbatches a rank holds. So "aux_loss" itself is
  the invariant quantity; no layout needs "seq_aux_loss" (equal to it at one sequence per microbatch) or
  "global_aux_loss" (statistics over DP and steps). The micro-batch size, not the layout, would change it.
- TP > 1 needs sequence parallelism for MoE (megatron-core refuses to train without it). The all-to-all
  dispatcher runs at EP=2 with expert TP 1 only: gloo cannot gather the unequal token counts expert TP needs, which
  ParallelConfig refuses (tests/test_layout.py).
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
    # Sliding windows with a RoPE of their own beside full layers, sandwich norms, scaled embeddings, GeGLU.
    "gemma3": ("tiny-gemma3", {}),
    "bert-post-ln": ("tiny-bert", {}),
    "bert-pre-ln": ("tiny-bert", dict(bert_layernorm_style="pre", untie_embeddings_and_output_weights=True)),
}


# World 4: EP=2 leaves expert-DP 2 (DP 4); TP=2 x EP=2 has expert TP 2 (the default, = TP) or 1; PP=2 x EP=2 has
# expert TP 1.
MOE_LAYOUTS = [
    ("ep2", dict(expert_model_parallel_size=2)),
    ("ep2-alltoall", dict(expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall")),
    ("tp2-sp-ep2", dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2)),
    ("tp2-sp-ep2-etp1-alltoall", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                      expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                                      moe_token_dispatcher_type="alltoall")),
    ("pp2-ep2", dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2)),
    ("pp2-ep2-alltoall", dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                              moe_token_dispatcher_type="alltoall")),
]

# 4 experts, top-2. A load-balancing weight of 0.1 (Mixtral's is 0.02) makes its share of the router's gradient
# large, so a layout that scaled it wrongly would be far outside the tolerance.
MOE_FAMILIES = {
    "mixtral": ("tiny-mixtral", dict(moe_aux_loss_coeff=0.1)),
    "qwen2-moe-shared-expert-gate": ("tiny-qwen2-moe", dict(moe_aux_loss_coeff=0.1)),
}
ROUTER = "decoder.layers.mlp.router.weight"


def _relative_difference(actual, expected):
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-12))


def _single_process(name, overrides):
    [reference] = run_on_ranks(loss_and_grads, 1, args=(name, overrides, [("single", {})]))
    expected_loss, expected_grads = reference["single"]
    assert all(np.linalg.norm(g) > 0 for g in expected_grads.values()), "every parameter must get a gradient"
    return expected_loss, expected_grads


def _assert_layouts_match(results, expected_loss, expected_grads):
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layouts_match_single_process(family):
    name, overrides = FAMILIES[family]
    expected_loss, expected_grads = _single_process(name, overrides)
    results = run_on_ranks(loss_and_grads, 4, args=(name, overrides, LAYOUTS), timeout=300)[0]
    _assert_layouts_match(results, expected_loss, expected_grads)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_moe_layouts_match_single_process(family):
    name, overrides = MOE_FAMILIES[family]
    expected_loss, expected_grads = _single_process(name, overrides)
    # The load-balancing loss is part of what the layouts must match: without it the loss and the router's
    # gradient move by far more than the tolerance.
    lm_loss, lm_grads = _single_process(name, {**overrides, "moe_aux_loss_coeff": 0.0})
    assert expected_loss - lm_loss > 1e-2 * expected_loss
    assert _relative_difference(lm_grads[ROUTER], expected_grads[ROUTER]) > 1e-1
    results = run_on_ranks(loss_and_grads, 4, args=(name, overrides, MOE_LAYOUTS), timeout=300)[0]
    _assert_layouts_match(results, expected_loss, expected_grads)
