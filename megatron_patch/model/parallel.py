"""How a model is split and what it keeps in memory: TP, PP, virtual PP, SP, CP, recompute and precision.

Example::

    torchrun --nproc-per-node 4 pretrain.py --model-name tiny-llama --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --sequence-parallel --recompute-granularity selective

    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    parallel.validate(model_config, world_size=4)    # ValueError naming the flags, before anything is built

Every combination megatron-core would reject deep inside model construction (or, worse, accept and compute
wrongly) is refused here with a message that names the flags to change: the arithmetic of the layout by
``megatron_patch.layout.check_layout`` (which the launcher also runs before any rank starts), the rest (Transformer
Engine for context parallelism, precision, recompute) by ``validate`` itself.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Literal

from megatron_patch import compat
from megatron_patch.flags import add_flags, flag, from_flags
from megatron_patch.layout import check_layout
from megatron_patch.model.config import ModelConfig

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class ParallelConfig:
    """Parallel layout and memory options of one run (data-parallel size is what the world size leaves).

    Example::

        >>> ParallelConfig(recompute_granularity="full").recompute_method
        'uniform'
    """

    tensor_model_parallel_size: int = flag(default=1, type=int)
    pipeline_model_parallel_size: int = flag(default=1, type=int)
    virtual_pipeline_model_parallel_size: int | None = flag(type=int)
    """Model chunks per pipeline rank (interleaved 1F1B); None or 1 means no interleaving."""
    sequence_parallel: bool = flag(default=False)
    """Split norm/dropout activations along the sequence over the TP group (needs TP > 1)."""
    context_parallel_size: int = flag(default=1, type=int)
    expert_model_parallel_size: int = flag(default=1, type=int)
    """Ranks the experts of a MoE layer are split over (EP); the expert layers' data-parallel size is what
    world / (expert_tensor_parallel_size x EP x PP) leaves."""
    expert_tensor_parallel_size: int | None = flag(
        type=int, help="tensor parallelism inside each expert (default: --tensor-model-parallel-size)")
    """Tensor parallelism inside each expert (ETP); None means the same as tensor_model_parallel_size."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = flag(default="allgather")
    """How tokens reach the experts of other EP ranks (megatron-core's dispatchers; Megatron-LM's default).
    "allgather" gathers every token to every EP rank and works at any layout on gloo; "alltoall" sends each rank
    only its experts' tokens (less traffic at large EP) and on gloo needs expert TP 1; "flex" needs DeepEP on GPUs."""
    moe_grouped_gemm: bool = flag(default=False,
                                  help="one grouped GEMM over a rank's experts (needs Transformer Engine)")
    """One grouped GEMM for a rank's experts (Transformer Engine's TEGroupedMLP) instead of a loop over them."""
    recompute_granularity: Literal["full", "selective"] | None = flag()
    """"full" recomputes whole layers, "selective" only core attention (Korthikanti et al. 2022,
    https://arxiv.org/abs/2205.05198)."""
    recompute_method: Literal["uniform", "block"] | None = flag()
    """With full recompute: "uniform" checkpoints groups of recompute_num_layers layers, "block" the first
    recompute_num_layers layers of each stage. Defaults to "uniform" when full recompute is on."""
    recompute_num_layers: int | None = flag(type=int)
    """Defaults to 1 with full recompute (every layer is checkpointed)."""
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """The parameters' dtype, Megatron-LM's ``params_dtype`` name (``--bf16``, ``--fp16``, ``--mixed-precision``):
    the one field every part of a run reads its precision from."""
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = flag(
        default="auto",
        help="Transformer Engine's attention kernel (megatron-core's attention_backend); without Transformer Engine "
             "megatron-core's local attention (torch SDPA) runs")
    """Transformer Engine's attention kernel (megatron-core's ``attention_backend``); without Transformer Engine the
    local spec's SDPA attention runs whatever this says (the trainers log that as ignored)."""
    transformer_impl: Literal["transformer_engine", "local"] = flag(
        default="transformer_engine", unset=None,
        help="Megatron-LM's: transformer_engine (the default) uses Transformer Engine's layers where it is installed, "
             "megatron-core's local layers where not; local uses the local ones everywhere. Checkpoints of either "
             "load into the other")
    """Megatron-LM's ``--transformer-impl``: Transformer Engine's layers where TE imports (megatron-core's local
    ones where it does not), or the local ones everywhere. Checkpoints of either load into the other."""
    fused_kernels: bool = flag(default=False, help="torch.compile'd bias-activation and bias-dropout-add fusions (see "
                                                   "ParallelConfig)")
    """megatron-core's torch.compile'd bias-activation (SwiGLU, tanh-GeLU) and bias-dropout-add fusions. Off by
    default: the first call compiles for seconds, which only pays off on long runs."""

    @property
    def use_transformer_engine(self) -> bool:
        """Whether the layers are Transformer Engine's: asked for (the default) and installed."""
        return transformer_engine_missing(self.transformer_impl) is None

    def _needs_transformer_engine(self, need: str, fix: str) -> str:
        return f"{need}, but {transformer_engine_missing(self.transformer_impl)}; {fix}"

    def __post_init__(self):
        if self.virtual_pipeline_model_parallel_size == 1:
            self.virtual_pipeline_model_parallel_size = None
        if self.recompute_granularity == "full":
            # Megatron-LM's old --checkpoint-activations meant exactly this.
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1

    @property
    def params_dtype(self) -> torch.dtype:
        import torch  # here, not at the top: the flags' parser (`rapidformer --help`) imports this module

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.precision]

    def check_layout(self, model_config: ModelConfig | None, world_size: int | None = None,
                     micro_batch_size: int | None = None, global_batch_size: int | None = None,
                     padded_vocab_size: int | None = None) -> int | None:
        """``megatron_patch.layout.check_layout`` of this layout for ``model_config`` (None: a model the flags do
        not describe, a Hugging Face one or a user script's own): the data-parallel size (None without
        ``world_size``), or LayoutError naming the flags. The launcher, the ranks, the dry-run plan and the
        converter all check a layout through here.

        Example::

            >>> from megatron_patch.model.config import get_model_config
            >>> ParallelConfig(tensor_model_parallel_size=2).check_layout(get_model_config("gpt2-124m"), world_size=8)
            4
        """
        m = model_config
        model = {} if m is None else dict(
            num_layers=m.num_layers, num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_hidden_size, seq_length=m.seq_length, num_moe_experts=m.num_moe_experts,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size)
        return check_layout(
            world_size, tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            context_parallel_size=self.context_parallel_size,
            virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            sequence_parallel=self.sequence_parallel, micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size, padded_vocab_size=padded_vocab_size, **model)

    def validate(self, model_config: ModelConfig, world_size: int | None = None) -> None:
        """Raise a ValueError (LayoutError), naming the flags, when this layout cannot run ``model_config`` on this
        machine.

        Example::

            >>> from megatron_patch.model.config import get_model_config
            >>> ParallelConfig(tensor_model_parallel_size=5).validate(get_model_config("gpt2-124m"))
            Traceback (most recent call last):
            megatron_patch.layout.LayoutError: --num-attention-heads 12 is not divisible by ...
        """
        self.check_layout(model_config, world_size)
        self.check_options(model_config)
        self.check_backend(model_config)

    def check_backend(self, model_config: ModelConfig | None) -> None:
        """What needs a package this machine lacks, or Transformer Engine's layers, is refused by name (the launcher
        checks this before any rank starts, ``model_config`` None when the flags describe no model)."""
        if self.context_parallel_size > 1 and not self.use_transformer_engine:
            raise ValueError(self._needs_transformer_engine(
                "--context-parallel-size greater than 1 needs Transformer Engine", "drop --context-parallel-size"))
        if model_config is None or model_config.num_moe_experts is None:
            return
        if self.moe_grouped_gemm and not self.use_transformer_engine:
            raise ValueError(self._needs_transformer_engine(
                "--moe-grouped-gemm needs Transformer Engine's grouped GEMM", "drop it (each rank then loops over its "
                "experts)"))
        if self.moe_token_dispatcher_type == "flex":
            raise ValueError("--moe-token-dispatcher-type flex needs DeepEP or HybridEP on GPUs; use alltoall or "
                             "allgather")
        expert_tp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        # Across expert-TP ranks the all-to-all dispatcher gathers unequal token counts
        # (MoEAlltoAllTokenDispatcher.dispatch_postprocess -> _gather_along_first_dim with output_split_sizes), which
        # gloo's all_gather cannot: its tensors must be equal.
        if self.moe_token_dispatcher_type == "alltoall" and expert_tp > 1 and not _cuda_available():
            raise ValueError(f"--moe-token-dispatcher-type alltoall with expert tensor parallelism {expert_tp} needs "
                             "NCCL (gloo cannot gather unequal token counts); use --moe-token-dispatcher-type "
                             "allgather or --expert-tensor-parallel-size 1")

    def check_options(self, model_config: ModelConfig) -> None:
        """Raise ValueError, naming the flags, when the precision or recompute options contradict each other or
        the layers of a model chunk (the layout itself is ``check_layout``'s)."""
        if self.precision not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"precision must be fp32, fp16 or bf16, got {self.precision!r}")
        m, vpp = model_config, self.virtual_pipeline_model_parallel_size or 1
        self._validate_recompute(m, layers_per_chunk=m.num_layers // (self.pipeline_model_parallel_size * vpp))

    def _validate_recompute(self, m: ModelConfig, layers_per_chunk: int) -> None:
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(
                f"--recompute-granularity must be 'full' or 'selective', got {self.recompute_granularity!r}"
            )
        if self.recompute_granularity != "full":
            if self.recompute_method is not None or self.recompute_num_layers is not None:
                raise ValueError(
                    "--recompute-method and --recompute-num-layers only apply with --recompute-granularity full"
                )
            return
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"--recompute-method must be 'uniform' or 'block', got {self.recompute_method!r}")
        if not 1 <= self.recompute_num_layers <= layers_per_chunk:
            raise ValueError(
                f"--recompute-num-layers {self.recompute_num_layers} must be between 1 and the {layers_per_chunk} "
                f"layers of one model chunk (--num-layers {m.num_layers} / --pipeline-model-parallel-size "
                f"{self.pipeline_model_parallel_size} / --virtual-pipeline-model-parallel-size "
                f"{self.virtual_pipeline_model_parallel_size or 1})"
            )


