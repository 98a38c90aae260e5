"""How a cold file's pages come into a private mapping, one way per process: the question behind
issue 70's cold start on AVX-512 (the mapped load pages a file in with ``MADV_POPULATE_READ``, then
reads a byte of each page where vLLM's post-processing reads every weight next).

    python -m benchmarks.page_in_probe FILE MODE [DELAY]

MODE: ``populate`` (``MADV_POPULATE_READ`` over the whole mapping), ``populate_touch`` (then one byte
of every page read), ``touch_only`` (one byte of every page read, the kernel's read-ahead doing the
I/O), ``mmap_copy`` (the mapping copied into fresh memory, as a loader that copies does),
``read_copy`` (``readv`` into fresh memory); ``chunked`` (populate, then touch, 64 MiB at a time),
``pipelined`` (the next 64 MiB populated on a second thread while one touches), ``willneed``
(``MADV_WILLNEED`` on the whole mapping, then ``chunked``); ``streams`` (``chunked`` on 4 threads,
each over a quarter, as the loader's streams), ``streams_touch`` (the same, touch only); ``steps``
(``POSIX_FADV_WILLNEED`` one read-ahead window at a time over the file, as the loader asks now, then
``populate_touch``), ``steps_read_copy`` (the same asking, then ``read_copy``); ``warm`` and
``steps_warm`` (the file read into the page cache first, as it is or after that asking, so in
large or small pages; then ``populate`` timed, a warm load's mapping). The file's
pages are dropped from the page cache first (``posix_fadvise(DONTNEED)``); run the modes interleaved,
several times: the host behind a VM may hold the dropped pages back or not, which moves the figures
between runs.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

import torch

from benchmarks.harness import warm
from vllm_sharded_loader.storage import oscalls

MADV_POPULATE_READ = 22
PAGE = mmap.PAGESIZE


CHUNK = 64 << 20


def _populate(libc: ctypes.CDLL, data: torch.Tensor) -> None:
    if libc.madvise(ctypes.c_void_p(data.data_ptr()), ctypes.c_size_t(data.numel()), MADV_POPULATE_READ):
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")


def chunked(libc: ctypes.CDLL, data: torch.Tensor) -> None:
    """Populate, then touch, 64 MiB at a time, on one thread."""
    for start in range(0, data.numel(), CHUNK):
        chunk = data[start : start + CHUNK]
        _populate(libc, chunk)
        chunk[::PAGE].sum()


def pipelined(libc: ctypes.CDLL, data: torch.Tensor) -> None:
    """Populate the next 64 MiB on a second thread while this one touches the last populated."""
    from concurrent.futures import ThreadPoolExecutor

    chunks = [data[start : start + CHUNK] for start in range(0, data.numel(), CHUNK)]
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(_populate, libc, chunks[0])
        for i, chunk in enumerate(chunks):
            ahead.result()
            if i + 1 < len(chunks):
                ahead = pool.submit(_populate, libc, chunks[i + 1])
            chunk[::PAGE].sum()


def willneed(libc: ctypes.CDLL, data: torch.Tensor) -> None:
    """``MADV_WILLNEED`` over the whole mapping (read-ahead started), then :func:`chunked`."""
    libc.madvise(ctypes.c_void_p(data.data_ptr()), ctypes.c_size_t(data.numel()), MADV_WILLNEED)
    chunked(libc, data)


def _on_threads(each, data: torch.Tensor, threads: int = 4) -> None:
    """``each(part)`` on ``threads`` threads, each over its own page-aligned share of ``data``."""
    from concurrent.futures import ThreadPoolExecutor

    share = -(-data.numel() // threads // PAGE) * PAGE
    with ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(each, data[i : i + share]) for i in range(0, data.numel(), share)]:
            done.result()


def streams(libc: ctypes.CDLL, data: torch.Tensor) -> None:
    """:func:`chunked` on 4 threads, each over its own quarter (as the loader's streams)."""
    _on_threads(lambda part: chunked(libc, part), data)


def streams_touch(libc: ctypes.CDLL, data: torch.Tensor) -> None:
    """One byte of every page read on 4 threads, each over its own quarter (no populate)."""
    _on_threads(lambda part: part[::PAGE].sum(), data)


MADV_WILLNEED = 3
CHUNKED = {
    "chunked": chunked,
    "pipelined": pipelined,
    "willneed": willneed,
    "streams": streams,
    "streams_touch": streams_touch,
}


# Modes that ask for the file first (``steps*``) or cache it before the pause (``*warm``), and the
# way each then reads it.
WAYS = {"steps": "populate_touch", "steps_read_copy": "read_copy", "warm": "populate", "steps_warm": "populate"}


def main(path: str, mode: str, delay: float = 0.0) -> None:
    way = WAYS.get(mode, mode)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if mode.endswith("warm"):
        if mode == "steps_warm":
            oscalls.will_need(fd, 0, size)
        warm([path])
    time.sleep(delay)  # as an engine's start lies between its files' eviction and its load
    libc = ctypes.CDLL(None, use_errno=True)
    cpu_started = time.process_time()
    started = time.perf_counter()
    first = started
    if mode in ("steps", "steps_read_copy"):
        oscalls.will_need(fd, 0, size)  # small page-cache pages, not the kernel read-ahead's large folios
    if way == "read_copy":
        out = torch.empty(size, dtype=torch.uint8)
        first = time.perf_counter()
        view, done = memoryview(out.numpy()), 0
        while done < size:
            done += os.readv(fd, [view[done : done + (64 << 20)]])
    else:
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        data = torch.frombuffer(mapping, dtype=torch.uint8)
        address, length = ctypes.c_void_p(data.data_ptr()), ctypes.c_size_t(size)
        if way in CHUNKED:
            CHUNKED[way](libc, data)
        elif way.startswith("populate") and libc.madvise(address, length, MADV_POPULATE_READ):
            raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")
        first = time.perf_counter()
        if way in ("populate_touch", "touch_only"):
            data[::PAGE].sum()
        elif way == "mmap_copy":
            torch.empty(size, dtype=torch.uint8).copy_(data)
    ended = time.perf_counter()
    cpu = time.process_time() - cpu_started
    print(
        f"{mode}: {size / 1e9:.2f} GB, first step {first - started:.2f} s, cpu {cpu:.2f} s, "
        f"total {ended - started:.2f} s"
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
