"""``megatron-patch convert``: hf-to-megatron, megatron-to-hf, peft-to-megatron and verify.

Example::

    megatron-patch convert hf-to-megatron --hf-dir qwen2-hf --save-dir qwen2-mcore
    megatron-patch convert hf-to-megatron --hf-dir qwen2-hf --save-dir qwen2-legacy --ckpt-format torch \\
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    megatron-patch convert megatron-to-hf --load-dir qwen2-mcore --save-dir qwen2-hf-again
    megatron-patch convert verify --hf-dir qwen2-hf --megatron-dir qwen2-mcore --tensor-model-parallel-size 2
    megatron-patch convert hf-to-megatron --hf-dir mixtral-hf --save-dir mixtral-mcore \\
        --target-expert-model-parallel-size 2          # verified with each of 2 ranks holding half the experts
    megatron-patch convert megatron-to-hf --load-dir qwen2-lora --save-dir qwen2-peft   # LoRA: PEFT's adapters
    megatron-patch convert peft-to-megatron --peft-dir qwen2-peft --base-dir qwen2-mcore --save-dir qwen2-lora

``verify`` with more than one rank (TP x PP x EP) relaunches itself under torchrun (one per rank); exit status 1 when
the outputs differ beyond the threshold. ``hf-to-megatron`` verifies at the target layout unless --no-verify, before
the checkpoint gets its name: a conversion that fails verification, or is stopped by SIGTERM (status 143), leaves
nothing under --save-dir. Bad input is one line naming the file and the fix (``megatron-patch --debug convert ...``
adds the traceback).
"""

from __future__ import annotations

import argparse
import os
import signal

from megatron_patch.errors import FlagParser, UserError, one_line_errors, unwind_on_sigterm
from megatron_patch.startup import paused_collector


def _parser() -> argparse.ArgumentParser:
    from megatron_patch.model.config import SETTINGS, add_flag

    parser = FlagParser(prog="megatron-patch convert", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    to_mcore = commands.add_parser("hf-to-megatron", help="Hugging Face directory -> Megatron checkpoint")
    to_mcore.add_argument("--hf-dir", required=True)
    to_mcore.add_argument("--save-dir", required=True)
    to_mcore.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                          help="torch_dist (megatron-core, loads at any TP/PP) or torch (Megatron-LM per-rank files)")
    to_mcore.add_argument("--target-tensor-parallel-size", type=int, default=1,
                          help="TP of the torch format's files; for torch_dist it only sets the vocabulary padding")
    to_mcore.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    to_mcore.add_argument("--target-expert-model-parallel-size", type=int, default=1,
                          help="EP the conversion is verified at; a torch_dist checkpoint loads at any EP dividing "
                               "the experts")
    add_flag(to_mcore, "make_vocab_size_divisible_by", default=SETTINGS["make_vocab_size_divisible_by"].default)
    to_mcore.add_argument("--no-verify", action="store_true", help="skip the numerical check against transformers")
    to_mcore.add_argument("--overwrite", action="store_true")

    to_hf = commands.add_parser("megatron-to-hf", help="Megatron checkpoint (either format) -> Hugging Face")
    to_hf.add_argument("--load-dir", required=True)
    to_hf.add_argument("--save-dir", required=True)
    to_hf.add_argument("--model-type", default=None,
                       help="Hugging Face model_type (llama, qwen2, gpt2, ...), for checkpoints that record no Hugging "
                            "Face config: trained from scratch, or saved by Megatron-LM (default: llama for a LLaMA "
                            "block, RMSNorm + SwiGLU + RoPE without biases; gpt2 for a GPT-2 block, LayerNorm + GELU + "
                            "learned positions with biases)")
    to_hf.add_argument("--tokenizer-dir", default=None, help="tokenizer files to include (default: the recorded)")
    to_hf.add_argument("--max-shard-size-gb", type=float, default=5.0)
    to_hf.add_argument("--merge-lora", action="store_true",
                       help="a LoRA checkpoint (--lora-rank training): write its base with the adapters merged in, a "
                            "whole Hugging Face model, instead of a PEFT adapter directory")
    to_hf.add_argument("--overwrite", action="store_true")

    from_peft = commands.add_parser(
        "peft-to-megatron", help="PEFT LoRA adapter directory -> LoRA checkpoint on a converted base (train it with "
                                 "--load DIR --finetune and the --lora-rank/--lora-alpha this prints)")
    from_peft.add_argument("--peft-dir", required=True, help="adapter_config.json and adapter_model.safetensors")
    from_peft.add_argument("--base-dir", required=True,
                           help="the adapters' Hugging Face base converted by hf-to-megatron")
    from_peft.add_argument("--save-dir", required=True)
    from_peft.add_argument("--overwrite", action="store_true")

    verify = commands.add_parser("verify", help="compare a Megatron checkpoint with its Hugging Face model")
    verify.add_argument("--hf-dir", required=True)
    verify.add_argument("--megatron-dir", required=True)
    verify.add_argument("--tensor-model-parallel-size", type=int, default=1)
    verify.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    verify.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="ranks the experts of a mixture-of-experts model are split over")
    verify.add_argument("--text", default=None, help="input text (tokenised with --hf-dir's tokenizer); "
                                                     "random token ids by default")
    verify.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    for sub in (to_mcore, to_hf):
        sub.add_argument("--no-progress", action="store_true")
    return parser


