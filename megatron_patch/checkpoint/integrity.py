"""Crash safety and integrity of an iteration directory: staged, checksummed, fsynced, then published.

Example::

    staging = make_staging_dir("ckpt/iter_0000100", rank)     # ckpt/iter_0000100.tmp-1f2e3d4c, on every rank
    checksums = {rng_file(rank): save_checksummed(rng_state, os.path.join(staging, rng_file(rank)))}
    write_rank_checksums(staging, rank, checksums)            # each rank: the files it wrote
    write_checksums(staging, world_size); fsync_tree(staging); publish(staging, "ckpt/iter_0000100")  # rank 0
    verify_checkpoint("ckpt/iter_0000100", megatron=True)     # a truncated or bit-flipped file raises

Crash safety: a save goes to ``SAVE/iter_0000100.tmp-<id>/``, is fsynced, renamed to ``iter_0000100`` and only
then named by the tracker (:func:`format.write_tracker`, replaced atomically), so a process killed mid-save leaves
the previous checkpoint current; loading ignores ``*.tmp-*`` leftovers and :func:`remove_old` removes them (and,
with ``keep_last_k``, all but the newest checkpoints) after the next successful save.

Integrity: every save records each file's length and CRC-32 in ``iter_*/checksums.json``, written before the rename
that publishes the checkpoint. A checkpoint with a missing, truncated or damaged file (one whose CRC-32 differs,
e.g. flipped bytes) raises CorruptCheckpointError naming both. A checkpoint saved before checksums were recorded
(no ``checksums.json``) is checked for its files' presence and length only.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import mmap
import os
import queue
import re
import shutil
import threading
import uuid
import zipfile
from typing import Callable

import torch

# ISA-L's CRC-32: zlib's checksum (same polynomial, same values), about 8x faster here (PCLMULQDQ); a checkpoint's
# checksums then cost a tenth of what writing it does, not a third.
from isal.isal_zlib import crc32

from megatron_patch import compat
from megatron_patch.checkpoint.format import checkpoint_dir, complete_iterations, fsync_path, rng_file
from megatron_patch.errors import CorruptCheckpointError
from megatron_patch.unpickle import load_dcp_metadata, load_plain_values

CHECKSUMS = "checksums.json"
_CHECKSUMS_FORMAT = {"format": "megatron_patch checkpoint checksums", "version": 1, "algorithm": "crc32"}
# Each rank's checksums of the files it wrote, merged into CHECKSUMS by rank 0 before the checkpoint is published.
_RANK_CHECKSUMS = "checksums.rank_{:05d}.json"
_STAGING = re.compile(r"iter_(\d{7})\.tmp-")
# What the read-ahead of an unverified load reads at a time. Read, not posix_fadvise(WILLNEED): asking the kernel
# for the files ahead made the load slower than none here (bench/checkpoint_io.py's checkpoint: 0.72 s against
# 0.64 s, median of 15), reading them as the verified load's checksums do made it faster (0.57 s).
_READ_AHEAD_CHUNK = 8 << 20


class _ChecksummedFile:
    """A file opened for writing that keeps the length and CRC-32 of what is written to it (``torch.save`` takes
    it as its file), so the file is checksummed as it is written, not read back; flushed to disk when closed.

    Example::

        with _ChecksummedFile("ckpt/trainer_state.pt") as f:
            torch.save(state, f)
        f.checksum()   # {"bytes": 1234, "crc32": "9a3c11f0"}
    """

    def __init__(self, path: str):
        self._file = open(path, "wb")
        self._crc = self._bytes = 0

    def write(self, data) -> int:
        self._crc = crc32(data, self._crc)
        self._bytes += memoryview(data).nbytes
        return self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def checksum(self) -> dict:
        return _checksum_entry(self._bytes, self._crc)

    def __enter__(self) -> "_ChecksummedFile":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._file.flush()
            # Each rank flushes its own files: on a shared filesystem rank 0's fsync does not reach another node's.
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


def save_checksummed(obj, path: str) -> dict:
    """``torch.save(obj, path)``, flushed to disk; returns the file's checksum."""
    with _ChecksummedFile(path) as f:
        torch.save(obj, f)
    return f.checksum()


