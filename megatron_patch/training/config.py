"""The run's typed configuration: frozen values built once from the flags, passed to everything below the entry
point.

Example::

    config, args = parse_run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                              "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8"],
                             world_size=2)                  # training/arguments.py
    config.training.num_microbatches, config.data.seq_length      # (2, 32)
    config.model.build(family="gpt", vocab_size=1000).hidden_size  # 64

``training`` is the schedule, optimizer and step options; ``data``, ``checkpointing`` and ``logging`` the rest;
``model`` the model the flags (or ``--model-name``, or ``--load``'s record) describe and ``parallel`` its layout
(``megatron_patch.model``'s ``ModelConfig`` and ``ParallelConfig``). Each quantity has one home: the sequence length
is ``data.seq_length`` (the model's when the flags describe one), the data-parallel size and the microbatches per
step are ``training``'s, known from the world size before any process group starts. The ``args`` beside it
(``get_args()``) is the same run under Megatron-LM's names, for user scripts; our code reads the ``RunConfig``.
"""

from __future__ import annotations

import dataclasses

from megatron_patch.checkpoint.format import CheckpointInfo
from megatron_patch.model.config import ModelConfig, model_config_from_flags
from megatron_patch.model.parallel import ParallelConfig


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """How the run steps: batch, iterations, learning-rate schedule, optimizer, precision and step options."""

    micro_batch_size: int
    global_batch_size: int
    """At full size; ``--rampup-batch-size`` starts smaller (megatron-core's microbatch calculator)."""
    data_parallel_size: int
    num_microbatches: int
    """Microbatches per step at the full global batch: global / (micro x data-parallel size)."""
    train_iters: int | None
    """``--train-iters``, or the iterations ``--train-samples`` makes (ramp-up included, Megatron-LM's
    update_train_iters)."""
    train_samples: int | None
    epochs: int | None
    rampup_batch_size: tuple[int, int, int] | None
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_decay_iters: int | None
    lr_warmup_iters: int
    lr_warmup_fraction: float | None
    lr_decay_samples: int | None
    lr_warmup_samples: int
    decoupled_lr: float | None
    decoupled_min_lr: float | None
    weight_decay: float
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    seed: int
    fp16: bool
    bf16: bool
    loss_scale: float | None
    initial_loss_scale: float
    use_distributed_optimizer: bool
    memory_optimization: str | None
    """zero-1, zero-2, zero-3, fsdp or None (arguments.MEMORY_HELP says what each does)."""
    max_bad_steps: int
    distributed_timeout_minutes: float
    calculate_per_token_loss: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    grad_reduce_in_bf16: bool
    cross_entropy_loss_fusion: bool
    fp8_format: str | None
    fp8_amax_history_len: int
    fp8_amax_compute_algo: str
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool
    exit_duration_in_mins: int | None
    exit_signal_handler: bool
    empty_unused_memory_level: int
    profile: bool
    profile_step_start: int
    profile_step_end: int
    profile_ranks: tuple[int, ...]
    onnx_runtime_training: bool
    compile_backend: str

    @property
    def precision(self) -> str:
        """Megatron-LM's ``params_dtype`` name: bf16, fp16 or fp32."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the samples come from and how long they are."""

    data_path: tuple[str, ...] | None
    data_name: str | None
    seq_length: int | None
    split: str
    data_cache_path: str | None
    mock_data: bool
    mask_prob: float
    short_seq_prob: float
    mmap_bin_files: bool
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool
    num_workers: int


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """What is saved where, and how a run resumes."""

    save: str | None
    load: str | None
    save_interval: int | None
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    exit_on_missing_checkpoint: bool
    load_fallback: bool
    no_verify_checksums: bool
    keep_last_k: int | None
    async_save: bool


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    eval_interval: int | None
    eval_iters: int
    tensorboard_dir: str | None
    log_dir: str | None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The model the flags describe: ``--model-name`` and/or Megatron-LM's model flags, or ``--load``'s record.
    The family may come from the trainer (a BERT script given only shape flags builds a BERT) and the vocabulary
    from the tokenizer, so the ``ModelConfig`` is built when those are known (``build``).

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

    @property
    def described(self) -> bool:
        """Whether the flags give a whole model (a name, a ``--load`` record or the four shape flags)."""
        given = dict(self.fields)
        return (self.name is not None or self.loaded is not None
                or all(f in given for f in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run, as parsed and validated once per process (``arguments.parse_run``)."""

    task: str | None
    user_script: str | None
    pretrained_model_name_or_path: str | None
    world_size: int
    training: TrainingConfig
    data: DataConfig
    checkpointing: CheckpointConfig
    logging: LoggingConfig
    model: ModelSpec
    parallel: ParallelConfig
    tokenizer_type: str | None
    tokenizer_options: tuple[tuple[str, object], ...]
    """The files and options of ``--tokenizer-type`` (tokenizer.registry.tokenizer_options)."""
    flag_notices: tuple[str, ...]
    """One line per given flag that does nothing here (arguments.flag_notices), logged once by the engine."""

    @property
    def checkpoint_info(self) -> CheckpointInfo | None:
        return self.model.loaded


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
