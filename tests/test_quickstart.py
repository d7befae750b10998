"""The README's quick start, run once as a user runs it: each step's output exists and is what it claims to be.

The run is the suite's costliest test (minutes on 2 cores), so one module-scoped run serves every check here.
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

TIMEOUT = 720  # seconds; the issue promises under 10 minutes on 2 cores
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """(output directory, stdout) of ``python -m megatron_patch.cli quickstart --output-dir DIR``."""
    out = tmp_path_factory.mktemp("quickstart") / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_patch.cli", "quickstart", "--output-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: a timeout ends torchrun and the ranks too
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")},
    )
    try:
        stdout, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        pytest.fail(f"the quick start ran past {TIMEOUT} s; its output ends:\n{stdout[-5000:]}")
    assert process.returncode == 0, stdout[-8000:]
    return out, stdout


def _validation_losses(stdout: str) -> list[tuple[int, float]]:
    return [(int(i), float(x)) for i, x in re.findall(r"validation loss at iteration (\d+) \| lm loss: (\S+)", stdout)]


def _tracked_checkpoint(out) -> str:
    iteration = int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip())
    return str(out / "checkpoints" / f"iter_{iteration:07d}")


def test_every_step_is_the_command_a_user_types(quickstart):
    _, stdout = quickstart
    for command in ("make-corpus", "train-tokenizer --kind gpt2-bpe", "preprocess-data", "train --task pretraining",
                    "convert megatron-to-hf"):
        assert f"+ megatron-patch {command}" in stdout, command
    [torchrun] = [line for line in stdout.splitlines() if "torch.distributed.run" in line]
    assert "--nproc-per-node=2" in torchrun and "--tensor-model-parallel-size 2" in torchrun
    assert "--recompute-granularity full" in torchrun
    minutes, seconds = map(int, re.search(r"quickstart: done in (\d+)m (\d+)s", stdout).groups())
    assert 60 * minutes + seconds < 600


def test_pretraining_reports_a_falling_validation_loss(quickstart):
    _, stdout = quickstart
    losses = _validation_losses(stdout)
    assert len(losses) >= 2, stdout[-3000:]
    (first_at, first), (last_at, last) = losses[0], losses[-1]
    assert first_at < last_at and last < first, losses


def test_the_checkpoint_is_saved_with_its_parallel_layout(quickstart):
    out, stdout = quickstart
    checkpoint = _tracked_checkpoint(out)
    assert os.path.isfile(os.path.join(checkpoint, ".metadata")), os.listdir(checkpoint)  # dist_checkpointing's
    assert checkpoint in stdout
    recorded = json.loads((out / "checkpoints" / "megatron_patch_args.json").read_text())
    assert recorded["tensor_model_parallel_size"] == 2


def test_loss_curves_png_is_written_and_shown(quickstart):
    out, stdout = quickstart
    last_line = stdout.strip().splitlines()[-1]
    assert last_line.startswith("loss curves: "), last_line
    path = last_line.removeprefix("loss curves: ")
    assert os.path.dirname(path) == str(out / "logs")
    with open(path, "rb") as f:
        assert f.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE


def test_the_export_is_the_trained_model(quickstart):
    """transformers alone loads the export; on held-out documents its loss is the trainer's last validation loss,
    not the first one (nor a fresh model's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, stdout = quickstart
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    recorded = json.loads((out / "checkpoints" / "megatron_patch_args.json").read_text())["model_config"]
    assert (model.config.n_layer, model.config.n_embd) == (recorded["num_layers"], recorded["hidden_size"])
    assert len(tokenizer) == model.config.vocab_size == recorded["vocab_size"]
    # Trained from scratch, so the end-of-text id is the trained vocabulary's, not GPT-2's 50256.
    end_of_text = json.loads((out / "hf" / "vocab.json").read_text())["<|endoftext|>"]
    assert model.config.bos_token_id == model.config.eos_token_id == end_of_text

    # The last 1% of the documents lie in the validation split (its last 2%), as the trainer's data does:
    # documents joined by the end-of-text token, cut into training-length windows.
    texts = [json.loads(line)["text"] for line in (out / "corpus.jsonl").read_text().splitlines()]
    ids = []
    for text in texts[-max(1, len(texts) // 100):]:
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    seq = recorded["seq_length"]
    windows = torch.tensor(ids[: len(ids) // (seq + 1) * (seq + 1)]).view(-1, seq + 1)
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    losses = _validation_losses(stdout)
    first, last = losses[0][1], losses[-1][1]
    assert abs(loss - last) < (first - last) / 2, (loss, losses)


def test_the_printed_text_is_the_exports_greedy_generation(quickstart):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from megatron_patch.quickstart import NEW_TOKENS, NO_REPEAT_NGRAM, PROMPTS

    out, stdout = quickstart
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, no_repeat_ngram_size=NO_REPEAT_NGRAM,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    printed = stdout[stdout.index("Generated by transformers"):]
    saved = (out / "generated.txt").read_text()
    for prompt in PROMPTS:
        with torch.no_grad():
            tokens = model.generate(**tokenizer(prompt, return_tensors="pt"), generation_config=config)[0]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        continuation = text[len(prompt):]
        assert text.startswith(prompt) and re.search(r"\w", continuation), text
        assert text in saved
        assert "  | " + text.replace("\n", "\n  | ") in printed, (text, printed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_gpus_without_cuda_are_refused_before_any_work(tmp_path):
    from megatron_patch.quickstart import main

    with pytest.raises(SystemExit, match=r"--gpus 2, but torch sees 0 CUDA device.*drop --gpus"):
        main(["--gpus", "2", "--output-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_gpu_layout_uses_every_gpu(gpus):
    from megatron_patch.quickstart import Layout

    layout = Layout.for_devices(gpus)
    data_parallel, remainder = divmod(layout.processes, layout.tensor_parallel)
    assert layout.processes == gpus and remainder == 0 and layout.gpus
    assert layout.global_batch == layout.micro_batch * data_parallel  # one microbatch per step and rank


def test_output_dir_of_an_earlier_quickstart_is_replaced_and_any_other_is_refused(tmp_path):
    from megatron_patch.quickstart import prepare_output_dir

    prepare_output_dir(str(tmp_path / "qs"))
    (tmp_path / "qs" / "corpus.jsonl").write_text("old")
    prepare_output_dir(str(tmp_path / "qs"))
    assert not (tmp_path / "qs" / "corpus.jsonl").exists() and (tmp_path / "qs" / "logs").is_dir()

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="--output-dir .*mine is not empty"):
        prepare_output_dir(str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
