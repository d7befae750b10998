"""The flags that set nothing of the run here, each said once in the log (``flag_notices``) or refused in one
line: Megatron-LM's and Pai-Megatron-Patch's recipe flags this package does not act on (accepted and logged as
ignored, or refused saying why and what to use), and the flags this machine cannot honour (fp8, CUDA's profiler,
Transformer Engine's kernels), which the run turns off. The flags that do set something are the RunConfig's
fields (training/config.py).

Example::

    parser = argparse.ArgumentParser()    # the command line's parser (arguments.build_parser)
    add_ignored_flags(parser)
    ignored_notices(parser.parse_args(["--use-flash-attn"]))
    # ["ignored: --use-flash-attn (Megatron-LM's switch for the flash-attn package; ...)"]
    refusal(["--multi-latent-attention"])      # '--multi-latent-attention: ...' (why, and what to use)
"""

from __future__ import annotations

from megatron_patch.model.parallel import transformer_engine_missing

# Megatron-LM and Pai-Megatron-Patch flags accepted but without effect here: flag -> (values it takes, why). Their
# recipes pass them (tests/data/example_script_flags.json); flag_notices logs each one given.
_FUSION = "a fused kernel that is off here already (megatron-core's local layers; --fused-kernels turns fusions on)"
IGNORED_FLAGS = {
    "--use-flash-attn": (0, "Megatron-LM's switch for the flash-attn package; megatron-core picks its attention "
                            "kernel from --attention-backend"),
    **dict.fromkeys(["--no-rope-fusion", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion"],
                    (0, _FUSION)),
    **dict.fromkeys(["--no-bias-dropout-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion"],
                    (0, "the bias-dropout and bias-activation fusions run only with --fused-kernels")),
    "--cross-entropy-fusion-impl": (1, "--cross-entropy-loss-fusion uses megatron-core's native fused cross-entropy"),
    "--accumulate-allreduce-grads-in-fp32": (0, "gradients are accumulated and reduced in fp32 here already "
                                                "(unless --grad-reduce-in-bf16)"),
    "--attention-softmax-in-fp32": (0, "torch SDPA, the attention here, computes its softmax in fp32"),
    "--apply-query-key-layer-scaling": (0, "an fp16 overflow guard of Megatron-LM's fused softmax, which is not "
                                           "used here"),
    "--no-check-for-nan-in-loss-and-grad": (0, "every step's gradients are checked for NaN/Inf here "
                                               "(--max-bad-steps)"),
    "--log-params-norm": (0, "the parameter norm is not computed; the log has the gradient norm"),
    "--log-num-zeros-in-grad": (0, "zeros in the gradient are not counted"),
    "--log-timers-to-tensorboard": (0, "tensorboard gets the iteration time with every step already"),
    "--log-batch-size-to-tensorboard": (0, "tensorboard gets the global batch size with every step already"),
    "--log-memory-to-tensorboard": (0, "peak memory is in the iteration log line"),
    "--log-validation-ppl-to-tensorboard": (0, "tensorboard gets the validation loss; its perplexity is exp(loss)"),
    "--tensorboard-queue-size": (1, "torch.utils.tensorboard's default queue is used"),
    "--logging-level": (1, "the log level is fixed (INFO on the last rank); --debug shows more"),
    "--moe-per-layer-logging": (0, "routing statistics are logged per layer already"),
    "--no-save-optim": (0, "checkpoints here always hold the optimizer so that a resume is exact; --no-load-optim "
                           "skips loading it"),
    "--dist-ckpt-strictness": (1, "loads are strict here: a missing or unexpected tensor is an error"),
    "--auto-detect-ckpt-format": (0, "--load detects the checkpoint's format always"),
    "--use-precision-aware-optimizer": (0, "a Transformer Engine FusedAdam option; Adam's state stays in fp32"),
    "--tp-comm-overlap": (0, "Transformer Engine userbuffers on GPUs with NVLink; tensor-parallel communication is "
                             "not overlapped here"),
    "--use-nccl-ub": (0, "NCCL user buffers are not registered here"),
    "--te-rng-tracker": (0, "megatron-core's own RNG tracker is used"),
    "--disable-bf16-reduced-precision-matmul": (0, "torch's default matmul precision is kept"),
    **{name: (nargs, "CUDA graphs are not captured here")
       for name, nargs in (("--cuda-graph-impl", 1), ("--cuda-graph-scope", "+"), ("--external-cuda-graph", 0))},
    **{name: (nargs, "no CUDA memory snapshot is taken here")
       for name, nargs in (("--record-memory-history", 0), ("--memory-snapshot-path", 1))},
    "--moe-permute-fusion": (0, "a Transformer Engine kernel for token permutation; the unfused one runs"),
    "--enable-experimental": (0, "megatron-core's experimental features are not used here"),
}

# Flags of features this package does not have: flag -> why, and what to use instead. Refused in one line.
_MAMBA = "hybrid Mamba models are not built here (GPT and BERT only)"
_VISION = "vision-language models are not built here (GPT and BERT only)"
_OFFLOAD = "CPU offloading is not implemented here; use --recompute-granularity or more data-parallel ranks"
_MEGATRON_FSDP = ("Megatron FSDP is not used here; --zero-3-memory-optimization shards parameters with torch FSDP2 "
                  "(plain/HF models), --use-distributed-optimizer shards optimizer state (megatron models)")
_ROUTER = ("this router option of megatron-core's MoE layer is not exposed here; the router is top-k by softmax or "
           "sigmoid (--moe-router-score-function), in the parameters' precision")
_GPT_OSS = "gpt-oss's attention and activation variants are not built here"
_PMP_DATA = ("Pai-Megatron-Patch's dataset switch: give Megatron .bin/.idx prefixes with --data-path (--mock-data "
             "for synthetic data; --sft for conversations)")
REFUSED_FLAGS = {
    "--qk-nope-head-dim": "Pai-Megatron-Patch's name: give --qk-head-dim N (Megatron-LM's)",
    "--qk-rope-head-dim": "Pai-Megatron-Patch's name: give --qk-pos-emb-head-dim N (Megatron-LM's)",
    **dict.fromkeys(["--mamba-head-dim", "--mamba-num-groups", "--mamba-num-heads", "--mamba-state-dim",
                     "--hybrid-attention-ratio", "--hybrid-mlp-ratio", "--hybrid-override-pattern",
                     "--is-hybrid-model"], _MAMBA),
    **dict.fromkeys(["--img-h", "--img-w", "--patch-dim", "--patch-size", "--freeze-LM", "--freeze-ViT",
                     "--disable-vision-class-token", "--allow-missing-vision-projection-checkpoint",
                     "--language-model-type", "--tokenizer-prompt-format", "--mrope-section"], _VISION),
    **dict.fromkeys(["--cpu-offloading", "--cpu-offloading-num-layers", "--optimizer-cpu-offload",
                     "--optimizer-offload-fraction", "--optimizer-offload-policy"], _OFFLOAD),
    **dict.fromkeys(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--outer-dp-sharding-strategy",
                     "--fsdp-double-buffer", "--fsdp-manual-registration", "--fsdp-db-use-persist-buf-on-alloc-fail",
                     "--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype",
                     "--megatron-fsdp-main-params-dtype", "--megatron-fsdp-max-pool-double-buffer",
                     "--num-distributed-optimizer-instances", "--init-model-with-meta-device"], _MEGATRON_FSDP),
    **dict.fromkeys(["--moe-router-dtype", "--moe-router-force-load-balancing", "--moe-z-loss-coeff"], _ROUTER),
    "--moe-enable-deepep": "DeepEP's all-to-all needs its CUDA kernels; the alltoall token dispatcher runs here",
    "--moe-flex-dispatcher-backend": "the flex dispatcher's DeepEP/HybridEP backends need their CUDA kernels, which "
                                     "are not used here; give --moe-token-dispatcher-type alltoall",
    "--moe-shared-expert-overlap": "shared-expert overlap is not used here; the shared expert runs after routing",
    "--moe-layer-recompute": "give --recompute-granularity full (MoE layers are recomputed with the rest)",
    "--enable-shared-expert": "Pai-Megatron-Patch's switch: give --moe-shared-expert-intermediate-size N",
    "--shared-moe-ffn-hidden-size": "Pai-Megatron-Patch's name: give --moe-shared-expert-intermediate-size N",
    "--sliding-window": "Pai-Megatron-Patch's window of N tokens: give --window-size N-1,0 (megatron-core's)",
    **dict.fromkeys(["--enable-gpt-oss", "--softmax-type", "--quick-geglu", "--glu-linear-offset",
                     "--activation-func-clamp-value"], _GPT_OSS),
    **dict.fromkeys(["--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                     "--pipeline-model-parallel-layout"],
                    "uneven pipeline stages are not supported here: --num-layers must divide evenly by "
                    "--pipeline-model-parallel-size"),
    "--recompute-activations": "Megatron-LM's old switch: give --recompute-granularity selective",
    "--recompute-modules": "selective recompute here recomputes the core attention only; give "
                           "--recompute-granularity selective or full",
    "--no-position-embedding": "deprecated in Megatron-LM too: give --position-embedding-type rope",
    "--use-rotary-position-embeddings": "deprecated in Megatron-LM too: give --position-embedding-type rope",
    "--fp8-recipe": "fp8 here is Transformer Engine's delayed scaling (--fp8-format); other recipes are not built",
    "--step-batch-size-schedule": "give --rampup-batch-size START INCR SAMPLES (megatron-core's ramp-up)",
    "--decoder-seq-length": "encoder-decoder models are not built here; give --seq-length",
    "--export-force-local-attention": "a ModelOpt export option; export with megatron-patch convert",
    "--patch-tokenizer-type": "Pai-Megatron-Patch's tokenizer names: give --tokenizer-type HuggingFaceTokenizer "
                              "--tokenizer-model DIR (a Hugging Face tokenizer directory) or another --tokenizer-type",
    "--extra-vocab-size": "Pai-Megatron-Patch's padding of the vocabulary: give --vocab-extra-ids N or "
                          "--make-vocab-size-divisible-by N",
    "--padded-vocab-size": "the vocabulary is padded from the tokenizer's size (--make-vocab-size-divisible-by)",
    **dict.fromkeys(["--dataset", "--train-mode"], _PMP_DATA),
    "--max-padding-length": "Pai-Megatron-Patch's SFT padding: sequences are --seq-length long here",
    "--pretrained-checkpoint": "give --load DIR (add --finetune to start at iteration 0)",
}


def _dest(name: str) -> str:
    """Where an IGNORED_FLAGS flag lands: a name of its own, so that it cannot set a setting of the run."""
    return "ignored_" + name[2:].replace("-", "_")


def add_ignored_flags(parser) -> None:
    """The IGNORED_FLAGS, each taking the values its recipes give it, in a group of the argparse ``parser``."""
    group = parser.add_argument_group("accepted from Megatron-LM and Pai-Megatron-Patch recipes, without effect "
                                      "here (each given one is logged)")
    for name, (nargs, why) in IGNORED_FLAGS.items():
        options = {"action": "store_true"} if nargs == 0 else {"nargs": None if nargs == 1 else nargs}
        group.add_argument(name, dest=_dest(name), help=why, **options)


def ignored_notices(flags) -> list[str]:
    """One ``ignored: FLAG (why)`` line for each IGNORED_FLAGS flag the parsed ``flags`` give."""
    return [f"ignored: {name} ({why})" for name, (_, why) in IGNORED_FLAGS.items()
            if getattr(flags, _dest(name)) not in (None, False)]


def refusal(unknown: list[str]) -> str | None:
    """Why the first REFUSED_FLAGS flag among the ``unknown`` command-line words is refused (None without one)."""
    for item in unknown:
        name = item.split("=", 1)[0]
        if name in REFUSED_FLAGS:
            return f"{name}: {REFUSED_FLAGS[name]}"
    return None


def flag_notices(flags, precision: str) -> tuple[list[str], dict]:
    """For the parsed ``flags``, one line for each given flag that does nothing on this machine or in this package,
    saying why (the engine logs them once), and the settings those lines say are off, as ``{field: value}`` for
    the RunConfig.

    Example::

        flag_notices(parse_flags([..., "--profile"]), "fp32")   # on a machine without CUDA:
        # (['ignored on this machine: --profile (runs CUDA's profiler for nsys; ...)'], {'profile': False, ...})
    """
    from megatron_patch.startup import paused_collector

    with paused_collector():  # the launcher's first import of torch (startup.py)
        import torch

    cuda = torch.cuda.is_available()
    no_te = transformer_engine_missing(flags.transformer_impl)
    te = no_te is None
    notices, off = [], {}
    if flags.transformer_impl == "transformer_engine" and not te:
        notices.append(f"ignored on this machine: --transformer-impl transformer_engine ({no_te}; megatron-core's "
                       "local layers run, and their checkpoints load into Transformer Engine's)")
    if flags.use_mcore_models:
        notices.append("ignored: --use-mcore-models (deprecated in Megatron-LM 0.16, where megatron-core models are "
                       "the default; here every megatron model is one)")
    if flags.tiktoken_pattern is not None:
        notices.append(f"ignored: --tiktoken-pattern {flags.tiktoken_pattern} (it configures Megatron-LM's "
                       "TikTokenizer, which no --tokenizer-type here is)")
    if flags.sequence_parallel and flags.tensor_model_parallel_size == 1:
        # megatron/training/arguments.py (core_v0.16.1) turns it off at TP=1 with a warning, as here.
        off["sequence_parallel"] = False
        notices.append("ignored: --sequence-parallel (it splits activations over tensor-parallel ranks, and "
                       "--tensor-model-parallel-size is 1; Megatron-LM turns it off too)")
    if flags.rampup_batch_size is not None and flags.train_iters is not None:
        # Megatron-LM 0.16.1 asserts "expected no batch-size rampup for iteration-based training" although its own
        # examples/gpt3/train_gpt3_175b_distributed.sh combines the two; here that script runs.
        notices.append("note: --rampup-batch-size with --train-iters (Megatron-LM 0.16.1 refuses the pair): the "
                       "run takes --train-iters iterations, the first ones with the ramp-up's smaller batches")
    notices += ignored_notices(flags)
    if flags.grad_reduce_in_bf16 and not flags.bf16:
        notices.append("ignored: --grad-reduce-in-bf16 (it applies to --bf16 runs)")
    if not (te and cuda):
        missing = no_te if not te else "no CUDA device here"
        fp8 = [("--fp8-format", flags.fp8_format is not None),
               ("--fp8-amax-history-len", flags.fp8_amax_history_len != 1),
               ("--fp8-amax-compute-algo", flags.fp8_amax_compute_algo != "most_recent"),
               ("--fp8-param-gather", flags.fp8_param_gather)]
        for flag, given in fp8:
            if given:
                notices.append(f"ignored on this machine: {flag} (fp8 needs Transformer Engine and an fp8-capable "
                               f"GPU; {missing}): the run computes in {precision}")
        off.update(fp8_format=None, fp8_param_gather=False)
    elif flags.fp8_param_gather:
        notices.append("ignored: --fp8-param-gather (parameters are built in --bf16/--fp16 here; --fp8-format "
                       "applies to the matmuls)")
        off["fp8_param_gather"] = False
    if flags.attention_backend in ("flash", "fused", "unfused") and not te:
        notices.append(f"ignored on this machine: --attention-backend {flags.attention_backend} (a Transformer "
                       f"Engine kernel; {no_te}, so megatron-core's local attention (torch SDPA) runs)")
        off["attention_backend"] = "auto"
    if not cuda:
        if flags.profile:
            notices.append("ignored on this machine: --profile (runs CUDA's profiler for nsys between "
                           "--profile-step-start and --profile-step-end; no CUDA device here)")
            off["profile"] = False
        if flags.empty_unused_memory_level:
            notices.append(f"ignored on this machine: --empty-unused-memory-level {flags.empty_unused_memory_level} "
                           "(it empties the CUDA caching allocator; no CUDA device here)")
            off["empty_unused_memory_level"] = 0
    return notices, off
