"""DeepSeek-V3, DeepSeek-V2 and GLM-4.5 (issue 41), tiny random models built from transformers' config classes:
multi-latent attention (with and without the query's compression, YaRN with mscale) or GLM's grouped-query attention
(q/k/v biases, q/k norms, RoPE on half of each head), a dense first layer, shared experts, sigmoid routing with a
score-correction bias from 1 of 2 expert groups (V3, GLM) or the softmax's top 2 as they are (V2).
megatron-core's forward equals transformers' at EP=2, TP=2 x EP=2 and PP=2; every tensor comes back bit for bit,
also from a checkpoint re-saved by the PP=2 ranks; megatron-core's router picks the experts, and gives them the
weights, that transformers' router does; what megatron-core scores otherwise is refused by name.

    python -m pytest -q -p no:cacheprovider tests/test_deepseek.py
"""

import pytest

from megatron_patch.model.conversion import UnsupportedCheckpoint, family_for
from megatron_patch.model.config import get_model_config
from megatron_patch.testing import run_on_ranks
from tests.convert_oracles import (
    DEEPSEEK_MODELS, add_mtp_layer, assert_bit_exact, assert_layouts_match_transformers, assert_round_trips_bit_exact,
    cli, convert_command, hf_tensors, make_hf_model,
)

LAYOUTS = [(1, 1, 2), (2, 1, 2), (1, 2, 1)]  # (TP, PP, EP) on 4 ranks; the last re-saves the checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Both models converted to torch_dist by the CLI (verified by the test below, at every layout in one start of
    the ranks)."""
    root = tmp_path_factory.mktemp("convert-deepseek")
    dirs = {}
    for name in DEEPSEEK_MODELS:
        hf, dist = make_hf_model(name, str(root / f"{name}-hf")), str(root / f"{name}-dist")
        argv = ["hf-to-megatron", "--hf-dir", hf, "--save-dir", dist, "--no-verify", "--no-progress"]
        assert run_on_ranks(cli, 1, args=(argv,), timeout=300) == [0], f"{name}: conversion failed"
        dirs[name] = (hf, dist, root)
    return dirs


def test_forward_matches_transformers_with_expert_tensor_and_pipeline_parallelism(converted):
    assert_layouts_match_transformers(converted, LAYOUTS)


def test_round_trip_is_bit_exact_from_the_conversion_and_from_a_checkpoint_saved_by_pipeline_ranks(converted):
    assert_round_trips_bit_exact(converted, LAYOUTS)


def test_multi_token_prediction_layers_are_kept_both_ways(tmp_path):
    """A DeepSeek-V3 directory with its multi-token prediction layer (as the published checkpoint has it, which
    transformers ignores): converted at EP=2 with the main model verified against transformers, the layer becomes
    megatron-core's MTP module and comes back bit for bit, its copies of the embedding and output matrices too."""
    hf, dist, out = str(tmp_path / "hf"), str(tmp_path / "dist"), str(tmp_path / "out")
    add_mtp_layer(make_hf_model("deepseek-v3", hf))
    assert convert_command(["hf-to-megatron", "--hf-dir", hf, "--save-dir", dist,
                            "--target-expert-model-parallel-size", "2", "--no-progress"]) == 0
    assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", dist, "--save-dir", out, "--no-progress"],),
                        timeout=120) == [0]
    assert_bit_exact(hf, out)
    assert any(name.startswith("model.layers.4.") for name in hf_tensors(out))


def conversion_refusal(rank, world_size, hf_dir, save_dir):
    """hf_to_megatron's ConversionError, in a rank: the refusal comes after the conversion's process group starts,
    which in pytest's own process would hold MASTER_PORT for every later launch."""
    from megatron_patch.convert.core import ConversionError, hf_to_megatron

    with pytest.raises(ConversionError) as refused:
        hf_to_megatron(hf_dir, save_dir, progress=False)
    return str(refused.value)


