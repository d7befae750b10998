"""The parallel layout of a run, checked in one place: TP x PP x CP tiling the world (and, for mixture-of-experts
models, expert-TP x EP x PP tiling it too), the model's sizes divided by them, and the global batch by micro batch x
data-parallel size.

Example::

    python -m megatron_patch.training.launcher --task pretraining --mock-data --nproc-per-node 8 \
        --model-name gpt2-124m --tensor-model-parallel-size 8
    # rapidformer: error: --num-attention-heads 12 is not divisible by --tensor-model-parallel-size 8; ...

    from megatron_patch.layout import check_layout
    dp = check_layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_attention_heads=12)

One function, ``check_layout``, called with whatever its caller knows: the launcher before torchrun starts (the
world from ``--nproc-per-node`` x ``NNODES``, the model from the flags, ``--model-name`` or ``--load``),
``initialize_distributed`` in each rank (the world, no model), ``ParallelConfig.validate`` before a model is built
(the model, no world) and the ``--dry-run`` plan (everything). A value left at None is not known there and is not
checked. It takes plain numbers and imports nothing of the package but its errors, so ``model/``,
``distributed.py`` and the launcher all call it without importing one another (or torch).
"""

from __future__ import annotations

from megatron_patch.errors import UserError


class LayoutError(UserError, ValueError):
    """A parallel layout that cannot run: the one-line message names the flags and the fix."""


def _divides(flag: str, value: int | None, tp: int) -> None:
    """Tensor parallelism splits ``value`` (heads, query groups, MLP columns, vocabulary rows) evenly over TP ranks."""
    if value is not None and value % tp:
        raise LayoutError(f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}; choose a "
                          f"--tensor-model-parallel-size that divides it")


def _tiles_world(world_size: int | None, sizes: list[tuple[str, int]]) -> int:
    """The product of ``sizes`` (flag, size), refused unless it divides ``world_size``: one grid of megatron-core's
    process groups."""
    product = 1
    for _, size in sizes:
        product *= size
    if world_size is not None and world_size % product:
        named = " x ".join(f"{flag} {size}" for flag, size in sizes)
        raise LayoutError(f"world size {world_size} is not divisible by {named} = {product}; change the sizes or the "
                          "number of processes (--nproc-per-node x NNODES)")
    return product


def _check_experts(world_size, tp, pp, ep, etp, sequence_parallel, num_layers, num_moe_experts,
                   moe_ffn_hidden_size) -> None:
    """megatron-core's second grid, for the expert layers: ETP x EP x PP x expert-DP tiles the same world."""
    # A caller that knows the model passes num_layers; only then does a missing num_moe_experts mean "dense".
    if num_layers is not None and num_moe_experts is None and (ep > 1 or etp != tp):
        flag = "--expert-model-parallel-size" if ep > 1 else "--expert-tensor-parallel-size"
        raise LayoutError(f"{flag} splits the experts of a mixture-of-experts model, and this model has none; add "
                          "--num-experts or drop it")
    _tiles_world(world_size, [("--expert-tensor-parallel-size", etp), ("--expert-model-parallel-size", ep),
                              ("--pipeline-model-parallel-size", pp)])
    if num_moe_experts is not None and num_moe_experts % ep:
        raise LayoutError(f"--num-experts {num_moe_experts} is not divisible by --expert-model-parallel-size {ep}; "
                          "every expert-parallel rank holds as many experts as the others, so choose a size that "
                          "divides it")
    if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % etp:
        raise LayoutError(f"--moe-ffn-hidden-size {moe_ffn_hidden_size} is not divisible by "
                          f"--expert-tensor-parallel-size {etp}; choose a size that divides it")
    # MoELayer.forward refuses to train a TP-split MoE model without it (MoELayer.forward at core_v0.16.1).
    if num_moe_experts is not None and tp > 1 and not sequence_parallel:
        raise LayoutError("mixture-of-experts layers with --tensor-model-parallel-size greater than 1 need "
                          "--sequence-parallel (megatron-core refuses to train without it); add it")


