"""Cold reads for the tests: a file's pages dropped from the page cache."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


def evict(path: str) -> None:
    """Write back and drop ``path``'s cached pages (``fsync`` + ``POSIX_FADV_DONTNEED``): its next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident(path: str | Path) -> int:
    """Bytes of ``path`` in the page cache (``mincore`` over a mapping nothing touches)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert ctypes.CDLL(None, use_errno=True).mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0
        del address  # (the buffer export ends with the last reference)
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
