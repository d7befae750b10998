"""Preference tuning (issue 50): examples/gpt/dpo_gpt.py on megatron-core against TRL's DPOTrainer, the oracle, on
the same tiny LLaMA, Qwen2 and Mixtral (random weights, converted from transformers), chat template, pairs and beta:
the loss, gradient norm and rewards of the first two steps (the second after one AdamW step; at the first the policy
is the reference) at one process and across layouts, packed or not, for the sigmoid and IPO losses, with an SFT term
and with LoRA (TRL with peft).

    python -m pytest -q -p no:cacheprovider tests/test_dpo.py
"""

import importlib.util
import json
import os

import pytest
from conftest_data import data_assets
from sft_assets import ROOT, chat_tokenizer, converted_chat_model

from megatron_patch.data.stand_ins import conversations, preference_pairs, write_jsonl
from megatron_patch.testing import run_on_ranks

SCRIPT = os.path.join(ROOT, "examples", "gpt", "dpo_gpt.py")
SLOW_SCRIPT = os.path.join(ROOT, "tests", "scripts", "slow_finetuner.py")
PAIRS, SEQ, BETA, LR = 8, 128, 0.1, 1e-3


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    """The chat tokenizer, a LLaMA converted with it, and PAIRS pairs prepared by ``preprocess-data --dpo``."""
    from megatron_patch.data.preprocess import PreprocessConfig, preprocess

    root = str(tmp_path_factory.mktemp("dpo"))
    tokenizer = chat_tokenizer(data_assets(tmp_path_factory), os.path.join(root, "tokenizer"))
    rows = preference_pairs(PAIRS, seed=0)
    jsonl = write_jsonl(os.path.join(root, "prefs.jsonl"), rows)
    preprocess(PreprocessConfig(input=jsonl, output_prefix=os.path.join(root, "prefs"),
                                tokenizer_type="HuggingFaceTokenizer", tokenizer_options={"tokenizer_model": tokenizer},
                                dpo=True, workers=1))
    models = {kind: converted_chat_model(kind, tokenizer, root) for kind in ("llama", "qwen2", "mixtral")}
    return {"root": root, "tokenizer": tokenizer, "rows": rows, "models": models,
            "prefix": os.path.join(root, "prefs_dpo_document")}


