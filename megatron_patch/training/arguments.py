"""One argument definition for the engine, the trainers and the ``rapidformer`` CLI: Megatron-LM's names plus the
Rapidformer flags, parsed and validated once per process into the typed ``RunConfig`` (training/config.py).

Example::

    config, args = parse_run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                              "--mixed-precision", "--zero-1-memory-optimization"], world_size=2)
    config.training.fp16, config.training.memory_optimization, config.training.num_microbatches  # True, 'zero-1', 2
    args.num_microbatches                      # 2: the same run under Megatron-LM's names, for user scripts

``parse_args`` is the validated ``argparse.Namespace`` alone (for tools that need no world size, e.g. the dry-run
plan). The launcher parses once in its parent (so a bad flag is one line before any rank starts) and once in each
rank, whose engine takes that parse (``parse_run``'s hand-over) instead of parsing again.

Unknown flags are refused with their names (``allow_abbrev`` is off, so a typo never silently matches a longer
flag), and every conflict names both flags and the fix. ``--load DIR`` with ``DIR/megatron_patch_args.json`` (a
conversion's or our trainer's) or Megatron-LM's own checkpoint (the ``args`` in its common.pt or rank files) supplies
the model flags not given, as Megatron-LM's ``--use-checkpoint-args``. ``--pretrained-model-name-or-path DIR`` with a
``DIR/config.json`` refuses the shape flags that contradict it; user scripts' ``args.load`` names ``DIR`` when
``--load`` is not given (Rapidformer's Finetuner template loads ``from_pretrained(args.load)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os

from megatron_patch.checkpoint.format import find_info
# The flag tables themselves: which model flags exist and which ModelConfig field each one sets.
from megatron_patch.layout import check_layout
from megatron_patch.model.config import (
    _SWITCH_FLAGS, _VALUE_FLAGS, HF_SIZE_KEYS, add_model_arguments, get_model_config, hf_size_key, model_flag_values,
)
from megatron_patch.model.parallel import (
    ParallelConfig, add_parallel_arguments, parallel_config_from_args, transformer_engine_missing,
)
from megatron_patch.tokenizer.registry import add_tokenizer_args, tokenizer_options
from megatron_patch.training.config import (
    CheckpointConfig, DataConfig, LoggingConfig, ModelSpec, RunConfig, TrainingConfig, rampup_batch_sizes,
)

# --zero-*/--fsdp flag -> memory mode; what each does is in MEMORY_HELP (and in --help).
MEMORY_FLAGS = {
    "zero_1_memory_optimization": "zero-1",
    "zero_2_memory_optimization": "zero-2",
    "zero_3_memory_optimization": "zero-3",
    "fsdp_memory_optimization": "fsdp",
}
MEMORY_HELP = {
    "zero-1": "shard optimizer state over data-parallel ranks (megatron models: megatron-core's distributed "
              "optimizer, which shards Adam's state and, in mixed precision, the fp32 master weights; plain/HF "
              "models: torch.distributed.optim.ZeroRedundancyOptimizer)",
    # megatron-core's DDP allocates the whole gradient buffer on every rank and reduce-scatters into a view of
    # it (distributed/param_and_grad_buffer.py), so no megatron-core option shards gradient memory.
    "zero-2": "plain/HF models: shard optimizer state and gradients (torch FSDP2 fully_shard with "
              "reshard_after_forward=False); megatron models: the same as --zero-1-memory-optimization "
              "(megatron-core's distributed optimizer): gradients are reduce-scattered instead of all-reduced, "
              "but every rank keeps a full-size gradient buffer, so only optimizer state is sharded",
    "zero-3": "shard parameters, gradients and optimizer state (torch FSDP2 fully_shard per layer; plain/HF "
              "models only)",
    "fsdp": "same as --zero-3-memory-optimization (torch FSDP2; plain/HF models only)",
}
TASKS = ("pretraining", "sequence_classification")


def build_parser() -> argparse.ArgumentParser:
    """The full parser (also what ``rapidformer --help`` prints)."""
    parser = argparse.ArgumentParser(
        prog="rapidformer", allow_abbrev=False,
        description="Train megatron-core, plain torch and Hugging Face models: black-box with --task, or "
                    "white-box with --user-script (a Pretrainer/Finetuner subclass or a no-trainer script).",
    )
    rapid = parser.add_argument_group("rapidformer")
    rapid.add_argument("--task", choices=TASKS, default=None,
                       help="black-box task: the model and data come from flags, no user code")
    rapid.add_argument("--user-script", default=None, help="white-box: a Python file run on every rank")
    rapid.add_argument("--pretrained-model-name-or-path", default=None,
                       help="a local Hugging Face model directory (config.json, weights, tokenizer files)")
    rapid.add_argument("--data-name", default=None,
                       help="dataset name under --data-path (e.g. mrpc for DIR/mrpc/train.tsv)")
    rapid.add_argument("--dataset-path", default=None, help="old Rapidformer name read by user scripts")
    rapid.add_argument("--dataset-name", default=None, help="old Rapidformer name read by user scripts")
    rapid.add_argument("--epochs", type=int, default=None,
                       help="fine-tuning epochs; with --train-iters too, training stops at whichever comes first "
                            "(no-trainer scripts read both: epochs for their loop, train iters for the scheduler)")
    rapid.add_argument("--mixed-precision", action="store_true",
                       help="fp16 with dynamic loss scaling (bf16 without scaling when --bf16 is also given); "
                            "megatron models train in fp16 with megatron-core's optimizer, plain/HF models keep "
                            "fp32 weights and run their forward under torch.autocast with a GradScaler, also "
                            "on CPUs")
    for dest, mode in MEMORY_FLAGS.items():
        rapid.add_argument("--" + dest.replace("_", "-"), action="store_true", help=MEMORY_HELP[mode])
    rapid.add_argument("--onnx-runtime-training", action="store_true",
                       help="ONNX Runtime training is unmaintained upstream; this flag compiles the model's "
                            "forward with torch.compile (backend from --compile-backend) and says so in the log")
    rapid.add_argument("--compile-backend", default="inductor",
                       help="torch.compile backend used by --onnx-runtime-training (inductor, aot_eager, eager)")
    rapid.add_argument("--nproc-per-node", type=int, default=None,
                       help="launcher: processes per node (default: one per visible GPU, or 1 on CPU)")
    rapid.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None,
                       help="accepted for old launchers; LOCAL_RANK from the environment wins")

    add_model_arguments(parser)
    add_parallel_arguments(parser)
    add_tokenizer_args(parser)
    # Fine-tuning and HF models bring their own tokenizer, so the tokenizer type is optional here.
    parser._option_string_actions["--tokenizer-type"].required = False

    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=1)
    train.add_argument("--global-batch-size", type=int, default=None,
                       help="gradient accumulation: global / (micro x data-parallel size) microbatches per step")
    train.add_argument("--train-iters", type=int, default=None)
    train.add_argument("--lr", type=float, default=1e-4)
    train.add_argument("--min-lr", type=float, default=0.0)
    train.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                       default="linear")
    train.add_argument("--lr-decay-iters", type=int, default=None)
    train.add_argument("--lr-warmup-iters", type=int, default=0)
    train.add_argument("--lr-warmup-fraction", type=float, default=None)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--adam-beta1", type=float, default=0.9)
    train.add_argument("--adam-beta2", type=float, default=0.999)
    train.add_argument("--adam-eps", type=float, default=1e-8)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale (default: dynamic)")
    train.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    train.add_argument("--use-distributed-optimizer", action="store_true")
    train.add_argument("--max-bad-steps", type=int, default=3, metavar="N",
                       help="bf16/fp32: stop after N consecutive steps with NaN/Inf gradients (each is skipped, "
                            "not applied), keeping the last checkpoint; fp16 skips them and lowers the loss scale")
    train.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                       help="a collective waiting longer than this (a rank died or hangs) fails the job")
    train.add_argument("--exit-signal-handler", action="store_true",
                       help="on SIGTERM (preemption) finish the current iteration, save a checkpoint under --save "
                            "and exit with status 0")

    data = parser.add_argument_group("data")
    data.add_argument("--data-path", nargs="*", default=None,
                      help="mmap prefixes (optionally weighted), or a directory for sequence classification")
    data.add_argument("--data-impl", choices=["mmap"], default="mmap",
                      help="megatron-core's indexed datasets are memory-mapped; only mmap exists")
    data.add_argument("--split", default="969,30,1")
    data.add_argument("--data-cache-path", default=None)
    data.add_argument("--mock-data", action="store_true")
    data.add_argument("--mask-prob", type=float, default=0.15)
    data.add_argument("--short-seq-prob", type=float, default=0.1)
    data.add_argument("--mmap-warmup", action="store_true")
    data.add_argument("--reset-position-ids", action="store_true")
    data.add_argument("--reset-attention-mask", action="store_true")
    data.add_argument("--eod-mask-loss", action="store_true")
    data.add_argument("--num-workers", type=int, default=0)

    ckpt = parser.add_argument_group("checkpointing")
    ckpt.add_argument("--save", default=None)
    ckpt.add_argument("--load", default=None)
    ckpt.add_argument("--save-interval", type=int, default=None)
    ckpt.add_argument("--no-load-optim", action="store_true")
    ckpt.add_argument("--no-load-rng", action="store_true")
    ckpt.add_argument("--finetune", action="store_true",
                      help="load model weights only and start at iteration 0")
    ckpt.add_argument("--exit-on-missing-checkpoint", action="store_true")
    ckpt.add_argument("--load-fallback", action="store_true",
                      help="when --load's latest checkpoint has a missing, truncated or damaged file, load the "
                           "newest intact earlier iter_* instead of stopping")
    ckpt.add_argument("--no-verify-checksums", action="store_true",
                      help="load without comparing each file's CRC-32 with the checksums.json its save wrote "
                           "(missing and truncated files are still refused)")
    ckpt.add_argument("--keep-last-k", type=int, default=None, metavar="K",
                      help="after each save keep only the newest K iter_* checkpoints under --save")
    ckpt.add_argument("--async-save", action="store_true",
                      help="write megatron-core checkpoints in a background thread while training goes on; "
                           "a save becomes the latest only once every rank's files are complete")

    log = parser.add_argument_group("logging")
    log.add_argument("--log-interval", type=int, default=10)
    log.add_argument("--eval-interval", type=int, default=None)
    log.add_argument("--eval-iters", type=int, default=10)
    log.add_argument("--tensorboard-dir", default=None)
    log.add_argument("--log-dir", default=None,
                     help="where the loss-curve PNG goes (default: --tensorboard-dir, else --save)")
    log.add_argument("--log-throughput", action="store_true", help="accepted; throughput is always logged")
    _add_megatron_lm_arguments(parser)
    return parser


def _add_megatron_lm_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of Megatron-LM's examples/ launch scripts (core_v0.16.1) beyond the basic ones above; each acts
    as it does there, or is refused or logged as ignored by ``flag_notices`` (none is silently dropped)."""
    schedule = parser.add_argument_group("Megatron-LM sample-counted schedules and batch ramp-up")
    schedule.add_argument("--train-samples", type=int, default=None,
                          help="train on this many samples instead of --train-iters (iterations: samples / global "
                               "batch, with ramp-up counted as Megatron-LM's update_train_iters does)")
    schedule.add_argument("--lr-decay-samples", type=int, default=None,
                          help="with --train-samples: decay the learning rate over this many samples (default "
                               "--train-samples)")
    schedule.add_argument("--lr-warmup-samples", type=int, default=0,
                          help="with --train-samples: warm the learning rate up over this many samples")
    schedule.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCR", "SAMPLES"),
                          help="grow the global batch from START by INCR over SAMPLES samples up to "
                               "--global-batch-size (megatron-core's num_microbatches_calculator); with "
                               "--train-iters too, which Megatron-LM 0.16.1 refuses (logged)")
    schedule.add_argument("--decoupled-lr", type=float, default=None,
                          help="megatron models: learning rate of the input embedding and output layer")
    schedule.add_argument("--decoupled-min-lr", type=float, default=None,
                          help="megatron models: minimum learning rate of the input embedding and output layer")

    step = parser.add_argument_group("Megatron-LM step, memory and exit options")
    step.add_argument("--calculate-per-token-loss", action="store_true",
                      help="megatron models: divide the summed loss by the tokens of the whole global batch, not "
                           "each microbatch by its own tokens (megatron-core's calculate_per_token_loss)")
    step.add_argument("--overlap-grad-reduce", action="store_true",
                      help="megatron models: reduce gradient buckets during the backward pass (megatron-core DDP)")
    step.add_argument("--overlap-param-gather", action="store_true",
                      help="megatron models with the distributed optimizer: all-gather updated parameters during "
                           "the next forward pass (megatron-core DDP; needs --overlap-grad-reduce)")
    step.add_argument("--grad-reduce-in-bf16", action="store_true",
                      help="--bf16: accumulate and reduce gradients in bf16 instead of fp32")
    step.add_argument("--cross-entropy-loss-fusion", action="store_true",
                      help="megatron models: megatron-core's fused vocab-parallel cross-entropy (torch.compile'd; "
                           "the same loss)")
    step.add_argument("--manual-gc", action="store_true",
                      help="turn Python's automatic garbage collector off and collect every --manual-gc-interval "
                           "iterations and around evaluations, at the same point on every rank")
    step.add_argument("--manual-gc-interval", type=int, default=0,
                      help="with --manual-gc: iterations between collections (0: only around evaluations)")
    step.add_argument("--no-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                      help="with --manual-gc: no collection around evaluations")
    step.add_argument("--exit-duration-in-mins", type=int, default=None,
                      help="after this many minutes since start-up, save under --save (if given) and exit")
    step.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                      help="GPUs: empty the CUDA caching allocator after each step's backward (1) and also after "
                           "its optimizer step (2)")
    step.add_argument("--profile", action="store_true",
                      help="GPUs: run CUDA's profiler (for nsys) from --profile-step-start to --profile-step-end")
    step.add_argument("--profile-step-start", type=int, default=10)
    step.add_argument("--profile-step-end", type=int, default=12)
    step.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="global ranks that profile")

    kernels = parser.add_argument_group("Megatron-LM kernels and precision")
    kernels.add_argument("--use-mcore-models", action="store_true",
                         help="deprecated in Megatron-LM 0.16 (megatron-core models are its default); every "
                              "megatron model here is one")
    kernels.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                         help="fp8 matmuls through Transformer Engine (needs it and an fp8-capable GPU)")
    kernels.add_argument("--fp8-amax-history-len", type=int, default=1)
    kernels.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent")
    kernels.add_argument("--fp8-param-gather", action="store_true",
                         help="keep parameters in fp8 and all-gather them in fp8 (with --fp8-format)")

    data = parser.add_argument_group("Megatron-LM data and checkpoint formats")
    data.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                      help="read the .bin files of --data-path with file reads instead of memory-mapping them")
    data.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                      dest="create_attention_mask_in_dataloader",
                      help="accepted: the GPT datasets here never build attention masks (the attention is causal)")
    data.add_argument("--tiktoken-pattern", default=None,
                      help="Megatron-LM's TikTokenizer pattern; no --tokenizer-type here reads it (logged)")
    data.add_argument("--ckpt-format", choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
                      default="torch_dist",
                      help="megatron models are saved in torch_dist (megatron-core dist_checkpointing, loadable at "
                           "any TP/PP); the other formats are refused")