def _checksum_entry(size: int, crc: int) -> dict:
    return {"bytes": size, "crc32": f"{crc:08x}"}


def _checksum_file(path: str) -> dict:
    """The length and CRC-32 of the file at ``path``. Mapped, not read: the CRC runs over the page cache itself
    (a read's copy into a buffer made it about 1.5x slower here)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # mmap refuses an empty file
            return _checksum_entry(0, 0)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            return _checksum_entry(size, crc32(mapped))


def checksum_files(paths: list[str]) -> list[dict]:
    """``_checksum_file`` of each path, the files in parallel (the CRC releases the GIL)."""
    if len(paths) < 2:
        return [_checksum_file(path) for path in paths]
    with concurrent.futures.ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(_checksum_file, paths))


def write_checksummed(staging: str, checksums: dict, transforms: list, rank: int, write_buckets: list,
                      results_queue, *, background: bool = False) -> None:
    """megatron-core's torch_dist write (``async_fn(rank, write_buckets, results_queue)`` of
    ``FileSystemWriterAsync.get_save_function_and_args``, strategies/filesystem_async.py) with its own
    per-file writer, ``FileSystemWriterAsync.write_preloaded_data``, run in a thread per file instead of the
    process per file 0.16.1's ``write_preloaded_data_multiproc`` forks; then the CRC-32 of each ``.distcp``, read back
    from the page cache it was just written through, and this rank's checksums file.

    Example::

        request = dist_checkpointing.save(state, staging, async_sharded_save=True, **async_save_options())
        request = compat.with_write_function(request, functools.partial(write_checksummed, staging, checksums))

    Threads suffice: torch.save's writes release the GIL. So no save forks a process (an ``--async-save`` runs
    this in a thread of its own: ``checkpoint.async_save``). The write results (or the first failure) go to
    ``results_queue`` as megatron-core's do, where the save's finalization (``retrieve_write_results``) raises a
    failure.

    ``background``: this is an ``--async-save``'s thread; it and the writer threads it starts take the CPU only
    when training leaves it (nice 19, which on Linux applies to the calling thread and the threads it starts, and
    also puts their I/O last in the best-effort class), so the steps that run meanwhile are not slowed by the
    writing: the save finishes later instead.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if background:
        os.nice(19)
    local_results, count = queue.Queue(), queue.Queue()  # what each writer reports, and its done-marker

    def write(index: int, bucket) -> None:
        count.put(index)
        # The zip records torch.save writes carry a CRC-32 of their own, which torch.load never checks (torch/
        # serialization.py ``set_crc32_options``); this rank's checksums file holds each whole file's CRC-32, so the
        # records' would be a second pass over every byte for nothing. The option is per thread: set in the writer.
        torch.serialization.set_crc32_options(False)
        FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, local_results, count, use_fsync=True)

    with concurrent.futures.ThreadPoolExecutor(len(write_buckets)) as pool:
        list(pool.map(write, range(len(write_buckets)), write_buckets))
    written = dict(local_results.get() for _ in write_buckets)
    failure = next((result for result in written.values() if isinstance(result, Exception)), None)
    if failure is not None:
        results_queue.put(failure)
        return
    results_queue.put(written)
    files = [file for file, _, _ in write_buckets]
    for file, checksum in zip(files, checksum_files(files)):
        checksums[os.path.relpath(file, staging)] = checksum
    write_rank_checksums(staging, rank, checksums)


def write_rank_checksums(staging: str, rank: int, checksums: dict) -> None:
    with open(os.path.join(staging, _RANK_CHECKSUMS.format(rank)), "w") as f:
        json.dump(checksums, f)


