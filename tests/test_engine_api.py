"""
    python -m pytest -q tests/test_engine_api.py

The engine's smaller promises, each against a reference built in the test: the logger and timers user scripts
get, Megatron-LM's left-to-right masks, the torchrun command the launcher builds from the seed's environment, and a
Hugging Face model trained by the Pretrainer (gradient accumulation equals one big batch; ``save_pretrained``
checkpoints that transformers loads; resume with and without the optimizer and RNG state).
"""

import os
import shutil
import sys
import time

import pytest
import torch

from megatron_patch.testing import logged_messages, run_on_ranks


# -- get_logger / get_timers --------------------------------------------------------------------------------------
def logger_and_timers(rank, world_size):
    from megatron_patch.training.engine import Engine, get_logger, get_timers

    engine = Engine(["--micro-batch-size", "1"])
    logger = get_logger()
    with logged_messages(logger) as messages:
        logger.info("hello from a user script")
    timer = get_timers()("forward")
    before = time.perf_counter()
    for _ in range(2):  # elapsed() adds up every start/stop pair, as Megatron-LM's timers do
        timer.start()
        time.sleep(0.02)
        timer.stop()
    bound = time.perf_counter() - before
    return {"same": logger is engine.logger and get_timers() is engine.timers, "name": logger.name,
            "messages": messages, "elapsed": timer.elapsed(), "bound": bound,
            "after_reset": timer.elapsed(), "same_timer": get_timers()("forward") is timer}


def test_get_logger_and_get_timers():
    [result] = run_on_ranks(logger_and_timers, 1)
    assert result["same"] and result["name"] == "rapidformer"
    assert result["messages"] == ["hello from a user script"]  # the only (so last) rank logs at INFO
    assert 0.04 <= result["elapsed"] <= result["bound"]
    assert result["after_reset"] == 0.0 and result["same_timer"]


def run_twice_in_one_process(rank, world_size):
    import gc
    import os
    import weakref

    from megatron_patch.testing import tiny_gpt
    from megatron_patch.training.engine import Engine, get_args

    threads, models = [], []
    for _ in range(2):
        engine = Engine(["--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1"])
        model = tiny_gpt()
        engine.compose(model_obj=model)  # DDP and the optimizer hold megatron-core's process groups
        threads.append(len(os.listdir("/proc/self/task")))  # gloo's communication threads are OS threads
        models.append(weakref.ref(model))
        del engine, model
        gc.collect()
    try:
        message = f"get_args() answered {get_args()}"
    except RuntimeError as error:
        message = str(error)
    return {"threads": threads, "freed": [ref() is None for ref in models], "message": message}


def test_an_engine_the_script_dropped_frees_its_model_and_process_groups():
    """Failed before: the module kept the last engine (for ``get_args()``), so its model, optimizer and process groups
    lived on after the script let go of them, through the next engine's start-up: two models in memory at once, and
    the old groups' threads running after their groups were destroyed (a reused test worker gained ~48 per test)."""
    [result] = run_on_ranks(run_twice_in_one_process, 1)
    assert result["freed"] == [True, True]
    assert result["threads"][1] == result["threads"][0]
    assert "create `engine = RapidformerEngine()` and keep it" in result["message"]


# -- get_ltor_masks_and_position_ids ------------------------------------------------------------------------------
EOD = 0
# Documents end with their EOD; one row ends in an EOD, the other starts with one.
TOKENS = torch.tensor([[5, 6, 0, 7, 8, 0, 9], [0, 1, 2, 3, 4, 5, 0]])


def _document_of(row: list[int]) -> list[int]:
    """Which document each position is in: the number of EODs strictly before it (an EOD ends its document)."""
    return [sum(token == EOD for token in row[:i]) for i in range(len(row))]