def _refuse(message: str):
    raise SystemExit(f"rapidformer: error: {message}")


def _memory_mode(args: argparse.Namespace) -> str | None:
    chosen = [dest for dest in MEMORY_FLAGS if getattr(args, dest)]
    if len(chosen) > 1:
        flags = " and ".join("--" + d.replace("_", "-") for d in chosen)
        _refuse(f"{flags} conflict; choose one memory optimization")
    return MEMORY_FLAGS[chosen[0]] if chosen else None


# Each check: (predicate that is True when the arguments are wrong, message naming the flags and the fix).
_CHECKS = [
    (lambda a: a.fp16 and a.bf16, "--fp16 and --bf16 conflict; give one (or --mixed-precision [--bf16])"),
    (lambda a: a.lr_warmup_fraction is not None and a.lr_warmup_iters,
     "--lr-warmup-iters and --lr-warmup-fraction conflict; give one"),
    (lambda a: a.finetune and a.load is None, "--finetune needs --load DIR"),
    (lambda a: a.save_interval is not None and a.save is None, "--save-interval needs --save DIR"),
    (lambda a: a.keep_last_k is not None and a.save is None, "--keep-last-k needs --save DIR"),
    (lambda a: a.keep_last_k is not None and a.keep_last_k < 1, "--keep-last-k must be at least 1"),
    (lambda a: a.load_fallback and a.load is None, "--load-fallback needs --load DIR"),
    (lambda a: a.max_bad_steps < 1, "--max-bad-steps must be at least 1"),
    (lambda a: a.distributed_timeout_minutes <= 0, "--distributed-timeout-minutes must be positive"),
    (lambda a: a.exit_signal_handler and a.save is None,
     "--exit-signal-handler saves on SIGTERM: give --save DIR"),
    (lambda a: a.async_save and a.save is None, "--async-save needs --save DIR"),
    (lambda a: a.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None,
     "--tensorboard-dir needs the tensorboard package (pip install tensorboard)"),
]


