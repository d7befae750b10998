"""What the training log reports, against references computed here: TFLOP/s, MFU, tokens/s and peak memory from
their definitions; a fine-tune's tokens (what its model took) and epochs when resumed mid-epoch (an unbroken
run's); TensorBoard scalars at PP=2 (the printed losses)."""

import glob
import json
import logging
import math
import os
import random
import re

import pytest
import torch
from seed_scripts.assets import rapidformer_assets
from test_trainer_megatron import _gpt_flags

from megatron_patch.testing import run_on_ranks
from megatron_patch.checkpoint.format import write_tracker

VOCAB = 40  # the fine-tuning tests' token ids


class _Lines(logging.Handler):
    """Keeps the messages of the logger it is added to."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _fields(line: str) -> dict[str, str]:
    """``" iteration 2/4 | tokens/s: 512 | MFU: 32.1%"`` -> ``{"tokens/s": "512", "MFU": "32.1%"}``."""
    return dict(part.strip().rsplit(": ", 1) for part in line.split(" | ") if ": " in part)


def _peak_rss_mb() -> float:
    """The kernel's high-water mark of this process's resident memory (VmHWM, kB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def test_tflops_mfu_tokens_and_peak_memory_follow_their_definitions(monkeypatch):
    from megatron_patch.training import metrics

    # GPT-2 124M at sequence length 1024 (padded vocabulary 50304), Megatron-LM's FLOP formula for a vanilla GPT
    # by hand (docs/flops-and-mfu.md, item 1): 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) for B = 1.
    s, layers, h, vocab = 1024, 12, 768, 50304
    flops_per_sample = 72 * s * layers * h * h * (1 + s / (6 * h) + vocab / (12 * layers * h))
    monkeypatch.setattr(metrics, "_peak_tflops", lambda: 989.0)  # an H100's dense bf16 peak, as on a GPU
    logger = logging.getLogger("test_training_metrics")
    logger.setLevel(logging.INFO)
    lines = _Lines()
    logger.addHandler(lines)
    try:
        log = metrics.TrainingLog(logger, log_interval=2, train_iters=4, flops_per_sample=flops_per_sample,
                                  world_size=4)
        samples, times, tokens = 16, [0.010, 0.012], [16 * 1024, 16 * 1000]
        low = _peak_rss_mb()
        for iteration in (1, 2):
            log.step(iteration, iteration * samples, 1e-4, 3.0, 1.0, 1.0, False, times[iteration - 1],
                     tokens[iteration - 1], samples)
        high = _peak_rss_mb()
    finally:
        logger.removeHandler(lines)
    [line] = lines.lines  # one line per --log-interval, over the two iterations since the last
    fields = _fields(line)
    # FLOPs of the two iterations over their time, per GPU: 318 TFLOP/s/GPU, 32% of the peak.
    tflops = 2 * samples * flops_per_sample / sum(times) / 4 / 1e12
    assert float(fields["TFLOP/s/GPU"]) == pytest.approx(tflops, abs=0.051)
    assert float(fields["MFU"].rstrip("%")) == pytest.approx(100 * tflops / 989.0, abs=0.051)
    assert float(fields["tokens/s"]) == pytest.approx(sum(tokens) / sum(times), abs=0.51)
    assert low - 1 <= float(fields["peak memory (MB)"]) <= high + 1


class _Classifier(torch.nn.Module):
    """A bag-of-embeddings classifier over padded token ids."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, input_ids, attention_mask, labels):
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embedding(input_ids) * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.cross_entropy(self.head(pooled), labels)


def _samples(count: int, seed: int) -> list[dict]:
    """Token lists of 3-9 ids labelled by whether they hold more small ids than large ones."""
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        ids = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 9))]
        samples.append({"input_ids": ids, "label": int(sum(i < VOCAB // 2 for i in ids) * 2 > len(ids))})
    return samples


def _pad(samples: list[dict]) -> dict:
    longest = max(len(s["input_ids"]) for s in samples)
    return {
        "input_ids": torch.tensor([s["input_ids"] + [0] * (longest - len(s["input_ids"])) for s in samples]),
        "attention_mask": torch.tensor([[1] * len(s["input_ids"]) + [0] * (longest - len(s["input_ids"]))
                                        for s in samples]),
        "labels": torch.tensor([s["label"] for s in samples]),
    }


class _Recording:
    """A trainer mixin keeping (iteration, input tokens) of each batch its forward steps take in ``taken``."""

    def __init__(self, engine):
        super().__init__(engine)
        self.taken: list[tuple[int, int]] = []


def _finetune(rank, world_size, argv):
    """Fine-tune the classifier; returns its losses, step times, printed lines and the input tokens each
    iteration's forward steps took on this rank."""
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.trainers import Finetuner

    class ClassifierFinetuner(_Recording, Finetuner):
        def train_valid_test_datasets_provider(self):
            return _samples(20, seed=1), _samples(8, seed=2), None, _pad

        def model_optimizer_lr_scheduler_provider(self):
            torch.manual_seed(0)
            return _Classifier(), None, None

        def run_forward_step(self, batch, model):
            self.taken.append((self.iteration + 1, batch["input_ids"].numel()))
            return model(**batch)

        def run_compute_metrics(self, model, eval_dataloader):
            return {"batches": float(len(eval_dataloader))}

    return _train_capturing(ClassifierFinetuner(engine=Engine(argv)))


def _train_capturing(trainer):
    lines = _Lines()
    logging.getLogger("rapidformer").addHandler(lines)
    try:
        log = trainer.train()
    finally:
        logging.getLogger("rapidformer").removeHandler(lines)
    return {"losses": log.train_losses, "step_times": log.step_times, "lines": lines.lines,
            "taken": trainer.taken}


def _printed(result: dict, pattern: str) -> list[str]:
    return [m.group(1) for line in result["lines"] for m in [re.match(pattern, line)] if m]


def _assert_tokens_are_what_the_model_took(results: list[dict]) -> None:
    """Each iteration's printed tokens/s (--log-interval 1) is the tokens all data-parallel ranks' forward steps
    took in it over its time."""
    logging_rank = results[-1]
    taken = {}
    for result in results:
        for iteration, tokens in result["taken"]:
            taken[iteration] = taken.get(iteration, 0) + tokens
    printed = {int(i): float(_fields(line)["tokens/s"]) for line in logging_rank["lines"]
               for i in re.findall(r"^ iteration (\d+)/", line)}
    iterations = [i for i, _ in logging_rank["losses"]]
    assert sorted(printed) == iterations and set(taken) == set(iterations)
    for iteration, step_time in zip(iterations, logging_rank["step_times"]):
        assert printed[iteration] == pytest.approx(taken[iteration] / step_time, abs=0.51)
        assert printed[iteration] > 0


def test_resumed_finetune_continues_its_epoch_and_counts_the_tokens_it_took(tmp_path):
    save = str(tmp_path / "ckpt")
    # 20 samples over DP=2, 2 per microbatch and rank, one microbatch per step: 5 steps an epoch, 15 in all.
    argv = ["--micro-batch-size", "2", "--global-batch-size", "4", "--epochs", "3", "--lr", "1e-2",
            "--log-interval", "1", "--seed", "3"]
    unbroken = run_on_ranks(_finetune, 2, args=(argv + ["--save", save, "--save-interval", "7"],), timeout=300)
    # Resume from an earlier checkpoint than the last one. Set before the ranks start: every rank reads the
    # tracker while parsing its flags.
    write_tracker(save, 7)
    resumed = run_on_ranks(_finetune, 2, args=(argv + ["--load", save],), timeout=300)
    full, tail = unbroken[-1]["losses"], resumed[-1]["losses"]
    assert [i for i, _ in full] == list(range(1, 16)) and [i for i, _ in tail] == list(range(8, 16))
    # Iteration 7 ended in the second epoch (7 // 5 = 1): the resumed run evaluates epochs 1 and 2 only, and
    # trains on the batches the unbroken run took after iteration 7 (with its shuffle of each epoch).
    assert _printed(unbroken[-1], r" epoch (\d+) \|") == ["0", "1", "2"]
    assert _printed(resumed[-1], r" epoch (\d+) \|") == ["1", "2"]
    assert [loss for _, loss in tail] == pytest.approx([loss for _, loss in full[7:]], rel=1e-6)
    for before, after in zip(unbroken, resumed):
        assert after["taken"] == [taken for taken in before["taken"] if taken[0] > 7]
    for run in (unbroken, resumed):
        _assert_tokens_are_what_the_model_took(run)
    # Samples of 3-9 ids padded to the longest of each batch: the count is not a fixed batch x length.
    assert len({tokens for _, tokens in unbroken[0]["taken"]}) > 1


def _megatron_finetune(rank, world_size, argv):
    """A tiny megatron-core GPT fine-tuned on causal-LM samples of 8-16 tokens, padded to the longest of each batch
    (no --seq-length)."""
    from megatron_patch.testing import tiny_gpt
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.step import lm_forward_step
    from megatron_patch.training.trainers import Finetuner

    def pad(samples):
        longest = max(len(s["input_ids"]) for s in samples)
        tokens = torch.tensor([s["input_ids"] + [0] * (longest + 1 - len(s["input_ids"])) for s in samples])
        return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                "loss_mask": (torch.arange(longest) < torch.tensor([[len(s["input_ids"]) - 1] for s in samples]))
                .float(),
                "position_ids": torch.arange(longest).expand(len(samples), -1)}

    class GPTFinetuner(_Recording, Finetuner):
        def train_valid_test_datasets_provider(self):
            samples = [{"input_ids": [(3 * i + 7 * j) % VOCAB for j in range(8 + 4 * (i % 3))]} for i in range(8)]
            return samples, None, None, pad

        def model_optimizer_lr_scheduler_provider(self):
            return [tiny_gpt(vocab_size=VOCAB, seq_length=32, num_layers=2)], None, None

        def run_forward_step(self, batch, model):
            self.taken.append((self.iteration + 1, batch["tokens"].numel()))
            return lm_forward_step(iter([batch]), model)

        def run_compute_metrics(self, model, eval_dataloader):
            return {}

    return _train_capturing(GPTFinetuner(engine=Engine(argv)))