def check_layout(
    world_size: int | None = None,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    sequence_parallel: bool = False,
    micro_batch_size: int | None = None,
    global_batch_size: int | None = None,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    ffn_hidden_size: int | None = None,
    seq_length: int | None = None,
    padded_vocab_size: int | None = None,
    num_moe_experts: int | None = None,
    moe_ffn_hidden_size: int | None = None,
) -> int | None:
    """Return the data-parallel size (None when ``world_size`` is), or raise LayoutError naming the flags.

    Example::

        >>> check_layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        2
        >>> check_layout(8, tensor_model_parallel_size=8, num_attention_heads=12)
        Traceback (most recent call last):
        megatron_patch.layout.LayoutError: --num-attention-heads 12 is not divisible by ...

    ``num_query_groups`` None means one group per head; ``virtual_pipeline_model_parallel_size`` None or 1 means no
    interleaving. ``padded_vocab_size`` is a stored checkpoint's: one padded for this run is divisible by design.
    ``expert_tensor_parallel_size`` None means the same as ``tensor_model_parallel_size``.
    """
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    vpp = 1 if virtual_pipeline_model_parallel_size is None else virtual_pipeline_model_parallel_size
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp),
                        ("--context-parallel-size", cp), ("--virtual-pipeline-model-parallel-size", vpp),
                        ("--micro-batch-size", micro_batch_size), ("--global-batch-size", global_batch_size)):
        if value is not None and value < 1:
            raise LayoutError(f"{flag} must be at least 1, got {value}")
    if world_size is not None and world_size < 1:
        raise LayoutError(f"world size {world_size} must be at least 1 (--nproc-per-node x NNODES)")
    model_parallel = _tiles_world(world_size, [("--tensor-model-parallel-size", tp),
                                               ("--pipeline-model-parallel-size", pp), ("--context-parallel-size", cp)])
    _check_experts(world_size, tp, pp, ep, etp, sequence_parallel, num_layers, num_moe_experts, moe_ffn_hidden_size)
    _divides("--num-attention-heads", num_attention_heads, tp)
    _divides("--num-query-groups", num_query_groups, tp)
    _divides("--ffn-hidden-size", ffn_hidden_size, tp)
    if vpp > 1 and pp < 2:
        raise LayoutError(
            "--virtual-pipeline-model-parallel-size (or --num-layers-per-virtual-pipeline-stage) needs "
            f"--pipeline-model-parallel-size of at least 2, got {pp}; raise it or drop the virtual stages"
        )
    if num_layers is not None and num_layers % (pp * vpp):
        if vpp == 1:
            wrong = f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}"
        else:
            wrong = (f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                     f"--virtual-pipeline-model-parallel-size {vpp} = {pp * vpp}")
            if num_layers % pp == 0:
                wrong += (f" (the {num_layers // pp} layers of a pipeline stage are not divisible by "
                          f"--virtual-pipeline-model-parallel-size {vpp})")
        raise LayoutError(f"{wrong}; every model chunk needs the same number of layers, so choose sizes that "
                          "divide it")
    if sequence_parallel and tp == 1:
        raise LayoutError("--sequence-parallel needs --tensor-model-parallel-size greater than 1; drop it or raise "
                          "--tensor-model-parallel-size")
    if sequence_parallel and seq_length is not None and seq_length % tp:
        raise LayoutError(f"--sequence-parallel needs --seq-length {seq_length} divisible by "
                          f"--tensor-model-parallel-size {tp}; change one of them")
    # Each context-parallel rank takes two chunks of the sequence, one from each end, to balance causal attention.
    if cp > 1 and seq_length is not None and seq_length % (2 * cp):
        raise LayoutError(f"--context-parallel-size {cp} needs --seq-length {seq_length} divisible by 2 x {cp}; "
                          "change one of them")
    if padded_vocab_size is not None and padded_vocab_size % tp:
        raise LayoutError(f"--tensor-model-parallel-size {tp} does not divide the padded vocabulary "
                          f"{padded_vocab_size} of the checkpoint to load; choose a size that divides it")
    data_parallel = None if world_size is None else world_size // model_parallel
    if global_batch_size is not None and micro_batch_size is not None:
        if data_parallel is None and global_batch_size % micro_batch_size:
            raise LayoutError(f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                              f"{micro_batch_size}; give a multiple of it")
        if data_parallel is not None and global_batch_size % (micro_batch_size * data_parallel):
            raise LayoutError(
                f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size {micro_batch_size} "
                f"x data-parallel size {data_parallel} (world {world_size} / (TP {tp} x PP {pp} x CP {cp})); give a "
                f"multiple of {micro_batch_size * data_parallel}"
            )
    return data_parallel
