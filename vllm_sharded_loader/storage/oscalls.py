"""Linux calls for the reader and writer threads (libc where ``os`` lacks them); no-ops elsewhere."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import os
from typing import Any

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux 5.14+
MADV_POPULATE_WRITE = 23
SYNC_FILE_RANGE_WRITE = 2
# WILLNEED reads at most one read-ahead window per call: steps of the smallest window cover a range.
WILLNEED_STEP = 128 << 10

_libc: Any = None


def _c() -> Any:
    """libc with the prototypes we use, or None off Linux."""
    global _libc
    if _libc is None:
        if os.uname().sysname != "Linux":
            _libc = False
        else:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
            libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            libc.sync_file_range.restype = ctypes.c_int
            libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int64,
            ]
            libc.mmap.restype = ctypes.c_void_p
            _libc = libc
    return _libc or None


def madvise_hugepage(address: int, nbytes: int) -> bool:
    """``madvise(MADV_HUGEPAGE)`` over a page-aligned range; True if the kernel agreed."""
    libc = _c()
    return libc is not None and libc.madvise(address, nbytes, MADV_HUGEPAGE) == 0


def drop_pages(address: int, nbytes: int) -> None:
    """``madvise(MADV_DONTNEED)`` over a private file mapping no longer read, so its ``munmap`` is cheap."""
    libc = _c()
    if libc is not None:
        libc.madvise(address, nbytes, MADV_DONTNEED)


def populate_write(address: int, nbytes: int) -> None:
    """``madvise(MADV_POPULATE_WRITE)``: fault in a page-aligned range of fresh memory in one call (best effort)."""
    libc = _c()
    if libc is not None:
        libc.madvise(address, nbytes, MADV_POPULATE_WRITE)


def populate_read(address: int, nbytes: int) -> int:
    """``madvise(MADV_POPULATE_READ)``: page in a range of a file mapping now, without the GIL. Returns 0
    or the errno: ``EINVAL`` where the kernel lacks it, ``EFAULT`` past a truncated file's end."""
    libc = _c()
    if libc is None:
        return errno.ENOSYS
    return 0 if libc.madvise(address, nbytes, MADV_POPULATE_READ) == 0 else ctypes.get_errno()


def will_need(fd: int, begin: int, end: int, step: int | None = None) -> None:
    """Start reading a file's bytes ``[begin, end)`` into the page cache, without waiting, one read-ahead
    window per call (``step``, default :func:`read_ahead_window`). Pages read so come into the cache
    small, not in the large folios of the kernel's own read-ahead: on a VM whose host takes free memory
    back, the first access to large folios costs several times the CPU time (``benchmarks/page_in_probe.py``)."""
    step = step or read_ahead_window(fd)
    with contextlib.suppress(OSError):  # advice only: the reads that follow report any error
        for start in range(begin, end, step):
            os.posix_fadvise(fd, start, min(step, end - start), os.POSIX_FADV_WILLNEED)


def read_ahead_window(fd: int) -> int:
    """The bytes one ``WILLNEED`` call reads of ``fd``, at least: its disk's read-ahead window
    (``read_ahead_kb``), or :data:`WILLNEED_STEP` where that is not known."""
    try:
        device = os.fstat(fd).st_dev
    except OSError:
        return WILLNEED_STEP
    return _disk_window(os.major(device), os.minor(device))


@functools.cache
def _disk_window(major: int, minor: int) -> int:
    # A partition's read-ahead is its disk's, one folder up.
    for bdi in ("bdi", "../bdi"):
        with contextlib.suppress(OSError, ValueError), open(f"/sys/dev/block/{major}:{minor}/{bdi}/read_ahead_kb") as f:
            return max(WILLNEED_STEP, int(f.read()) << 10)
    return WILLNEED_STEP


def map_file_fixed(address: int, nbytes: int, fd: int, offset: int) -> int:
    """``mmap(MAP_FIXED | MAP_PRIVATE)`` of a file's pages over ``[address, address + nbytes)``, inside a
    mapping the caller owns (page-aligned). Returns 0, or the errno, for the caller to copy instead."""
    libc = _c()
    if libc is None:
        return errno.ENOSYS
    prot, flags = 0x1 | 0x2, 0x02 | 0x10  # PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED
    result = libc.mmap(address, nbytes, prot, flags, fd, offset)
    if result is None or result == ctypes.c_void_p(-1).value:
        return ctypes.get_errno() or errno.EINVAL
    return 0 if result == address else errno.EINVAL


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a file range to disk now (``sync_file_range``), overlapping the next chunk's copy."""
    libc = _c()
    if libc is not None:
        libc.sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


def numa_nodes() -> dict[int, frozenset[int]]:
    """The machine's NUMA nodes and their CPUs (``/sys/devices/system/node``); empty where it does not say."""
    nodes: dict[int, frozenset[int]] = {}
    root = "/sys/devices/system/node"
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if name.startswith("node") and name[4:].isdigit():
                with contextlib.suppress(OSError, ValueError), open(f"{root}/{name}/cpulist") as f:
                    nodes[int(name[4:])] = frozenset(parse_cpu_list(f.read()))
    return nodes


def parse_cpu_list(text: str) -> set[int]:
    """CPUs of a kernel CPU list such as ``0-3,8,10-11``. Pure.

    >>> sorted(parse_cpu_list("0-2,5\\n"))
    [0, 1, 2, 5]
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def binding_cpus(affinity: set[int] | frozenset[int], nodes: dict[int, frozenset[int]]) -> set[int]:
    """The CPUs of the NUMA nodes that ``affinity`` touches (without node information, ``affinity``). Pure.

    >>> sorted(binding_cpus({5}, {0: frozenset({0, 1, 2, 3}), 1: frozenset({4, 5, 6, 7})}))
    [4, 5, 6, 7]
    >>> sorted(binding_cpus({1, 2}, {}))
    [1, 2]
    """
    touched = [cpus for cpus in nodes.values() if cpus & affinity]
    return set().union(*touched) if touched else set(affinity)


def use_binding_cpus() -> None:
    """Let the calling thread run on every CPU of the NUMA nodes it is bound to (a thread-pool initializer):
    vLLM pins a worker's threads to the rank's cores, idle during I/O; another node's memory would be remote."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, binding_cpus(os.sched_getaffinity(0), numa_nodes()))


use_every_cpu = use_binding_cpus


def release_free_heap() -> None:
    """``malloc_trim(0)``: hand the C heap's free pages back (glibc). vLLM's CPU repacking frees the old
    packing into the heap, so repeated weight updates would otherwise grow towards a second copy."""
    libc = _c()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


def available_memory() -> int:
    """The memory the kernel can give without swapping (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
