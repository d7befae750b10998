"""The run's typed configuration: frozen values built once from the command line, passed to everything below the
entry point. Each field that a flag sets declares that flag (Megatron-LM's name), and ``rapidformer``'s parser is
generated from these declarations (``add_flags``); each section refuses its own contradictions when built.

Example::

    config, args = parse_run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8"],
                             world_size=2)                  # training/arguments.py
    config.training.num_microbatches, config.data.seq_length      # (2, 32)
    config.model.build(family="gpt", vocab_size=1000).hidden_size  # 64

``training`` is the schedule, optimizer and step options; ``data``, ``checkpointing`` and ``logging`` the rest;
``model`` the model the flags (or ``--model-name``, or ``--load``'s record) describe and ``parallel`` its layout and
precision (``megatron_patch.model``'s ``ModelConfig`` and ``ParallelConfig``). Each quantity has one home: the
sequence length is ``data.seq_length`` (the model's when the flags describe one), the precision is
``parallel.precision``, the data-parallel size and the microbatches per step are ``training``'s, known from the
world size before any process group starts. The ``args`` beside it (``get_args()``) is a read-only view of the same
run under Megatron-LM's names, for user scripts (``arguments.args_view``); our code reads the ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from typing import Literal

from megatron_patch.checkpoint.format import CheckpointInfo
from megatron_patch.flags import flag
from megatron_patch.model.config import (
    SWITCH_FLAGS, VALUE_FLAGS, ModelConfig, get_model_config, model_config_from_flags, switch_name,
)
from megatron_patch.model.parallel import ParallelConfig


def _refusals(checks) -> None:
    """Raise ValueError with the message of the first ``(wrong, message)`` pair whose ``wrong`` is true."""
    for wrong, message in checks:
        if wrong:
            raise ValueError(message)


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

@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """How the run steps: batch, iterations, learning-rate schedule, optimizer and step options."""

    micro_batch_size: int = flag(default=1, type=int)
    global_batch_size: int | None = flag(
        type=int, help="gradient accumulation: global / (micro x data-parallel size) microbatches per step")
    """At full size; ``--rampup-batch-size`` starts smaller (megatron-core's microbatch calculator)."""
    data_parallel_size: int | None = None
    """What the world size leaves; None when it is not known (the launcher's check of an elastic world), and then
    the global batch, the microbatches and ``--train-samples``'s iterations are not known either."""
    num_microbatches: int | None = None
    """Microbatches per step at the full global batch: global / (micro x data-parallel size)."""
    train_iters: int | None = flag(type=int)
    """``--train-iters``, or the iterations ``--train-samples`` makes (ramp-up included, Megatron-LM's
    update_train_iters)."""
    train_samples: int | None = flag(
        type=int, help="train on this many samples instead of --train-iters (iterations: samples / global batch, "
                       "with ramp-up counted as Megatron-LM's update_train_iters does)")
    epochs: int | None = flag(
        type=int, help="fine-tuning epochs; with --train-iters too, training stops at whichever comes first "
                       "(no-trainer scripts read both: epochs for their loop, train iters for the scheduler)")
    rampup_batch_size: tuple[int, int, int] | None = flag(
        type=int, nargs=3, metavar=("START", "INCR", "SAMPLES"),
        help="grow the global batch from START by INCR over SAMPLES samples up to --global-batch-size (megatron-core's "
             "num_microbatches_calculator); with --train-iters too, which Megatron-LM 0.16.1 refuses (logged)")
    lr: float = flag(default=1e-4, type=float)
    min_lr: float = flag(default=0.0, type=float)
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = flag(default="linear")
    lr_decay_iters: int | None = flag(type=int)
    lr_warmup_iters: int = flag(default=0, type=int)
    lr_warmup_fraction: float | None = flag(type=float)
    lr_warmup_init: float = flag(default=0.0, type=float, help="the learning rate the warmup starts from")
    lr_decay_samples: int | None = flag(
        type=int, help="with --train-samples: decay the learning rate over this many samples (default "
                       "--train-samples)")
    lr_warmup_samples: int = flag(default=0, type=int,
                                  help="with --train-samples: warm the learning rate up over this many samples")
    decoupled_lr: float | None = flag(
        type=float, help="megatron models: learning rate of the input embedding and output layer")
    decoupled_min_lr: float | None = flag(
        type=float, help="megatron models: minimum learning rate of the input embedding and output layer")
    override_opt_param_scheduler: bool = flag(
        "--override-opt_param-scheduler", "--override-opt-param-scheduler", default=False,
        help="on resume, take the learning-rate schedule (lr, min lr, warmup, decay iterations and style) from the "
             "flags, not from the checkpoint")
    use_checkpoint_opt_param_scheduler: bool = flag(
        "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler", default=False,
        help="on resume, keep the checkpoint's learning-rate schedule whatever the flags say; with neither flag a "
             "resume whose flags change the schedule is refused, as in Megatron-LM")
    optimizer: Literal["adam"] = flag(
        default="adam", help="Adam (AdamW-style decoupled weight decay, megatron-core's); no other is built here")
    weight_decay: float = flag(default=0.01, type=float)
    clip_grad: float = flag(default=1.0, type=float)
    adam_beta1: float = flag(default=0.9, type=float)
    adam_beta2: float = flag(default=0.999, type=float)
    adam_eps: float = flag(default=1e-8, type=float)
    seed: int = flag(default=1234, type=int)
    loss_scale: float | None = flag(type=float, help="static fp16 loss scale (default: dynamic)")
    initial_loss_scale: float = flag(default=2.0 ** 32, type=float)
    use_distributed_optimizer: bool = flag(default=False)
    memory_optimization: str | None = None
    """zero-1, zero-2, zero-3, fsdp or None (MEMORY_HELP says what each does)."""
    max_bad_steps: int = flag(
        default=3, type=int, metavar="N",
        help="bf16/fp32: stop after N consecutive steps with NaN/Inf gradients (each is skipped, not applied), "
             "keeping the last checkpoint; fp16 skips them and lowers the loss scale")
    distributed_timeout_minutes: float = flag(
        default=10.0, type=float, help="a collective waiting longer than this (a rank died or hangs) fails the job")
    calculate_per_token_loss: bool = flag(
        default=False, help="megatron models: divide the summed loss by the tokens of the whole global batch, not "
                            "each microbatch by its own tokens (megatron-core's calculate_per_token_loss)")
    overlap_grad_reduce: bool = flag(
        default=False, help="megatron models: reduce gradient buckets during the backward pass (megatron-core DDP)")
    overlap_param_gather: bool = flag(
        default=False, help="megatron models with the distributed optimizer: all-gather updated parameters during "
                            "the next forward pass (megatron-core DDP; needs --overlap-grad-reduce)")
    grad_reduce_in_bf16: bool = flag(default=False,
                                     help="--bf16: accumulate and reduce gradients in bf16 instead of fp32")
    cross_entropy_loss_fusion: bool = flag(
        default=False, help="megatron models: megatron-core's fused vocab-parallel cross-entropy (torch.compile'd; "
                            "the same loss)")
    fp8_format: Literal["e4m3", "hybrid"] | None = flag(
        help="fp8 matmuls through Transformer Engine (needs it and an fp8-capable GPU)")
    fp8_amax_history_len: int = flag(default=1, type=int)
    fp8_amax_compute_algo: Literal["most_recent", "max"] = flag(default="most_recent")
    fp8_param_gather: bool = flag(default=False,
                                  help="keep parameters in fp8 and all-gather them in fp8 (with --fp8-format)")
    manual_gc: bool = flag(
        default=False, help="turn Python's automatic garbage collector off and collect every --manual-gc-interval "
                            "iterations and around evaluations, at the same point on every rank")
    manual_gc_interval: int = flag(
        default=0, type=int, help="with --manual-gc: iterations between collections (0: only around evaluations)")
    manual_gc_eval: bool = flag("--no-manual-gc-eval", default=True, action="store_false",
                                help="with --manual-gc: no collection around evaluations")
    exit_interval: int | None = flag(
        type=int, help="stop after the first iteration divisible by this, saving under --save (if given)")
    exit_duration_in_mins: int | None = flag(
        type=int, help="after this many minutes since start-up, save under --save (if given) and exit")
    exit_signal_handler: bool = flag(
        default=False, help="on SIGTERM (preemption) finish the current iteration, save a checkpoint under --save "
                            "and exit with status 0")
    empty_unused_memory_level: Literal[0, 1, 2] = flag(
        default=0, type=int,
        help="GPUs: empty the CUDA caching allocator after each step's backward (1) and also after its optimizer "
             "step (2)")
    profile: bool = flag(default=False, help="GPUs: run CUDA's profiler (for nsys) from --profile-step-start to "
                                             "--profile-step-end")
    profile_step_start: int = flag(default=10, type=int)
    profile_step_end: int = flag(default=12, type=int)
    profile_ranks: tuple[int, ...] = flag(default=(0,), type=int, nargs="+", help="global ranks that profile")
    onnx_runtime_training: bool = flag(
        default=False, help="ONNX Runtime training is unmaintained upstream; this flag compiles the model's forward "
                            "with torch.compile (backend from --compile-backend) and says so in the log")
    compile_backend: str = flag(
        default="inductor", help="torch.compile backend used by --onnx-runtime-training (inductor, aot_eager, eager)")

    def __post_init__(self):
        # Megatron-LM's own refusals of its schedule and DDP flags (megatron/training/arguments.py, core_v0.16.1:
        # validate_args), each with the fix.
        samples = self.train_samples is not None
        _refusals([
            (self.lr_warmup_fraction is not None and self.lr_warmup_iters,
             "--lr-warmup-iters and --lr-warmup-fraction conflict; give one"),
            (self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler,
             "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler conflict; give one"),
            (self.exit_interval is not None and self.exit_interval < 1, "--exit-interval must be at least 1"),
            (self.max_bad_steps < 1, "--max-bad-steps must be at least 1"),
            (self.distributed_timeout_minutes <= 0, "--distributed-timeout-minutes must be positive"),
            (samples and self.train_iters is not None, "--train-samples and --train-iters conflict; give one"),
            (samples and self.lr_decay_iters is not None,
             "--lr-decay-iters counts iterations but --train-samples counts samples; give --lr-decay-samples"),
            (samples and self.lr_warmup_iters,
             "--lr-warmup-iters counts iterations but --train-samples counts samples; give --lr-warmup-samples"),
            (not samples and (self.lr_decay_samples is not None or self.lr_warmup_samples),
             "--lr-decay-samples/--lr-warmup-samples count samples: give --train-samples instead of --train-iters"),
            (self.lr_warmup_fraction is not None and self.lr_warmup_samples,
             "--lr-warmup-samples and --lr-warmup-fraction conflict; give one"),
            (self._rampup_wrong() is not None, self._rampup_wrong()),
            (self.decoupled_min_lr is not None and self.decoupled_lr is None,
             "--decoupled-min-lr needs --decoupled-lr"),
            (self.overlap_param_gather and not self.use_distributed_optimizer,
             "--overlap-param-gather needs the distributed optimizer: add --use-distributed-optimizer"),
            (self.overlap_param_gather and not self.overlap_grad_reduce,
             "--overlap-param-gather needs --overlap-grad-reduce"),
            (self.manual_gc_interval < 0, "--manual-gc-interval must be at least 0"),
            (self.profile and self.profile_step_end <= self.profile_step_start,
             "--profile-step-end must be after --profile-step-start"),
        ])
        if self.data_parallel_size is not None:
            self._derive_batches()

    def _derive_batches(self) -> None:
        """The global batch (default: one microbatch per data-parallel rank), the microbatches per step and the
        iterations of ``--train-samples``, once the data-parallel size is known (set on this frozen instance as it
        is built, as Megatron-LM's validate_args and update_train_iters set them on its args)."""
        step = self.micro_batch_size * self.data_parallel_size
        global_batch = self.global_batch_size or step
        if self.rampup_batch_size is not None:
            start, increment, _ = self.rampup_batch_size
            _refusals([(start % step or increment % step,
                        f"--rampup-batch-size START {start} and INCR {increment} must be multiples of "
                        f"--micro-batch-size {self.micro_batch_size} x data-parallel size {self.data_parallel_size}")])
        iterations = self.train_iters
        if self.train_samples is not None:
            ramp = rampup_batch_sizes(global_batch, self.micro_batch_size, self.data_parallel_size,
                                      self.rampup_batch_size, self.train_samples)
            # The constant phase drops a partial last batch, as Megatron-LM does.
            iterations = len(ramp) + max(0, self.train_samples - sum(ramp)) // global_batch
        for name, value in (("global_batch_size", global_batch), ("num_microbatches", global_batch // step),
                            ("train_iters", iterations)):
            object.__setattr__(self, name, value)

    def _rampup_wrong(self) -> str | None:
        """What is wrong with ``--rampup-batch-size`` (None when nothing is), as megatron-core's calculator checks."""
        if self.rampup_batch_size is None:
            return None
        start, increment, samples = self.rampup_batch_size
        if start < 1 or increment < 1 or samples < 0:
            return "--rampup-batch-size START INCR SAMPLES needs START and INCR at least 1 and SAMPLES at least 0"
        if self.global_batch_size is None or start > self.global_batch_size:
            return "--rampup-batch-size START must not exceed --global-batch-size (the batch it ramps up to)"
        if (self.global_batch_size - start) % increment:
            return (f"--rampup-batch-size: --global-batch-size {self.global_batch_size} minus START {start} is not a "
                    f"multiple of INCR {increment}")
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the samples come from and how long they are."""

    data_path: tuple[str, ...] | None = flag(
        nargs="*", help="mmap prefixes (optionally weighted), or a directory for sequence classification")
    data_name: str | None = flag(help="dataset name under --data-path (e.g. mrpc for DIR/mrpc/train.tsv)")
    dataset_path: str | None = flag(help="old Rapidformer name read by user scripts (default: the first "
                                         "--data-path)")
    dataset_name: str | None = flag(help="old Rapidformer name read by user scripts (default: --data-name)")
    seq_length: int | None = None
    """``--seq-length``, or the model's (``--model-name``'s, ``--load``'s)."""
    data_impl: Literal["mmap"] = flag(default="mmap",
                                      help="megatron-core's indexed datasets are memory-mapped; only mmap exists")
    split: str = flag(default="969,30,1")
    data_cache_path: str | None = flag()
    mock_data: bool = flag(default=False)
    mask_prob: float = flag(default=0.15, type=float)
    short_seq_prob: float = flag(default=0.1, type=float)
    mmap_warmup: bool = flag(default=False)
    mmap_bin_files: bool = flag(
        "--no-mmap-bin-files", default=True, action="store_false",
        help="read the .bin files of --data-path with file reads instead of memory-mapping them")
    create_attention_mask_in_dataloader: bool = flag(
        "--no-create-attention-mask-in-dataloader", default=True, action="store_false",
        help="accepted: the GPT datasets here never build attention masks (the attention is causal)")
    reset_position_ids: bool = flag(default=False)
    reset_attention_mask: bool = flag(default=False)
    eod_mask_loss: bool = flag(default=False)
    num_workers: int = flag(default=0, type=int)
    dataloader_type: str = flag(default="single", help="single: samples in order, a resume continuing at the "
                                                       "consumed sample (Megatron-LM's default; the only one here)")
    sft: bool = flag(default=False, help="supervised fine-tuning on conversations (examples/gpt/finetune_gpt.py): "
                                         "--data-path names prefixes written by `megatron-patch preprocess-data "
                                         "--sft` or .jsonl files (prepared into --data-cache-path before any rank "
                                         "starts); the loss is per trained token over the global batch")
    train_data_path: tuple[str, ...] | None = flag(
        nargs="*", help="with --sft: the training conversations (prefixes or .jsonl), all of them, instead of "
                        "--data-path's --split share")
    valid_data_path: tuple[str, ...] | None = flag(
        nargs="*", help="with --sft: the dev conversations (prefixes or .jsonl) evaluated after each epoch and "
                        "every --eval-interval iterations")
    sft_packing: bool = flag(
        "--no-sft-packing", default=True, action="store_false",
        help="one conversation per --seq-length sample, padded; by default conversations are packed into "
             "--seq-length sequences (best-fit decreasing), each attending to itself only, positions from 0")
    sft_overlong: Literal["truncate", "skip"] | None = flag(
        help="a conversation longer than --seq-length is cut to it (truncate) or left out (skip), and counted in "
             "the log; without the flag such a conversation stops the run before it starts")
    sft_loss: Literal["assistant", "last-turn", "all"] = flag(
        default="assistant", help="the tokens a .jsonl given with --sft trains on: every assistant turn, the last "
                                  "one, or every token (preprocess-data --sft-loss)")
    chat_template: str | None = flag(
        metavar="FILE", help="a jinja chat template rendering the .jsonl conversations given with --sft, instead of "
                             "the tokenizer's own (preprocess-data --chat-template)")
    dpo: bool = flag(default=False, help="preference tuning, DPO (examples/gpt/dpo_gpt.py): --data-path names "
                                         "prefixes written by `megatron-patch preprocess-data --dpo`; the "
                                         "reference model's log-probabilities come from one pass before training")
    dpo_beta: float = flag(default=0.1, type=float, help="DPO's beta, the weight of the log-probability ratios "
                                                         "against the reference (TRL's beta)")
    dpo_loss_type: Literal["sigmoid", "ipo"] = flag(
        default="sigmoid", help="sigmoid: -log sigmoid(beta * margin) (DPO); ipo: (margin per token - 1/(2 beta))^2")
    dpo_sft_loss_weight: float = flag(
        default=0.0, type=float, help="adds this weight times the chosen answer's negative log-likelihood per token "
                                      "to each pair's loss (NeMo-RL's sft_loss_weight, averaged per token; TRL's "
                                      "'sft' loss type); 0: none")
    dpo_overlong: Literal["skip"] | None = flag(
        help="a preference pair whose two sequences do not fit --seq-length is left out, and "
             "counted in the log; without the flag such a pair stops the run before it starts")

    def __post_init__(self):
        # Megatron-LM's cyclic loader reshuffles every epoch and its external one leaves batching to the user script;
        # neither is built here.
        _refusals([(self.dataloader_type != "single",
                    f"--dataloader-type {self.dataloader_type}: samples come here in Megatron-LM's 'single' order "
                    "(megatron-core's datasets are shuffled already, and a resume continues at the consumed sample); "
                    "drop the flag or give single"),
                   ((self.train_data_path or self.valid_data_path) and not (self.sft or self.dpo),
                    "--train-data-path/--valid-data-path name supervised fine-tuning data here: add --sft (pretraining "
                    "takes --data-path with --split)"),
                   ((self.sft or self.dpo) and self.train_data_path and self.data_path,
                    f"{'--dpo' if self.dpo else '--sft'}: give either --data-path (split by --split) or "
                    "--train-data-path/--valid-data-path, not both"),
                   (self.sft and self.dpo, "--sft and --dpo train on different data: give one of them"),
                   (self.dpo_beta <= 0, f"--dpo-beta {self.dpo_beta}: give a positive beta (TRL's default is 0.1)"),
                   (self.dpo_sft_loss_weight < 0,
                    f"--dpo-sft-loss-weight {self.dpo_sft_loss_weight}: give 0 (no SFT term) or a positive weight")])


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """What is saved where, and how a run resumes."""

    save: str | None = flag()
    load: str | None = flag()
    save_interval: int | None = flag(type=int)
    no_load_optim: bool = flag(default=False)
    no_load_rng: bool = flag(default=False)
    finetune: bool = flag(default=False, help="load model weights only and start at iteration 0")
    exit_on_missing_checkpoint: bool = flag(default=False)
    load_fallback: bool = flag(
        default=False, help="when --load's latest checkpoint has a missing, truncated or damaged file, load the "
                            "newest intact earlier iter_* instead of stopping")
    no_verify_checksums: bool = flag(
        default=False, help="load without comparing each file's CRC-32 with the checksums.json its save wrote "
                            "(missing and truncated files are still refused)")
    keep_last_k: int | None = flag(type=int, metavar="K",
                                   help="after each save keep only the newest K iter_* checkpoints under --save")
    async_save: bool = flag(
        default=False, help="write megatron-core checkpoints in a background thread while training goes on; a save "
                            "becomes the latest only once every rank's files are complete")
    dist_ckpt_optim_fully_reshardable: bool = flag(
        default=False, help="save the distributed optimizer's state gathered per parameter, loadable at another "
                            "TP/PP (slower to save); by default it is saved as Megatron-LM does, in its buckets, "
                            "loadable at the saved TP/PP and any DP")
    ckpt_fully_parallel_load: bool = flag(
        default=False, help="the data-parallel replicas share the reading of the weights they all hold, each "
                            "reading a part and sending it to the others")
    ckpt_format: Literal["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"] = flag(
        default="torch_dist",
        help="megatron models are saved in torch_dist (megatron-core dist_checkpointing, loadable at any TP/PP); "
             "the other formats are refused")

    def __post_init__(self):
        _refusals([
            (self.finetune and self.load is None, "--finetune needs --load DIR"),
            (self.save_interval is not None and self.save is None, "--save-interval needs --save DIR"),
            (self.keep_last_k is not None and self.save is None, "--keep-last-k needs --save DIR"),
            (self.keep_last_k is not None and self.keep_last_k < 1, "--keep-last-k must be at least 1"),
            (self.load_fallback and self.load is None, "--load-fallback needs --load DIR"),
            (self.async_save and self.save is None, "--async-save needs --save DIR"),
            (self.ckpt_format != "torch_dist",
             f"--ckpt-format {self.ckpt_format}: megatron models are saved here in torch_dist (megatron-core "
             "dist_checkpointing, which loads at any TP/PP); give --ckpt-format torch_dist or drop the flag"),
        ])


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Parameter-efficient fine-tuning: LoRA adapters on the attention and MLP linears, the base frozen
    (``model/lora.py``), Megatron-Bridge's and PEFT's flag names.

    Example::

        --load llama-mcore --finetune --lora-rank 8 --lora-alpha 16 --lora-target-modules q_proj,k_proj,v_proj
    """

    lora_rank: int | None = flag(type=int, metavar="R",
                                 help="fine-tune LoRA adapters of rank R, the base weights frozen (with --load BASE "
                                      "--finetune); the optimizer and the checkpoints hold the adapters only")
    lora_alpha: float | None = flag(type=float, metavar="A", help="LoRA scaling alpha / rank (default: 2 x rank)")
    lora_dropout: float = flag(default=0.0, type=float, metavar="P", help="dropout on the adapters' input")
    lora_target_modules: str | None = flag(
        metavar="NAMES",
        help="comma-separated layers to adapt: PEFT's q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj or "
             "megatron-core's linear_qkv,linear_proj,linear_fc1,linear_fc2 (q/k/v and gate/up are fused layers, "
             "given together); default every attention and dense MLP linear the model has")

    def __post_init__(self):
        _refusals([
            (self.lora_rank is not None and self.lora_rank < 1, "--lora-rank must be at least 1"),
            (self.lora_rank is None and self.lora_alpha is not None, "--lora-alpha needs --lora-rank R"),
            (not 0.0 <= self.lora_dropout < 1.0, "--lora-dropout must be in [0, 1)"),
        ])
        if self.lora_target_modules is None:
            return
        # Here, not above: model/lora.py imports torch, which --help and a run without adapters need not.
        from megatron_patch.errors import UserError
        from megatron_patch.model.lora import resolve_targets

        try:
            resolve_targets(self.lora_target_modules.split(","))
        except UserError as error:
            raise ValueError(str(error)) from None

    @property
    def settings(self):
        """``model.lora.LoraSettings`` of the run; None without ``--lora-rank``."""
        from megatron_patch.model.lora import LoraSettings, resolve_targets

        if self.lora_rank is None:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank
        if self.lora_target_modules is None:
            return LoraSettings(rank=self.lora_rank, alpha=alpha, dropout=self.lora_dropout)
        named = tuple(self.lora_target_modules.split(","))
        return LoraSettings(rank=self.lora_rank, alpha=alpha, dropout=self.lora_dropout,
                            targets=resolve_targets(named), named=named)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    log_interval: int = flag(default=10, type=int)
    eval_interval: int | None = flag(type=int)
    eval_iters: int = flag(default=10, type=int)
    tensorboard_dir: str | None = flag()
    log_dir: str | None = flag(help="where the loss-curve PNG goes (default: --tensorboard-dir, else --save)")
    log_throughput: bool = flag(default=False, help="accepted; throughput is always logged")
    wandb_project: str | None = flag(help="log the tensorboard scalars to this Weights & Biases project too (from "
                                          "the last rank, as Megatron-LM)")
    wandb_exp_name: str | None = flag(help="the W&B run's name")
    wandb_save_dir: str | None = flag(help="the W&B run's local directory (default: --save's wandb/)")
    wandb_entity: str | None = flag(help="the W&B entity (team) the project belongs to")

    def __post_init__(self):
        _refusals([(self.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None,
                    "--tensorboard-dir needs the tensorboard package (pip install tensorboard)"),
                   (self.wandb_project is not None and importlib.util.find_spec("wandb") is None,
                    "--wandb-project needs the wandb package (pip install wandb)"),
                   # Megatron-LM's _set_wandb_writer refuses an empty name too.
                   (self.wandb_project is not None and self.wandb_exp_name == "",
                    "--wandb-exp-name is empty; give the W&B run a name or drop the flag")])


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model the flags describe: ``--model-name`` and/or Megatron-LM's model flags, or ``--load``'s record.
    The family may come from the trainer (a BERT script given only shape flags builds a BERT) and the vocabulary
    from the tokenizer, so the ``ModelConfig`` is built when those are known (``build``, ``model_and_vocab``).

    Example::

        ModelSpec(name="tiny-llama", family=None, fields=(("num_layers", 4),)).build("gpt", 128).num_layers   # 4
    """

    name: str | None
    family: str | None
    fields: tuple[tuple[str, object], ...]
    """ModelConfig fields the flags set, switches included, in flag order."""
    loaded: CheckpointInfo | None = None
    """``--load``'s record of the model (its training-time fields replaced by the flags')."""

    def build(self, family: str, vocab_size: int | None = None) -> ModelConfig:
        """The ModelConfig for a trainer of ``family``, with the tokenizer's ``vocab_size``; ``--load``'s model
        as recorded. Megatron-LM's BERT has the next-sentence head and two segment types unless
        ``--bert-no-binary-head`` (pretrain_bert.py: num_tokentypes = 2 if args.bert_binary_head else 0)."""
        if self.loaded is not None:
            return self.loaded.model_config
        fields = dict(self.fields)
        family = self.family or family
        if family == "bert" and self.name is None:
            binary = fields.get("add_binary_head", True)
            fields.update(add_binary_head=binary, num_tokentypes=2 if binary else 0)
        return model_config_from_flags(fields, name=self.name, family=family, vocab_size=vocab_size)

    def model_and_vocab(self, family: str, vocab_size: int | None, tensor_model_parallel_size: int
                        ) -> tuple[ModelConfig, int]:
        """The model a run builds and its padded vocabulary: the one function the trainers and the dry-run plan
        resolve it with. ``--load``'s description keeps its stored vocabulary (a conversion pads for TP=1, so
        recomputing it may not match); otherwise the flags' model with the tokenizer's ``vocab_size`` (or the
        named configuration's), padded as Megatron-LM pads it for ``tensor_model_parallel_size``.

        Example::

            ModelSpec("gpt2-124m", None, ()).model_and_vocab("gpt", None, 1)[1]       # 50304
        """
        from megatron_patch.tokenizer.registry import padded_vocab_size

        if self.loaded is not None:
            return self.loaded.model_config, self.loaded.padded_vocab_size
        model = self.build(family, vocab_size)
        if model.vocab_size is None:
            raise ValueError("the vocabulary size is unknown: give --tokenizer-type and its files, or a --model-name "
                             "that has one")
        return model, padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by,
                                        tensor_model_parallel_size)

    def value(self, field: str):
        """The model flag ``field``'s value in this run: given, else ``--load``'s record's, else the named
        configuration's (what Megatron-LM's ``args.num_layers`` etc. hold after --use-checkpoint-args)."""
        given = dict(self.fields)
        if field in given:
            return given[field]
        if self.loaded is not None:
            return getattr(self.loaded.model_config, field)
        return getattr(get_model_config(self.name), field) if self.name is not None else None

    @property
    def described(self) -> bool:
        """Whether the flags give a whole model (a name, a ``--load`` record or the four shape flags)."""
        given = dict(self.fields)
        return (self.name is not None or self.loaded is not None
                or all(f in given for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run, as parsed and validated once per process (``arguments.parse_run``): Rapidformer's own flags
    here, the rest in the sections."""

    task: Literal["pretraining", "sequence_classification"] | None = flag(
        help="black-box task: the model and data come from flags, no user code")
    user_script: str | None = flag(help="white-box: a Python file run on every rank")
    pretrained_model_name_or_path: str | None = flag(
        help="a local Hugging Face model directory (config.json, weights, tokenizer files)")
    nproc_per_node: int | None = flag(
        type=int, help="launcher: processes per node (default: one per visible GPU, or 1 on CPU)")
    local_rank: int | None = flag("--local-rank", "--local_rank", type=int,
                                  help="accepted for old launchers; LOCAL_RANK from the environment wins")
    use_mcore_models: bool = flag(
        default=False, help="deprecated in Megatron-LM 0.16 (megatron-core models are its default); every megatron "
                            "model here is one")
    tiktoken_pattern: str | None = flag(
        help="Megatron-LM's TikTokenizer pattern; no --tokenizer-type here reads it (logged)")
    world_size: int | None = None
    """None when not known yet (the launcher's check of an elastic world)."""
    rank: int = 0
    training: TrainingConfig
    data: DataConfig
    checkpointing: CheckpointConfig
    logging: LoggingConfig
    lora: LoraConfig = LoraConfig()
    model: ModelSpec
    parallel: ParallelConfig
    tokenizer_type: str | None
    tokenizer_options: tuple[tuple[str, object], ...]
    """The files and options of ``--tokenizer-type`` (tokenizer.registry.tokenizer_options)."""
    flag_notices: tuple[str, ...] = ()
    """One line per given flag that does nothing here (ignored_flags.flag_notices), logged once by the engine."""

    def __post_init__(self):
        _refusals([(self.data.dpo and self.training.micro_batch_size != 1,
                    f"--dpo places each preference pair's two sequences in one --seq-length sample, attending to "
                    f"themselves only: give --micro-batch-size 1 (not {self.training.micro_batch_size})"),
                   (self.data.dpo and self.parallel.context_parallel_size > 1,
                    "--dpo with --context-parallel-size > 1 is not built here: give 1"),
                   (self.data.dpo and self.model.value("mtp_num_layers"),
                    "--dpo with --mtp-num-layers is not built here: drop it"),
                   (self.data.sft and self.data.sft_packing and self.training.micro_batch_size != 1,
                    f"--sft packs conversations into one --seq-length sequence per microbatch: give --micro-batch-size "
                    f"1 (not {self.training.micro_batch_size}) and a longer --seq-length, or --no-sft-packing"),
                   (self.data.sft and self.data.sft_packing and self.parallel.context_parallel_size > 1,
                    "--sft packing with --context-parallel-size > 1 is not built here (each packed conversation would "
                    "have to split evenly over the context-parallel ranks): give --no-sft-packing"),
                   (self.data.sft and self.data.sft_packing and self.model.value("mtp_num_layers"),
                    "--sft packing with --mtp-num-layers is not built here (multi-token prediction would look across "
                    "the packed conversations): give --no-sft-packing"),
                   (self.lora.lora_rank is not None and self.checkpointing.load is None,
                    "--lora-rank trains adapters on a base model: give --load BASE --finetune"),
                   (self.training.exit_signal_handler and self.checkpointing.save is None,
                    "--exit-signal-handler saves on SIGTERM: give --save DIR"),
                   (self.logging.wandb_project is not None and self.logging.wandb_save_dir is None
                    and self.checkpointing.save is None,
                    "--wandb-project writes its run under --wandb-save-dir DIR (default: --save's wandb/): give one")])

    @property
    def checkpoint_info(self) -> CheckpointInfo | None:
        return self.model.loaded

    @property
    def precision(self) -> str:
        """bf16, fp16 or fp32 (``parallel.precision``, where the model builder reads it too)."""
        return self.parallel.precision


class ArgsView(types.SimpleNamespace):
    """Megatron-LM's ``args`` of one run (``get_args()``): the RunConfig under Megatron-LM's names, read-only, so
    that what a user script reads is what the run does. ``"lr" in args`` and ``vars(args)`` work as on argparse's
    Namespace."""

    def __contains__(self, name: str) -> bool:
        return name in self.__dict__

    def __setattr__(self, name, value=None):
        raise AttributeError(f"args.{name}: get_args() is a read-only view of the run's configuration; give "
                             f"--{name.replace('_', '-')} on the command line instead")

    def __delattr__(self, name):
        self.__setattr__(name)


def args_view(config: RunConfig) -> ArgsView:
    """Megatron-LM's ``args`` made from ``config``: every flag's destination with the value the run uses (the
    model's from ``--load`` or ``--model-name`` when not given, settings this machine turns off as off), and the
    values Megatron-LM derives (``num_microbatches``, ``data_parallel_size``, ``params_dtype``, ...).

    Example::

        args = args_view(parse_run(["--model-name", "tiny-llama", "--bf16"], 1)[0])
        args.num_layers, args.params_dtype, args.swiglu                       # (4, 'bf16', True)
    """
    sections = (config, config.training, config.data, config.checkpointing, config.logging, config.lora,
                config.parallel)
    values = {f.name: getattr(section, f.name) for section in sections for f in dataclasses.fields(section)
              if not dataclasses.is_dataclass(getattr(section, f.name)) and f.name != "tokenizer_options"}
    spec, parallel, memory = config.model, config.parallel, config.training.memory_optimization
    values.update({field: spec.value(field) for _, field, _ in VALUE_FLAGS})
    values.update({switch_name(flag): spec.value(field) == value for flag, field, value in SWITCH_FLAGS})
    values.update({key: None for key in ("vocab_file", "merge_file", "tokenizer_model", "vocab_size",
                                         "vocab_extra_ids")}, **dict(config.tokenizer_options))
    values.update({dest: memory == mode for dest, mode in MEMORY_FLAGS.items()})
    values.update(
        model_name=spec.name, model_family=spec.family, checkpoint_info=spec.loaded,
        group_query_attention=spec.value("num_query_groups") not in (None, spec.value("num_attention_heads")),
        fp16=config.precision == "fp16", bf16=config.precision == "bf16", params_dtype=config.precision,
        mixed_precision=config.precision != "fp32", checkpoint_activations=parallel.recompute_granularity == "full",
        # Resolved into virtual_pipeline_model_parallel_size, as parallel_config_from_args(get_args()) reads it.
        num_layers_per_virtual_pipeline_stage=None,
        # Rapidformer's Finetuner template loads from_pretrained(args.load) and its launch command gives only
        # --pretrained-model-name-or-path. config.checkpointing.load stays the trainer checkpoint to resume from: a
        # Hugging Face directory is none (no tracker file, so --exit-on-missing-checkpoint would stop the run).
        load=config.checkpointing.load or config.pretrained_model_name_or_path,
        flag_notices=list(config.flag_notices))
    view = ArgsView()
    view.__dict__.update({name: list(v) if isinstance(v, tuple) else v for name, v in values.items()})
    return view


def rampup_batch_sizes(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                       rampup: tuple[int, int, int] | None, limit: float) -> list[int]:
    """Global batch sizes of the iterations that start within the ramp-up (at most ``limit`` samples consumed);
    every later iteration takes the full global batch. megatron-core's own calculator says each size.

    Example::

        >>> rampup_batch_sizes(16, 2, 2, (4, 4, 48), float("inf"))
        [4, 4, 4, 4, 8, 8, 12, 12]
    """
    from megatron_patch.compat import rampup_calculator

    if rampup is None:
        return []
    samples = rampup[2]
    # rank -1: the calculator logs each change on rank 0 only, and these are not the run's changes.
    calculator = rampup_calculator(global_batch_size, micro_batch_size, data_parallel_size, rampup, rank=-1)
    sizes, consumed = [], 0
    while consumed <= min(samples, limit):
        calculator.update(consumed, consistency_check=False)
        sizes.append(calculator.get_current_global_batch_size())
        consumed += sizes[-1]
    return sizes
