"""The examples/ scripts run as users run them (``megatron-patch train --user-script examples/...``) on one CPU
process with tiny models, and learn: GPT pretraining from flags and from a converted Hugging Face LLaMA, SFT of
that LLaMA, BERT pretraining, fine-tuning a classifier from that BERT checkpoint, and the no-trainer loop.

    python -m pytest -q -p no:cacheprovider tests/test_examples.py

A run on one process keeps one of CI's two cores busy, so the runs go side by side (tests/side_by_side.py; one that
needs another's checkpoint waits for it), and each test checks its own run's output."""

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
from seed_scripts.assets import rapidformer_assets
from side_by_side import After, side_by_side

from megatron_patch.data.preprocess import PreprocessConfig, preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
VOCAB = 1000  # the test tokenizers' vocabulary (conftest_data trains them with vocab_size=1000)


def _train(script: str, *argv: str, timeout: int = 240) -> str:
    """``megatron-patch train --user-script examples/SCRIPT --nproc-per-node 1 ARGV``; returns its output."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", NNODES="1", NODE_RANK="0")
    env.pop("MASTER_PORT", None)
    done = subprocess.run(
        [sys.executable, "-m", "megatron_patch.cli", "train", "--user-script", os.path.join(EXAMPLES, script),
         "--nproc-per-node", "1", *argv], env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def _losses(output: str, name: str = "lm loss") -> list[float]:
    """The logged losses: a language model's "lm loss", a sequence classifier's "classification loss"."""
    return [float(x) for x in re.findall(rf"{name}: ([0-9.E+-]+)", output)]


def _epoch_metrics(output: str) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in re.findall(r"(\w+): ([0-9.]+)", line)}
            for line in re.findall(r"epoch \d+ \| (.*)", output)]


def _assert_learns(losses: list[float]) -> None:
    assert len(losses) >= 4, losses
    assert sum(losses[-3:]) / 3 < losses[0], losses


def _weights(save_dir: str) -> dict:
    """The model tensors of ``save_dir``'s latest torch_dist checkpoint, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(os.path.join(save_dir, f"iter_{iteration:07d}"), os.path.join(scratch, "flat.pt"))
        return torch.load(os.path.join(scratch, "flat.pt"), weights_only=False)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def _tokenizer_flags(assets, kind: str) -> list[str]:
    if kind == "gpt":
        return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", assets.gpt_options["vocab_file"],
                "--merge-file", assets.gpt_options["merge_file"]]
    return ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", assets.vocab_file]


# ----------------------------------------------------------------------------------------------------------
# GPT
# ----------------------------------------------------------------------------------------------------------

# SFT rows: the answer is a function of the prompt's last word (one token each in the test tokenizer).
SFT_ANSWERS = {"return": "self", "yield": "value", "raise": "name", "import": "data"}


def _write_sft(root: str, seed: int = 0) -> None:
    rng = random.Random(seed)
    fillers = ["the", "new", "for", "if", "while", "with", "key", "list"]
    os.makedirs(root)
    for split, count in (("train", 128), ("dev", 32)):
        with open(os.path.join(root, f"{split}.jsonl"), "w") as f:
            for _ in range(count):
                keyword = rng.choice(list(SFT_ANSWERS))
                prompt = " ".join(rng.sample(fillers, 4) + [keyword]) + "\nanswer:"
                f.write(json.dumps({"prompt": prompt, "response": " " + SFT_ANSWERS[keyword]}) + "\n")


def _convert_llama(assets, data, root):
    """A random Hugging Face LLaMA with the test tokenizer, converted with ``megatron-patch convert``; documents
    and SFT rows for it. Its output layer is scaled up, so its loss (far above a fresh model's ln V) shows when
    training starts from its weights."""
    import transformers

    hf, converted = str(root / "hf"), str(root / "mcore")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)
    model.save_pretrained(hf)
    tokenizer_dir = data.options["HuggingFaceTokenizer"]["tokenizer_model"]
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), hf)
    done = subprocess.run([sys.executable, "-m", "megatron_patch.cli", "convert", "hf-to-megatron", "--hf-dir", hf,
                           "--save-dir", converted], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                 os.path.join(converted, "hf_tokenizer")]  # the conversion keeps the model's tokenizer
    preprocess(PreprocessConfig(input=data.corpus, output_prefix=str(root / "corpus"),
                                tokenizer_type="HuggingFaceTokenizer",
                                tokenizer_options={"tokenizer_model": tokenizer[-1]}, append_eod=True))
    _write_sft(str(root / "sft"))
    return {"dir": converted, "tokenizer": tokenizer, "prefix": str(root / "corpus_text_document"),
            "sft": str(root / "sft")}