def _rampup_wrong(a: argparse.Namespace) -> str | None:
    """What is wrong with ``--rampup-batch-size`` (None when nothing is), as megatron-core's calculator checks."""
    start, increment, samples = a.rampup_batch_size
    if start < 1 or increment < 1 or samples < 0:
        return "--rampup-batch-size START INCR SAMPLES needs START and INCR at least 1 and SAMPLES at least 0"
    if a.global_batch_size is None or start > a.global_batch_size:
        return "--rampup-batch-size START must not exceed --global-batch-size (the batch it ramps up to)"
    if (a.global_batch_size - start) % increment:
        return (f"--rampup-batch-size: --global-batch-size {a.global_batch_size} minus START {start} is not a "
                f"multiple of INCR {increment}")
    return None


# Megatron-LM's own refusals for its schedule and DDP flags (megatron/training/arguments.py, core_v0.16.1:
# validate_args), each with the fix.
_MEGATRON_LM_CHECKS = [
    (lambda a: a.train_samples is not None and a.train_iters is not None,
     "--train-samples and --train-iters conflict; give one"),
    (lambda a: a.train_samples is not None and a.lr_decay_iters is not None,
     "--lr-decay-iters counts iterations but --train-samples counts samples; give --lr-decay-samples"),
    (lambda a: a.train_samples is not None and a.lr_warmup_iters,
     "--lr-warmup-iters counts iterations but --train-samples counts samples; give --lr-warmup-samples"),
    (lambda a: a.train_samples is None and (a.lr_decay_samples is not None or a.lr_warmup_samples),
     "--lr-decay-samples/--lr-warmup-samples count samples: give --train-samples instead of --train-iters"),
    (lambda a: a.lr_warmup_fraction is not None and a.lr_warmup_samples,
     "--lr-warmup-samples and --lr-warmup-fraction conflict; give one"),
    (lambda a: a.rampup_batch_size is not None and _rampup_wrong(a) is not None, lambda a: _rampup_wrong(a)),
    (lambda a: a.decoupled_min_lr is not None and a.decoupled_lr is None,
     "--decoupled-min-lr needs --decoupled-lr"),
    (lambda a: a.overlap_param_gather and not a.use_distributed_optimizer,
     "--overlap-param-gather needs the distributed optimizer: add --use-distributed-optimizer"),
    (lambda a: a.overlap_param_gather and not a.overlap_grad_reduce,
     "--overlap-param-gather needs --overlap-grad-reduce"),
    (lambda a: a.manual_gc_interval < 0, "--manual-gc-interval must be at least 0"),
    (lambda a: a.profile and a.profile_step_end <= a.profile_step_start,
     "--profile-step-end must be after --profile-step-start"),
    (lambda a: a.ckpt_format != "torch_dist",
     lambda a: f"--ckpt-format {a.ckpt_format}: megatron models are saved here in torch_dist (megatron-core "
               "dist_checkpointing, which loads at any TP/PP); give --ckpt-format torch_dist or drop the flag"),
]


