"""Mixture-of-experts training through the run_*.sh recipe: a short tiny-mixtral pretraining run on 2 CPU processes
with expert parallelism 2 whose loss falls and whose log carries the routing statistics; its resume from a middle
checkpoint at EP 2 repeats the uninterrupted run's records bitwise; the --dry-run plan's expert groups and expert
memory against arithmetic done here; the launcher's parent check refuses expert layouts that do not divide; and at
4 processes (EP 2 x expert-DP 2) the dense parameters stay equal on every rank and each expert on its expert-data-
parallel replicas, while the experts of different EP ranks differ.

    python -m pytest -q -p no:cacheprovider tests/test_moe_training.py
"""

import json
import os
import re
import shutil

import pytest
from seed_scripts.assets import rapidformer_assets
from test_run_scripts import GPT, _command_words, _field, _losses, _number, _recipe

from megatron_patch.testing import run_on_ranks

# tiny-mixtral (megatron_patch/model/config.py): 2 layers, hidden 64, 4 experts of width 32, top-2, SwiGLU.
HIDDEN, EXPERTS, EXPERT_FFN, TOPK, LAYERS = 64, 4, 32, 2, 2
SEQ, MICRO, GLOBAL, ITERS, RESUME_AT = 32, 4, 8, 16, 8


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def _flags(assets, *extra):
    return ["--cpu", "--nproc-per-node", "2", "--model-size", "tiny-mixtral", "--ep", "2", "--seq-length", str(SEQ),
            "--data-path", assets.gpt_prefix, "--vocab-file", assets.gpt_options["vocab_file"],
            "--merge-file", assets.gpt_options["merge_file"], "--micro-batch-size", str(MICRO),
            "--global-batch-size", str(GLOBAL), "--lr", "3e-3", *extra,
            "--", "--log-interval", "4", "--split", "98,2,0", "--lr-decay-style", "constant"]


