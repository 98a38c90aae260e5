"""Reads that bypass the page cache (``O_DIRECT``): each thread reads a whole window per request into
an aligned buffer. ``SHARDED_STATE_DIRECT_IO=on`` reads local files so where the file system allows;
``auto`` (default) and ``off`` keep the page cache (see ``docs/performance.md``)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ..format.errors import InvalidOption
from .local import truncated

# O_DIRECT aligns offset, length and address to the logical block size; the page size covers it.
ALIGN = mmap.PAGESIZE
WINDOW_BYTES = 16 * 1024 * 1024
ENV = "SHARDED_STATE_DIRECT_IO"
MODES = ("auto", "on", "off")


def direct_mode() -> str:
    """The ``SHARDED_STATE_DIRECT_IO`` setting: ``auto`` (default), ``on`` or ``off``."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise InvalidOption(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}.")
    return mode


def choose_direct(fds_and_sizes: Sequence[tuple[int, int]], mode: str | None = None) -> bool:
    """Whether a load of these local files reads them with ``O_DIRECT``."""
    mode = direct_mode() if mode is None else mode
    return mode == "on" and bool(fds_and_sizes)


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
    """One thread's ``O_DIRECT`` reads of an opened file (a :class:`.location.ByteStream`), through
    an aligned window: the reader has it :meth:`hold` each span, one direct request, and copies out."""

    def __init__(self, path: str, fd: int, size: int, window: int = WINDOW_BYTES) -> None:
        self.path, self.fd, self.size, self.window = path, fd, size, window
        self.buffer: AlignedBuffer | None = None
        self.begin = self.end = 0  # the file bytes the buffer holds
        # The next window, read by a helper thread while this one copies out of the current.
        self.spare: AlignedBuffer | None = None
        self.ahead: tuple[int, int, Future[int]] | None = None
        self.helper: ThreadPoolExecutor | None = None

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

    def _aligned(self, begin: int, end: int) -> tuple[int, int]:
        return begin // ALIGN * ALIGN, min(-(-end // ALIGN) * ALIGN, -(-self.size // ALIGN) * ALIGN)

    def _fill(self, buffer: AlignedBuffer, begin: int, need: int) -> int:
        view, offset, got = buffer.view, begin, 0
        while got < need:
            n = os.preadv(self.fd, [view[got:need]], offset)
            if n <= 0:
                break  # end of file: the bytes wanted may still all be there
            got += n
            offset += n
            if n % ALIGN:
                break  # a short read ends at the end of the file
        return got

    @staticmethod
    def _sized(buffer: AlignedBuffer | None, need: int, window: int) -> AlignedBuffer:
        if buffer is None or buffer.nbytes < need:
            if buffer is not None:
                buffer.close()
            buffer = AlignedBuffer(max(need, window))
        return buffer

    def hold(self, begin: int, end: int) -> None:
        """Have the file bytes ``[begin, end)`` (aligned outwards) in the window: read ahead, or one request now."""
        begin, end = self._aligned(begin, end)
        if self.begin <= begin and end <= self.end:
            return
        if self.ahead is not None:
            a_begin, _, future = self.ahead
            self.ahead = None
            got = future.result()
            if a_begin <= begin and end <= a_begin + got:
                self.buffer, self.spare = self.spare, self.buffer
                self.begin, self.end = a_begin, a_begin + got
                return
        self.buffer = self._sized(self.buffer, end - begin, self.window)
        self.begin, self.end = begin, begin + self._fill(self.buffer, begin, end - begin)

    def read_ahead(self, begin: int, end: int) -> None:
        """Start reading ``[begin, end)`` on the helper thread, for the :meth:`hold` after the current one."""
        begin, end = self._aligned(begin, end)
        if self.ahead is not None or end <= begin or (self.begin <= begin and end <= self.end):
            return
        self.spare = self._sized(self.spare, end - begin, self.window)
        if self.helper is None:
            self.helper = ThreadPoolExecutor(1, thread_name_prefix="sharded-direct")
        self.ahead = (begin, end, self.helper.submit(self._fill, self.spare, begin, end - begin))

    def readv(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` with consecutive bytes from ``offset``."""
        total = sum(len(v) for v in views)
        if not (self.begin <= offset and offset + total <= self.end):
            self.hold(offset, offset + max(total, self.window))
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
        if self.ahead is not None:
            with contextlib.suppress(Exception):
                self.ahead[2].result()  # never unmap a buffer a read is still filling
            self.ahead = None
        if self.helper is not None:
            self.helper.shutdown()
            self.helper = None
        for buffer in (self.buffer, self.spare):
            if buffer is not None:
                buffer.close()
        self.buffer = self.spare = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