def flag_notices(args: argparse.Namespace) -> list[str]:
    """One line for each given flag that does nothing on this machine or in this package, saying why; the
    engine logs them once. Settings the notice names as off are turned off here.

    Example::

        flag_notices(parse_args([..., "--profile"]))   # on a machine without CUDA:
        # ['ignored on this machine: --profile (runs CUDA's profiler for nsys; no CUDA device here)']
    """
    from megatron_patch.startup import paused_collector

    with paused_collector():  # the launcher's first import of torch (startup.py)
        import torch

    cuda = torch.cuda.is_available()
    no_te = transformer_engine_missing(args.transformer_impl)
    te = no_te is None
    notices = []
    if args.transformer_impl == "transformer_engine" and not te:
        notices.append(f"ignored on this machine: --transformer-impl transformer_engine ({no_te}; megatron-core's "
                       "local layers run, and their checkpoints load into Transformer Engine's)")
    if args.use_mcore_models:
        notices.append("ignored: --use-mcore-models (deprecated in Megatron-LM 0.16, where megatron-core models are "
                       "the default; here every megatron model is one)")
    if args.tiktoken_pattern is not None:
        notices.append(f"ignored: --tiktoken-pattern {args.tiktoken_pattern} (it configures Megatron-LM's "
                       "TikTokenizer, which no --tokenizer-type here is)")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        # megatron/training/arguments.py (core_v0.16.1) turns it off at TP=1 with a warning, as here.
        args.sequence_parallel = False
        notices.append("ignored: --sequence-parallel (it splits activations over tensor-parallel ranks, and "
                       "--tensor-model-parallel-size is 1; Megatron-LM turns it off too)")
    if args.rampup_batch_size is not None and args.train_iters is not None:
        # Megatron-LM 0.16.1 asserts "expected no batch-size rampup for iteration-based training" although its own
        # examples/gpt3/train_gpt3_175b_distributed.sh combines the two; here that script runs.
        notices.append("note: --rampup-batch-size with --train-iters (Megatron-LM 0.16.1 refuses the pair): the "
                       "run takes --train-iters iterations, the first ones with the ramp-up's smaller batches")
    if args.grad_reduce_in_bf16 and not args.bf16:
        notices.append("ignored: --grad-reduce-in-bf16 (it applies to --bf16 runs)")
    if not (te and cuda):
        missing = no_te if not te else "no CUDA device here"
        fp8 = [("--fp8-format", args.fp8_format is not None),
               ("--fp8-amax-history-len", args.fp8_amax_history_len != 1),
               ("--fp8-amax-compute-algo", args.fp8_amax_compute_algo != "most_recent"),
               ("--fp8-param-gather", args.fp8_param_gather)]
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        for flag, given in fp8:
            if given:
                notices.append(f"ignored on this machine: {flag} (fp8 needs Transformer Engine and an fp8-capable "
                               f"GPU; {missing}): the run computes in {precision}")
        args.fp8_format, args.fp8_param_gather = None, False
    elif args.fp8_param_gather:
        notices.append("ignored: --fp8-param-gather (parameters are built in --bf16/--fp16 here; --fp8-format "
                       "applies to the matmuls)")
        args.fp8_param_gather = False
    if args.attention_backend in ("flash", "fused", "unfused") and not te:
        notices.append(f"ignored on this machine: --attention-backend {args.attention_backend} (a Transformer "
                       f"Engine kernel; {no_te}, so megatron-core's local attention (torch SDPA) runs)")
        args.attention_backend = "auto"
    if not cuda:
        if args.profile:
            notices.append("ignored on this machine: --profile (runs CUDA's profiler for nsys between "
                           "--profile-step-start and --profile-step-end; no CUDA device here)")
            args.profile = False
        if args.empty_unused_memory_level:
            notices.append(f"ignored on this machine: --empty-unused-memory-level {args.empty_unused_memory_level} "
                           "(it empties the CUDA caching allocator; no CUDA device here)")
            args.empty_unused_memory_level = 0
    return notices