def write_checksums(staging: str, world_size: int) -> None:
    """Merge the ranks' checksums into ``checksums.json``, adding those of the files no rank checksummed while
    writing (rank 0's ``common.pt`` with megatron-core 0.16.1, ``metadata.json`` and ``.metadata``;
    ``save_pretrained``'s files)."""
    files = {}
    for rank in range(world_size):
        part = os.path.join(staging, _RANK_CHECKSUMS.format(rank))
        with open(part) as f:
            files.update(json.load(f))
        os.remove(part)
    rest = [os.path.relpath(os.path.join(directory, name), staging)
            for directory, _, names in os.walk(staging) for name in names]
    rest = [name for name in rest if name not in files]
    files.update(zip(rest, checksum_files([os.path.join(staging, name) for name in rest])))
    with open(os.path.join(staging, CHECKSUMS), "w") as f:
        json.dump({**_CHECKSUMS_FORMAT, "files": dict(sorted(files.items()))}, f, indent=1)


def make_staging_dir(path: str, rank: int) -> str:
    """A fresh ``iter_*.tmp-<id>`` every rank writes into; the id (made by rank 0) keeps a killed save's
    leftovers from mixing with this one's files."""
    name = [f"{path}.tmp-{uuid.uuid4().hex[:8]}" if rank == 0 else None]
    if rank == 0:
        os.makedirs(name[0])
    torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


def fsync_tree(path: str) -> None:
    """Flush every file and directory under ``path`` before the rename publishes it: a rename can reach the disk
    before the data it names (ext4/xfs delayed allocation), leaving a complete-looking checkpoint of empty files."""
    for directory, _, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(directory, name))
        fsync_path(directory)


def publish(staging: str, path: str) -> None:
    """Rename ``staging`` to ``path``; an existing ``path`` (the same iteration saved again) is moved aside
    first, since a directory cannot be renamed onto a non-empty one."""
    replaced = None
    if os.path.exists(path):
        replaced = f"{staging}-replaced"
        os.rename(path, replaced)
    os.rename(staging, path)
    fsync_path(os.path.dirname(path))
    if replaced is not None:
        shutil.rmtree(replaced)


def remove_old(root: str, iteration: int, keep_last_k: int | None) -> None:
    """Remove killed saves' ``*.tmp-*`` directories (up to ``iteration``) and, with ``keep_last_k``, all but the
    newest K checkpoints (``iteration``, the one the tracker now names, always stays)."""
    for name in os.listdir(root):
        staging = _STAGING.match(name)
        # Later iterations' staging directories may be asynchronous saves still being written.
        if staging and int(staging.group(1)) <= iteration:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if keep_last_k is None:
        return
    complete = complete_iterations(root)
    keep = set(complete[-keep_last_k:]) | {iteration}
    for old in complete:
        if old not in keep:
            shutil.rmtree(checkpoint_dir(root, old))


def verify_checkpoint(path: str, megatron: bool, *, checksums: bool = True, logger=None) -> None:
    """Raise CorruptCheckpointError naming ``path`` and the file when a file is missing, shorter than what the
    checkpoint's own metadata records, or (``checksums``) its CRC-32 differs from ``checksums.json``'s. Under
    torch.distributed every rank must call it: the ranks share the reading, each file is read once.

    Example::

        verify_checkpoint("ckpt/iter_0000100", megatron=True)   # a truncated or bit-flipped __0_0.distcp raises

    A checkpoint without ``checksums.json`` (saved before checksums were recorded) is checked from its own
    metadata and its RNG files, and ``logger`` says so.
    """
    if not os.path.isdir(path):
        raise CorruptCheckpointError(f"checkpoint {path} does not exist")
    if not megatron:
        _require(path, "trainer_state.pt", zipped=True)
        if not any(os.path.isfile(os.path.join(path, name)) for name in ("model.pt", "config.json")):
            raise CorruptCheckpointError(f"checkpoint {path} is incomplete: neither model.pt nor config.json")
    else:
        # megatron-core 0.16.1 saves a common.pt; 0.19 its common state among the sharded objects, which DCP's
        # .metadata (written last, by rank 0) indexes (compat.common_state_source). Either end reads either.
        source = compat.common_state_source(path)
        _require(path, os.path.basename(source), zipped=source.endswith(compat.COMMON_STATE_FILE))
        try:
            with open(_require(path, "metadata.json")) as f:
                json.load(f)
        except ValueError as error:
            raise CorruptCheckpointError(f"checkpoint {path} is corrupted: metadata.json is not JSON ({error})"
                                         ) from None
        _verify_distcp_sizes(path)
    if not os.path.isfile(os.path.join(path, CHECKSUMS)):
        (logger or logging.getLogger(__name__)).info(
            f"{path} has no {CHECKSUMS} (saved before checksums were recorded): its files are checked for presence "
            "and length, not content")
        _verify_rng_files(path)
        return
    _verify_checksums(path, checksums)


