"""One argument definition for the engine, the trainers and the ``rapidformer`` CLI: Megatron-LM's names plus the
Rapidformer flags, parsed into typed values and validated once.

Example::

    args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                       "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                       "--mixed-precision", "--zero-1-memory-optimization"])
    args.fp16, args.memory_optimization        # (True, 'zero-1')

Unknown flags are refused with their names (``allow_abbrev`` is off, so a typo never silently matches a longer
flag), and every conflict names both flags and the fix. ``--load DIR`` with ``DIR/megatron_patch_args.json`` (a
conversion's or our trainer's) supplies the model flags not given, as Megatron-LM's ``--use-checkpoint-args``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os

from megatron_patch.convert.mcore_io import ARGS_FILE, read_info
# The flag tables themselves: which model flags exist and which ModelConfig field each one sets.
from megatron_patch.model.config import _SWITCH_FLAGS, _VALUE_FLAGS, add_model_arguments, get_model_config
from megatron_patch.model.parallel import add_parallel_arguments
from megatron_patch.tokenizer.registry import add_tokenizer_args

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
                      help="write megatron-core checkpoints in a background process while training goes on; "
                           "a save becomes the latest only once every rank's files are complete")

    log = parser.add_argument_group("logging")
    log.add_argument("--log-interval", type=int, default=10)
    log.add_argument("--eval-interval", type=int, default=None)
    log.add_argument("--eval-iters", type=int, default=10)
    log.add_argument("--tensorboard-dir", default=None)
    log.add_argument("--log-dir", default=None,
                     help="where the loss-curve PNG goes (default: --tensorboard-dir, else --save)")
    log.add_argument("--log-throughput", action="store_true", help="accepted; throughput is always logged")
    return parser


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
    (lambda a: a.micro_batch_size < 1, "--micro-batch-size must be at least 1"),
    (lambda a: a.global_batch_size is not None and a.global_batch_size % a.micro_batch_size,
     "--global-batch-size must be a multiple of --micro-batch-size"),
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


# Fields a flag may change on a stored model: they shape the training run, not the weights.
_TRAINING_FIELDS = {"seq_length", "hidden_dropout", "attention_dropout", "init_method_std"}


def _apply_checkpoint_args(args: argparse.Namespace) -> None:
    """Set ``args.checkpoint_info`` from ``--load``'s ``megatron_patch_args.json`` (None without one) and fill the
    model flags not given from it; a given flag that contradicts the stored model is refused.

    Example::

        args = parse_args(["--load", "llama-mcore", "--seq-length", "16"])   # a converted checkpoint
        args.hidden_size, args.checkpoint_info.padded_vocab_size             # (32, 128): from the file
    """
    path = os.path.join(args.load, ARGS_FILE) if args.load else None
    if path is None or not os.path.isfile(path):
        args.checkpoint_info = None
        return
    info = read_info(args.load)
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
    if info.padded_vocab_size % args.tensor_model_parallel_size:
        _refuse(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} does not divide the padded "
                f"vocabulary {info.padded_vocab_size} in {path}")
    args.checkpoint_info = dataclasses.replace(info, model_config=dataclasses.replace(stored, **training))


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Derive the typed values the rest of the code uses and refuse conflicts, once."""
    args.memory_optimization = _memory_mode(args)
    if args.mixed_precision and not args.bf16:
        args.fp16 = True
    for wrong, message in _CHECKS:
        if wrong(args):
            _refuse(message)
    if args.memory_optimization in ("zero-1", "zero-2"):
        args.use_distributed_optimizer = True
    args.dataset_path = args.dataset_path or (args.data_path[0] if args.data_path else None)
    args.dataset_name = args.dataset_name or args.data_name
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
        from megatron_patch.data.datasets import parse_data_path

        try:
            parse_data_path(args.data_path)
        except ValueError as error:
            _refuse(str(error))
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