# Fields a flag may change on a stored model: they shape the training run, not the weights.
_TRAINING_FIELDS = {"seq_length", "hidden_dropout", "attention_dropout", "init_method_std"}


def _apply_checkpoint_args(args: argparse.Namespace) -> None:
    """Set ``args.checkpoint_info`` from ``--load``'s ``megatron_patch_args.json`` or, without one, the Megatron-LM
    ``args`` in its common.pt or rank files (None without a Megatron checkpoint) and fill the model flags not given
    from it; a given flag that contradicts the stored model is refused.

    Example::

        args = parse_args(["--load", "llama-mcore", "--seq-length", "16"])   # a converted checkpoint
        args.hidden_size, args.checkpoint_info.padded_vocab_size             # (32, 128): from the file
    """
    found = find_info(args.load) if args.load else None
    if found is None:
        args.checkpoint_info = None
        return
    info, path = found
    stored = info.model_config
    if args.model_name is not None:
        _refuse(f"--model-name {args.model_name} conflicts with --load {args.load}: {path} describes the model; "
                "drop --model-name")
    if args.model_family not in (None, stored.family):
        _refuse(f"--model-family {args.model_family} contradicts family={stored.family!r} in {path}")
    training = {}
    for flag, field, _ in _VALUE_FLAGS:
        given, kept = getattr(args, field), getattr(stored, field)
        if given is None:
            setattr(args, field, kept)
        elif field in _TRAINING_FIELDS:
            training[field] = given
        elif given != kept:
            _refuse(f"{flag} {given} contradicts {field}={kept!r} in {path}; drop {flag} (the stored model is "
                    "used) or load another checkpoint")
    for flag, field, value in _SWITCH_FLAGS:
        dest = f"_switch_{flag[2:].replace('-', '_')}"
        if getattr(args, dest) and getattr(stored, field) != value:
            _refuse(f"{flag} (sets {field}={value!r}) contradicts {field}={getattr(stored, field)!r} in {path}")
        setattr(args, dest, getattr(stored, field) == value)
    args.model_family = stored.family
    args.checkpoint_info = dataclasses.replace(info, model_config=dataclasses.replace(stored, **training))