def _pretrain_gpt_from_model_flags(assets, data, root):
    save = root / "ckpt"
    output = _train(
        "gpt/pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", *_tokenizer_flags(assets, "gpt"),
        "--data-path", assets.gpt_prefix, "--split", "980,20", "--micro-batch-size", "4", "--global-batch-size", "8",
        "--train-iters", "30", "--lr", "3e-3", "--log-interval", "1", "--save", str(save))
    return output, save


def test_pretrain_gpt_from_model_flags(job):
    output, save = job
    _assert_learns(_losses(output))
    # The save describes its model: `--load ckpt` (and megatron-to-hf) need no model flags.
    with open(save / "megatron_patch_args.json") as f:
        assert json.load(f)["model_config"]["hidden_size"] == 32


def _continue_converted_llama(assets, data, root, converted):
    converted_llama = converted.result()
    return _train(
        "gpt/pretrain_gpt.py", "--load", converted_llama["dir"], *converted_llama["tokenizer"],
        "--data-path", converted_llama["prefix"], "--split", "980,20", "--seq-length", "32",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "20", "--lr", "3e-3",
        "--log-interval", "1")


def test_pretrain_gpt_continues_a_converted_hugging_face_model(job):
    losses = _losses(job)
    # A fresh model starts near ln V; the converted one's scaled output layer starts far above it.
    assert losses[0] > 1.5 * math.log(VOCAB), losses
    _assert_learns(losses)


def _finetune_converted_llama(assets, data, root, converted):
    converted_llama = converted.result()
    return _train(
        "gpt/finetune_gpt.py", "--sft", "--load", converted_llama["dir"], *converted_llama["tokenizer"],
        "--data-path", converted_llama["sft"], "--seq-length", "32", "--global-batch-size", "4", "--epochs", "2",
        "--lr", "3e-3", "--log-interval", "1")


def test_finetune_gpt_learns_responses_of_a_converted_model(job):
    output = job
    _assert_learns(_losses(output))
    metrics = _epoch_metrics(output)
    assert len(metrics) == 2, output[-3000:]
    # The loss covers the answer token and the end of document. A model blind to the prompt pays at least ln 4
    # on the answer (4 answers, equally likely), so at least ln(4) / 2 a token; below half of that it reads the
    # prompt's keyword.
    assert metrics[-1]["loss"] < math.log(4) / 4, metrics
    assert metrics[-1]["ppl"] == pytest.approx(math.exp(metrics[-1]["loss"]), rel=1e-3)


# ----------------------------------------------------------------------------------------------------------
# BERT
# ----------------------------------------------------------------------------------------------------------


def _pretrain_bert(assets, data, root):
    """examples/bert/pretrain_bert.py from Megatron-LM's shape flags, saved: (its output, the save directory)."""
    save = str(root / "ckpt")
    output = _train(
        "bert/pretrain_bert.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", *_tokenizer_flags(assets, "bert"),
        "--data-path", assets.bert_prefix, "--split", "980,20", "--micro-batch-size", "8",
        "--global-batch-size", "16", "--train-iters", "30", "--lr", "2e-3", "--log-interval", "1", "--save", save)
    return output, save


def test_pretrain_bert_masked_lm_and_next_sentence(job):
    output, save = job
    _assert_learns(_losses(output))
    weights = _weights(save)
    assert {"binary_head.weight", "embedding.tokentype_embeddings.weight"} <= weights.keys()  # Megatron's BERT


def _finetune_pretrained_bert(assets, data, root, pretrained):
    """(output, the pretrained checkpoint, the classifier's) of examples/bert/finetune_classification.py."""
    _, pretrained = pretrained.result()
    save = str(root / "classifier")
    # No weight decay: an embedding row no training input looks up gets a zero gradient, so Adam leaves it as
    # loaded (the tied LM head of pretraining moved every row away from its initialisation).
    output = _train(
        "bert/finetune_classification.py", "--load", pretrained, "--finetune", *_tokenizer_flags(assets, "bert"),
        "--data-path", assets.glue_dir, "--data-name", "mrpc", "--seq-length", "32", "--micro-batch-size", "8",
        "--epochs", "3", "--lr", "3e-3", "--lr-warmup-iters", "2", "--weight-decay", "0", "--log-interval", "4",
        "--save", save)
    return output, pretrained, save