def test_megatron_finetune_counts_the_tokens_it_took():
    argv = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
            "--log-interval", "1", "--seed", "3"]
    results = run_on_ranks(_megatron_finetune, 2, args=(argv,), timeout=300)
    _assert_tokens_are_what_the_model_took(results)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return rapidformer_assets(tmp_path_factory)


def _pretrain_on_a_pretend_gpu(rank, world_size, argv):
    from megatron_patch.training import metrics
    from megatron_patch.training.engine import Engine
    from megatron_patch.training.tasks import MegatronGPTPretrainer

    peak = metrics._peak_tflops
    metrics._peak_tflops = lambda: 989.0  # TFLOP/s are logged on GPUs only; pretend one (workers are reused)
    try:
        log = MegatronGPTPretrainer(engine=Engine(argv)).train()
    finally:
        metrics._peak_tflops = peak
    return {"valid": log.valid_losses, "step_times": log.step_times}


def test_tensorboard_at_pp2_holds_the_losses_and_throughput(assets, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board, logs = str(tmp_path / "tb"), str(tmp_path / "logs")
    gbs, seq, layers, h = 4, 32, 4, 32  # _gpt_flags' model
    argv = _gpt_flags(assets, "--pipeline-model-parallel-size", "2", "--train-iters", "4", "--micro-batch-size",
                      "2", "--global-batch-size", str(gbs), "--eval-interval", "2", "--eval-iters", "1",
                      "--tensorboard-dir", board, "--log-dir", logs)
    first, last = run_on_ranks(_pretrain_on_a_pretend_gpu, 2, args=(argv,), timeout=300)
    assert not first["valid"] and len(last["valid"]) == 2  # the loss lives on the last stage only
    assert len(glob.glob(os.path.join(board, "events.out.tfevents.*"))) == 1  # one writer: the last rank
    events = EventAccumulator(board)
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    with open(os.path.join(logs, "iterations.jsonl")) as f:
        records = [json.loads(line) for line in f]
    # TensorBoard keeps float32.
    assert scalars["lm loss"] == [(r["iteration"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert scalars["learning-rate"] == [(r["iteration"], pytest.approx(r["lr"], rel=1e-6)) for r in records]
    assert scalars["validation lm loss"] == [(i, pytest.approx(loss, rel=1e-6)) for i, loss in last["valid"]]
    assert scalars["validation ppl"] == [(i, pytest.approx(math.exp(loss), rel=1e-5)) for i, loss in last["valid"]]
    # Megatron-LM's FLOP formula by hand for this vanilla GPT (ffn 4h, one KV head per head), the logits over
    # the vocabulary padded to --make-vocab-size-divisible-by 512; per iteration, per GPU of the two.
    with open(assets.gpt_options["vocab_file"]) as f:
        vocab = -(-len(json.load(f)) // 512) * 512
    flops = 72 * gbs * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (12 * layers * h))
    times = last["step_times"]
    assert scalars["tflops-per-gpu"] == [(i + 1, pytest.approx(flops / t / 2 / 1e12, rel=1e-5))
                                         for i, t in enumerate(times)]
    assert scalars["tokens-per-second"] == [(i + 1, pytest.approx(gbs * seq / t, rel=1e-5))
                                            for i, t in enumerate(times)]
