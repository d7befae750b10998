"""Saving and loading a trainer's checkpoint, whatever its model: the staging directory, every rank's RNG state,
publishing, choosing the checkpoint to load and the RNG on the way back. What the model, optimizer and scheduler
write is the model kind's (``checkpoint.megatron``, ``checkpoint.plain``): it passes its ``write_state``/``read_state``
here.

Example::

    save_checkpoint("ckpt", 100, write_state, info=info)                          # any TP/PP/DP layout
    iteration = load_checkpoint("ckpt", read_state, megatron=True)                # loads at another TP/PP too

The files and their description are ``checkpoint.format``'s: ``SAVE/iter_0000100/`` named by
``SAVE/latest_checkpointed_iteration.txt``, written through a staging directory and checksummed
(``checkpoint.integrity``).

A megatron model whose description is known (``info``) also gets ``SAVE/megatron_patch_args.json``, the file
``megatron-patch convert megatron-to-hf`` reads. A tracker holding ``release`` names a converted checkpoint
(``SAVE/release/``, Megatron-LM's convention): it has weights only, so loading it starts at iteration 0. A checkpoint
Megatron-LM's trainer saved loads too (its model described by the ``args`` it carries): torch_dist as ours, its
legacy per-rank files (``iter_N/mp_rank_*/model_optim_rng.pt``) for the model only, with --finetune or
--no-load-optim; both through ``checkpoint.load.load_into_chunks``.

megatron-core models go through ``dist_checkpointing`` (torch_dist, ``checkpoint.megatron``), plain/Hugging Face
models through ``save_pretrained`` and the optimizer state keyed by parameter name (``checkpoint.plain``).

A checkpoint with a missing, truncated or damaged file raises CorruptCheckpointError; ``load_fallback`` loads the
newest intact earlier ``iter_*`` instead.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import shutil
import time
from typing import Callable

import numpy
import torch

from megatron_patch.checkpoint.format import (
    RELEASE, TRACKER_FILE, CheckpointInfo, checkpoint_dir, checkpoint_format, complete_iterations, dtype_name,
    fsync_path, read_tracker, rng_file, write_args_file, write_tracker,
)
from megatron_patch.checkpoint.integrity import (
    CorruptCheckpointError, checksum_files, fsync_tree, make_staging_dir, publish, read_ahead_meanwhile, remove_old,
    save_checksummed, verify_checkpoint, verify_checksums_meanwhile, write_checksums,
)
from megatron_patch.unpickle import load_plain_values

# The trainer's log (training/engine.py sets it up: the last rank prints INFO), so each save is said once.
_LOG = logging.getLogger("rapidformer")


def trained_model_info(model_config, padded_vocab_size: int, precision: str, parallel,
                       loaded: CheckpointInfo | None) -> CheckpointInfo:
    """What ``megatron_patch_args.json`` records for the trainer's own checkpoints: the model, the stored weights'
    dtype (``precision``: bf16, fp16 or fp32) and ``parallel`` layout, and the Hugging Face description of the
    checkpoint it was ``loaded`` from (for export).

    Example::

        info = trained_model_info(model, 128, "bf16", config.parallel, config.checkpoint_info)
        save_megatron_checkpoint("ckpt", 10, chunks, optimizer, scheduler, info)
    """
    return CheckpointInfo(
        format="torch_dist", model_config=model_config, padded_vocab_size=padded_vocab_size,
        dtype=dtype_name(precision), tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        hf_config=loaded.hf_config if loaded else None, hf_architecture=loaded.hf_architecture if loaded else None,
        initialized_tensors=loaded.initialized_tensors if loaded else [],
    )


def save_checkpoint(root: str, iteration: int, write_state: Callable, *, info: CheckpointInfo | None = None,
                    keep_last_k: int | None = None, rng_from: str | None = None) -> str:
    """Write ``iter_{iteration}`` through a ``.tmp-`` directory, renamed once every rank's files are on disk and
    their checksums in ``checksums.json``; then ``info`` as ``megatron_patch_args.json`` and the tracker; with
    ``keep_last_k`` delete all but the newest K ``iter_*`` (never the tracker's).

    Example::

        save_checkpoint("ckpt", 300, backend.write_state, info=info, keep_last_k=2)
        # ckpt/iter_0000200, ckpt/iter_0000300; the tracker holds 300

    ``write_state(staging, rank, write_rng, finalize)`` writes this rank's model, optimizer and scheduler under
    ``staging``, calls ``write_rng()`` once its writer has started (it writes this rank's RNG state as it was at
    this call and returns the file's checksum, keyed by its name), checksums what it wrote, and calls
    ``finalize()`` on every rank once the files are written: at once, or when an asynchronous save is done.
    ``rng_from``: an iteration directory whose RNG files are copied instead (a resharded checkpoint keeps the
    generators of the run that saved it, not those of the processes that resharded it).
    """
    path = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    # Megatron-LM's wording (training/checkpointing.py save_checkpoint), which log scrapers look for.
    _LOG.info(f"saving checkpoint at iteration {iteration} to {root}")
    staging = make_staging_dir(path, rank)
    save = {"started": time.perf_counter(), "returned": False}
    finalize = functools.partial(_publish_when_written, root, staging, path, iteration, info, keep_last_k, save)
    write_rng = (functools.partial(_copy_rng, rng_from, staging, rank) if rng_from is not None
                 else functools.partial(_save_rng, staging, rank, _rng_state()))
    write_state(staging, rank, write_rng, finalize)
    save["returned"] = True
    return path


def _publish_when_written(root: str, staging: str, path: str, iteration: int, info: CheckpointInfo | None,
                          keep_last_k: int | None, save: dict) -> None:
    torch.distributed.barrier()  # every rank's files are written: rank 0 may publish them
    if torch.distributed.get_rank() == 0:
        write_checksums(staging, torch.distributed.get_world_size())
        fsync_tree(staging)
        publish(staging, path)
        if info is not None:
            write_args_file(root, info)
        write_tracker(root, iteration)
        remove_old(root, iteration, keep_last_k)
    torch.distributed.barrier()
    # An asynchronous save (--async-save) is published after later iterations ran, when save_checkpoint has long
    # returned: the line says it only now became the checkpoint a resume loads.
    latest = " (asynchronously; it is now the latest)" if save["returned"] else ""
    _LOG.info(f"saved checkpoint at iteration {iteration} to {root} in {time.perf_counter() - save['started']:.2f} s"
              f"{latest}")


def _rng_state() -> dict:
    """Every generator a step draws from, as Megatron-LM saves them: Python's and NumPy's (data code), torch's
    (dropout outside tensor-parallel regions), the GPU's, and megatron-core's tensor-parallel tracker (dropout
    inside them, different per TP rank); and the world size, which a resume must match to restore them. Tensors
    and plain values only, so the file loads with ``weights_only=True``: NumPy's key array is a tensor here (int64,
    which holds its uint32 values exactly); Python's state is a tuple of ints already."""
    from megatron.core import tensor_parallel

    name, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(numpy.int64)), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "world_size": torch.distributed.get_world_size(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    # A tensor, or a NumPy array in a checkpoint saved before the state was stored as tensors.
    numpy.random.set_state((name, numpy.asarray(keys).astype(numpy.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _save_rng(path: str, rank: int, state: dict) -> dict:
    """Write this rank's RNG ``state``; return its file's checksum, keyed by its name in the checkpoint."""
    os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    return {rng_file(rank): save_checksummed(state, os.path.join(path, rng_file(rank)))}


def _copy_rng(source: str, path: str, rank: int) -> dict:
    """Copy this rank's share of ``source``'s RNG files (every world-size-th, from ``rank`` on) to ``path``; return
    their checksums, keyed by their names in the checkpoint."""
    directory = os.path.join(source, "rng")
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    mine = [os.path.join("rng", name) for name in names[rank::torch.distributed.get_world_size()]]
    if mine:
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    for name in mine:
        shutil.copyfile(os.path.join(source, name), os.path.join(path, name))
        fsync_path(os.path.join(path, name))
    return dict(zip(mine, checksum_files([os.path.join(path, name) for name in mine])))


def _load_rng(path: str, rank: int, logger) -> None:
    # verify_checkpoint found every rank's file of the world size the checkpoint was saved at; none for this
    # rank, or another world size in it, means a resume at another world size.
    if not os.path.isdir(os.path.join(path, os.path.dirname(rng_file(rank)))):
        # Megatron-LM keeps its RNG state in its own common.pt/rank files, in a form not read here.
        logger.warning(f"{path}: no RNG state of this trainer (saved by Megatron-LM?); keeping the seeded RNG "
                       "(as --no-load-rng)")
        return
    file = os.path.join(path, rng_file(rank))
    state = load_plain_values(file) if os.path.isfile(file) else None
    if state is None or state["world_size"] != torch.distributed.get_world_size():
        logger.warning(f"{path}: no RNG state for this world size; keeping the seeded RNG (as --no-load-rng)")
        return
    _set_rng_state(state)


def load_checkpoint(root: str, read_state: Callable, *, megatron: bool, load_converted: Callable | None = None,
                    load_optim: bool = True, load_rng: bool = True, finetune: bool = False,
                    load_fallback: bool = False, verify_checksums: bool = True, logger=None) -> int:
    """Load the tracker's iteration; return the iteration to resume from (0 with ``finetune``). Raises
    FileNotFoundError when ``root`` has no tracker, CorruptCheckpointError when that checkpoint has a missing,
    truncated or damaged file (with ``load_fallback``: loads the newest intact earlier one);
    ``verify_checksums=False`` skips comparing the files' CRC-32s with ``checksums.json``.

    Example::

        iteration = load_checkpoint("ckpt", backend.read_state, megatron=True, load_fallback=True)

    ``read_state(path, with_optimizer, finetune)`` loads a checkpoint directory the trainer wrote (``megatron``:
    torch_dist files, else the plain backend's). A converted checkpoint (tracker ``release``) or Megatron-LM's
    per-rank files go to ``load_converted(root, iteration, with_optimizer, finetune) -> iteration`` (megatron models
    only), which loads the model alone, as Megatron-LM does.
    """
    logger = logger or logging.getLogger(__name__)
    iteration = _load(root, read_state, megatron, load_converted, load_optim and not finetune, load_rng, finetune,
                      load_fallback, verify_checksums, logger)
    # Megatron-LM's wording (training/checkpointing.py load_checkpoint), which log scrapers look for.
    logger.info(f"successfully loaded checkpoint from {root} at iteration {iteration}")
    return iteration


def _load(root: str, read_state: Callable, megatron: bool, load_converted: Callable | None, with_optimizer: bool,
          load_rng: bool, finetune: bool, load_fallback: bool, verify_checksums: bool, logger) -> int:
    iteration = read_tracker(root)
    if iteration is None:
        raise FileNotFoundError(f"--load {root}: no {TRACKER_FILE}; nothing to resume from")
    converted = iteration == RELEASE or checkpoint_format(checkpoint_dir(root, iteration)) == "torch"
    if converted:
        if load_converted is None:
            raise ValueError(f"--load {root}: a converted ({RELEASE}) or Megatron-LM per-rank checkpoint holds a "
                             "megatron-core model; this trainer's model is a plain torch/Hugging Face one")
        return load_converted(root, iteration, with_optimizer, finetune)
    # Every file there at its length first; the checksums are compared while the state loads (one read from disk).
    iteration = _complete_iteration(root, iteration, megatron, load_fallback, False, logger)
    path = checkpoint_dir(root, iteration)
    try:
        _read_verified(path, read_state, with_optimizer, finetune, verify_checksums)
    except CorruptCheckpointError as error:
        if not load_fallback:
            raise CorruptCheckpointError(f"--load {root}: {error}; pass --load-fallback to load the newest "
                                         "complete earlier checkpoint instead") from None
        # Whatever the damaged checkpoint put into the model and optimizer is overwritten: the earlier one holds
        # every tensor the state has.
        iteration = _intact_before(root, iteration, error, megatron, verify_checksums, logger)
        path = checkpoint_dir(root, iteration)
        read_state(path, with_optimizer, finetune)
    if load_rng and not finetune:
        _load_rng(path, torch.distributed.get_rank(), logger)
    torch.distributed.barrier()
    return 0 if finetune else iteration


def _read_verified(path: str, read_state: Callable, with_optimizer: bool, finetune: bool, checksums: bool) -> None:
    """``read_state`` of ``path`` while its checksums are compared (``integrity.verify_checksums_meanwhile``), or
    without ``checksums`` while its files are read ahead (``integrity.read_ahead_meanwhile``); a damaged file is
    named before any error the load met on it."""
    finish = verify_checksums_meanwhile(path) if checksums else read_ahead_meanwhile(path)
    try:
        read_state(path, with_optimizer, finetune)
    except Exception:
        finish()
        raise
    finish()


def _complete_iteration(root: str, iteration: int, megatron: bool, load_fallback: bool, checksums: bool,
                        logger) -> int:
    """``iteration`` when its checkpoint is intact (``checksums``: to its files' CRC-32s, else their presence and
    lengths); else, with ``load_fallback``, the newest intact earlier one. Every rank checks the same files, so
    all ranks pick the same checkpoint."""
    try:
        verify_checkpoint(checkpoint_dir(root, iteration), megatron=megatron, checksums=checksums, logger=logger)
        return iteration
    except CorruptCheckpointError as error:
        if not load_fallback:
            raise CorruptCheckpointError(f"--load {root}: {error}; pass --load-fallback to load the newest "
                                         "complete earlier checkpoint instead") from None
        return _intact_before(root, iteration, error, megatron, checksums, logger)


def _intact_before(root: str, iteration: int, problem: CorruptCheckpointError, megatron: bool, checksums: bool,
                   logger) -> int:
    """The newest checkpoint before ``iteration`` (whose ``problem`` is logged) that is intact; --load-fallback's."""
    verify = functools.partial(verify_checkpoint, megatron=megatron, checksums=checksums, logger=logger)
    for earlier in reversed([i for i in complete_iterations(root) if i < iteration]):
        try:
            verify(checkpoint_dir(root, earlier))
        except CorruptCheckpointError as error:
            logger.warning(f"--load-fallback: skipping {error}")
            continue
        logger.warning(f"--load {root}: {problem}; --load-fallback: loading iteration {earlier} instead")
        return earlier
    raise CorruptCheckpointError(f"--load {root}: {problem}; --load-fallback found no intact earlier checkpoint")


