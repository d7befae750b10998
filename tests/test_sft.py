"""Supervised fine-tuning on conversations (examples/gpt/finetune_gpt.py --sft): the dev loss we report equals the
token-weighted loss transformers computes on the same conversations one at a time, packed or not, at TP 2 with
sequence parallelism, PP 4 (middle stages), DP 2 with the distributed optimizer, EP 2 for a mixture of experts and
with LoRA; packed and unpacked train alike; a packed run SIGKILLed mid-epoch resumes bitwise; wrong input stops
before any rank starts.

    python -m pytest -q -p no:cacheprovider tests/test_sft.py
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy
import pytest
from conftest_data import data_assets
from sft_assets import ROOT, chat_tokenizer, converted_chat_model, hf_token_loss

from megatron_patch.data.stand_ins import conversations, write_jsonl
from megatron_patch.testing import run_on_ranks

SEQ = 128
SCRIPT = os.path.join(ROOT, "examples", "gpt", "finetune_gpt.py")
SLOW_SCRIPT = os.path.join(ROOT, "tests", "scripts", "slow_finetuner.py")


def _finetuner():
    spec = importlib.util.spec_from_file_location("finetune_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SFTFinetuner


def finetune(rank, world_size, argv):
    """examples/gpt/finetune_gpt.py's trainer on this rank: its dev metrics after each epoch."""
    from megatron_patch.training.engine import Engine

    trainer = _finetuner()(engine=Engine(argv))
    trainer.train()
    return trainer.metrics


def _prepare(jsonl: str, tokenizer_dir: str, prefix: str) -> str:
    from megatron_patch.data.preprocess import PreprocessConfig, preprocess

    preprocess(PreprocessConfig(input=jsonl, output_prefix=prefix, tokenizer_type="HuggingFaceTokenizer",
                                tokenizer_options={"tokenizer_model": tokenizer_dir}, sft=True, workers=1))
    return prefix + "_sft_document"


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """The chat tokenizer, a converted LLaMA and Mixtral with it, and 48 conversations prepared with
    ``preprocess-data --sft`` (the first 36 train, the last 12 dev with ``--split 75,25,0``)."""
    root = str(tmp_path_factory.mktemp("sft"))
    tokenizer = chat_tokenizer(data_assets(tmp_path_factory), os.path.join(root, "tokenizer"))
    jsonl = write_jsonl(os.path.join(root, "chat.jsonl"), conversations(48, seed=0))
    models = {kind: converted_chat_model(kind, tokenizer, root) for kind in ("llama", "mixtral")}
    return {"root": root, "tokenizer": tokenizer, "jsonl": jsonl, "models": models,
            "prefix": _prepare(jsonl, tokenizer, os.path.join(root, "chat"))}