def dpo(rank, world_size, argv):
    """examples/gpt/dpo_gpt.py's trainer on this rank."""
    from megatron_patch.training.engine import Engine

    spec = importlib.util.spec_from_file_location("dpo_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer = module.DPOFinetuner(engine=Engine(argv))
    trainer.train()
    return trainer.reference.source


def _ours(prefs, log_dir, world_size, loss_type, *extra, load=None, finetune=False, model="llama"
          ) -> tuple[list[dict], str | None]:
    """Our run's records (iterations.jsonl) and where its reference log-probabilities came from (None: computed);
    from the converted ``model``, or resumed from ``load`` (``finetune``: started from it)."""
    start = ["--load", load or prefs["models"][model]["mcore"]] + (["--finetune"] if finetune or not load else [])
    argv = ["--dpo", *start, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", prefs["tokenizer"],
            "--data-path", prefs["prefix"], "--split", "100,0,0", "--seq-length", str(SEQ), "--micro-batch-size",
            "1", "--lr", str(LR), "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--dpo-beta", str(BETA), "--dpo-loss-type",
            loss_type, "--log-interval", "1", "--log-dir", str(log_dir), "--seed", "3", *extra]
    sources = run_on_ranks(dpo, world_size, args=(argv,), timeout=300)
    with open(os.path.join(log_dir, "iterations.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()], sources[-1]


def _trl(prefs, out_dir, loss_type, steps=2, model="llama", sft_weight=0.0) -> list[dict]:
    """TRL's DPOTrainer on the same pairs, every pair in each step's batch (so its shuffling changes nothing);
    ``model`` a name of ``prefs["models"]`` or a PEFT model. With an SFT term, one pair to a micro-batch (TRL's
    ``sft`` loss is a token mean over its micro-batch; ours per pair)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    per_device, losses = (1, dict(loss_type=[loss_type, "sft"], loss_weights=[1.0, sft_weight])) if sft_weight \
        else (PAIRS, dict(loss_type=[loss_type]))
    args = DPOConfig(output_dir=str(out_dir), per_device_train_batch_size=per_device,
                     gradient_accumulation_steps=PAIRS // per_device, max_steps=steps, learning_rate=LR,
                     lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
                     report_to=[], beta=BETA, use_cpu=True, bf16=False, seed=3, save_strategy="no", **losses)
    # (bf16=False: TRL trains in bf16 by default.)
    trainer = DPOTrainer(model=prefs["models"][model]["hf"] if isinstance(model, str) else model, args=args,
                         train_dataset=datasets.Dataset.from_list(prefs["rows"]),
                         processing_class=AutoTokenizer.from_pretrained(prefs["tokenizer"]))
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _compare(ours: list[dict], theirs: list[dict], grad_norms=(1, 2)) -> None:
    assert len(ours) == len(theirs) == 2, (ours, theirs)
    for step, (mine, trl) in enumerate(zip(ours, theirs), start=1):
        assert mine["loss"] == pytest.approx(trl["loss"], rel=1e-5), step
        if step in grad_norms:
            assert mine["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-5), step
        # A reward is beta times a difference of two summed log-probabilities of about 60 nats each, so it keeps
        # their absolute error, not a relative one: 1e-5 (0.1 x 60 x fp32's ~1e-6 summing error); seen: 7e-7.
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert mine[name] == pytest.approx(trl[name], rel=1e-5, abs=1e-5), (step, name)
        assert mine["rewards/accuracies"] == trl["rewards/accuracies"], step


LAYOUTS = {
    "one-process": (1, ["--no-sft-packing"]),
    "packed": (1, []),
    "tp2-sp": (2, ["--no-sft-packing", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--no-sft-packing", "--pipeline-model-parallel-size", "2"]),
    "dp2-distributed-optimizer": (2, ["--no-sft-packing", "--use-distributed-optimizer"]),
}


@pytest.fixture(scope="module")
def trl_runs(prefs, tmp_path_factory):
    """TRL's first two steps, by (model, loss type)."""
    return {(model, loss_type): _trl(prefs, tmp_path_factory.mktemp(f"trl-{model}-{loss_type}"), loss_type, model=model)
            for model, loss_type in (("llama", "sigmoid"), ("llama", "ipo"), ("qwen2", "sigmoid"), ("qwen2", "ipo"),
                                     ("mixtral", "sigmoid"))}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_first_two_steps_equal_trl(prefs, trl_runs, layout, tmp_path):
    """Every pair in each global batch (one pair a sample, or the pairs packed): the loss, gradient norm and rewards
    of steps 1 and 2 equal TRL's (relative 1e-5, fp32), at each layout."""
    from megatron_patch.training.sft import DPO, Conversations, pack_best_fit

    world_size, extra = LAYOUTS[layout]
    data = Conversations(prefs["prefix"], DPO)
    samples = PAIRS if "--no-sft-packing" in extra else len(pack_best_fit(data.predictions, SEQ))
    ours, _ = _ours(prefs, tmp_path, world_size, "sigmoid", "--train-iters", "2", "--global-batch-size",
                    str(samples), *extra)
    _compare(ours, trl_runs["llama", "sigmoid"])


def test_a_mixture_of_experts_at_expert_parallel_size_2_equals_trl(prefs, trl_runs, tmp_path):
    ours, _ = _ours(prefs, tmp_path, 2, "sigmoid", "--train-iters", "2", "--global-batch-size", str(PAIRS),
                    "--no-sft-packing", "--expert-model-parallel-size", "2", model="mixtral")
    _compare(ours, trl_runs["mixtral", "sigmoid"])


@pytest.mark.parametrize("model, loss_type", [("llama", "ipo"), ("qwen2", "sigmoid"), ("qwen2", "ipo")])
def test_the_ipo_loss_and_a_qwen2_equal_trl(prefs, trl_runs, model, loss_type, tmp_path):
    ours, _ = _ours(prefs, tmp_path, 1, loss_type, "--train-iters", "2", "--global-batch-size", str(PAIRS),
                    "--no-sft-packing", model=model)
    _compare(ours, trl_runs[model, loss_type])


def test_the_sft_term_equals_trl_s(prefs, tmp_path):
    """--dpo-sft-loss-weight: each pair's loss gains the weight times its chosen answer's per-token negative
    log-likelihood, TRL's ``sft`` loss at one pair to a micro-batch."""
    theirs = _trl(prefs, tmp_path / "trl", "sigmoid", sft_weight=0.5)
    ours, _ = _ours(prefs, tmp_path / "ours", 1, "sigmoid", "--train-iters", "2", "--global-batch-size", str(PAIRS),
                    "--no-sft-packing", "--dpo-sft-loss-weight", "0.5")
    _compare(ours, theirs)
    # The term is there: without it, the first step's loss is log 2.
    assert ours[0]["loss"] > 0.7


def test_a_run_sigkilled_mid_run_resumes_bitwise_without_a_second_reference_pass(prefs, tmp_path):
    """Launched as a user launches it, dropout on, killed after iteration 8 (its third epoch) and resumed from its
    iteration-6 save into another --save: every iteration's record is the unbroken run's bit for bit, and the
    reference log-probabilities are read from the first --save, not computed again from a model that has trained
    since; the other --save gets them too (for its own resumes)."""
    import subprocess
    import sys

    from test_reliability import ITERS, _assert_same_as, _kill_when, _last_iteration, _records

    def launch(*argv, env=None):
        return subprocess.Popen(
            [sys.executable, "-m", "megatron_patch.cli", "train", "--user-script", SLOW_SCRIPT, "--nproc-per-node", "1",
             "--dpo", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", prefs["tokenizer"],
             "--data-path", prefs["prefix"], "--split", "100,0,0", "--seq-length", str(SEQ), "--hidden-dropout", "0.1",
             "--global-batch-size", "2", "--train-iters", str(ITERS), "--lr", "1e-3", "--lr-warmup-iters", "2",
             "--lr-decay-style", "cosine", "--log-interval", "1", "--save-interval", "3", *argv],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "SLOW_EXAMPLE": "examples/gpt/dpo_gpt.py",
                 "SLOW_FROM": str(ITERS + 1), **(env or {})})

    base = ["--load", prefs["models"]["llama"]["mcore"], "--finetune"]
    # The unbroken run reports to TensorBoard and W&B (offline) too: each gets TRL's names at every iteration.
    board, runs = tmp_path / "tb", tmp_path / "wandb"
    unbroken = launch(*base, "--save", str(tmp_path / "unbroken"), "--log-dir", str(tmp_path / "reference"),
                      "--tensorboard-dir", str(board), "--wandb-project", "dpo", "--wandb-save-dir", str(runs),
                      env={"WANDB_MODE": "offline"})
    output, _ = unbroken.communicate(timeout=300)
    assert unbroken.returncode == 0 and output.count("DPO reference:") == 1, output[-3000:]
    _assert_reported(board, runs)
    save, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    job = launch(*base, "--save", save, "--log-dir", logs, env={"SLOW_FROM": "9"})
    assert _kill_when(job, lambda: _last_iteration(logs) >= 8), "the job ended before the kill"
    resumed = launch("--load", save, "--save", str(tmp_path / "other"), "--log-dir", logs)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    assert "at iteration 6" in output and "DPO reference:" not in output, output[-3000:]
    assert os.path.isfile(tmp_path / "other" / "dpo_reference.npz")
    _assert_same_as(_records(tmp_path / "reference"), _records(logs))


def _assert_reported(board, runs):
    """TensorBoard and W&B hold the DPO loss and TRL's four reports at every iteration, the same values."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_reliability import ITERS
    from test_wandb import wandb_history

    from megatron_patch.training.dpo import REPORTS

    events = EventAccumulator(str(board))
    events.Reload()
    [run_file] = glob.glob(str(runs / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(run_file)
    for tag in ("dpo loss", *REPORTS):
        steps = {e.step: e.value for e in events.Scalars(tag)}
        assert sorted(steps) == list(range(1, ITERS + 1)), tag
        assert {step: history[step][tag] for step in steps} == {step: pytest.approx(value, rel=1e-6)
                                                                 for step, value in steps.items()}, tag


def test_ten_steps_on_a_learnable_preference_raise_accuracy_and_margin(prefs, tmp_path):
    """40 fresh pairs (the chosen answer opens with "yes", the rejected with "no"), 4 to a step: the pairs of steps
    6-10, unseen before, are told apart more often and by a wider margin than those of steps 1-5."""
    from megatron_patch.data.preprocess import PreprocessConfig, preprocess

    jsonl = write_jsonl(str(tmp_path / "more.jsonl"), preference_pairs(40, seed=1))
    preprocess(PreprocessConfig(input=jsonl, output_prefix=str(tmp_path / "more"),
                                tokenizer_type="HuggingFaceTokenizer",
                                tokenizer_options={"tokenizer_model": prefs["tokenizer"]}, dpo=True, workers=1))
    records, _ = _ours({**prefs, "prefix": str(tmp_path / "more_dpo_document")}, tmp_path / "logs", 1, "sigmoid",
                       "--train-iters", "10", "--global-batch-size", "4", "--no-sft-packing", "--lr", "3e-3")
    early, late = records[:5], records[5:]
    mean = lambda rows, name: sum(r[name] for r in rows) / len(rows)  # noqa: E731
    assert mean(late, "rewards/accuracies") > mean(early, "rewards/accuracies"), records
    assert mean(late, "rewards/margins") > 2 * mean(early, "rewards/margins") > 0, records
    assert late[-1]["loss"] < records[0]["loss"]


def test_wrong_input_is_refused_in_one_line_before_any_rank_starts(prefs, tmp_path):
    """A pair longer than --seq-length (unless --dpo-overlong skip, which counts it), a pair's line the data
    preparation refuses, and the micro-batch a pair needs: each one line from the launcher, no rank started."""
    import subprocess
    import sys

    def launch(*argv):
        done = subprocess.run(
            [sys.executable, "-m", "megatron_patch.cli", "train", "--user-script", SCRIPT, "--nproc-per-node", "1",
             "--dpo", "--load", prefs["models"]["llama"]["mcore"], "--finetune", "--tokenizer-type",
             "HuggingFaceTokenizer", "--tokenizer-model", prefs["tokenizer"], "--data-cache-path",
             str(tmp_path / "cache"), "--train-iters", "1", "--global-batch-size", "2", *argv],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
        return done.returncode, done.stdout + done.stderr

    status, output = launch("--data-path", prefs["prefix"], "--seq-length", "24")
    [line] = [line for line in output.splitlines() if line.startswith("rapidformer: error:")]
    assert status == 1 and "longer than --seq-length 24" in line and "--dpo-overlong skip" in line, output
    assert "torch.distributed.run" not in output and "Traceback" not in output
    rows = preference_pairs(4, seed=2)
    rows[2]["rejected"] = rows[2]["chosen"]
    same = write_jsonl(str(tmp_path / "same.jsonl"), rows)
    status, output = launch("--data-path", same, "--seq-length", str(SEQ))
    assert status == 1 and f"{same}:3:" in output and "torch.distributed.run" not in output, output
    status, output = launch("--data-path", prefs["prefix"], "--seq-length", str(SEQ), "--micro-batch-size", "2")
    assert status == 1 and "--micro-batch-size 1" in output, output
    # SFT data where pairs belong (the previous step's data, a natural slip).
    from megatron_patch.data.preprocess import PreprocessConfig, preprocess

    chat = write_jsonl(str(tmp_path / "chat.jsonl"), conversations(4, seed=3))
    preprocess(PreprocessConfig(input=chat, output_prefix=str(tmp_path / "chat"), tokenizer_type="HuggingFaceTokenizer",
                                tokenizer_options={"tokenizer_model": prefs["tokenizer"]}, sft=True, workers=1))
    status, output = launch("--data-path", str(tmp_path / "chat_sft_document"), "--seq-length", str(SEQ))
    assert status == 1 and "these are conversations (preprocess-data --sft), not preference pairs" in output, output


def test_with_lora_the_reference_is_the_base(prefs, tmp_path):
    """Adapters start at zero (B = 0, PEFT's start), so the model as loaded is the base, which the reference pass
    scores: the first step's policy equals it (loss log 2, no reward), and the adapters alone then move it."""
    import math

    records, _ = _ours(prefs, tmp_path, 1, "sigmoid", "--train-iters", "3", "--global-batch-size", str(PAIRS),
                       "--lora-rank", "4", "--lr", "1e-2")
    assert records[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and records[0]["rewards/margins"] == 0.0
    assert records[2]["loss"] < records[1]["loss"] < records[0]["loss"] and records[2]["rewards/margins"] > 0


def _peft_model(hf_dir: str, out_dir: str):
    """A fresh PEFT LoRA (r 4, alpha 8, every linear) on ``hf_dir``'s model, saved to ``out_dir``: B zero (PEFT's
    start) and A shared by q, k and v and by gate and up, which megatron-core fuses into one layer with one A."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dir), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for layer in model.base_model.model.model.layers:
            for first, *others in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                                   (layer.mlp.gate_proj, layer.mlp.up_proj)):
                for module in others:
                    module.lora_A["default"].weight.copy_(first.lora_A["default"].weight)
    model.save_pretrained(out_dir)
    return model


def test_with_lora_the_first_two_steps_equal_trl_with_peft(prefs, tmp_path):
    """The same adapters on both sides (PEFT's, brought in by peft-to-megatron): the loss and rewards of steps 1
    and 2 equal TRL's with peft, whose reference is the base with the adapters off. The gradient norm is compared
    at step 1 only: from step 2 on A has a gradient, and the A that q, k and v share is one parameter here (its
    gradient their sum) but three in PEFT."""
    from tests.convert_oracles import cli

    peft_dir, lora = str(tmp_path / "peft"), str(tmp_path / "lora")
    model = _peft_model(prefs["models"]["llama"]["hf"], peft_dir)
    assert run_on_ranks(cli, 1, args=(["peft-to-megatron", "--peft-dir", peft_dir, "--base-dir",
                                       prefs["models"]["llama"]["mcore"], "--save-dir", lora],)) == [0]
    theirs = _trl(prefs, tmp_path / "trl", "sigmoid", model=model)
    ours, _ = _ours(prefs, tmp_path / "ours", 1, "sigmoid", "--train-iters", "2", "--global-batch-size", str(PAIRS),
                    "--no-sft-packing", "--lora-rank", "4", "--lora-alpha", "8", load=lora, finetune=True)
    _compare(ours, theirs, grad_norms=(1,))