def _check_pretrained_shape(args: argparse.Namespace) -> None:
    """Refuse a shape flag that contradicts ``--pretrained-model-name-or-path DIR``'s ``config.json`` (the model
    ``from_pretrained`` loads, whatever the flags say), naming the flag, the file, its value and the fix; a
    ``--seq-length`` within the model's ``max_position_embeddings`` only shapes the run and is accepted.

    Example::

        parse_args(["--pretrained-model-name-or-path", "bert-base", "--hidden-size", "64"])
        # SystemExit: rapidformer: error: --hidden-size 64 contradicts hidden_size=768 in bert-base/config.json ...

    config.json is read with json, not transformers, so the launcher's parse stays fast. A name that is not a
    local directory with a config.json (a hub name) is not checked.
    """
    path = os.path.join(args.pretrained_model_name_or_path or "", "config.json")
    if not args.pretrained_model_name_or_path or not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        stored = json.load(f)
    keys = {field: hf_size_key(stored, field) for field in HF_SIZE_KEYS}
    for field, key in keys.items():
        flag, given = "--" + field.replace("_", "-"), getattr(args, field)
        if given is not None and key is not None and given != stored[key]:
            _refuse(f"{flag} {given} contradicts {key}={stored[key]} in {path} (the pretrained model); drop {flag} "
                    f"or give {stored[key]}")
    key = keys["max_position_embeddings"]
    if args.seq_length is not None and key is not None and args.seq_length > stored[key]:
        _refuse(f"--seq-length {args.seq_length} exceeds {key}={stored[key]} in {path} (the pretrained model has no "
                f"positions beyond it); give --seq-length {stored[key]} or less")


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Derive the typed values the rest of the code uses and refuse conflicts, once."""
    args.memory_optimization = _memory_mode(args)
    if args.mixed_precision and not args.bf16:
        args.fp16 = True
    if args.memory_optimization in ("zero-1", "zero-2"):
        args.use_distributed_optimizer = True
    for wrong, message in _CHECKS + _MEGATRON_LM_CHECKS:
        if wrong(args):
            _refuse(message(args) if callable(message) else message)
    args.dataset_path = args.dataset_path or (args.data_path[0] if args.data_path else None)
    args.dataset_name = args.dataset_name or args.data_name
    _check_pretrained_shape(args)  # the flags as given, before --load or --model-name fill the others
    _apply_checkpoint_args(args)
    if args.checkpoint_info is None and args.model_name is not None:
        # Code that reads the flags (the datasets' --seq-length, the FLOP count) sees the named model's values.
        named = get_model_config(args.model_name)
        for _, field, _ in _VALUE_FLAGS:
            if getattr(args, field) is None:
                setattr(args, field, getattr(named, field))
    if args.task == "pretraining" and args.data_path and not args.mock_data:
        # Found now, before torchrun starts and models are built, not when the datasets are (user scripts that
        # build megatron-core datasets get the same check then, still before the first step).
        from megatron_patch.data.data_path import check_data_path

        try:
            check_data_path(args.data_path)
        except ValueError as error:
            _refuse(str(error))
    args.flag_notices = flag_notices(args)
    # Megatron-LM user scripts read these names.
    args.params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; unknown flags exit with their names.

    Example::

        >>> parse_args(["--zero-1-memory-optimization", "--zero-3-memory-optimization"])
        Traceback (most recent call last):
        SystemExit: rapidformer: error: --zero-1-memory-optimization and --zero-3-memory-optimization conflict; ...
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [item for item in unknown if item.startswith("-")] or unknown
        _refuse(f"unrecognized arguments: {' '.join(flags)} (see rapidformer --help)")
    return validate_args(args)


def _pick(cls, args: argparse.Namespace, **derived):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in derived}
    return cls(**values, **derived)


def _tuple(value):
    return tuple(value) if isinstance(value, list) else value


def _train_iters(args: argparse.Namespace, data_parallel_size: int) -> int | None:
    if args.train_samples is None:
        return args.train_iters
    ramp = rampup_batch_sizes(args.global_batch_size, args.micro_batch_size, data_parallel_size,
                              _tuple(args.rampup_batch_size), args.train_samples)
    # The constant phase drops a partial last batch, as Megatron-LM does.
    return len(ramp) + max(0, args.train_samples - sum(ramp)) // args.global_batch_size


def _run_config(args: argparse.Namespace, model: ModelSpec, parallel: ParallelConfig, data_parallel_size: int,
               world_size: int, tokenizer_options: dict) -> RunConfig:
    """The frozen configuration of validated flags (``args``, with ``global_batch_size`` set)."""
    training = _pick(
        TrainingConfig, args, data_parallel_size=data_parallel_size,
        num_microbatches=args.global_batch_size // (args.micro_batch_size * data_parallel_size),
        train_iters=_train_iters(args, data_parallel_size), rampup_batch_size=_tuple(args.rampup_batch_size),
        profile_ranks=tuple(args.profile_ranks))
    return RunConfig(
        task=args.task, user_script=args.user_script, pretrained_model_name_or_path=args.pretrained_model_name_or_path,
        world_size=world_size, training=training,
        data=_pick(DataConfig, args, data_path=_tuple(args.data_path)),
        checkpointing=_pick(CheckpointConfig, args), logging=_pick(LoggingConfig, args), model=model,
        parallel=parallel, tokenizer_type=args.tokenizer_type,
        tokenizer_options=tuple(sorted((k, v) for k, v in tokenizer_options.items() if v is not None)),
        flag_notices=tuple(args.flag_notices),
    )


def _environment(name: str, default: int) -> int:
    """torchrun's ``name`` (``distributed.env_int``), a wrong value refused in one line."""
    from megatron_patch.distributed import env_int

    try:
        return env_int(name, default)
    except ValueError as error:
        _refuse(str(error))


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    if args.checkpoint_info is not None:
        return ModelSpec(name=None, family=args.model_family, fields=(), loaded=args.checkpoint_info)
    return ModelSpec(name=args.model_name, family=args.model_family, fields=tuple(model_flag_values(args).items()))