def test_a_multi_token_prediction_layer_whose_embedding_copy_differs_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = str(tmp_path / "hf")
    add_mtp_layer(make_hf_model("deepseek-v3", hf))
    mtp = load_file(f"{hf}/model-mtp.safetensors")
    mtp["model.layers.4.embed_tokens.weight"][0, 0] += 1
    save_file(mtp, f"{hf}/model-mtp.safetensors", metadata={"format": "pt"})
    [message] = run_on_ranks(conversion_refusal, 1, args=(hf, str(tmp_path / "dist")), timeout=300)
    assert "model.layers.4.embed_tokens.weight differs from model.embed_tokens.weight" in message
    assert not (tmp_path / "dist").exists()


def test_a_bf16_checkpoint_with_its_score_correction_bias_in_fp32_round_trips(tmp_path):
    """DeepSeek-V3's bf16 checkpoints keep e_score_correction_bias in fp32, as megatron-core keeps its expert bias:
    the one dtype the conversion otherwise requires leaves it out, and it comes back in fp32, bit for bit."""
    import glob

    import torch
    from safetensors.torch import load_file, save_file

    hf, dist, out = str(tmp_path / "hf"), str(tmp_path / "dist"), str(tmp_path / "out")
    make_hf_model("deepseek-v3", hf)
    for path in glob.glob(f"{hf}/*.safetensors"):
        tensors = {name: t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
                   for name, t in load_file(path).items()}
        save_file(tensors, path, metadata={"format": "pt"})
    assert run_on_ranks(cli, 1, args=(["hf-to-megatron", "--hf-dir", hf, "--save-dir", dist, "--no-verify",
                                       "--no-progress"],), timeout=300) == [0]
    assert run_on_ranks(cli, 1, args=(["megatron-to-hf", "--load-dir", dist, "--save-dir", out, "--no-progress"],),
                        timeout=120) == [0]
    assert_bit_exact(hf, out)
    assert hf_tensors(out)["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def route_both(rank, world_size, hf_dir, layer, tokens):
    """transformers' and megatron-core's routing of ``tokens`` random hidden states through layer ``layer``'s
    router, the same weights and score-correction bias in both; megatron-core's again with its bias zeroed."""
    import json
    import os

    import torch
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from transformers import AutoModelForCausalLM

    from megatron_patch import compat
    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import to_transformer_config
    from megatron_patch.model.parallel import ParallelConfig

    compat.apply()
    initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=1)
    hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
    model_config = family_for(hf_config).config_from_hf(hf_config)
    gate = AutoModelForCausalLM.from_pretrained(hf_dir).model.layers[layer].mlp.gate.eval()
    router = TopKRouter(to_transformer_config(model_config, ParallelConfig()),
                        ProcessGroupCollection.use_mpu_process_groups()).eval()
    hidden = torch.randn(tokens, model_config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        router.weight.copy_(gate.weight)
        if router.expert_bias is not None:
            router.expert_bias.copy_(gate.e_score_correction_bias)
        _, hf_weights, hf_experts = gate(hidden)
        probs, routing_map = router(hidden[:, None, :])
        unbiased = None
        if router.expert_bias is not None:
            router.expert_bias.zero_()
            unbiased = router(hidden[:, None, :])[1]
    return dict(hf_experts=hf_experts.sort(dim=-1).values, hf_weights=hf_weights.gather(1, hf_experts.argsort(-1)),
                experts=routing_map.nonzero()[:, 1].view(tokens, -1), probs=probs, unbiased=unbiased)


@pytest.mark.parametrize("name", list(DEEPSEEK_MODELS))
def test_megatron_core_routes_each_token_to_the_experts_transformers_picks(tmp_path, name):
    hf = make_hf_model(name, str(tmp_path / "hf"))
    [routes] = run_on_ranks(route_both, 1, args=(hf, 1, 256), timeout=120)
    assert (routes["experts"] == routes["hf_experts"]).all()
    chosen = routes["probs"].gather(1, routes["experts"])
    assert (routes["probs"] != 0).sum().item() == chosen.numel()
    torch_close = (chosen - routes["hf_weights"]).abs().max().item()
    assert torch_close < 1e-6, torch_close
    if routes["unbiased"] is not None:
        # The bias decides: without it some tokens go elsewhere, so a router ignoring it fails the first assertion.
        assert (routes["unbiased"].nonzero()[:, 1].view(256, -1) != routes["hf_experts"]).any()


_V3 = dict(DEEPSEEK_MODELS["deepseek-v3"][1], model_type="deepseek_v3")
_V2 = dict(DEEPSEEK_MODELS["deepseek-v2"][1], model_type="deepseek_v2")
_GLM = dict(DEEPSEEK_MODELS["glm4-moe"][1], model_type="glm4_moe")


@pytest.mark.parametrize("config,message", [
    (dict(_V3, norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(_V3, n_group=2, topk_group=2), "num_experts_per_tok=2, topk_group=2"),
    (dict(_V3, topk_method="greedy"), "topk_method='greedy'"),
    (dict(_V3, rope_parameters=dict(_V3["rope_parameters"], attention_factor=0.5)), "attention_factor"),
    (dict(_V3, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)), "'linear'"),
    (dict(_V3, first_k_dense_replace=4), "first_k_dense_replace=4"),
    (dict(_V2, topk_method="group_limited_greedy", n_group=2, topk_group=1), "num_experts_per_tok=2, topk_group=1"),
    (dict(_V2, attention_bias=True), "attention_bias=True"),
    (dict(_GLM, norm_topk_prob=False), "norm_topk_prob=false"),
    (dict(_GLM, n_group=2, topk_group=2), "num_experts_per_tok=2, topk_group=2"),
])
def test_hugging_face_options_megatron_core_cannot_compute_are_refused_by_name(config, message):
    with pytest.raises(UnsupportedCheckpoint, match=message):
        family_for(config).config_from_hf(config)


@pytest.mark.parametrize("model_type,changes,message", [
    ("deepseek_v3", dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False),
     "deepseek_v3 routes by sigmoid"),
    ("deepseek_v2", {}, "deepseek_v2 takes the top k of a softmax"),
    ("deepseek_v3", dict(moe_layer_freq=[1, 0, 1, 1]), "first_k_dense_replace layers are dense"),
    ("deepseek_v3", dict(moe_shared_expert_intermediate_size=48), "not a multiple of --moe-ffn-hidden-size 32"),
    ("deepseek_v3", dict(multi_latent_attention=False, q_lora_rank=None, rope_type="rope"),
     "multi-latent attention with experts"),
    ("glm4_moe", {}, "glm4_moe is grouped-query attention"),
])
def test_export_refuses_what_the_model_type_cannot_express(model_type, changes, message):
    config = get_model_config("tiny-deepseek-v3", **changes)
    with pytest.raises(UnsupportedCheckpoint, match=message):
        family_for({"model_type": model_type}).config_to_hf(config)


