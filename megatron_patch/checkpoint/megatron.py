"""megatron-core model chunks' checkpoints: their model, optimizer and scheduler through ``dist_checkpointing``
(torch_dist) in the trainer's layout (``checkpoint.trainer``), and back from ours, Megatron-LM's torch_dist or
per-rank files, or a conversion, with the refusals of an optimizer state that cannot load at this layout.

Example::

    save_megatron_checkpoint("ckpt", 100, chunks, optimizer, scheduler, info, keep_last_k=2)
    iteration = load_megatron_checkpoint("ckpt", chunks, optimizer, scheduler, load_fallback=True)

The training backend (``training/backends/megatron.py``) calls these two; nothing else here is public.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, NamedTuple

import torch

from megatron_patch import compat
from megatron_patch.checkpoint import trainer
from megatron_patch.checkpoint.async_save import live_storages, with_snapshot
from megatron_patch.checkpoint.format import (
    RELEASE, CheckpointInfo, CheckpointMismatch, checkpoint_dir, checkpoint_format, megatron_lm_common_state,
    read_args_state, read_info, read_tracker, weights_dir,
)
from megatron_patch.checkpoint.integrity import write_checksummed, write_rank_checksums
from megatron_patch.checkpoint.legacy import load_legacy_optimizer
from megatron_patch.checkpoint.load import load_into_chunks
from megatron_patch.checkpoint.read_into import reading_into_place
from megatron_patch.checkpoint.torch_dist import exact_storage
from megatron_patch.errors import UserError


def _megatron_state(model, optimizer, scheduler, is_loading: bool, with_optimizer: bool, metadata: dict) -> dict:
    """The sharded state of the model chunks (with the optimizer's and the scheduler's state) that megatron-core
    builds from ``metadata``, given to the model and the optimizer alike as in Megatron-LM's
    ``generate_state_dict``: a checkpoint loads into the state built with the metadata it was saved with."""
    from megatron.core.utils import unwrap_model

    chunks = unwrap_model(list(model))
    # Copies: megatron-core adds its data-parallel group to the dict it is given (ensure_metadata_has_dp_cp_group).
    if len(chunks) == 1:
        state = {"model": chunks[0].sharded_state_dict(metadata=dict(metadata))}
    else:
        state = {f"model{i}": c.sharded_state_dict(metadata=dict(metadata)) for i, c in enumerate(chunks)}
    if with_optimizer:
        model_state = {k: v for k, v in state.items() if k.startswith("model")}
        compat.initialise_adam_state(optimizer, is_loading)
        with compat.collect_only_new_objects():
            state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading, metadata=dict(metadata))
        if scheduler is not None:
            state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def save_megatron_checkpoint(root: str, iteration: int, chunks: list, optimizer, scheduler,
                             info: CheckpointInfo | None = None, *, keep_last_k: int | None = None,
                             async_queue=None, run_args: dict | None = None, fully_reshardable: bool = False,
                             rng_from: str | None = None) -> str:
    """Save model chunks, optimizer and scheduler with megatron-core's ``dist_checkpointing`` (torch_dist, whose
    model weights reshard on load), in the trainer's layout (``trainer.save_checkpoint``). The distributed
    optimizer's state is saved as Megatron-LM saves it by default, ``dp_reshardable``: its buckets as they are, which
    load at another data-parallel size but only at the saved tensor/pipeline layout; ``fully_reshardable``
    (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``) gathers it per parameter, to load at any layout
    (``compat.distrib_optimizer_metadata``; ``megatron-patch checkpoint reshard`` turns one into the other).

    Example::

        save_megatron_checkpoint("ckpt", 100, chunks, optimizer, scheduler, info, keep_last_k=2)

    With ``async_queue`` (``checkpoint.async_save.async_save_queue``) the tensors are written and checksummed by a
    background thread, from copies of any that training still writes, and the publishing (rename, tracker) happens
    when the queue finalizes the save on every rank (``maybe_finalize_async_calls``), so an unfinished save is never
    the latest. With ``info``, ``common.pt``
    carries Megatron-LM's ``args`` (``run_args``, e.g. ``consumed_train_samples``, override what ``info`` cannot
    know), so Megatron-LM resumes it with ``--use-checkpoint-args``. ``rng_from``: ``trainer.save_checkpoint``'s.
    """
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    # Without the distributed optimizer the state is keyed by parameter, as the fully reshardable format is (which
    # the distributed optimizer loads too): recorded as that.
    metadata = compat.distrib_optimizer_metadata(fully_reshardable or not _distributed(optimizer))

    def write_state(staging: str, rank: int, write_rng: Callable[[], dict], finalize: Callable[[], None]) -> None:
        state = _megatron_state(chunks, optimizer, scheduler, is_loading=False, with_optimizer=True,
                                metadata=metadata)
        # dist_checkpointing.save writes the state's non-sharded entries to common.pt (rank 0), which
        # write_checksums covers.
        state.update(megatron_lm_common_state(info, iteration, **(run_args or {})) if info is not None
                     else {"iteration": iteration})
        if async_queue is None:
            _write_views_in_place(state)
        # Asynchronous in form even for a synchronous save (run at once by execute_sync, as megatron-core's own
        # synchronous save does: AsyncSaveShardedStrategy.save), so that its write function can be replaced by ours,
        # which runs megatron-core's per-file writer in threads and checksums the files (integrity.write_checksummed).
        # content_metadata: the metadata the state was built with, which Megatron-LM's load reads back
        # (load_content_metadata) to build the state it loads into; without it, it guesses another optimizer format.
        # Fully parallel, as Megatron-LM's default --ckpt-fully-parallel-save: the data-parallel replicas share the
        # writing (each DP rank holds the whole gathered optimizer state), not DP rank 0 alone.
        strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                                    parallel_state.get_data_parallel_group(with_context_parallel=True))
        with compat.write_results_in_this_process():
            request = dist_checkpointing.save(state, staging, sharded_strategy=strategy, async_sharded_save=True,
                                              content_metadata=dict(metadata),
                                              **compat.async_save_options())
        # Only now: rank 0's dist_checkpointing.save warns "Overwriting old incomplete / corrupted checkpoint" when
        # the directory holds a file (serialization.py's save), and no rank leaves save() before rank 0 has
        # passed that check (its sharding validation is a collective).
        checksums = write_rng()
        if request.async_fn is None:  # this rank holds only replicas another rank writes: no .distcp of its own
            write_rank_checksums(staging, rank, checksums)
        else:
            request = compat.with_write_function(request, functools.partial(
                write_checksummed, staging, checksums, background=async_queue is not None))
        request.add_finalize_fn(finalize)
        if async_queue is None:
            request.execute_sync()
        else:
            async_queue.schedule_async_request(with_snapshot(request, live_storages(chunks, optimizer)))

    return trainer.save_checkpoint(root, iteration, write_state, info=info, keep_last_k=keep_last_k, rng_from=rng_from)


def _write_views_in_place(state: dict) -> None:
    """Give megatron-core's writer each CPU tensor of ``state`` over a storage of exactly its bytes
    (``torch_dist.exact_storage``, sharing them), so that it writes the tensor where it is.

    The writer copies a tensor that is a view of a larger storage (strategies/filesystem_async.py,
    ``prepare_write_data``'s ``_clone_if_needed`` in 0.16.1, ``_clone_or_dequantize_if_needed`` in 0.19.2), since
    ``torch.save`` would write all of that storage: every parameter, a view of DDP's buffer (half of
    bench/checkpoint_io.py's 406 MB checkpoint: 0.05 s and as much memory again). A synchronous save has written them
    before training goes on; an ``--async-save`` keeps the copy, which is its snapshot (``checkpoint.async_save``).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for sharded in nested_values(state):
        if isinstance(sharded, ShardedTensor) and sharded.data is not None and sharded.data.device.type == "cpu":
            sharded.data = exact_storage(sharded.data)


def load_megatron_checkpoint(root: str, chunks: list, optimizer, scheduler, *, fully_parallel: bool = False,
                             **options) -> int:
    """Load ``root``'s latest checkpoint into model chunks (``options``: ``trainer.load_checkpoint``'s): ours or
    Megatron-LM's torch_dist with its optimizer and scheduler, their sharded state built with the metadata the
    checkpoint records (``saved_metadata``: the distributed optimizer's default state, ours and Megatron-LM's,
    at its TP/PP and any DP, its fully reshardable state at any layout), Megatron-LM's per-rank files likewise (at
    their TP/PP and any DP: ``_load_legacy``), or the model alone of a converted (``release``) checkpoint.

    Example::

        iteration = load_megatron_checkpoint("ckpt", chunks, optimizer, scheduler, load_fallback=True)

    ``fully_parallel`` (Megatron-LM's ``--ckpt-fully-parallel-load``): the data-parallel replicas share the reading
    of what they all hold (the model weights), each reading a part and sending it to the others, instead of each
    reading all of it (megatron-core's ``FullyParallelLoadStrategyWrapper``).
    """

    def read_state(path: str, with_optimizer: bool, finetune: bool) -> None:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling
        from megatron.core.utils import unwrap_model

        common = read_args_state(compat.common_state_source(path))
        metadata = saved_metadata(common)
        if with_optimizer:
            _require_optimizer_state(root, path)
            _check_optimizer_layout(root, path, metadata, common.get("args"), optimizer)
        state = _megatron_state(chunks, optimizer, scheduler, is_loading=True, with_optimizer=with_optimizer,
                                metadata=metadata)
        load_options = dict(compat.dist_load_options(), **_parallel_load_strategy(path) if fully_parallel else {})
        with reading_into_place(), compat.refusals_raised():
            if finetune:
                # --finetune may put a new head on the loaded weights (a classifier on a pretrained BERT): tensors
                # the checkpoint lacks keep their initialisation, as Megatron-LM's tasks/finetune_utils.py loads its
                # pretrained checkpoint with strict=False.
                loaded, _, absent = dist_checkpointing.load(state, path, strict=StrictHandling.RETURN_UNEXPECTED,
                                                            **load_options)
                _check_finetune_coverage(path, state, absent, logger)
            else:
                loaded = dist_checkpointing.load(state, path, **load_options)
        modules = unwrap_model(list(chunks))
        for i, module in enumerate(modules):
            module.load_state_dict(loaded["model" if len(modules) == 1 else f"model{i}"], strict=not finetune)
        if with_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            compat.restore_adam_step(optimizer)
            if scheduler is not None and "opt_param_scheduler" in loaded:
                scheduler.load_state_dict(loaded["opt_param_scheduler"])
        else:
            _reload_main_params(optimizer)

    def load_converted(root: str, iteration, with_optimizer: bool, finetune: bool) -> int:
        if iteration == RELEASE:
            start = _load_release(root, chunks, logger)
            _reload_main_params(optimizer)
            return start
        return _load_legacy(root, iteration, chunks, optimizer, scheduler, with_optimizer, finetune, logger)

    logger = options.get("logger") or logging.getLogger(__name__)
    return trainer.load_checkpoint(root, read_state, megatron=True, load_converted=load_converted, **options)


def _parallel_load_strategy(path: str) -> dict:
    """``dist_checkpointing.load``'s strategy for ``fully_parallel``, as Megatron-LM builds it
    (training/checkpointing.py, where it picks the load strategy, with --ckpt-fully-parallel-load)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return {"sharded_strategy": FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(path), parallel_state.get_data_parallel_group(with_context_parallel=True))}


def _reload_main_params(optimizer) -> None:
    """Copy freshly loaded weights into the optimizer's fp32 main parameters (fp16/bf16 runs; a no-op in fp32),
    which were made from the weights the model was built with: its first step would write them back over the
    loaded ones. Megatron-LM's ``load_checkpoint`` does the same when it loads a model without its optimizer."""
    if optimizer is not None:
        optimizer.reload_model_params()


def _require_optimizer_state(root: str, path: str) -> None:
    """Refuse, in one line, resuming the optimizer from a torch_dist checkpoint that has none (a model-only save,
    e.g. Megatron-LM's with --no-save-optim), before megatron-core's loader fails on the missing keys."""
    from megatron.core import dist_checkpointing

    # A ChainedOptimizer (a mixture of experts' dense and expert parameters) prefixes each part's keys with
    # chained_N. (megatron/core/optimizer/optimizer.py, ChainedOptimizer.sharded_state_dict at core_v0.16.1).
    if not any(key.startswith("optimizer.") or (key.startswith("chained_") and ".optimizer." in key)
               for key in dist_checkpointing.load_tensors_metadata(path)):
        raise UserError(f"--load {root}: {path} has no optimizer state; pass --finetune or --no-load-optim to load "
                        "its model")


def saved_metadata(common: dict) -> dict:
    """The metadata ``common`` (a checkpoint's common.pt) says its sharded state was built with, which the state
    that loads it must be built with too, as Megatron-LM's ``load_checkpoint`` does
    (``dist_checkpointing.load_content_metadata``, megatron/training/checkpointing.py at core_v0.16.1).

    Example::

        saved_metadata(read_args_state("ckpt/iter_0000100/common.pt"))
        # Megatron-LM's: {'distrib_optim_sharding_type': 'dp_reshardable', 'singleton_local_shards': False,
        #                 'chained_optim_avoid_prefix': True}

    Megatron-LM has recorded it since megatron-core 0.13, our saves since they began to; for older ones the
    distributed optimizer's own record of its sharding stands in (``param_state_sharding_type``, beside its state:
    distrib_optimizer.py ``sharded_state_dict``), and without that (no distributed optimizer) the format our saves
    had then, ``fully_reshardable``.
    """
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if saved is not None:
        return dict(saved)
    recorded = recorded_sharding(common.get("optimizer"))
    return {"distrib_optim_sharding_type": recorded} if recorded else compat.distrib_optimizer_metadata(True)


def recorded_sharding(optimizer_state) -> str | None:
    """The distributed optimizer's ``param_state_sharding_type`` in a common.pt's optimizer entry (one per
    optimizer of a chained one, keyed by its index); None for another optimizer's."""
    if not isinstance(optimizer_state, dict):
        return None
    if "param_state_sharding_type" in optimizer_state:
        return optimizer_state["param_state_sharding_type"]
    return next(filter(None, map(recorded_sharding, optimizer_state.values())), None)


class Layout(NamedTuple):
    """A run's parallel sizes as far as the distributed optimizer's checkpoint is concerned."""

    tensor: int
    pipeline: int
    virtual: int
    expert: int
    data: int | None


def _current_layout() -> Layout:
    from megatron.core import parallel_state

    return Layout(parallel_state.get_tensor_model_parallel_world_size(),
                  parallel_state.get_pipeline_model_parallel_world_size(),
                  parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
                  parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_data_parallel_world_size())


def saved_layout(args) -> Layout:
    """The layout Megatron-LM's ``args`` in a checkpoint record (ours carry them too).

    Example::

        saved_layout(read_args_state("ckpt/iter_0000100/common.pt")["args"])   # Layout(tensor=2, pipeline=1, ...)
    """
    return Layout(getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1),
                  getattr(args, "virtual_pipeline_model_parallel_size", None) or 1,
                  getattr(args, "expert_model_parallel_size", None) or 1, getattr(args, "data_parallel_size", None))