def _check_layout(args: argparse.Namespace, spec: ModelSpec, world_size: int | None
                  ) -> tuple[ParallelConfig, int | None]:
    """The layout (``megatron_patch.layout.check_layout``) with everything the flags tell: the model of
    ``--load``'s record, ``--model-name`` or the shape flags (none for a Hugging Face model or a user script's own),
    the world (None: not known yet). Returns the ParallelConfig and the data-parallel size."""
    model = None
    if spec.described:
        try:
            model = spec.build(spec.family or "gpt")
        except ValueError as error:  # the ranks would refuse the same model when they build it
            _refuse(str(error))
    if args.num_layers_per_virtual_pipeline_stage is not None and model is None:
        _refuse("--num-layers-per-virtual-pipeline-stage needs the model's --num-layers")
    loaded = spec.loaded
    try:
        parallel = parallel_config_from_args(args, model.num_layers if model else 0)
        data_parallel_size = check_layout(
            world_size, tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
            sequence_parallel=parallel.sequence_parallel, micro_batch_size=args.micro_batch_size,
            global_batch_size=args.global_batch_size,
            num_layers=model and model.num_layers, num_attention_heads=model and model.num_attention_heads,
            num_query_groups=model and model.num_query_groups, ffn_hidden_size=model and model.ffn_hidden_size,
            seq_length=model and model.seq_length, padded_vocab_size=loaded and loaded.padded_vocab_size,
            num_moe_experts=model and model.num_moe_experts, moe_ffn_hidden_size=model and model.moe_ffn_hidden_size)
        parallel.check_backend(model)
    except ValueError as error:
        _refuse(str(error))
    return parallel, data_parallel_size