def transformer_engine_missing(transformer_impl: str | None) -> str | None:
    """Why a run with ``--transformer-impl transformer_impl`` (None: the default, transformer_engine) has no
    Transformer Engine layers, or None when it has them.

    Example::

        >>> transformer_engine_missing("local")
        '--transformer-impl local is given'
    """
    if transformer_impl == "local":
        return "--transformer-impl local is given"
    if not compat.transformer_engine_available():
        return "Transformer Engine is not installed"
    return None


def _cuda_available() -> bool:
    import torch  # only when asked: the launcher's parent checks layouts without torch

    return torch.cuda.is_available()


def add_parallel_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add Megatron-LM's parallelism, recompute and precision flags (and Rapidformer's ``--mixed-precision``) to
    ``parser``.

    Example::

        parser = add_parallel_arguments(argparse.ArgumentParser())
        parallel = parallel_config_from_args(parser.parse_args(["--checkpoint-activations"]), num_layers=12)
    """
    add_flags(parser, ParallelConfig, "parallelism and memory")
    # Flags that compute a field: Megatron-LM's other way to ask for virtual stages, the old recompute switch, and
    # the precision (ParallelConfig.precision, from --bf16, --fp16 and --mixed-precision by precision_of).
    group = parser.add_argument_group("parallelism and memory: other names")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Megatron-LM's way to ask for virtual pipeline stages")
    group.add_argument("--checkpoint-activations", action="store_true",
                       help="old name for --recompute-granularity full --recompute-method uniform")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--fp16", action="store_true")
    group.add_argument("--mixed-precision", action="store_true",
                       help="Rapidformer's: fp16 with dynamic loss scaling (bf16 without scaling when --bf16 is also "
                            "given); megatron models train in fp16 with megatron-core's optimizer, plain/HF models "
                            "keep fp32 weights and run their forward under torch.autocast with a GradScaler, also "
                            "on CPUs")
    return parser


def precision_of(args: argparse.Namespace) -> str:
    """The run's precision from ``--bf16``, ``--fp16`` and ``--mixed-precision`` (fp16 unless ``--bf16``), the
    one place it is decided; ``--fp16`` with ``--bf16`` is refused.

    Example::

        >>> precision_of(argparse.Namespace(bf16=True, fp16=False, mixed_precision=True))
        'bf16'
    """
    if args.fp16 and args.bf16:
        raise ValueError("--fp16 and --bf16 conflict; give one (or --mixed-precision [--bf16])")
    return "bf16" if args.bf16 else "fp16" if args.fp16 or args.mixed_precision else "fp32"


def parallel_config_from_args(args: argparse.Namespace, num_layers: int) -> ParallelConfig:
    """A ParallelConfig from the flags of ``add_parallel_arguments`` (``num_layers`` resolves
    ``--num-layers-per-virtual-pipeline-stage``)."""
    vpp = args.virtual_pipeline_model_parallel_size
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is not None:
        if vpp is not None:
            raise ValueError("give --num-layers-per-virtual-pipeline-stage or "
                             "--virtual-pipeline-model-parallel-size, not both")
        stage_layers = num_layers // args.pipeline_model_parallel_size
        if per_stage < 1 or stage_layers % per_stage:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {per_stage} must divide the {stage_layers} layers of a "
                f"pipeline stage (--num-layers {num_layers} / --pipeline-model-parallel-size "
                f"{args.pipeline_model_parallel_size})"
            )
        vpp = stage_layers // per_stage
    granularity = args.recompute_granularity
    if args.checkpoint_activations:
        if granularity not in (None, "full"):
            raise ValueError("--checkpoint-activations means --recompute-granularity full; do not combine it with "
                             f"--recompute-granularity {granularity}")
        granularity = "full"
    return from_flags(ParallelConfig, vars(args), virtual_pipeline_model_parallel_size=vpp,
                      recompute_granularity=granularity, precision=precision_of(args),
                      transformer_impl=args.transformer_impl or "transformer_engine")
