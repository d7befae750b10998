"""The seed document's six usage patterns, run through our launcher on CPU processes with local data: its
launch flags with hub names replaced by local paths (tiny models), and its user scripts in seed_scripts/.

The torch.compile backend of --onnx-runtime-training is aot_eager here (inductor's C++ compile costs ~30 s a
process on 2 shared cores; it works the same)."""

import os
import re
import subprocess
import sys

import pytest
from conftest_data import write_pairs_jsonl
from seed_scripts.assets import rapidformer_assets

SCRIPTS = os.path.join(os.path.dirname(__file__), "seed_scripts")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def _rapidformer(*argv, timeout=300, env=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", NNODES="1", NODE_RANK="0", **(env or {}))
    env.pop("MASTER_PORT", None)
    result = subprocess.run([sys.executable, "-m", "megatron_patch.training.launcher", *argv], env=env,
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def _losses(output: str, name: str = "lm loss") -> list[float]:
    """The logged losses: a language model's "lm loss", a sequence classifier's "classification loss"."""
    return [float(x) for x in re.findall(rf"{name}: ([0-9.E+-]+)", output)]


def _epoch_metrics(output: str) -> list[tuple[float, float]]:
    """(accuracy, f1) per epoch, from the Finetuner's log or the no-trainer script's prints."""
    found = re.findall(r"epoch \d+ \| accuracy: ([0-9.]+) \| f1: ([0-9.]+)", output) or \
        re.findall(r"epoch \d+: \{'accuracy': ([0-9.]+), 'f1': ([0-9.]+)\}", output)
    return [(float(a), float(f)) for a, f in found]


def _finetune_flags(assets, *extra):
    """The seed's black-box fine-tuning command (a larger lr and smaller batches suit the tiny model)."""
    return ["--nproc-per-node", "2", "--pretrained-model-name-or-path", assets.bert_dir,
            "--data-path", assets.glue_dir, "--data-name", "mrpc", "--epochs", "3", "--micro-batch-size", "8",
            "--global-batch-size", "16", "--lr", "2e-3", "--lr-decay-style", "linear", "--lr-warmup-iters", "2",
            "--weight-decay", "1e-2", "--clip-grad", "1.0", "--seed", "42", "--mixed-precision",
            "--onnx-runtime-training", "--compile-backend", "aot_eager", *extra]


def _bert_pretrain_flags(assets, *extra):
    """The seed's BERT pretraining command, at the tiny model's size."""
    return ["--nproc-per-node", "2", "--pretrained-model-name-or-path", assets.bert_dir, "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "2", "--micro-batch-size", "8",
            "--global-batch-size", "32", "--seq-length", "64", "--tokenizer-type", "BertWordPieceLowerCase",
            "--max-position-embeddings", "64", "--train-iters", "20", "--data-path", assets.bert_prefix,
            "--vocab-file", assets.vocab_file, "--data-impl", "mmap", "--split", "980,20", "--lr", "1e-2",
            "--lr-decay-style", "linear", "--min-lr", "0.0", "--lr-decay-iters", "2000", "--weight-decay", "1e-2",
            "--clip-grad", "1.0", "--lr-warmup-fraction", ".01", "--log-interval", "5", "--mixed-precision",
            "--onnx-runtime-training", "--compile-backend", "aot_eager", *extra]


def _assert_learns_pairs(code: int, output: str) -> None:
    assert code == 0, output[-4000:]
    metrics = _epoch_metrics(output)
    assert len(metrics) >= 3, output[-3000:]
    # The label is a keyword at the start of sentence 1: a few dozen steps take a random 2-layer BERT to ~1.0.
    assert metrics[-1][0] >= 0.95 and metrics[-1][1] >= 0.95, metrics


@pytest.mark.parametrize("memory, script", [
    ("--zero-1-memory-optimization", None),  # pattern 1: black-box --task sequence_classification
    ("--zero-3-memory-optimization", "rapidformer_finetune_huggingface_bert_trainer.py"),  # pattern 3: Finetuner
])
def test_sequence_classification_reports_accuracy_and_f1_per_epoch(assets, memory, script):
    user = ["--user-script", os.path.join(SCRIPTS, script)] if script else []
    code, output = _rapidformer(*user, "--task", "sequence_classification", *_finetune_flags(assets, memory),
                                env={"TORCH_LOGS": "recompiles"})
    _assert_learns_pairs(code, output)
    losses = _losses(output, "classification loss")
    assert losses[-1] < 0.5 * losses[0], losses
    assert "lm loss" not in output
    assert "compiled with torch.compile(backend='aot_eager')" in output
    if script is None:
        # The task's model is compiled again for evaluation (no_grad), not for the problem_type transformers
        # would set at the first forward (the seed's Finetuner script builds its own model).
        assert "Recompiling function" in output and "problem_type" not in output, output[-4000:]


def test_sequence_classification_reads_jsonl_pairs(assets, tmp_path):
    """Black-box fine-tuning on JSONL (``sentence1, sentence2, label``): the MRPC test's rows, in one process."""
    write_pairs_jsonl(os.path.join(assets.glue_dir, "mrpc"), str(tmp_path / "mrpc_jsonl"))
    code, output = _rapidformer(
        "--task", "sequence_classification", "--nproc-per-node", "1", "--pretrained-model-name-or-path",
        assets.bert_dir, "--data-path", str(tmp_path), "--data-name", "mrpc_jsonl", "--epochs", "3",
        "--micro-batch-size", "16", "--lr", "2e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "42")
    assert code == 0, output[-4000:]
    metrics = _epoch_metrics(output)
    assert len(metrics) == 3, output[-3000:]
    # F1 as well as accuracy: labels read wrongly (all one class) could still score a high accuracy.
    assert metrics[-1][0] >= 0.9 and metrics[-1][1] >= 0.9, metrics
    losses = _losses(output, "classification loss")
    assert losses[-1] < 0.5 * losses[0], losses


def test_no_trainer_script_with_compose_build_data_loader_and_gather(assets):
    """Pattern 5: the user's own loop; the scheduler comes from transformers through lr_scheduler_fn."""
    code, output = _rapidformer(
        "--user-script", os.path.join(SCRIPTS, "rapidformer_no_trainer_huggingface_bert.py"),
        *_finetune_flags(assets, "--train-iters", "48", "--zero-1-memory-optimization"))
    _assert_learns_pairs(code, output)
    losses = [float(x) for x in re.findall(r"epoch 2 step \d+ loss ([0-9.]+)", output)]
    first = [float(x) for x in re.findall(r"epoch 0 step [0-3] loss ([0-9.]+)", output)]
    assert losses and max(losses) < min(first), (first, losses)


@pytest.mark.parametrize("memory, script", [
    ("--fsdp-memory-optimization", None),  # pattern 2: black-box --task pretraining
    ("--zero-3-memory-optimization", "rapidformer_pretrain_huggingface_bert_trainer.py"),  # pattern 4
])
def test_huggingface_bert_pretraining_on_mmap_data(assets, memory, script):
    user = ["--user-script", os.path.join(SCRIPTS, script)] if script else ["--task", "pretraining"]
    code, output = _rapidformer(*user, *_bert_pretrain_flags(assets, memory))
    assert code == 0, output[-4000:]
    losses = _losses(output)
    assert len(losses) == 4, output[-3000:]
    assert losses[-1] < losses[0] - 1.0, losses


def test_megatron_gpt_pretrainer_tp2_pp2_zero2_recompute_fp16(assets, tmp_path):
    code, output = _rapidformer(
        "--user-script", os.path.join(SCRIPTS, "rapidformer_pretrain_megatron_gpt_trainer.py"),
        "--nproc-per-node", "4", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--seq-length", "32", "--tokenizer-type", "GPT2BPETokenizer",
        "--max-position-embeddings", "32", "--train-iters", "16", "--data-path", assets.gpt_prefix,
        "--vocab-file", assets.gpt_options["vocab_file"], "--merge-file", assets.gpt_options["merge_file"],
        "--data-impl", "mmap", "--split", "980,20", "--lr", "3e-3", "--lr-decay-style", "linear",
        "--weight-decay", "1e-2", "--clip-grad", "1.0", "--lr-warmup-fraction", ".01", "--log-interval", "1",
        "--zero-2-memory-optimization", "--checkpoint-activations", "--mixed-precision",
        "--initial-loss-scale", "4096", "--save", str(tmp_path / "ckpt"),
    )
    assert code == 0, output[-4000:]
    # dist_checkpointing's writer processes start by spawn and re-import __main__ (launcher.run_user_script).
    with open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert f.read() == "16"
    losses = _losses(output)
    assert len(losses) == 16, output[-3000:]
    # --lr-warmup-fraction .01 is 0.96 samples of warm-up, as in Megatron-LM: iteration 1 runs at lr 0.
    assert losses[-1] < losses[0] - 0.3, losses
    # fp16 with dynamic loss scaling from --initial-loss-scale (it may halve on an overflow, never grow here).
    scales = [float(x) for x in re.findall(r"loss scale: ([0-9.]+)", output)]
    assert scales and all(1.0 < scale <= 4096.0 for scale in scales), scales


def test_refusals_name_the_flag_and_the_hook(tmp_path):
    code, output = _rapidformer("--task", "pretraining", "--no-such-flag", "--zero-1-memory-optimization")
    assert code != 0 and "--no-such-flag" in output
    code, output = _rapidformer("--task", "pretraining", "--zero-1-memory-optimization",
                                "--fsdp-memory-optimization")
    assert code != 0 and "--zero-1-memory-optimization and --fsdp-memory-optimization conflict" in output
    script = tmp_path / "no_hook.py"
    script.write_text(
        "from rapidformer import Finetuner, RapidformerEngine\n"
        "class T(Finetuner):\n"
        "    def train_valid_test_datasets_provider(self):\n        return None, None, None, None\n"
        "    def model_optimizer_lr_scheduler_provider(self):\n        return None, None, None\n"
        "    def run_forward_step(self, batch, model):\n        return None\n"
        "T(engine=RapidformerEngine()).train()\n")
    code, output = _rapidformer("--user-script", str(script), "--nproc-per-node", "1")
    assert code != 0 and "run_compute_metrics" in output, output[-2000:]


# The seed document's acceleration flags, each of which --help must explain.
SEED_ACCELERATION_FLAGS = [
    "--mixed-precision", "--zero-1-memory-optimization", "--zero-2-memory-optimization",
    "--zero-3-memory-optimization", "--fsdp-memory-optimization", "--checkpoint-activations",
    "--onnx-runtime-training", "--data-impl", "--global-batch-size",
]


def _help_entries(text: str) -> dict[str, str]:
    """flag -> its help text, from argparse's option list (an entry starts with two spaces and a dash; its help
    follows after two or more spaces or on lines indented further)."""
    entries, current = {}, []
    for line in text.splitlines():
        if re.match(r"  -", line):
            option, *help_text = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            current = re.findall(r"--?[\w-]+", option)
            for flag in current:
                entries[flag] = " ".join(help_text)
        elif current and line.startswith(" " * 3):
            for flag in current:
                entries[flag] = (entries[flag] + " " + line.strip()).strip()
        else:
            current = []
    return entries


def test_megatron_patch_train_is_the_launcher(capsys):
    from megatron_patch.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    for flag in SEED_ACCELERATION_FLAGS:
        assert entries.get(flag), f"rapidformer --help does not explain {flag}"


@pytest.mark.parametrize("outer", [None, "4242"])
def test_the_launcher_pid_reaches_its_ranks_only(monkeypatch, outer):
    """run_torchrun gives the ranks it starts its pid (a rank whose launcher died ends itself, issue 42). A process
    that goes on afterwards (a rank relaunching convert verify, a test's rank pool) keeps the environment it had:
    left there, the pid made that process's next in-process rank take it for a dead launcher and SIGKILL itself
    (test_run_config's test_a_rank_parses_its_flags_once, exit -9, in the fresh-clone CI run)."""
    from megatron_patch.training import launcher

    if outer is None:
        monkeypatch.delenv(launcher._LAUNCHER_PID, raising=False)
    else:
        monkeypatch.setenv(launcher._LAUNCHER_PID, outer)
    script = "import os, sys; sys.exit(0 if os.environ['MEGATRON_PATCH_LAUNCHER_PID'] == str(os.getppid()) else 3)"
    command = launcher.torchrun_command("megatron_patch.testing", [], nproc_per_node=1)
    command[command.index("-m", 3):] = ["--no-python", sys.executable, "-c", script]
    assert launcher.run_torchrun(command) == 0
    assert os.environ.get(launcher._LAUNCHER_PID) == outer


def test_finetuner_script_reads_a_hugging_face_load(assets):
    """The seed's Finetuner loads ``from_pretrained(args.load)``: with ``--load`` naming the Hugging Face directory
    (the workaround users added before ``args.load`` fell back to ``--pretrained-model-name-or-path``), the script
    reads it and the trainer does not take it for a missing checkpoint. One epoch; the document's own line, without
    --load, learns in test_sequence_classification_reports_accuracy_and_f1_per_epoch."""
    script = os.path.join(SCRIPTS, "rapidformer_finetune_huggingface_bert_trainer.py")
    flags = _finetune_flags(assets, "--zero-1-memory-optimization")
    flags[flags.index("--epochs") + 1] = "1"
    code, output = _rapidformer("--user-script", script, "--task", "sequence_classification", *flags,
                                "--load", assets.bert_dir)
    assert code == 0, output[-4000:]
    assert len(_epoch_metrics(output)) == 1, output[-3000:]
    assert "random weights" not in output
