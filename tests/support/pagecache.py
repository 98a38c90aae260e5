"""Cold reads for the tests: a file's pages dropped from the page cache."""

from __future__ import annotations

import os


def evict(path: str) -> None:
    """Write back and drop ``path``'s cached pages (``fsync`` + ``POSIX_FADV_DONTNEED``): its next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