def check_resume_layout(root: str, requested: Layout, distributed: bool) -> None:
    """Refuse, before any rank starts, resuming ``root``'s latest checkpoint's optimizer state at a layout it does
    not load at (``_optimizer_layout_refusal``); a checkpoint without a torch_dist optimizer state, or one that
    cannot be read, is left to the ranks' load, which names what is wrong with it.

    Example::

        check_resume_layout("ckpt", Layout(1, 1, 1, 1, 2), distributed=True)
        # UserError: --load ckpt: ckpt/iter_0000100 holds the distributed optimizer's state in its buckets ...
    """
    iteration = read_tracker(root)
    if iteration is None or iteration == RELEASE:
        return
    path = checkpoint_dir(root, iteration)
    if checkpoint_format(path) != "torch_dist":
        return
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        common = read_args_state(compat.common_state_source(path))
    # A damaged checkpoint: the ranks' verification names the file (and --load-fallback acts). DCP's reader wraps
    # its errors in CheckpointException, a BaseException (torch/distributed/checkpoint/api.py).
    except (Exception, CheckpointException):
        return
    refusal = _optimizer_layout_refusal(root, path, saved_metadata(common), common.get("args"), requested,
                                        distributed)
    if refusal is not None:
        raise UserError(refusal)


def _distributed(optimizer) -> bool:
    """Whether ``optimizer`` (every part of a chained one) is megatron-core's distributed optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return all(isinstance(part, DistributedOptimizer) for part in getattr(optimizer, "chained_optimizers", [optimizer]))


def _check_optimizer_layout(root: str, path: str, metadata: dict, args, optimizer) -> None:
    """The ranks' ``_optimizer_layout_refusal`` at their layout, for this ``optimizer``."""
    refusal = _optimizer_layout_refusal(root, path, metadata, args, _current_layout(), _distributed(optimizer))
    if refusal is not None:
        raise UserError(refusal)