def _verify_here(args) -> int:
    """Run the comparison on this process's rank (all ranks of a torchrun world call it)."""
    import torch

    from megatron_patch import compat
    from megatron_patch.convert.startup import import_megatron_core

    import_megatron_core()
    compat.apply()
    from megatron_patch.convert.verify import verify_on_rank
    from megatron_patch.distributed import one_rank_world

    with one_rank_world():
        results = verify_on_rank(args.hf_dir, args.megatron_dir, args.tensor_model_parallel_size,
                                 args.pipeline_model_parallel_size, text=args.text, dtype=args.dtype,
                                 ep=args.expert_model_parallel_size)
        # On the process group's device: NCCL reduces CUDA tensors only.
        failed = torch.zeros(1, device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
        if results is not None:
            for comparison in results:
                print(comparison.line(), flush=True)
            failed += not all(c.passed for c in results)
        torch.distributed.all_reduce(failed)  # every rank exits with the verdict
    return int(failed.item() > 0)


def verify(args) -> int:
    from megatron_patch.convert.core import check_layout_of, check_pair

    # From the config files, before megatron-core's seconds of import and before any rank starts.
    info, _ = check_pair(args.hf_dir, args.megatron_dir)
    check_layout_of(info.model_config, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                    args.expert_model_parallel_size, info.padded_vocab_size)
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.expert_model_parallel_size
    # Not already a rank of such a world (torchrun's): a conversion's own one-rank world, or none, starts one.
    if world > 1 and os.environ.get("WORLD_SIZE") != str(world):
        from megatron_patch.cli import launch

        forwarded = ["verify", "--hf-dir", args.hf_dir, "--megatron-dir", args.megatron_dir,
                     "--tensor-model-parallel-size", str(args.tensor_model_parallel_size),
                     "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size),
                     "--expert-model-parallel-size", str(args.expert_model_parallel_size),
                     "--dtype", args.dtype, *(["--text", args.text] if args.text is not None else [])]
        return launch("megatron_patch.convert.cli", world, forwarded)
    return _verify_here(args)


def hf_to_megatron(args) -> int:
    # convert imports megatron-core itself (import_megatron_core, compat.apply) while it reads the first weights.
    from megatron_patch.convert.core import hf_to_megatron as convert

    def verify_staged(staged_dir: str) -> None:
        """Verify the written checkpoint under its temporary name, at the layout the files were written for
        (torch) or the one asked for (torch_dist)."""
        verify_args = argparse.Namespace(
            hf_dir=args.hf_dir, megatron_dir=staged_dir, text=None, dtype="float32",
            tensor_model_parallel_size=args.target_tensor_parallel_size,
            pipeline_model_parallel_size=args.target_pipeline_parallel_size,
            expert_model_parallel_size=args.target_expert_model_parallel_size,
        )
        status = verify(verify_args)
        if status == 128 + signal.SIGTERM:  # the ranks of a verification at TP/PP/EP > 1 stopped on it
            raise SystemExit(status)
        if status:
            kept = "; the checkpoint already there is kept" if os.path.exists(args.save_dir) else ""
            raise UserError(f"{args.hf_dir}: verification of the conversion failed (above), so "
                            f"nothing was written to {args.save_dir}{kept}; check the Hugging Face weights "
                            "(NaN or inf?), or pass --no-verify to keep an unverified conversion")

    convert(args.hf_dir, args.save_dir, ckpt_format=args.ckpt_format,
            target_tensor_parallel_size=args.target_tensor_parallel_size,
            target_pipeline_parallel_size=args.target_pipeline_parallel_size,
            target_expert_model_parallel_size=args.target_expert_model_parallel_size,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, overwrite=args.overwrite,
            progress=not args.no_progress, check=None if args.no_verify else verify_staged)
    print(f"wrote {args.ckpt_format} checkpoint to {args.save_dir}", flush=True)
    return 0


def megatron_to_hf(args) -> int:
    from megatron_patch import compat
    from megatron_patch.checkpoint.lora import read_lora_record
    from megatron_patch.convert.core import megatron_to_hf as export
    from megatron_patch.convert.startup import import_megatron_core

    import_megatron_core()
    compat.apply()
    export(args.load_dir, args.save_dir, model_type=args.model_type, tokenizer_dir=args.tokenizer_dir,
           max_shard_bytes=int(args.max_shard_size_gb * (1 << 30)), overwrite=args.overwrite,
           progress=not args.no_progress, merge_lora=args.merge_lora)
    what = "PEFT adapters" if read_lora_record(args.load_dir) and not args.merge_lora else "Hugging Face model"
    print(f"wrote {what} to {args.save_dir}", flush=True)
    return 0


def peft_to_megatron(args) -> int:
    from megatron_patch import compat
    from megatron_patch.convert.peft import peft_to_megatron as convert
    from megatron_patch.convert.startup import import_megatron_core

    import_megatron_core()
    compat.apply()
    settings = convert(args.peft_dir, args.base_dir, args.save_dir, overwrite=args.overwrite)
    print(f"wrote LoRA checkpoint to {args.save_dir}; train it with --load {args.save_dir} --finetune --lora-rank "
          f"{settings.rank} --lora-alpha {settings.alpha:g} --lora-target-modules {','.join(settings.targets)}",
          flush=True)
    return 0


_COMMANDS = {"hf-to-megatron": hf_to_megatron, "megatron-to-hf": megatron_to_hf, "peft-to-megatron": peft_to_megatron,
             "verify": verify}


@one_line_errors("megatron-patch convert")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    unwind_on_sigterm()  # a SIGTERM removes the conversion's temporary directory
    with paused_collector():  # every command needs torch: imported here the faster way (megatron_patch.startup)
        import torch  # noqa: F401
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    from megatron_patch.cli import run

    run(main)