def _recorded_checksums(path: str) -> dict:
    try:
        with open(os.path.join(path, CHECKSUMS)) as f:
            return json.load(f)["files"]
    except (ValueError, KeyError) as error:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupted: {CHECKSUMS} does not load ({error!r})"
                                     ) from None


def _verify_checksums(path: str, checksums: bool) -> None:
    """Every file ``checksums.json`` lists is there with its length and (``checksums``) its CRC-32."""
    files = _recorded_checksums(path)
    for name, recorded in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        size = os.path.getsize(file)
        if size != recorded["bytes"]:
            damage = "truncated" if size < recorded["bytes"] else "longer than written"
            raise CorruptCheckpointError(f"checkpoint {path} is corrupted: {name} is {damage} ({size} bytes; "
                                         f"{CHECKSUMS} records {recorded['bytes']})")
    if checksums:
        _agree_on_damage(path, _damaged_file(path, files))


def verify_checksums_meanwhile(path: str) -> Callable[[], None]:
    """Start comparing this rank's share of ``path``'s files with their CRC-32s in ``checksums.json`` in a thread;
    return the function that waits for it and raises CorruptCheckpointError on every rank when any rank found a
    damaged file. Under torch.distributed every rank must call both, the second outside any other collective.

    Example::

        verify_checkpoint(path, megatron=True, checksums=False)   # every file there, at its length
        finish = verify_checksums_meanwhile(path)
        dist_checkpointing.load(state, path)                       # reads the files the thread reads: once from disk
        finish()                                                   # a flipped byte raises here

    The checksums and the load read the same bytes; side by side, the disk serves them once and the CRC, which
    releases the GIL, runs while the load unpickles, instead of a whole read of the checkpoint before it.
    A checkpoint without ``checksums.json`` has nothing to compare.
    """
    if not os.path.isfile(os.path.join(path, CHECKSUMS)):
        return lambda: None
    files = _recorded_checksums(path)
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verify-checksums")
    damaged = pool.submit(_damaged_file, path, files, one_at_a_time=True)
    pool.shutdown(wait=False)
    return lambda: _agree_on_damage(path, damaged.result())


def read_ahead_meanwhile(path: str) -> Callable[[], None]:
    """Read this rank's share of ``path``'s files into the page cache in a thread, as ``verify_checksums_meanwhile``
    does without the checksums; return the function that stops it. For a load with ``--no-verify-checksums``, which
    otherwise waits on the disk at each of the load's reads.

    Example::

        stop = read_ahead_meanwhile(path)
        dist_checkpointing.load(state, path)     # finds the files' bytes in the page cache
        stop()
    """
    sizes = {os.path.relpath(os.path.join(directory, name), path): os.path.getsize(os.path.join(directory, name))
             for directory, _, names in os.walk(path) for name in names}
    stopped = threading.Event()

    def read() -> None:
        buffer = bytearray(_READ_AHEAD_CHUNK)
        for name in _rank_share(sizes, one_at_a_time=True):
            with open(os.path.join(path, name), "rb", buffering=0) as f:
                while f.readinto(buffer):
                    if stopped.is_set():
                        return

    threading.Thread(target=read, name="read-ahead", daemon=True).start()
    return stopped.set


