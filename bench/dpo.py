"""DPO's step against SFT on the same tokens: a DPO step over N preference pairs reads 2N sequences, as two SFT
steps over N conversations each do; it should cost about what those two cost (target <= 1.3x, issue 50; the
reference pass, one forward over the pairs before training, apart).

    PYTHONPATH=. python bench/dpo.py --pairs 64 --seq-length 1024 --steps 4

A tiny megatron-core GPT (``tiny-llama``, one process, CPU or GPU) and synthetic pairs: a shared prompt and two
answers of lognormal lengths (random ids, the answers trained), written as ``preprocess-data --dpo`` and
``--sft`` write them and packed alike (best-fit decreasing into ``--seq-length``). Times, alternating over
``--steps`` rounds after a warm-up: one DPO optimizer step over every pair, and two SFT steps, one over the chosen
sequences and one over the rejected; prints the median of each and their ratio.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TARGET = 1.3
VOCAB = 1000


def _write(prefix: str, documents: list[list], kind) -> None:
    """Items of ``(ids, mask)`` sequences as preprocess-data writes ``kind`` (training/sft.py's SFT or DPO)."""
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_patch.training.sft import sidecar_path

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(VOCAB))
    for sequences in documents:
        arrays = [array for ids, mask in sequences for array in (ids, mask)]
        builder.add_document(numpy.concatenate(arrays), [len(array) for array in arrays])
    builder.finalize(prefix + ".idx")
    with open(sidecar_path(prefix), "w") as f:
        json.dump({"format": kind.format, "version": kind.version}, f)


def _pairs(count: int, seq_length: int, seed: int) -> list[tuple]:
    """``count`` (chosen, rejected) sequences, each ``(ids, mask)``: a prompt of about 100 tokens shared by two
    answers of lognormal lengths around 150, a pair fitting ``seq_length``."""
    import numpy

    rng = numpy.random.default_rng(seed)
    pairs = []
    while len(pairs) < count:
        prompt = rng.integers(0, VOCAB, max(2, int(rng.lognormal(numpy.log(100), 0.5))))
        answers = [rng.integers(0, VOCAB, max(1, int(rng.lognormal(numpy.log(150), 0.6)))) for _ in range(2)]
        if 2 * len(prompt) + sum(map(len, answers)) - 2 > seq_length:
            continue
        pairs.append(tuple((numpy.concatenate([prompt, a]), numpy.concatenate([numpy.zeros(len(prompt), numpy.int64),
                                                                               numpy.ones(len(a), numpy.int64)]))
                           for a in answers))
    return pairs


def measure(pairs: int, seq_length: int, steps: int, seed: int = 0) -> dict:
    import numpy
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.utils import get_model_config as transformer_config

    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.training.dpo import DPOSettings, dpo_forward_step
    from megatron_patch.training.sft import DPO, SFT, Conversations, SFTDataset, sft_forward_step
    from megatron_patch.training.step import build_optimizer, train_step, wrap_model

    initialize_distributed(seed=seed)
    model_config = get_model_config("tiny-llama").replace(seq_length=seq_length, max_position_embeddings=seq_length)
    chunks = wrap_model(build_model_chunks(model_config, ParallelConfig(), 1024), DistributedDataParallelConfig())
    transformer_config(chunks[0]).calculate_per_token_loss = True  # as --sft and --dpo set it
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-5))
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    made = _pairs(pairs, seq_length, seed)
    reference = torch.zeros(pairs, 2)  # the reference pass apart: any values cost the same

    def batches(prefix, documents, kind):
        _write(prefix, documents, kind)
        data = Conversations(prefix, kind)
        dataset = SFTDataset([(data, numpy.arange(len(data)))], seq_length, 0, True, None, None)
        return [{k: v[None].to(device) for k, v in dataset[i].items()} for i in range(len(dataset))]

    with tempfile.TemporaryDirectory() as scratch:
        dpo = batches(os.path.join(scratch, "bench_dpo_document"), [list(p) for p in made], DPO)
        chosen = batches(os.path.join(scratch, "chosen_sft_document"), [[p[0]] for p in made], SFT)
        rejected = batches(os.path.join(scratch, "rejected_sft_document"), [[p[1]] for p in made], SFT)

    def dpo_step():
        train_step(lambda it, model: dpo_forward_step(next(it), model, reference, DPOSettings()), iter(dpo),
                   chunks, optimizer, len(dpo), seq_length, 1)

    def sft_steps():
        for samples in (chosen, rejected):
            train_step(lambda it, model: sft_forward_step(next(it), model), iter(samples), chunks, optimizer,
                       len(samples), seq_length, 1)

    times = {"dpo": [], "sft": []}
    for round_ in range(steps + 1):
        for name, run in (("dpo", dpo_step), ("sft", sft_steps)):
            start = time.perf_counter()
            run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if round_:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    tokens = sum(len(ids) for pair in made for ids, _ in pair)
    dpo_s, sft_s = statistics.median(times["dpo"]), statistics.median(times["sft"])
    return {"tokens": tokens, "dpo_packs": len(dpo), "sft_packs": len(chosen) + len(rejected), "dpo_s": dpo_s,
            "sft_s": sft_s, "ratio": dpo_s / sft_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4, help="rounds timed after the warm-up")
    args = parser.parse_args()
    r = measure(args.pairs, args.seq_length, args.steps)
    verdict = "ok" if r["ratio"] <= TARGET else "ABOVE TARGET"
    print(f"dpo: {args.pairs} pairs, {r['tokens']} tokens in {r['dpo_packs']} packs of {args.seq_length}: one DPO step "
          f"{r['dpo_s']:.3f} s; the same sequences as two SFT steps ({r['sft_packs']} packs) {r['sft_s']:.3f} s; "
          f"ratio {r['ratio']:.2f} (target <= {TARGET}: {verdict}; median of {args.steps} rounds)")


if __name__ == "__main__":
    main()