@pytest.mark.parametrize("reset_position_ids", [False, True])
@pytest.mark.parametrize("reset_attention_mask", [False, True])
@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_ltor_masks_and_position_ids(reset_position_ids, reset_attention_mask, eod_mask_loss):
    from megatron_patch.training.data import get_ltor_masks_and_position_ids

    mask, loss_mask, positions = get_ltor_masks_and_position_ids(
        TOKENS, EOD, reset_position_ids, reset_attention_mask, eod_mask_loss)
    batch, length = TOKENS.shape
    # Megatron-LM: one mask for the batch unless it is reset per row; True marks a pair that may not attend.
    assert mask.dtype == torch.bool and mask.shape == (batch if reset_attention_mask else 1, 1, length, length)
    for b, row in enumerate(TOKENS.tolist()):
        document = _document_of(row)
        start = [document.index(d) for d in document]  # each document's first position
        assert positions[b].tolist() == [i - start[i] if reset_position_ids else i for i in range(length)]
        assert loss_mask[b].tolist() == [0.0 if eod_mask_loss and t == EOD else 1.0 for t in row]
        blocked = [[j > i or (reset_attention_mask and document[j] != document[i]) for j in range(length)]
                   for i in range(length)]
        assert mask[b if reset_attention_mask else 0, 0].tolist() == blocked
    if reset_position_ids:  # the same, written out
        assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 5]]


# -- the launcher's torchrun command ------------------------------------------------------------------------------
def test_launch_command_follows_the_seed_environment(monkeypatch):
    from torch.distributed.run import get_args_parser

    from megatron_patch.training.launcher import launch_command

    for name, value in dict(CUDA_VISIBLE_DEVICES="0,1,2,3", NNODES="2", NODE_RANK="1", MASTER_ADDR="h",
                            MASTER_PORT="6010").items():
        monkeypatch.setenv(name, value)
    flags = ["--task", "pretraining", "--mock-data", "--train-iters", "1"]
    for argv, processes in ((flags, "4"), (["--nproc-per-node", "2", *flags], "2")):
        command = launch_command(argv)
        assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
        # torchrun's own parser reads the command the way the launched torchrun will.
        launch = get_args_parser().parse_args(command[3:])
        assert (launch.nproc_per_node, launch.nnodes, launch.node_rank) == (processes, "2", 1)
        assert (launch.master_addr, launch.master_port) == ("h", 6010)
        assert launch.module and launch.training_script == "megatron_patch.training.launcher"
        # Each rank gets the flags less the launcher's own.
        assert launch.training_script_args == ["--rank-entry", *flags]


# -- a Hugging Face model under the Pretrainer --------------------------------------------------------------------
VOCAB, SEQ, LR = 64, 16, 1e-2
# Adam turns a gradient that is rounding noise (GPT-2's key biases get none: softmax ignores a shift) into a step
# of up to about lr, so weights of runs that sum in another order agree to a fraction of lr, not to fp32 rounding.
WEIGHTS_CLOSE = dict(rtol=1e-4, atol=1e-2 * LR)
_BATCH = ["--micro-batch-size", "2", "--global-batch-size", "8"]


class CountingSequences(torch.utils.data.Dataset):
    """Sequences ``start, start+stride, ...`` (mod VOCAB): a pattern a 2-layer GPT-2 picks up in a few steps."""

    def __len__(self):
        return 256

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        start = torch.randint(0, VOCAB, (1,), generator=generator)
        stride = torch.randint(1, 4, (1,), generator=generator)
        return (start + stride * torch.arange(SEQ)) % VOCAB


def _local_optimizer(optimizer) -> torch.optim.Optimizer:
    inner = optimizer.optimizer
    return getattr(inner, "optim", inner)  # ZeroRedundancyOptimizer keeps this rank's optimizer in .optim