def test_named_deepseek_v3_reads_back_from_its_own_config_json():
    """deepseek-v3's fields written as DeepSeek-V3's config.json and read back give the same model."""
    model_config = get_model_config("deepseek-v3")
    family = family_for({"model_type": "deepseek_v3"})
    hf = {**family.config_to_hf(model_config), "model_type": "deepseek_v3"}
    assert (hf["first_k_dense_replace"], hf["n_group"], hf["topk_group"], hf["n_shared_experts"]) == (3, 8, 4, 1)
    read = family.config_from_hf(hf).replace(seq_length=model_config.seq_length)
    assert read == model_config


def built_parameters(rank, world_size, names_and_changes):
    """The parameters of megatron-core's model of each ``(name, changes)`` at TP=1, PP=1, EP=1 (on the meta device)."""
    from megatron_patch.convert.core import build_reference_model

    return [sum(p.numel() for p in build_reference_model(get_model_config(name, **changes), 128, meta=True)
                .parameters()) for name, changes in names_and_changes]


def test_parameter_count_is_that_of_the_model_megatron_core_builds():
    """With and without the query's compression; the dense first layer counted with its own MLP width."""
    from megatron_patch.model.flops import num_parameters

    models = [("tiny-deepseek-v3", {}), ("tiny-deepseek-v3", dict(q_lora_rank=None, moe_layer_freq=[0, 0, 1, 1]))]
    [built] = run_on_ranks(built_parameters, 1, args=(models,), timeout=120)
    assert built == [num_parameters(get_model_config(name, **changes), 128) for name, changes in models]


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite", "glm-4.5", "glm-4.5-air"])
def test_named_configs_count_the_parameters_transformers_builds_from_their_config_json(name):
    """The named model without its multi-token prediction layer (transformers has none) counts as many parameters
    as transformers' model of the config.json the export writes for it, built on the meta device."""
    import torch
    import transformers

    from megatron_patch.model.flops import num_parameters

    model_config = get_model_config(name, mtp_num_layers=None)
    model_type = {"deepseek-v3": "deepseek_v3", "deepseek-v2-lite": "deepseek_v2"}.get(name, "glm4_moe")
    hf_config = transformers.AutoConfig.for_model(
        model_type, **family_for({"model_type": model_type}).config_to_hf(model_config))
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert num_parameters(model_config, model_config.vocab_size) == sum(p.numel() for p in hf_model.parameters())