def _records(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "logs", "iterations.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def run(assets, tmp_path_factory):
    """One uninterrupted run (checkpoints at RESUME_AT and at the end) and its --dry-run, shared by the tests."""
    root = tmp_path_factory.mktemp("moe")
    out = root / "out"
    flags = _flags(assets, "--train-iters", str(ITERS), "--save-interval", str(RESUME_AT), "--output-dir", str(out))
    code, dry = _recipe(GPT, "--dry-run", *flags, cwd=root, timeout=120)
    assert code == 0, dry
    code, output = _recipe(GPT, *flags, cwd=root, timeout=300)
    assert code == 0, output[-5000:]
    log = (out / "logs" / "pretrain_gpt_node0.log").read_text()
    return {"root": root, "out": out, "dry": dry, "output": output, "log": log, "records": _records(out)}


def test_the_loss_falls_and_the_log_has_the_routing_statistics(run):
    losses = _losses(run["log"])
    assert len(losses) == ITERS // 4 and losses[-1] < losses[0], losses
    # Megatron-LM's name for the load-balancing loss, in the iteration line beside the LM loss.
    balancing = [float(x) for x in re.findall(r"\| lm loss: [0-9.E+-]+ \| load_balancing_loss: ([0-9.E+-]+) \|",
                                              run["log"])]
    assert len(balancing) == ITERS // 4
    routing = re.findall(r"routing of layer (\d+) at iteration (\d+) \| load_balancing_loss: ([0-9.E+-]+) \| "
                         r"tokens per expert per iteration: ([0-9. ]+)$", run["log"], re.M)
    assert len(routing) == LAYERS * ITERS // 4, run["log"][-3000:]
    by_iteration = {}
    for layer, iteration, loss, tokens in routing:
        counts = [float(x) for x in tokens.split()]
        assert len(counts) == EXPERTS and min(counts) >= 0
        # Every token of the global batch goes to top-k experts (no capacity factor drops any).
        assert sum(counts) == pytest.approx(GLOBAL * SEQ * TOPK)
        by_iteration.setdefault(int(iteration), []).append(float(loss))
    assert sorted(by_iteration) == list(range(4, ITERS + 1, 4))
    # The iteration line's value is the mean over the MoE layers of the per-layer ones (both printed to 7 digits).
    for (iteration, per_layer), mean in zip(sorted(by_iteration.items()), balancing):
        assert len(per_layer) == LAYERS and sum(per_layer) / LAYERS == pytest.approx(mean, rel=1e-5)
    # The switch loss is E x sum_i f_i P_i / k (f_i: token share routed to expert i, P_i: its mean probability):
    # near 1 for a router spreading tokens evenly, E / k at worst.
    assert all(0.5 < value <= EXPERTS / TOPK for value in balancing), balancing
    assert all("load_balancing_loss" in record for record in run["records"])


def test_the_dry_run_plans_the_expert_groups_and_memory_and_shows_the_command_that_runs(run):
    dry = run["dry"]
    assert _field(dry, "layout").startswith("TP 1 x CP 1 x DP 2 x PP 1")  # DP for the batch: world / (TP x PP x CP)
    assert _number(_field(dry, "gradient accumulation steps")) == GLOBAL // (MICRO * 2)
    assert _field(dry, "expert-parallel groups") == "[0, 1]"  # both ranks share the experts of each layer
    assert _field(dry, "expert-data-parallel groups") == "[0] [1]"  # world / (ETP 1 x EP 2 x PP 1) = 1
    assert _field(dry, "experts").startswith(f"{EXPERTS} per MoE layer, top-{TOPK}; {EXPERTS // 2} per rank (EP 2")
    # A SwiGLU expert: fc1 h -> 2 x ffn (gate and up), fc2 ffn -> h, no biases; each rank holds half of them.
    per_expert = HIDDEN * 2 * EXPERT_FFN + EXPERT_FFN * HIDDEN
    experts = LAYERS * EXPERTS * per_expert
    total = _number(_field(dry, "parameters"))
    per_gpu = _field(dry, "parameters per GPU")
    assert per_gpu.endswith(f"routed experts / (expert TP 1 x EP 2) = {experts // 2:,})")
    assert _number(per_gpu) == total - experts // 2
    # fp32 on CPU without the distributed optimizer: 4 bytes of weights, 4 of gradients and 8 of Adam's moments.
    # Per process on CPU, and in MiB: the tiny model's GiB showed as 0.00.
    memory = [float(x) for x in re.findall(r"(\d+\.\d+) MiB", _field(dry, "memory per process"))[:1]]
    assert memory == pytest.approx([(total - experts // 2) * 16 / 2 ** 20], abs=0.006)
    would_run = dry.split("the command it would run:\n", 1)[1].splitlines()[0]
    printed = next(line for line in run["output"].splitlines() if line.startswith("+ "))
    assert printed == would_run
    command = _command_words(printed)
    assert command[command.index("--expert-model-parallel-size") + 1] == "2"
    stored = json.loads((run["out"] / "checkpoints" / "megatron_patch_args.json").read_text())
    assert stored["model_config"]["num_moe_experts"] == EXPERTS


def test_the_plan_of_mixtral_8x7b_shards_expert_optimizer_state_over_expert_data_parallel_ranks():
    """Mixtral-8x7B from its published shape (32 layers, hidden 4096, 8 SwiGLU experts of 14336, top-2, 32 heads
    in 8 KV groups, 32000-token vocabulary, untied output) on 2 nodes of 8: TP 2 with SP, PP 2, EP 8 with expert
    TP 1, so DP 16 / (2 x 2) = 4 for the rest but expert DP 16 / (1 x 8 x 2) = 1."""
    from megatron_patch.training.plan import build_plan

    h, ffn, experts, layers, vocab = 4096, 14336, 8, 32, 32000
    plan = build_plan(["--model-name", "mixtral-8x7b", "--nproc-per-node", "8", "--bf16", "--sequence-parallel",
                       "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
                       "--use-distributed-optimizer", "--global-batch-size", "64"], nnodes=2)
    assert (plan.dp, plan.expert_dp) == (4, 1)
    assert plan.ep_groups == [list(range(8)), list(range(8, 16))]  # each node holds every expert of its stage
    attention = h * (h + 2 * 1024) + h * h  # q, k, v (8 groups of 128) and the output projection
    dense_layer, expert_layer = attention + experts * h + 2 * h, experts * 3 * h * ffn  # + router, two RMSNorms
    last = layers // 2 * dense_layer + h + vocab * h  # the final norm and the output layer besides
    others, routed = last / 2, layers // 2 * expert_layer / 8
    assert plan.parameters_per_gpu == others + routed
    # bf16 weights 2 + fp32 gradients 4 + fp32 master weights and moments 12 over the data-parallel ranks: DP 4 for
    # the rest, expert DP 1 for the experts.
    expected = (others * (6 + 12 / 4) + routed * (6 + 12 / 1)) / 2 ** 30
    assert sum(plan.memory_gib().values()) == pytest.approx(expected)


def test_a_resume_at_ep2_repeats_the_uninterrupted_records(assets, run):
    from megatron_patch.checkpoint.format import write_tracker

    saved = run["root"] / "saved"
    shutil.copytree(run["out"] / "checkpoints", saved)
    write_tracker(str(saved), RESUME_AT)  # resume from the middle, not the last save
    resumed = run["root"] / "resumed"
    code, output = _recipe(GPT, *_flags(assets, "--train-iters", str(ITERS), "--load", str(saved), "--output-dir",
                                        str(resumed)), cwd=run["root"], timeout=300)
    assert code == 0, output[-5000:]
    records = _records(resumed)
    assert [r["iteration"] for r in records] == list(range(RESUME_AT + 1, ITERS + 1))
    assert records == run["records"][RESUME_AT:]


@pytest.mark.parametrize("flags, world_size, message", [
    (["--expert-model-parallel-size", "3"], 3, "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
    (["--expert-model-parallel-size", "4"], 2, "world size 2 is not divisible by --expert-tensor-parallel-size 1 x "
                                               "--expert-model-parallel-size 4"),
    (["--tensor-model-parallel-size", "2"], 2, "need --sequence-parallel"),
])
def test_the_launcher_refuses_an_expert_layout_before_any_rank_starts(flags, world_size, message):
    from megatron_patch.training.arguments import parse_flags, run_config

    with pytest.raises(SystemExit) as error:
        run_config(parse_flags(["--model-name", "tiny-mixtral", *flags]), world_size)
    assert message in str(error.value)


def _train_and_gather(rank, world_size, argv):
    """Train, then every rank's parameters by name (with the overlapped parameter gather finished)."""
    import torch
    from megatron.core import parallel_state

    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import MegatronGPTPretrainer

    trainer = MegatronGPTPretrainer(engine=Engine(argv))
    trainer.train()
    with trainer.backend.parameters_in_sync():
        params = {name: p.detach().clone() for name, p in trainer.model[0].module.named_parameters()}
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, params)
    return {"params": gathered if rank == 0 else None,
            "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "expert_dp_group": torch.distributed.get_process_group_ranks(
                parallel_state.get_expert_data_parallel_group())}


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group(assets):
    import torch

    argv = ["--model-name", "tiny-mixtral", "--seq-length", str(SEQ), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", assets.gpt_options["vocab_file"], "--merge-file", assets.gpt_options["merge_file"],
            "--data-path", assets.gpt_prefix, "--split", "98,2,0", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "3", "--lr", "3e-3", "--expert-model-parallel-size", "2",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    results = run_on_ranks(_train_and_gather, 4, args=(argv,), timeout=300)
    params = results[0]["params"]
    groups = {tuple(r["expert_dp_group"]) for r in results}
    assert groups == {(0, 2), (1, 3)}  # megatron-core's order tp-ep-dp: EP ranks adjacent
    experts = [name for name in params[0] if ".experts." in name]
    assert experts and len(experts) < len(params[0])
    for name in params[0]:
        if name in experts:
            # Each rank's data differ, so replicas that did not average their gradients would differ too.
            for a, b in groups:
                assert torch.equal(params[a][name], params[b][name]), name
            assert not torch.equal(params[0][name], params[1][name]), name  # other experts, by design
        else:
            for rank in range(1, 4):
                assert torch.equal(params[0][name], params[rank][name]), name


def _losses_of(rank, world_size, argv):
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import MegatronGPTPretrainer

    log = MegatronGPTPretrainer(engine=Engine(argv)).train()
    return [loss for _, loss in log.train_losses]


def _refusal_of(rank, world_size, argv) -> str:
    from megatron_patch.errors import UserError

    try:
        _losses_of(rank, world_size, argv)
    except UserError as error:
        return str(error)
    return "not refused"


@pytest.mark.parametrize("per_token", [[], ["--calculate-per-token-loss"]], ids=["per-microbatch", "per-token"])
def test_ep2_trains_as_one_rank_with_the_load_balancing_loss_scaled_as_megatron_lm_scales_it(assets, tmp_path,
                                                                                               per_token):
    """Megatron-LM's aux loss is each microbatch's, averaged over microbatches and data-parallel ranks (the
    schedules' MoEAuxLossAutoScaler scale). So one rank's two microbatches make the updates of one microbatch on
    each of two ranks (EP 2 x DP 2): a scale that forgot the microbatches would double the router's aux gradient
    on one rank only, which a coefficient of 1 makes visible in the next steps' losses. EP ranks initialise their
    experts from seeds of their own, so both runs start from one checkpoint's weights with a fresh optimizer."""
    save = str(tmp_path / "ckpt")
    argv = ["--seq-length", str(SEQ), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", assets.gpt_options["vocab_file"], "--merge-file", assets.gpt_options["merge_file"],
            "--data-path", assets.gpt_prefix, "--split", "98,2,0", "--micro-batch-size", str(MICRO),
            "--global-batch-size", str(GLOBAL), "--lr", "1e-2", "--lr-decay-style", "constant",
            "--hidden-dropout", "0", "--attention-dropout", "0", *per_token]
    run_on_ranks(_losses_of, 1, args=(["--model-name", "tiny-mixtral", "--moe-aux-loss-coeff", "1.0", *argv,
                                       "--train-iters", "1", "--save", save],), timeout=300)
    resume = argv + ["--train-iters", "4", "--load", save, "--no-load-optim"]
    [single] = run_on_ranks(_losses_of, 1, args=(resume,), timeout=300)
    if not per_token:  # with its optimizer, the EP 1 save is refused at EP 2 by name (it would fail on its keys)
        refusals = run_on_ranks(_refusal_of, 2, args=(argv + ["--train-iters", "4", "--load", save,
                                                              "--expert-model-parallel-size", "2"],), timeout=300)
        assert all("at --expert-model-parallel-size 1, requested 2" in r and "--no-load-optim" in r
                   for r in refusals), refusals
    parallel = run_on_ranks(_losses_of, 2, args=(resume + ["--expert-model-parallel-size", "2"],), timeout=300)
    assert len(single) == 3
    # The gradient reduction over two ranks sums in another order: equal to float rounding.
    assert parallel[-1] == pytest.approx(single, rel=1e-5)
