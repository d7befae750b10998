"""What a run says, and refuses before it starts (issue 38): checkpoint saves, the signal that stopped it, a resume
with nothing left to train, a Hugging Face directory given to --load, data that cannot train the model, and
sentence pairs truncated to the model's positions. Each through the launcher, on tiny models and data made here."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = [f"w{i}" for i in range(40)]


def rapidformer(*argv, timeout=240):
    """``rapidformer ARGV`` (the launcher) in a subprocess: (exit status, stdout and stderr, seconds)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", NNODES="1", NODE_RANK="0")
    env.pop("MASTER_PORT", None)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "megatron_patch.training.launcher", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.perf_counter() - start


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A 2-layer BERT of 32 positions and its WordPiece tokenizer, saved as Hugging Face saves them (the
    tokenizer records no model_max_length, as many on the hub do not)."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    root = tmp_path_factory.mktemp("bert")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(str(root / "model"))
    BertForSequenceClassification(BertConfig(
        vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32)).save_pretrained(str(root / "model"))
    return str(root / "model")


def _long_pairs(root) -> str:
    """A JSONL pair data set (``--data-path ROOT --data-name pairs``) whose pairs are 50 tokens, longer than the
    model's 32 positions."""
    os.makedirs(root / "pairs", exist_ok=True)
    rows = [{"sentence1": " ".join(WORDS[i:i + 24]), "sentence2": " ".join(WORDS[:23]), "label": i % 2}
            for i in range(8)]
    for split in ("train", "dev"):
        (root / "pairs" / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(root)


@pytest.mark.parametrize("entry", [
    ["--task", "sequence_classification"],
    ["--user-script", os.path.join(ROOT, "examples", "bert", "finetune_classification_no_trainer.py")],
])
def test_sentence_pairs_are_truncated_to_the_models_positions(bert, tmp_path, entry):
    status, output, _ = rapidformer(
        *entry, "--nproc-per-node", "1", "--pretrained-model-name-or-path", bert, "--data-path",
        _long_pairs(tmp_path), "--data-name", "pairs", "--epochs", "1", "--micro-batch-size", "4", "--lr", "1e-3",
        "--log-interval", "1", "--log-dir", str(tmp_path / "logs"))
    assert status == 0, output[-3000:]
    assert "must match the size" not in output
    arguments = (tmp_path / "logs" / "arguments.txt").read_text()  # the arguments block, written there (issue 53)
    assert re.search(r"^ *seq_length \.+ 32$", arguments, re.M), arguments  # the model's, not None


def test_load_of_a_hugging_face_directory_is_refused_before_launch(bert):
    status, output, _ = rapidformer("--task", "pretraining", "--nproc-per-node", "1", "--load", bert, "--mock-data",
                                    "--train-iters", "1", "--micro-batch-size", "1", timeout=60)
    assert status != 0
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert f"megatron-patch convert hf-to-megatron --hf-dir {bert} --save-dir" in lines[0], output


MODEL = ["--task", "pretraining", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size",
         "2", "--lr", "1e-3", "--log-interval", "1", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
GPT = [*MODEL, "--nproc-per-node", "1", "--mock-data"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(output, --save directory) of 3 iterations saved at iteration 2 (asynchronously) and at the end."""
    save = str(tmp_path_factory.mktemp("trained") / "ckpt")
    status, output, _ = rapidformer(*GPT, "--train-iters", "3", "--save", save, "--save-interval", "2",
                                    "--async-save")
    assert status == 0, output[-3000:]
    return output, save


def test_each_save_says_when_it_starts_and_when_it_is_done(trained):
    output, save = trained
    for iteration in (2, 3):
        assert f"saving checkpoint at iteration {iteration} to {save}" in output, output[-3000:]
    assert re.search(rf"saved checkpoint at iteration 2 to {re.escape(save)} in [0-9.]+ s \(asynchronously; it is "
                     "now the latest\\)", output), output[-3000:]
    assert re.search(rf"saved checkpoint at iteration 3 to {re.escape(save)} in [0-9.]+ s", output), output[-3000:]


def test_a_resume_with_nothing_left_to_train_says_so_and_saves_nothing(trained, tmp_path):
    _, load = trained
    status, output, _ = rapidformer(*GPT, "--train-iters", "3", "--load", load, "--save", str(tmp_path / "new"))
    assert status == 0, output[-3000:]
    assert f"nothing left to train: --load {load} is at iteration 3 and --train-iters is 3" in output, output[-3000:]
    assert not os.path.exists(tmp_path / "new" / "latest_checkpointed_iteration.txt"), output[-3000:]
    assert " iteration 4" not in output and "saving checkpoint" not in output, output[-3000:]


def test_a_sigint_stop_names_the_signal_and_the_latest_checkpoint(tmp_path):
    """Ctrl-C reaches the launcher (its ranks run in sessions of their own): torchrun's agent stops them. (A run
    that never says it saved ends after its 50 iterations.)"""
    save = str(tmp_path / "ckpt")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    process = subprocess.Popen([sys.executable, "-m", "megatron_patch.training.launcher", *GPT, "--train-iters",
                                "50", "--save", save, "--save-interval", "1"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "saved checkpoint at iteration" in line:
                break
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines) + rest
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]
    stopped = [line for line in output.splitlines() if "stopped by signal" in line]
    assert len(stopped) == 1, output[-3000:]
    # The ranks stop where they were, without a traceback or a 'failed' line each: the launcher's line says it.
    assert "Traceback" not in output and "failed" not in output, output[-3000:]
    assert re.fullmatch(rf"rapidformer: stopped by signal 2 \(SIGINT\); the latest checkpoint is iteration \d+ in "
                        rf"{re.escape(save)}: resume with --load {re.escape(save)}", stopped[0]), output[-3000:]


def _documents(prefix: str, documents: list[list[int]]) -> str:
    """``prefix.bin``/``.idx`` of ``documents`` (token ids), written by megatron-core's own builder."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for tokens in documents:
        builder.add_document(torch.tensor(tokens), [len(tokens)])
    builder.finalize(prefix + ".idx")
    return prefix


DOCUMENTS = [[(7 * i + j) % 90 + 1 for j in range(40)] for i in range(20)]


def _one_line_refusal(status, output, prefix, fix):
    """A run refused in one line naming ``prefix`` and ``fix``, with no traceback."""
    assert status != 0, output[-3000:]
    lines = [line for line in output.splitlines() if f"--data-path {prefix}:" in line]
    assert len(lines) == 1 and fix in lines[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_a_missing_prefix_through_a_recipe_is_refused_before_launch(tmp_path):
    missing = str(tmp_path / "no_such_text_document")
    start = time.perf_counter()
    done = subprocess.run(["bash", os.path.join(ROOT, "examples", "gpt", "run_pretrain_gpt.sh"), "--cpu",
                           "--nproc-per-node", "1", "--data-path", missing, "--tokenizer-type", "NullTokenizer", "--",
                           "--vocab-size", "100"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1"))
    status, output, seconds = done.returncode, done.stdout + done.stderr, time.perf_counter() - start
    _one_line_refusal(status, output, missing, "not found")
    assert "torch.distributed.run" not in output, output[-3000:]  # no rank started
    print(f"refused in {seconds:.1f} s")


@pytest.mark.parametrize("damage, fix", [
    (lambda idx: idx.write_bytes(idx.read_bytes()[:-20]), "truncated"),
    (lambda idx: idx.write_bytes(b"NOTANIDX\x00" + idx.read_bytes()[9:]), "not a megatron-core index"),
    (lambda idx: idx.with_suffix(".bin").write_bytes(idx.with_suffix(".bin").read_bytes()[:100]), ".bin is truncated"),
])
def test_a_damaged_index_is_refused_before_launch(tmp_path, damage, fix):
    prefix = _documents(str(tmp_path / "corpus_text_document"), DOCUMENTS)
    damage(tmp_path / "corpus_text_document.idx")
    status, output, _ = rapidformer(*MODEL, "--nproc-per-node", "1", "--train-iters", "1", "--data-path", prefix,
                                    timeout=60)
    _one_line_refusal(status, output, prefix, fix)
    assert "torch.distributed.run" not in output, output[-3000:]


def test_token_ids_beyond_the_tokenizer_are_refused_before_launch_naming_the_file(tmp_path):
    """Data of another tokenizer (ids up to 999, this one has 100): once, by the launcher, before any rank starts."""
    prefix = _documents(str(tmp_path / "corpus_text_document"), [[*doc[:-1], 999] for doc in DOCUMENTS])
    status, output, _ = rapidformer(*MODEL, "--nproc-per-node", "2", "--global-batch-size", "4", "--train-iters", "1",
                                    "--data-path", prefix, timeout=60)
    _one_line_refusal(status, output, prefix, "token id 999")
    assert "torch.distributed.run" not in output, output[-3000:]  # no rank started


def test_token_ids_beyond_the_tokenizer_are_refused_once_by_ranks_started_without_the_launcher(tmp_path):
    """A job whose ranks torchrun starts itself (a user script on the no-trainer API) meets the same check where the
    ranks build the datasets: one line from rank 0, not one per rank, and no 'index out of range' from the
    embedding."""
    prefix = _documents(str(tmp_path / "corpus_text_document"), [[*doc[:-1], 999] for doc in DOCUMENTS])
    from megatron_patch.training.launcher import torchrun_command

    command = torchrun_command("megatron_patch.training.launcher", ["--rank-entry", *MODEL, "--global-batch-size",
                                                                    "4", "--train-iters", "1", "--data-path", prefix],
                               nproc_per_node=2, this_host_only=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""))
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    # torchrun's own report of the failed ranks follows (a traceback of its agent); the ranks say it once.
    lines = [line for line in output.splitlines() if f"--data-path {prefix}:" in line]
    assert len(lines) == 1 and "token id 999" in lines[0], output[-3000:]
    assert "index out of range" not in output, output[-3000:]