def test_finetune_classification_from_the_pretrained_bert(job, assets):
    from megatron_patch.tokenizer import build_tokenizer
    from megatron_patch.training.data import load_sentence_pair_dataset

    output, pretrained, save = job
    _assert_learns(_losses(output, "classification loss"))
    metrics = _epoch_metrics(output)
    assert len(metrics) == 3 and metrics[-1]["accuracy"] >= 0.9 and metrics[-1]["f1"] >= 0.9, metrics

    tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=assets.vocab_file)
    seen = {tokenizer.cls, tokenizer.sep, tokenizer.pad}
    for row in load_sentence_pair_dataset(assets.glue_dir, "mrpc")["train"]:
        seen.update(tokenizer.tokenize(row["sentence1"]) + tokenizer.tokenize(row["sentence2"]))
    unseen = sorted(set(range(tokenizer.vocab_size)) - seen)
    before = _weights(pretrained)["embedding.word_embeddings.weight"]
    after = _weights(save)["embedding.word_embeddings.weight"]
    assert torch.equal(after[unseen], before[unseen])  # loaded from the pretraining checkpoint
    assert not torch.equal(after[sorted(seen)], before[sorted(seen)])  # and fine-tuned


def _finetune_no_trainer(assets, data, root):
    return _train(
        "bert/finetune_classification_no_trainer.py", "--pretrained-model-name-or-path", assets.bert_dir,
        "--data-path", assets.glue_dir, "--data-name", "mrpc", "--epochs", "3", "--micro-batch-size", "8",
        "--lr", "2e-3", "--lr-warmup-iters", "2", "--seed", "42")


def test_finetune_classification_no_trainer(job):
    output = job
    first = [float(x) for x in re.findall(r"epoch 0 step [0-3] loss ([0-9.]+)", output)]
    last = [float(x) for x in re.findall(r"epoch 2 step \d+ loss ([0-9.]+)", output)]
    assert first and last and sum(last) / len(last) < min(first), (first, last)
    metrics = _epoch_metrics(output)
    assert len(metrics) == 3 and metrics[-1]["accuracy"] >= 0.9, metrics


def test_pair_sample_layout():
    from megatron_patch.training.bert import pair_sample

    class Specials:
        cls, sep, pad = 101, 102, 0

    sample = pair_sample([5, 6, 7, 8, 9], [20, 21], label=1, seq_length=8, tokenizer=Specials)
    # 8 - 3 special tokens leave 5: the longer sentence gives up tokens first.
    assert sample["text"].tolist() == [101, 5, 6, 7, 102, 20, 21, 102]
    assert sample["types"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    short = pair_sample([5], [20], label=0, seq_length=8, tokenizer=Specials)
    assert short["text"].tolist() == [101, 5, 102, 20, 102, 0, 0, 0]
    assert short["padding_mask"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0] and short["label"].item() == 0


def test_a_script_refuses_a_model_of_the_other_family(assets):
    from megatron_patch.tokenizer import build_tokenizer
    from megatron_patch.training.arguments import parse_run
    from megatron_patch.training.models import model_config_and_vocab

    tokenizer = build_tokenizer("BertWordPieceLowerCase", vocab_file=assets.vocab_file)
    with pytest.raises(SystemExit, match="--model-name tiny-gpt2 describes a gpt model; this trainer trains bert"):
        model_config_and_vocab(parse_run(["--model-name", "tiny-gpt2"], 1)[0], tokenizer, "bert")
    # Shape flags alone make Megatron-LM's BERT in a BERT script: two segment types and the binary head.
    config, vocab = model_config_and_vocab(parse_run(["--num-layers", "2", "--hidden-size", "32",
                                                      "--num-attention-heads", "4", "--seq-length", "32"], 1)[0],
                                           tokenizer, "bert")
    assert (config.family, config.num_tokentypes, config.add_binary_head) == ("bert", 2, True)
    assert vocab % 128 == 0 and vocab - 128 < tokenizer.vocab_size <= vocab


# ----------------------------------------------------------------------------------------------------------
# The runs, side by side
# ----------------------------------------------------------------------------------------------------------

BERT = "test_pretrain_bert_masked_lm_and_next_sentence"
# Each run by the pytest name of the test that checks it (the conversion, which no test checks, by its own name);
# a run comes after those it needs.
JOBS = {
    "converted_llama": (_convert_llama,),
    "test_pretrain_gpt_from_model_flags": (_pretrain_gpt_from_model_flags,),
    BERT: (_pretrain_bert,),
    "test_pretrain_gpt_continues_a_converted_hugging_face_model": (_continue_converted_llama, After("converted_llama")),
    "test_finetune_gpt_learns_responses_of_a_converted_model": (_finetune_converted_llama, After("converted_llama")),
    "test_finetune_classification_from_the_pretrained_bert": (_finetune_pretrained_bert, After(BERT)),
    "test_finetune_classification_no_trainer": (_finetune_no_trainer,),
}


@pytest.fixture(scope="module")
def jobs(assets, tmp_path_factory, request):
    from conftest_data import data_assets

    yield from side_by_side(request, tmp_path_factory, JOBS, assets, data_assets(tmp_path_factory))
