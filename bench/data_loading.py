"""Does reading real mmap data slow training down? Training steps over GPTDataset vs MockGPTDataset.

Example::

    python bench/data_loading.py --iters 30

Builds a small stdlib corpus, a GPT-2 BPE tokenizer and `.bin/.idx` files, then trains the same small GPT in one
process on megatron-core's ``GPTDataset`` (real mmap files) and on ``MockGPTDataset`` (no file reads), through a
DataLoader with one worker as a training run would. Short blocks of iterations alternate (real, mock, real, ...)
and the totals are compared, so background load on a shared machine affects both alike. Prints
``RESULT {json}`` with ratio = mock time / real time (target >= 0.98: real data costs at most 2%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

SEQ, MICRO_BATCH, MICROBATCHES = 256, 4, 2


def _prepare_data(work: str):
    from megatron_patch.data.corpus import write_stdlib_corpus
    from megatron_patch.data.preprocess import PreprocessConfig, preprocess
    from megatron_patch.data.train_tokenizer import train_tokenizer
    from megatron_patch.tokenizer import build_tokenizer

    corpus = os.path.join(work, "corpus.jsonl")
    write_stdlib_corpus(corpus, max_bytes=3_000_000, max_doc_chars=4000)
    train_tokenizer("gpt2-bpe", corpus, os.path.join(work, "tok"), vocab_size=4000)
    options = {"vocab_file": os.path.join(work, "tok", "vocab.json"),
               "merge_file": os.path.join(work, "tok", "merges.txt")}
    prefix = os.path.join(work, "corpus")
    preprocess(PreprocessConfig(input=corpus, output_prefix=prefix, tokenizer_type="GPT2BPETokenizer",
                                tokenizer_options=options, append_eod=True, workers=2))
    return build_tokenizer("GPT2BPETokenizer", **options), prefix + "_text_document"


def _loader(dataset):
    return iter(torch.utils.data.DataLoader(dataset, batch_size=MICRO_BATCH, num_workers=1, persistent_workers=True,
                                            prefetch_factor=4))


def main(argv: list[str] | None = None) -> int:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.data.datasets import build_gpt_datasets
    from megatron_patch.distributed import initialize_distributed
    from megatron_patch.model.builder import build_model_chunks, padded_vocab_size
    from megatron_patch.model.config import get_model_config
    from megatron_patch.model.parallel import ParallelConfig
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--block", type=int, default=3, help="iterations per alternation (real, mock, real, ...)")
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="bench_data_loading_")
    tokenizer, prefix = _prepare_data(work)
    initialize_distributed(seed=1234)
    num_samples = (args.iters + 2 * args.block) * MICRO_BATCH * MICROBATCHES
    datasets = {
        mock: build_gpt_datasets([prefix], "100,0,0", SEQ, tokenizer, [num_samples, 0, 0], mock=mock,
                                 create_attention_mask=False)[0]
        for mock in (False, True)
    }
    model_config = get_model_config("tiny-gpt2", num_layers=4, hidden_size=256, num_attention_heads=8,
                                    seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0,
                                    attention_dropout=0.0)
    vocab = padded_vocab_size(tokenizer.vocab_size, 128, 1)
    chunks = wrap_model(build_model_chunks(model_config, ParallelConfig(), vocab), DistributedDataParallelConfig())
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=1e-4))
    loaders = {mock: _loader(dataset) for mock, dataset in datasets.items()}

    def timed_block(mock: bool) -> float:
        loader = loaders[mock]
        start = time.perf_counter()
        for _ in range(args.block):
            train_step(lm_forward_step, loader, chunks, optimizer, MICROBATCHES, SEQ, MICRO_BATCH)
        return time.perf_counter() - start

    for mock in (False, True):  # warm-up: loader workers started, first-call costs paid
        timed_block(mock)
    total = {False: 0.0, True: 0.0}
    for _ in range(args.iters // args.block):
        for mock in (False, True):
            total[mock] += timed_block(mock)
    ratio = total[True] / total[False]
    print(f"real mmap data: {total[False]:.2f}s, mock data: {total[True]:.2f}s for {args.iters} iterations each")
    print("RESULT " + json.dumps({"benchmark": "training on mmap data vs --mock-data (mock time / real time)",
                                  "ratio": round(ratio, 3), "target": ">= 0.98",
                                  "note": f"{args.iters} iterations each, alternating every {args.block}"}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