def check_launch_layout(args: argparse.Namespace, world_size: int | None) -> None:
    """The launcher's check, in its own process before any rank starts: the layout of parsed ``args`` on
    ``world_size`` processes (None: an elastic world, not known yet), a wrong one refused in one line.

    Example::

        check_launch_layout(parse_args(["--model-name", "gpt2-124m", "--tensor-model-parallel-size", "8"]), 8)
        # SystemExit: rapidformer: error: --num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8...
    """
    _check_layout(args, _model_spec(args), world_size)


def _derive_run(args: argparse.Namespace, world_size: int) -> RunConfig:
    """The typed run of validated ``args`` on ``world_size`` processes; also sets the values Megatron-LM's ``args``
    carry for user scripts (global batch, microbatches, data-parallel size, ranks, iterations of
    ``--train-samples``)."""
    spec = _model_spec(args)
    parallel, data_parallel_size = _check_layout(args, spec, world_size)
    step = args.micro_batch_size * data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = step
    if args.rampup_batch_size is not None:
        start, increment, _ = args.rampup_batch_size
        if start % step or increment % step:
            _refuse(f"--rampup-batch-size START {start} and INCR {increment} must be multiples of "
                    f"--micro-batch-size {args.micro_batch_size} x data-parallel size {data_parallel_size}")
    config = _run_config(args, spec, parallel, data_parallel_size, world_size, tokenizer_options(args))
    # Megatron-LM's args carry these; user scripts read them.
    args.num_microbatches = config.training.num_microbatches
    if args.load is None and args.pretrained_model_name_or_path is not None:
        # Rapidformer's Finetuner template loads its model with from_pretrained(args.load), and its launch command
        # gives only --pretrained-model-name-or-path: the user's view names that directory. The RunConfig (built
        # above) does not: config.checkpointing.load is the trainer checkpoint to resume from (trainers._compose),
        # and a Hugging Face directory is none (it has no tracker file, so --exit-on-missing-checkpoint would stop
        # the run there).
        args.load = args.pretrained_model_name_or_path
    args.train_iters = config.training.train_iters
    args.data_parallel_size, args.world_size = data_parallel_size, world_size
    args.rank = _environment("RANK", 0)
    args.local_rank = _environment("LOCAL_RANK", args.local_rank or 0)
    return config


# The launcher's parse in a rank process: (argv, (RunConfig, args)); see parse_run.
_HANDED_OVER: tuple[tuple[str, ...], tuple[RunConfig, argparse.Namespace]] | None = None


def parse_run(argv: list[str], world_size: int | None = None, *, hand_over: bool = False
              ) -> tuple[RunConfig, argparse.Namespace]:
    """``(RunConfig, args)`` of ``argv`` on ``world_size`` processes (default: torchrun's ``WORLD_SIZE``).

    Example::

        config, args = parse_run(sys.argv[1:])
        config.training.global_batch_size == args.global_batch_size    # True

    ``hand_over=True`` (the launcher's rank entry) keeps the result for the engine the task or user script
    creates with the same ``argv``, so a rank parses its flags once.
    """
    global _HANDED_OVER
    key = tuple(argv)
    if _HANDED_OVER is not None and _HANDED_OVER[0] == key and world_size is None:
        return _HANDED_OVER[1]
    args = parse_args(argv)
    parsed = (_derive_run(args, _environment("WORLD_SIZE", 1) if world_size is None else world_size), args)
    if hand_over:
        _HANDED_OVER = (key, parsed)
    return parsed
