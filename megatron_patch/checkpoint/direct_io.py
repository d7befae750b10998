"""Write large checkpoint files around the page cache (``O_DIRECT``), for PyTorch DCP's ``FileSystemWriter``.

Example::

    from megatron_patch.checkpoint.direct_io import DirectFileSystemWriter
    dcp_save(state, planner=planner, storage_writer=DirectFileSystemWriter("out/release"))

A conversion writes gigabytes once and never reads them back in the same process. Through the page cache each byte
is copied into the cache and written back by the kernel at the closing ``fsync``, which on the virtual disks we
measured runs at a fifth of the speed of the same bytes written with ``O_DIRECT`` (1.7 GB in 4.4 s against 1.0 s).
Here the data files go through aligned buffers straight to the device (one written by a helper thread while the
caller fills the other) and the ``fsync`` that closes each stream (after its tail is written and the file cut to
length) only flushes the device, so they are just as durable. Only the stream is replaced: DCP's format, planner and
metadata are untouched. Where the file system refuses ``O_DIRECT`` (tmpfs, some network mounts) the stream falls
back to an ordinary buffered file.
"""

from __future__ import annotations

import errno
import fcntl
import io
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

_BUFFER_BYTES = 16 << 20
_ALIGN = 4096  # the largest logical block size of common devices; mmap buffers are page-aligned


class _DirectWriter(io.RawIOBase):
    """A write-only stream on an ``O_DIRECT`` descriptor: bytes gather in an aligned buffer written whole; the
    tail is written padded to the alignment at ``close``, the file truncated to its real length and synced (an
    ``fsync`` before ``close``, as DCP's writer does, cannot cover the tail and the truncation).

    Two buffers take turns: while a full one is written by a helper thread (``os.write`` releases the GIL and an
    ``O_DIRECT`` write waits for the device), the caller fills the other, so producing the bytes (reading and
    serialising tensors) overlaps the disk instead of alternating with it. Writes stay in order, one at a time; an
    error in the helper is raised by the next ``write`` or by ``close``.
    """

    def __init__(self, fd: int):
        super().__init__()
        self._fd = fd
        self._buffers = [mmap.mmap(-1, _BUFFER_BYTES) for _ in range(2)]
        self._views = [memoryview(b) for b in self._buffers]
        self._view = self._views[0]
        self._filled = 0
        self._written = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="direct-io")
        self._in_flight: Future | None = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._written + self._filled

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        taken = 0
        while taken < len(data):
            n = min(len(data) - taken, _BUFFER_BYTES - self._filled)
            self._view[self._filled:self._filled + n] = data[taken:taken + n]
            self._filled += n
            taken += n
            if self._filled == _BUFFER_BYTES:
                self._hand_over(_BUFFER_BYTES)
        return taken

    def _hand_over(self, nbytes: int) -> None:
        """Start writing the current buffer's first ``nbytes`` in the helper; go on filling the other buffer."""
        self._wait()
        self._in_flight = self._writer.submit(self._drain, self._view, nbytes)
        self._written += self._filled
        self._filled = 0
        self._view = self._views[1] if self._view is self._views[0] else self._views[0]

    def _wait(self) -> None:
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def _drain(self, view: memoryview, nbytes: int) -> None:
        done = 0
        while done < nbytes:
            try:
                # Released even when the write raises: the traceback must not pin the buffer (close unmaps it).
                with view[done:nbytes] as rest:
                    done += os.write(self._fd, rest)
            except OSError as error:
                flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                if error.errno != errno.EINVAL or not flags & os.O_DIRECT:
                    raise
                # The file system opened the file with O_DIRECT but refuses such writes: write through the cache.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)

    def close(self) -> None:
        if self.closed:
            return
        try:
            length = self.tell()
            self._wait()
            if self._filled:
                padded = -(-self._filled // _ALIGN) * _ALIGN
                self._view[self._filled:padded] = bytes(padded - self._filled)
                self._drain(self._view, padded)
            os.ftruncate(self._fd, length)
            os.fsync(self._fd)
        finally:
            self._writer.shutdown()
            for view, buffer in zip(self._views, self._buffers):
                view.release()
                buffer.close()
            os.close(self._fd)
            super().close()


def open_direct(path) -> io.RawIOBase:
    """A new file at ``path`` written around the page cache where the file system allows it, else through it;
    synced when closed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError:  # EINVAL: this file system does not do O_DIRECT
        fd = os.open(path, flags, 0o644)
    return _DirectWriter(fd)


class _DirectFileSystem(FileSystem):
    """DCP's local file system, with data files (``*.distcp``) written through :class:`_DirectWriter`."""

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb" or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_direct(path) as stream:
            yield stream


class DirectFileSystemWriter(FileSystemWriter):
    """PyTorch DCP's ``FileSystemWriter`` (one thread, files synced) writing its data files with ``O_DIRECT``."""

    def __init__(self, path):
        super().__init__(path, thread_count=1)
        self.fs = _DirectFileSystem()