def _optimizer_layout_refusal(root: str, path: str, metadata: dict, args, requested: Layout,
                              distributed: bool) -> str | None:
    """The one line refusing an optimizer state megatron-core cannot load at the ``requested`` layout or into this
    optimizer (``distributed``: megatron-core's distributed optimizer), before its loader fails on missing keys or
    mismatched buckets (``args``: the saving run's, from common.pt); None when it loads.

    Megatron-LM's default, ``dp_reshardable`` (and the older ``dp_zero_gather_scatter``), holds the state in the
    distributed optimizer's own buckets, which follow the tensor/pipeline layout: megatron-core reshards it across
    data-parallel ranks only (distrib_optimizer.py ``sharded_state_dict``), and Megatron-LM refuses a TP/PP change
    likewise (training/checkpointing.py ``load_checkpoint``: "(TP, PP) mismatch after resume"). Megatron-LM's
    default before megatron-core 0.13, ``fully_sharded_model_space``, stores flattened slices of each parameter's
    state, which megatron-core 0.16.1 no longer reads at any layout (``ShardedTensor.validate_metadata_integrity``,
    "ShardedTensor.flattened_range is not supported"). A run without the distributed optimizer records no sharding
    (``_build_sharded_state_dict_metadata``); its state is keyed by parameter, not laid out as the distributed
    optimizer's.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    sharding = metadata.get("distrib_optim_sharding_type")
    model_alone = "pass --finetune or --no-load-optim to load the model alone"
    saved = saved_layout(args)
    if saved.expert != requested.expert:
        # At EP > 1 megatron-core chains a dense and an expert optimizer, whose keys (chained_N.) and step
        # counters a one-part state lacks (optimizer.py ChainedOptimizer.sharded_state_dict); a change of EP is
        # refused rather than tried.
        return (f"--load {root}: {path} holds the optimizer state of a run at --expert-model-parallel-size "
                f"{saved.expert}, requested {requested.expert}: megatron-core splits a mixture of experts' optimizer "
                f"by expert parallelism, so it loads only at the saved size; resume with --expert-model-parallel-size "
                f"{saved.expert}, or {model_alone}")
    if sharding is None:
        if distributed:
            return (f"--load {root}: {path} holds the state of an optimizer saved without the distributed "
                    "optimizer, which megatron-core does not load into one; resume without "
                    f"--use-distributed-optimizer and --zero-*-memory-optimization, or {model_alone}")
        return None
    if sharding == "fully_sharded_model_space":
        return (f"--load {root}: {path} holds the distributed optimizer's state as flattened slices "
                f"('{sharding}', Megatron-LM's before megatron-core 0.13), which megatron-core "
                f"{compat.check_megatron_core_version()} no longer reads; {model_alone}")
    if sharding in DistributedOptimizer.checkpoint_fully_reshardable_formats:
        return None
    if saved[:3] == requested[:3] and distributed:
        return None
    layout = "TP={} PP={} VPP={}".format
    saved_text = layout(*saved[:3]) + (f" DP={saved.data}" if saved.data else "")
    requested_text = layout(*requested[:3]) + (f" DP={requested.data}" if requested.data else "") + (
        "" if distributed else " without the distributed optimizer")
    if not distributed:
        return (f"--load {root}: {path} holds the distributed optimizer's state in its buckets ('{sharding}'), which "
                f"megatron-core loads only into the distributed optimizer: saved at {saved_text}, requested "
                f"{requested_text}; resume with --use-distributed-optimizer, or {model_alone}")
    return (f"--load {root}: {path} holds the distributed optimizer's state in its buckets ('{sharding}', "
            f"Megatron-LM's default format), which loads at another data-parallel size but only at the tensor/"
            f"pipeline layout it was saved at: saved at {saved_text}, requested {requested_text}; resume at "
            f"{layout(*saved[:3])}, pass --no-load-optim to load the model alone with a new optimizer state, or "
            f"reshard it first: megatron-patch checkpoint reshard --load-dir {root} --save-dir RESHARDED "
            f"--target-tensor-parallel-size {requested.tensor} --target-pipeline-parallel-size {requested.pipeline}"
            ", then --load RESHARDED")


def _check_finetune_coverage(path: str, state: dict, absent: set, logger) -> None:
    """Log the model tensors ``path`` does not have (they keep their initialisation); refuse a checkpoint that
    has none of them (another model altogether)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    keys = {v.key for v in nested_values(state) if isinstance(v, ShardedTensor)}
    absent = set(absent) & keys
    if absent == keys:
        raise ValueError(f"--load {path} --finetune: the checkpoint has none of this model's tensors; it holds "
                         "another model")
    if absent:
        logger.info(f"--finetune: {path} has no {', '.join(sorted(absent))}; initialised, not loaded")