def _rank_share(sizes: dict, one_at_a_time: bool) -> list[str]:
    """This rank's share of the files ``sizes`` gives the bytes of (by name), largest first, dealt out in turn: the
    ranks read about as many bytes each. ``one_at_a_time``: in name order, as a load beside the reading reads them
    (DCP's data files in its plan's order, ``__0_0.distcp`` first): the load then finds each file's bytes in the page
    cache as soon as they are, where two files read side by side would both be half read until near the end."""
    rank, world_size = ((torch.distributed.get_rank(), torch.distributed.get_world_size())
                        if torch.distributed.is_initialized() else (0, 1))
    mine = sorted(sizes, key=lambda name: (-sizes[name], name))[rank::world_size]
    return sorted(mine) if one_at_a_time else mine


def _damaged_file(path: str, files: dict, one_at_a_time: bool = False) -> str | None:
    """The first of this rank's share of ``files`` (``checksums.json``'s) whose CRC-32 differs; None if none.
    ``one_at_a_time``: the files one after the other in name order (``_rank_share``), else side by side."""
    mine = _rank_share({name: entry["bytes"] for name, entry in files.items()}, one_at_a_time)
    if one_at_a_time:
        found = [_checksum_file(os.path.join(path, name)) for name in mine]
    else:
        found = checksum_files([os.path.join(path, name) for name in mine])
    return next((name for name, checksum in zip(mine, found) if checksum != files[name]), None)


def _agree_on_damage(path: str, here: str | None) -> None:
    """Raise on every rank when any rank's share had a damaged file (``here``: this rank's)."""
    damaged = [here]
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world_size > 1:
        damaged = [None] * world_size
        torch.distributed.all_gather_object(damaged, here)
    name = next((name for name in damaged if name is not None), None)
    if name is not None:
        raise CorruptCheckpointError(
            f"checkpoint {path} is corrupted: {name} does not match its CRC-32 in {CHECKSUMS} (damaged on disk or "
            "in a copy); --no-verify-checksums loads it as it is")


def _verify_rng_files(path: str) -> None:
    """Every rank's RNG file of the world size the checkpoint was saved at (recorded in each file), each a whole
    ``torch.save`` file. A missing one would leave that rank on its seeded RNG unnoticed: ``_load_rng`` takes a
    missing file for a resume at another world size."""
    directory = os.path.join(path, "rng")
    if not os.path.isdir(directory):  # not saved by this trainer (it always writes rng/): loaded as --no-load-rng
        return
    names = sorted(os.listdir(directory))
    for name in names:
        _require(path, os.path.join("rng", name), zipped=True)
    first = _require(path, os.path.join("rng", names[0]) if names else rng_file(0))
    for rank in range(load_plain_values(first)["world_size"]):
        _require(path, rng_file(rank))


def _require(path: str, name: str, zipped: bool = False) -> str:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise CorruptCheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    # torch.save writes a zip whose directory sits at the end, so a truncated file is not a zip any more.
    if zipped and not zipfile.is_zipfile(file):
        raise CorruptCheckpointError(f"checkpoint {path} is corrupted: {name} is truncated or not a torch.save file")
    return file


def _verify_distcp_sizes(path: str) -> None:
    """torch_dist's ``.metadata`` records each tensor's file, offset and length; a ``.distcp`` shorter than its
    last record was cut off."""
    metadata = _require(path, ".metadata")
    try:
        with open(metadata, "rb") as f:
            storage = load_dcp_metadata(f, metadata).storage_data
    except CorruptCheckpointError:  # load_dcp_metadata's refusal, already naming the file
        raise
    except Exception as error:  # any unpickling failure means the same thing: a damaged .metadata
        raise CorruptCheckpointError(f"checkpoint {path} is corrupted: .metadata does not load ({error!r})") from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CorruptCheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if os.path.getsize(file) < size:
            raise CorruptCheckpointError(f"checkpoint {path} is corrupted: {name} is truncated "
                                         f"({os.path.getsize(file)} bytes; .metadata records {size})")
