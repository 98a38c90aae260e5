"""Reads that bypass the page cache (``O_DIRECT``), for files that are not in it.

A cold load through the page cache is held back by readahead: each thread's stream has
one or two readahead requests of at most a few hundred KiB in flight, and every byte is
copied twice by the CPU (device -> page cache by DMA, page cache -> parameter by the
kernel) and leaves the page cache full of a checkpoint that is read once. With
``O_DIRECT`` each thread asks the device for a whole window (16 MiB by default) in one
request, which the block layer splits into as many device requests as it takes and
issues at once; the bytes land by DMA in a page-aligned buffer of the thread, from which
they are copied to their targets (or to the pinned staging of an accelerator target).
Nothing is cached, so memory stays the parameters'.

Which path a load takes (:func:`choose_direct`): ``SHARDED_STATE_DIRECT_IO=auto`` (the
default) reads directly when less than half of the files' pages are resident in the page
cache (``mincore`` over a mapping of each file, no read), ``on`` always where the file
system supports it, ``off`` never. Warm files keep the page-cache path: copying out of
the cache is faster than any device. File systems without ``O_DIRECT`` (tmpfs) fall back
to the page cache per file.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Sequence

from ..format.errors import ShardedStateError
from .local import truncated

# O_DIRECT wants the file offset, the length and the buffer address aligned to the logical
# block size (512 B or 4 KiB); the page size covers both.
ALIGN = mmap.PAGESIZE
# The bytes one direct request asks for: large enough that the device sees many requests in
# flight per thread (the block layer splits it into max_sectors_kb pieces, issued at once).
WINDOW_BYTES = 16 * 1024 * 1024
# auto: read directly when less than this share of the files' pages is in the page cache.
RESIDENT_LIMIT = 0.5
ENV = "SHARDED_STATE_DIRECT_IO"
MODES = ("auto", "on", "off")


def direct_mode() -> str:
    """The ``SHARDED_STATE_DIRECT_IO`` setting: ``auto`` (default), ``on`` or ``off``."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ShardedStateError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}.")
    return mode


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "mincore"):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def resident_bytes(fd: int, size: int) -> int | None:
    """How many bytes of the file's first ``size`` are in the page cache (``mincore``), or None if unknown.

    The file is mapped (``PROT_READ``, shared) but never touched, so nothing is read.
    """
    libc = _libc()
    if libc is None or size <= 0:
        return None if libc is None else 0
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        if libc.mincore(address, size, vector) != 0:
            return None
        resident = sum(b & 1 for b in vector.raw)
    finally:
        libc.munmap(address, size)
    return min(size, resident * mmap.PAGESIZE)


def choose_direct(fds_and_sizes: Sequence[tuple[int, int]], mode: str | None = None) -> bool:
    """Whether a load of these local files reads them with ``O_DIRECT`` (see the module docstring)."""
    mode = direct_mode() if mode is None else mode
    if mode != "auto" or not fds_and_sizes:
        return mode == "on" and bool(fds_and_sizes)
    total = sum(size for _, size in fds_and_sizes)
    resident = 0
    for fd, size in fds_and_sizes:
        r = resident_bytes(fd, size)
        if r is None:
            return False  # cannot tell: the page cache is never wrong, only slower
        resident += r
    return total > 0 and resident < RESIDENT_LIMIT * total


class AlignedBuffer:
    """Page-aligned anonymous memory (what ``O_DIRECT`` reads into); pinned for CUDA if asked."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = -(-nbytes // ALIGN) * ALIGN
        self.region = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self.region)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.region))

    def close(self) -> None:
        self.view.release()
        with contextlib.suppress(BufferError):
            self.region.close()


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


class DirectStream:
    """One thread's ``O_DIRECT`` reads of an opened file, through one aligned window buffer.

    ``readv`` (the :class:`.location.ByteStream` interface) serves requests from the window
    read last, reading a new window (aligned, ``WINDOW_BYTES`` or the request, whichever is
    larger) when a request leaves it; the reader calls :meth:`prefetch` with a whole span
    first, so a span is one direct request and its tensors are memory copies out of it.
    """

    def __init__(self, path: str, fd: int, size: int, window: int = WINDOW_BYTES) -> None:
        self.path, self.fd, self.size, self.window = path, fd, size, window
        self.buffer: AlignedBuffer | None = None
        self.begin = self.end = 0  # the file bytes the buffer holds

    @classmethod
    def open(cls, path: str, fd: int, size: int, window: int = WINDOW_BYTES) -> DirectStream | None:
        """A direct stream of the open file ``fd``, or None where its file system refuses ``O_DIRECT``."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            direct_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag)
        except OSError:
            return None
        return cls(path, direct_fd, size, window)

    def prefetch(self, begin: int, end: int) -> None:
        """Read the file bytes ``[begin, end)`` (aligned outwards) into the window, with one request."""
        begin = begin // ALIGN * ALIGN
        end = min(-(-end // ALIGN) * ALIGN, -(-self.size // ALIGN) * ALIGN)
        if self.begin <= begin and end <= self.end:
            return
        need = end - begin
        if self.buffer is None or self.buffer.nbytes < need:
            if self.buffer is not None:
                self.buffer.close()
            self.buffer = AlignedBuffer(max(need, self.window))
        view, offset, got = self.buffer.view, begin, 0
        while got < need:
            n = os.preadv(self.fd, [view[got:need]], offset)
            if n <= 0:
                break  # end of file: the bytes wanted may still all be there
            got += n
            offset += n
            if n % ALIGN:
                break  # a short read ends at the end of the file
        self.begin, self.end = begin, begin + got

    def readv(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` with consecutive bytes from ``offset``."""
        total = sum(len(v) for v in views)
        if not (self.begin <= offset and offset + total <= self.end):
            self.prefetch(offset, offset + max(total, self.window))
            if offset + total > self.end:
                raise truncated(self.path, self.end)
        assert self.buffer is not None
        source = self.buffer.address + offset - self.begin
        for v in views:
            if len(v):
                # ctypes releases the GIL for the copy, so threads copy in parallel.
                ctypes.memmove(_address(v), source, len(v))
                source += len(v)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