def _load_release(root: str, model, logger) -> int:
    _load_model_only(root, model)
    logger.info(f"--load {root}: converted checkpoint ({weights_dir(root)}) has no optimizer, scheduler or "
                "RNG state; loaded the model only, starting at iteration 0 (as --finetune)")
    return 0


def _load_legacy(root: str, iteration: int, model, optimizer, scheduler, with_optimizer: bool, finetune: bool,
                 logger) -> int:
    """A Megatron-LM ``--ckpt-format torch`` save (``iter_N/mp_rank_*/model_optim_rng.pt``): its model and, unless
    --finetune or --no-load-optim (Megatron-LM's own flags, which skip the optimizer and scheduler alike) leave
    ``with_optimizer`` off, its optimizer and scheduler state at the layout it was saved at
    (``legacy.load_legacy_optimizer``). Its RNG state is not read."""
    path = checkpoint_dir(root, iteration)
    info = _load_model_only(root, model)
    if with_optimizer:
        try:
            load_legacy_optimizer(path, info, optimizer, scheduler,
                                  fix="pass --finetune or --no-load-optim to load its model")
        except CheckpointMismatch as error:
            raise UserError(f"--load {root}: {error}") from None
        what = "the model, optimizer and scheduler"
    else:
        _reload_main_params(optimizer)
        what = "the model"
    torch.distributed.barrier()
    start = 0 if finetune else iteration
    logger.info(f"--load {root}: loaded {what} of {path} (Megatron-LM per-rank files) without its RNG state (the "
                f"seeded RNG is kept, as --no-load-rng), starting at iteration {start}")
    return start


def _load_model_only(root: str, model) -> CheckpointInfo:
    """Load ``root``'s model, either format a conversion or Megatron-LM writes (torch_dist, the legacy per-rank
    files); return its description."""
    from megatron.core.utils import unwrap_model

    info = read_info(root)
    # The bare model: the legacy files are merged by parameter name, which Float16Module prefixes.
    load_into_chunks(unwrap_model(list(model)), root, info)
    torch.distributed.barrier()
    return info