def train_gpt2(rank, world_size, argv, log_dir):
    """Train a tiny Hugging Face GPT-2 with the Pretrainer; returns its losses, what the optimizer held and the
    RNG state at the start of each iteration, (on rank 0) the final weights and (on the last rank) the gradient
    norms of the ``--log-dir`` record."""
    import json

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_patch.training.engine import Engine
    from megatron_patch.training.trainers import Pretrainer

    class CountingPretrainer(Pretrainer):
        def train_valid_test_datasets_provider(self, train_val_test_num_samples):
            return CountingSequences(), None, None

        def model_optimizer_lr_scheduler_provider(self):
            config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            return GPT2LMHeadModel(config), None, None

        def run_forward_step(self, data_iterator, model):
            iteration = self.iteration + 1
            if iteration not in self.seen:
                state = _local_optimizer(self.optimizer).state
                scaler = self.optimizer.scaler
                self.seen[iteration] = {"adam_steps": sorted({float(s["step"]) for s in state.values()}),
                                        "rng": torch.get_rng_state(),
                                        "scaler": None if scaler is None else scaler.state_dict()}
            # A draw, as dropout makes, so the RNG state moves with the iterations (the loss does not use it).
            torch.rand(1)
            tokens = next(data_iterator)
            return model(input_ids=tokens, labels=tokens).loss

    trainer = CountingPretrainer(engine=Engine([*argv, "--lr", str(LR), "--lr-decay-style", "constant",
                                                "--log-interval", "1", "--seed", "3", "--log-dir", log_dir]))
    trainer.seen = {}
    log = trainer.train()
    weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    grad_norms = None
    if rank == world_size - 1:
        with open(os.path.join(log_dir, "iterations.jsonl")) as f:
            grad_norms = [json.loads(line)["grad_norm"] for line in f]
    return {"iterations": [i for i, _ in log.train_losses], "losses": [loss for _, loss in log.train_losses],
            "seen": trainer.seen, "weights": weights if rank == 0 else None, "grad_norms": grad_norms}


