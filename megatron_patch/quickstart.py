"""A tiny real megatron-core GPT trained on the CPU, tensor-parallel over 2 processes; no download.

Example::

    megatron-patch quickstart --steps 40      # launches: torchrun --nproc-per-node 2 -m megatron_patch.quickstart

The data is a synthetic corpus with structure to learn (each sequence counts up from a random start with a random
stride, modulo the vocabulary), so the loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import argparse

import torch

VOCAB = 128
SEQ = 32


def tiny_gpt(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, vocab_size: int = VOCAB,
             seq_length: int = SEQ, num_layers: int = 4):
    """A 4-layer, 32-wide GPT-2-style megatron-core ``GPTModel`` (local layer spec) for this process's stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size, pipeline_dtype=torch.float32,
        # Initialise full weights then split them, so every layout starts from the same numbers.
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab_size,
        max_sequence_length=seq_length, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def counting_batches(generator: torch.Generator, micro_batch_size: int, num_microbatches: int):
    """Microbatches of sequences ``start, start+stride, ...`` (mod VOCAB) for causal-LM training."""
    for _ in range(num_microbatches):
        start = torch.randint(0, VOCAB, (micro_batch_size, 1), generator=generator)
        stride = torch.randint(1, 4, (micro_batch_size, 1), generator=generator)
        sequence = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        yield {
            "tokens": sequence[:, :-1].contiguous(),
            "labels": sequence[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, SEQ),
            "position_ids": torch.arange(SEQ).expand(micro_batch_size, SEQ).contiguous(),
        }


def main(argv: list[str] | None = None) -> int:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.distributed import destroy_distributed, initialize_distributed
    from megatron_patch.training.step import build_optimizer, lm_forward_step, train_step, wrap_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=2)
    args = parser.parse_args(argv)

    layout = initialize_distributed(tensor_model_parallel_size=args.tensor_model_parallel_size, seed=1234)
    chunks = wrap_model([tiny_gpt(args.tensor_model_parallel_size)], DistributedDataParallelConfig())
    optimizer = build_optimizer(chunks, OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0))
    generator = torch.Generator().manual_seed(0)  # same data on every tensor-parallel rank
    losses = []
    for step in range(1, args.steps + 1):
        stats = train_step(lm_forward_step, counting_batches(generator, 4, 2), chunks, optimizer,
                           num_microbatches=2, seq_length=SEQ, micro_batch_size=4)
        losses.append(stats.loss)
        if layout.rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d} | loss {stats.loss:.4f} | grad norm {stats.grad_norm:.3f}", flush=True)
    learned = losses[-1] < 0.9 * losses[0]
    if layout.rank == 0:
        print(f"quickstart: {layout.world_size} processes, TP={layout.tensor_model_parallel_size}; loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f} ({'learned' if learned else 'DID NOT LEARN'})", flush=True)
    destroy_distributed()
    return 0 if learned else 1


if __name__ == "__main__":
    raise SystemExit(main())