def _flags(chat, model="llama", *extra):
    return ["--sft", "--load", chat["models"][model]["mcore"], "--finetune", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", chat["tokenizer"], "--data-path", chat["prefix"],
            "--split", "75,25,0", "--seq-length", str(SEQ), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--log-interval", "1", "--seed", "3", *extra]


def _dev(chat) -> list[tuple[list[int], list[int]]]:
    from megatron_patch.data.data_path import split_ranges
    from megatron_patch.training.sft import Conversations

    data = Conversations(chat["prefix"])
    begin, end = split_ranges(len(data), "75,25,0")[1]
    return [tuple(array.astype(numpy.int64).tolist() for array in data[i]) for i in range(begin, end)]


_UNTRAINED = ("--lr", "0", "--min-lr", "0", "--train-iters", "1")
LAYOUTS = {
    "packed": (1, "llama", ["--micro-batch-size", "1", "--global-batch-size", "2"]),
    "unpacked": (1, "llama", ["--no-sft-packing", "--micro-batch-size", "2", "--global-batch-size", "4"]),
    "tp2-sp": (2, "llama", ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "2"]),
    "pp4": (4, "llama", ["--pipeline-model-parallel-size", "4", "--global-batch-size", "4"]),
    "pp2-vpp2": (2, "llama", ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                              "--global-batch-size", "4"]),
    "dp2-distributed-optimizer": (2, "llama", ["--use-distributed-optimizer", "--global-batch-size", "2"]),
    "lora": (1, "llama", ["--lora-rank", "4", "--global-batch-size", "2"]),
    "ep2-mixtral": (2, "mixtral", ["--expert-model-parallel-size", "2", "--global-batch-size", "2"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_dev_loss_is_the_token_weighted_loss_transformers_computes(chat, layout):
    """Before any update (lr 0), the dev loss over every trained token equals transformers' on the same
    conversations one at a time with the same masks (fp32, relative 1e-5): packing, its per-sequence attention and
    positions, and the split of the loss over ranks and stages change nothing."""
    world_size, model, extra = LAYOUTS[layout]
    results = run_on_ranks(finetune, world_size, args=(_flags(chat, model, *_UNTRAINED, *extra),), timeout=300)
    metrics = next(r for r in results if r and r[0])  # a last pipeline stage's
    expected = hf_token_loss(chat["models"][model]["hf"], _dev(chat))
    assert metrics[0]["loss"] == pytest.approx(expected, rel=1e-5)


def _records(log_dir: str) -> list[dict]:
    with open(os.path.join(log_dir, "iterations.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_packed_and_unpacked_train_alike(chat, tmp_path):
    """A global batch holding every training conversation, packed (one pack per microbatch) or one conversation per
    sample: the same loss and gradient norm at each step, and the same dev loss after each epoch."""
    from megatron_patch.data.data_path import split_ranges
    from megatron_patch.training.sft import Conversations, pack_best_fit

    data = Conversations(chat["prefix"])
    begin, end = split_ranges(len(data), "75,25,0")[0]
    packs = len(pack_best_fit(data.lengths[begin:end] - 1, SEQ))
    runs = {}
    for name, extra in (("packed", ["--global-batch-size", str(packs)]),
                        ("unpacked", ["--no-sft-packing", "--micro-batch-size", "4",
                                      "--global-batch-size", str(end - begin)])):
        logs = str(tmp_path / name)
        [metrics] = run_on_ranks(finetune, 1, args=(_flags(chat, "llama", "--lr", "1e-3", "--epochs", "3",
                                                            "--log-dir", logs, *extra),), timeout=300)
        runs[name] = (_records(logs), metrics)
    (packed, packed_metrics), (unpacked, unpacked_metrics) = runs["packed"], runs["unpacked"]
    assert len(packed) == len(unpacked) == 3 and packed[-1]["loss"] < packed[0]["loss"]
    for a, b in zip(packed, unpacked):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                    rel=1e-5)
    assert [m["loss"] for m in packed_metrics] == pytest.approx([m["loss"] for m in unpacked_metrics], rel=1e-5)


def _launch(*argv, script=SCRIPT, env=None):
    return subprocess.Popen([sys.executable, "-m", "megatron_patch.cli", "train", "--user-script", script,
                             "--nproc-per-node", "1", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})})


def test_a_packed_run_sigkilled_mid_epoch_resumes_bitwise(chat, tmp_path):
    """The .jsonl given to --data-path is prepared by the launcher (once: the resume finds it in the cache); a run
    killed after iteration 8 (in its second epoch, dropout on) resumes from its iteration-6 save with every
    iteration's record equal to the unbroken run's."""
    from test_reliability import _assert_same_as, _kill_when, _last_iteration

    flags = ["--sft", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", chat["tokenizer"],
             "--data-path", chat["jsonl"],
             "--split", "75,25,0", "--seq-length", str(SEQ), "--hidden-dropout", "0.1", "--global-batch-size", "2",
             "--train-iters", "16", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
             "--log-interval", "1", "--save-interval", "3", "--data-cache-path", str(tmp_path / "cache")]
    base = ["--load", chat["models"]["llama"]["mcore"], "--finetune"]
    reference = str(tmp_path / "reference")
    done = _launch(*flags, *base, "--save", str(tmp_path / "unbroken"), "--log-dir", reference)
    output, _ = done.communicate(timeout=300)
    assert done.returncode == 0, output[-3000:]
    assert output.count("preparing") == 1, output[-3000:]
    save, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    job = _launch(*flags, *base, "--save", save, "--log-dir", logs, script=SLOW_SCRIPT, env={"SLOW_FROM": "9"})
    assert _kill_when(job, lambda: _last_iteration(logs) >= 8), "the job ended before the kill"
    resumed = _launch(*flags, "--load", save, "--save", save, "--log-dir", logs)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    assert "preparing" not in output and "at iteration 6" in output, output[-3000:]
    from test_reliability import _records as records

    _assert_same_as(records(reference), records(logs))


def _refused(chat, tmp_path, *argv) -> str:
    job = _launch("--load", chat["models"]["llama"]["mcore"], "--finetune", "--tokenizer-type",
                  "HuggingFaceTokenizer", "--tokenizer-model", chat["tokenizer"], "--seq-length", str(SEQ),
                  "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "1", *argv)
    output, _ = job.communicate(timeout=120)
    assert job.returncode != 0, output[-3000:]
    assert "torch.distributed.run" not in output and "Traceback" not in output, output[-3000:]  # no rank started
    [line] = [line for line in output.splitlines() if line.startswith("rapidformer: error:")]
    return line


def test_wrong_input_is_refused_in_one_line_before_any_rank_starts(chat, tmp_path):
    rows = conversations(6, seed=1)
    rows[3] = {"question": "what?", "answer": "this"}
    unknown = write_jsonl(str(tmp_path / "unknown.jsonl"), rows)
    assert f"{unknown}:4:" in _refused(chat, tmp_path, "--sft", "--data-path", unknown)
    long = write_jsonl(str(tmp_path / "long.jsonl"), conversations(6, seed=2, turns=6, words=30))
    line = _refused(chat, tmp_path, "--sft", "--data-path", long, "--seq-length", "32")
    assert "longer than --seq-length 32" in line and "--sft-overlong truncate or skip" in line, line
    line = _refused(chat, tmp_path, "--sft", "--data-path", chat["prefix"], "--micro-batch-size", "2")
    assert "--micro-batch-size 1" in line and "--no-sft-packing" in line, line
    line = _refused(chat, tmp_path, "--sft", "--data-path", chat["prefix"][: -len("_sft_document")])
    assert f"give --data-path {chat['prefix']}" in line, line
    line = _refused(chat, tmp_path, "--sft", "--data-path", chat["prefix"] + ".bin")
    assert f"give its prefix, without .bin: --data-path {chat['prefix']}" in line, line
    line = _refused(chat, tmp_path, "--train-data-path", chat["prefix"])
    assert "add --sft" in line, line


def test_overlong_conversations_are_cut_or_skipped_and_counted(chat, tmp_path):
    from megatron_patch.training.sft import Conversations, SFTDataset

    data = Conversations(chat["prefix"])
    everything = numpy.arange(len(data))
    longest = int(data.lengths.max())
    cut = SFTDataset([(data, everything)], longest - 2, 0, True, "truncate", None)
    skipped = SFTDataset([(data, everything)], longest - 2, 0, True, "skip", None)
    over = int((data.lengths - 1 > longest - 2).sum())
    assert over >= 1 and (cut.stats.truncated, skipped.stats.skipped) == (over, over)
    assert cut.stats.conversations == len(data) and "truncated" in cut.stats.summary("train", longest - 2, True)
    positions = sum(int(sample["loss_mask"].numel()) for sample in cut)  # every sample is seq_length long
    assert positions == len(cut) * (longest - 2)


def test_a_pack_holds_its_conversations_one_after_another(chat):
    """Each conversation of a pack, at its bounds: its tokens, labels shifted by one, its mask's trained targets,
    positions from 0; the padding after the last is a sequence of its own that trains nothing."""
    from megatron_patch.training.sft import Conversations, SFTDataset

    data = Conversations(chat["prefix"])
    packed = SFTDataset([(data, numpy.arange(len(data)))], SEQ, 0, True, None, None)
    assert packed.stats.samples < len(data) and packed.stats.tokens == int((data.lengths - 1).sum())
    seen = []
    for index, members in enumerate(packed.samples):
        sample = packed[index]
        bounds = sample["cu_seqlens"].tolist()
        assert bounds[0] == 0 and bounds[-1] == SEQ
        for (start, end), item in zip(zip(bounds, bounds[1:]), members.tolist()):
            ids, mask = data[int(packed.items[item][1])]
            assert sample["tokens"][start:end].tolist() == ids[:-1].tolist()
            assert sample["labels"][start:end].tolist() == ids[1:].tolist()
            assert sample["loss_mask"][start:end].tolist() == mask[1:].astype(float).tolist()
            assert sample["position_ids"][start:end].tolist() == list(range(end - start))
            seen.append(int(packed.items[item][1]))
        assert sample["loss_mask"][bounds[len(members)]:].sum() == 0
    assert sorted(seen) == list(range(len(data)))


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    from megatron_patch.training.sft import pack_best_fit

    rng = numpy.random.default_rng(0)
    lengths = numpy.minimum(rng.lognormal(numpy.log(300), 0.9, 5000).astype(numpy.int64) + 1, 4096)
    packs = pack_best_fit(lengths, 4096)
    assert sorted(numpy.concatenate(packs).tolist()) == list(range(len(lengths)))
    assert max(int(lengths[p].sum()) for p in packs) <= 4096
    # Within 1% of the bound no packing can beat: the total length over the capacity.
    assert len(packs) <= 1.01 * numpy.ceil(lengths.sum() / 4096)
    assert [p.tolist() for p in pack_best_fit(lengths, 4096)] == [p.tolist() for p in packs]  # deterministic


@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "75,25,0", "1", "0,1", "1/1/1", "0.9,0.05,0.05"])
def test_split_ranges_are_megatron_core_s(split):
    """The launcher's and SFT's split, without importing megatron-core, is the one its dataset builder makes."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split,
    )

    from megatron_patch.data.data_path import split_ranges

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for count in (0, 1, 7, 48, 100, 1001, 123457):
        expected = [None if bounds is None else (int(round(bounds[0] * count)), int(round(bounds[1] * count)))
                    for bounds in matrix]
        assert split_ranges(count, split) == expected