def _resume_root(save: str, iteration: int, root: str) -> str:
    """A copy of ``save`` whose latest checkpoint is ``iteration`` (so a run resumes in the middle)."""
    shutil.copytree(os.path.join(save, f"iter_{iteration:07d}"), os.path.join(root, f"iter_{iteration:07d}"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    """One big batch at 1 rank; micro-batches at 2 ranks under ZeRO-1 and ZeRO-3, saving at iterations 2 and 4;
    resumes from iteration 2 in the other memory mode, and with --no-load-optim --no-load-rng."""
    root = tmp_path_factory.mktemp("gpt2")
    steps = ["--train-iters", "4"]

    def train(name, world_size, *flags):
        return run_on_ranks(train_gpt2, world_size, args=([*steps, *flags], str(root / "logs" / name)))

    runs = {"big": train("big", 1, "--micro-batch-size", "8")[0]}
    for mode in ("zero-1", "zero-3"):
        runs[mode + " save"] = str(root / mode)
        runs[mode] = train(mode, 2, *_BATCH, f"--{mode}-memory-optimization", "--save", runs[mode + " save"],
                           "--save-interval", "2")
    for saved, mode in (("zero-3", "zero-1"), ("zero-1", "zero-3")):
        name = f"{saved} resumed as {mode}"
        load = _resume_root(runs[saved + " save"], 2, str(root / name))
        runs[name] = train(name, 2, *_BATCH, f"--{mode}-memory-optimization", "--load", load)
    runs["fp16 save"] = str(root / "fp16")
    runs["fp16"] = train("fp16", 1, "--micro-batch-size", "8", "--mixed-precision", "--save", runs["fp16 save"],
                         "--save-interval", "2")
    load = _resume_root(runs["fp16 save"], 2, str(root / "fp16 resumed"))
    runs["fp16 resumed"] = train("fp16 resumed", 1, "--micro-batch-size", "8", "--mixed-precision", "--load", load)
    load = _resume_root(runs["zero-3 save"], 2, str(root / "no-optim"))
    runs["no optim, no rng"] = train("no optim, no rng", 2, *_BATCH, "--zero-3-memory-optimization", "--load", load,
                                     "--no-load-optim", "--no-load-rng")
    return runs


def _assert_same_weights(actual: dict, expected: dict, **tolerance) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, **tolerance, msg=lambda m: f"{name}: {m}")


def test_gradient_accumulation_matches_one_big_batch(gpt2_runs):
    big = gpt2_runs["big"]
    assert big["losses"][-1] < big["losses"][0] - 0.1
    # Two micro-batches of 2 on each of 2 ranks (DDP's no_sync under ZeRO-1, FSDP2's deferred reduce-scatter under
    # ZeRO-3) make the same updates as one batch of 8: the same samples, summed in another order.
    for mode in ("zero-1", "zero-3"):
        ranks = gpt2_runs[mode]
        assert ranks[0]["losses"] == ranks[1]["losses"] == pytest.approx(big["losses"], rel=1e-5)
        assert ranks[1]["grad_norms"] == pytest.approx(big["grad_norms"], rel=1e-5)
        _assert_same_weights(ranks[0]["weights"], big["weights"], **WEIGHTS_CLOSE)


def test_save_pretrained_holds_the_final_weights(gpt2_runs):
    from transformers import GPT2LMHeadModel

    for mode in ("zero-1", "zero-3"):
        save = gpt2_runs[mode + " save"]
        with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
            assert f.read() == "4"
        loaded = GPT2LMHeadModel.from_pretrained(os.path.join(save, "iter_0000004")).state_dict()
        _assert_same_weights(loaded, gpt2_runs[mode][0]["weights"], rtol=0, atol=0)


def test_resume_restores_optimizer_and_rng_across_memory_modes(gpt2_runs):
    for saved, mode in (("zero-3", "zero-1"), ("zero-1", "zero-3")):
        unbroken, resumed = gpt2_runs[saved][0], gpt2_runs[f"{saved} resumed as {mode}"]
        for rank in (0, 1):
            assert resumed[rank]["iterations"] == [3, 4]
            # Adam's moments of the first two steps are back (each rank its shard), and the RNG is where it was.
            assert resumed[rank]["seen"][3]["adam_steps"] == [2.0]
            assert torch.equal(resumed[rank]["seen"][3]["rng"], gpt2_runs[saved][rank]["seen"][3]["rng"])
        assert resumed[0]["losses"] == pytest.approx(unbroken["losses"][2:], rel=1e-5)
        assert resumed[1]["grad_norms"] == pytest.approx(gpt2_runs[saved][1]["grad_norms"][2:], rel=1e-5)
        _assert_same_weights(resumed[0]["weights"], unbroken["weights"], **WEIGHTS_CLOSE)


def test_no_load_optim_and_no_load_rng(gpt2_runs):
    unbroken, resumed = gpt2_runs["zero-3"], gpt2_runs["no optim, no rng"]
    for rank in (0, 1):
        assert resumed[rank]["iterations"] == [3, 4]  # the iteration continues from the checkpoint
        assert resumed[rank]["seen"][3]["adam_steps"] == []  # a fresh optimizer: no state before its first step
        assert resumed[rank]["seen"][4]["adam_steps"] == [1.0]
        assert not torch.equal(resumed[rank]["seen"][3]["rng"], unbroken[rank]["seen"][3]["rng"])
    losses = resumed[0]["losses"]
    # The weights and the data position are loaded, so the first loss is the unbroken run's; then a fresh Adam
    # (its first update is about lr per weight) takes another step than one with two steps of moments.
    assert losses[0] == pytest.approx(unbroken[0]["losses"][2], rel=1e-6)
    assert losses[1] != pytest.approx(unbroken[0]["losses"][3], rel=1e-3)


def test_fp16_resume_restores_the_loss_scaler(gpt2_runs):
    unbroken, resumed = gpt2_runs["fp16"][0], gpt2_runs["fp16 resumed"][0]
    assert resumed["iterations"] == [3, 4]
    # The scale and the count of good steps towards its next growth continue; a fresh scaler would restart both.
    assert unbroken["seen"][3]["scaler"]["_growth_tracker"] == 2
    assert resumed["seen"][3]["scaler"] == unbroken["seen"][3]["scaler"]
    assert resumed["losses"] == pytest.approx(unbroken["losses"][2:], rel=1e-5)