# The published sizes in billions, with the digits they are published to: DeepSeek-V3 671B total, 37B activated per
# token (arXiv:2412.19437); DeepSeek-V2-Lite 15.7B, 2.4B (its model card); Moonlight-16B-A3B 16B, 3B; Kimi K2 1T, 32B
# (their model cards). DeepSeek's activated count leaves out the embedding (a token reads its row, nothing is
# multiplied). Each count rounds to the published figure, except V2-Lite's activated 2.45B (2.5B, not 2.4B).
PUBLISHED = {"deepseek-v3": ((671, 0), (37, 0)), "deepseek-v2-lite": ((15.7, 1), (2.4, 1)),
             "moonlight-16b-a3b": ((16, 0), (3, 0)), "kimi-k2": ((1000, -2), (32, 0))}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_dry_run_counts_total_and_active_parameters_as_published(name):
    from megatron_patch.training.plan import build_plan

    plan = build_plan(["--model-name", name, "--nproc-per-node", "8", "--bf16", "--expert-model-parallel-size", "8",
                       "--global-batch-size", "8", "--use-distributed-optimizer"])
    [line] = [line for line in plan.render().splitlines() if line.startswith("parameters: ")]
    counts = [int(word.replace(",", "")) / 1e9 for word in line.split() if word[0].isdigit()]
    rounded = [round(count, digits) for count, (_, digits) in zip(counts, PUBLISHED[name])]
    if name == "deepseek-v2-lite":
        assert abs(counts[1] - 2.4) < 0.06, line
        rounded[1] = 2.4
    assert rounded == [published for published, _ in PUBLISHED[name]], line


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from seed_scripts.assets import rapidformer_assets

    return rapidformer_assets(tmp_path_factory)


def _losses_of(rank, world_size, argv):
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import MegatronGPTPretrainer

    log = MegatronGPTPretrainer(engine=Engine(argv)).train()
    return [loss for _, loss in log.train_losses]


def test_ep2_trains_as_one_rank_with_the_expert_bias_and_multi_token_prediction(assets, tmp_path):
    """tiny-deepseek-v3 (sigmoid routing from groups, a dense first layer, shared experts) with one multi-token
    prediction module, from one checkpoint, the same 4 global batches at EP=1 on one rank and at EP=2 or PP=2 on two:
    the same LM and MTP losses, both logged per iteration. The expert bias moves by 0.2 a step (megatron-core's
    finalize_model_grads, from the tokens each expert got on all ranks); a run whose bias stays put has other losses,
    so a bias updated from one rank's tokens only would show."""
    import json

    save = str(tmp_path / "ckpt")
    argv = ["--seq-length", "32", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", assets.gpt_options["vocab_file"], "--merge-file", assets.gpt_options["merge_file"],
            "--data-path", assets.gpt_prefix, "--split", "98,2,0", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--lr", "1e-2", "--lr-decay-style", "constant"]
    run_on_ranks(_losses_of, 1, args=(argv + ["--model-name", "tiny-deepseek-v3", "--moe-router-bias-update-rate",
                                              "0.2", "--mtp-num-layers", "1", "--train-iters", "1", "--save", save],),
                 timeout=300)

    def records(name, *extra, ranks=1):
        resume = argv + ["--train-iters", "5", "--load", save, "--no-load-optim", "--log-dir", str(tmp_path / name)]
        run_on_ranks(_losses_of, ranks, args=(resume + list(extra),), timeout=300)
        with open(tmp_path / name / "iterations.jsonl") as f:
            return [value for r in map(json.loads, f) for value in (r["loss"], r["mtp_1 loss"])]

    single, parallel = records("ep1"), records("ep2", "--expert-model-parallel-size", "2", ranks=2)
    pipelined = records("pp2", "--pipeline-model-parallel-size", "2", ranks=2)  # the MTP module on the last stage
    fixed_bias = records("fixed-bias", "--moe-router-bias-update-rate", "0")
    assert len(single) == 2 * 4 and min(single) > 0  # (LM loss, MTP loss) of each iteration
    assert single[::2] != pytest.approx(fixed_bias[::2], rel=1e-4)
    assert parallel == pytest.approx(single, rel=1e-5)
    assert pipelined == pytest.approx(single, rel=1e-5)


def test_a_sigkilled_ep2_run_resumes_exactly(assets, tmp_path):
    """examples/gpt/run_pretrain_gpt.sh with tiny-deepseek-v3 and a multi-token prediction module at EP=2 on 2 CPU
    processes, 8 iterations, a checkpoint every 3 (the expert bias with the weights): SIGKILLed in its process group
    once past iteration 4, the same command again resumes from its last checkpoint and repeats the unbroken run's
    records (LM and MTP losses, grad norms) bitwise. The log has the MTP loss beside the LM loss."""
    import re

    import os
    import signal
    import subprocess
    import sys
    import time

    from test_reliability import _last_iteration, _records
    from test_run_scripts import GPT

    def start(out):
        flags = ["--cpu", "--nproc-per-node", "2", "--model-size", "tiny-deepseek-v3", "--ep", "2", "--seq-length",
                 "32", "--data-path", assets.gpt_prefix, "--vocab-file", assets.gpt_options["vocab_file"],
                 "--merge-file", assets.gpt_options["merge_file"], "--micro-batch-size", "4", "--global-batch-size",
                 "8", "--train-iters", "8", "--lr", "3e-3", "--save-interval", "3", "--output-dir", str(out), "--",
                 "--log-interval", "1", "--split", "98,2,0", "--moe-router-bias-update-rate", "0.05",
                 "--mtp-num-layers", "1"]
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")}
        return subprocess.Popen(["bash", GPT, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**env, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})

    unbroken = start(tmp_path / "unbroken")
    output = unbroken.communicate(timeout=300)[0]
    assert unbroken.returncode == 0, output[-5000:]
    log = (tmp_path / "unbroken" / "logs" / "pretrain_gpt_node0.log").read_text()
    assert len(re.findall(r"\| lm loss: [0-9.E+-]+ \| mtp_1 loss: [0-9.E+-]+ \|", log)) == 8, log[-3000:]
    killed_dir = tmp_path / "killed"
    killed = start(killed_dir)
    try:
        deadline = time.monotonic() + 300
        while _last_iteration(killed_dir / "logs") < 5:
            assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()[0][-5000:]
            time.sleep(0.05)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.communicate(timeout=60)
    resumed = start(killed_dir)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output[-5000:]
    reference = {r["iteration"]: r for r in _records(tmp_path / "unbroken" / "logs")}
    records = _records(killed_dir / "logs")
    iterations = [r["iteration"] for r in records]
    [restart] = [i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1]]
    # The second start went on from a checkpoint (iteration 3 or 6), not from the beginning.
    assert iterations[restart] - 1 in (3, 6) and iterations[:restart] == list(range(1, iterations[restart - 1] + 1))
    assert sorted(reference) == list(range(1, 9)) and iterations[restart:] == list(range(iterations[restart], 9))
    assert [r for r in records if r != reference[r["iteration"]]] == []
