"""Where a load's bytes land: the targets, their memory, and private file mappings served in their place.

A CPU target whose caller can take another tensor (the vLLM loader swaps the parameter's
data) is served from a private mapping of its bytes in the file (:func:`map_pieces`):
the page cache's pages become its memory, with no copy and no first touch of fresh
memory. Every other target is written in place, or through staging when its bytes are
converted (another dtype, another device).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..format.errors import CheckpointCorrupt, CheckpointMismatch, ShardedStateError, listing
from ..planning.spans import Piece
from . import oscalls
from .local import OpenFile
from .tensors import byte_view, map_file_range

HUGE_PAGE = 2 * 1024 * 1024
# Idle memory a BufferPool keeps for the next tensors of the same sizes.
POOL_KEEP = 256 * 1024 * 1024
PAGE = mmap.PAGESIZE


@dataclass
class Target:
    """A tensor to fill, the dtype its bytes are stored in, and element runs to zero first.

    ``mapped`` says that ``tensor`` already lies over a private mapping of its piece's bytes
    (:func:`map_pieces`): the reader pages it in and verifies it like read bytes, and never
    writes it. ``filled``, if given, is
    called on a reader thread as soon as every byte of the target is read (and verified):
    work on those bytes (a strided copy out of a mapping) then overlaps the other reads.
    """

    tensor: torch.Tensor
    stored: torch.dtype
    zero_runs: Sequence[tuple[int, int]] = ()
    mapped: bool = False
    filled: Callable[[], None] | None = None


def unmaterialized(targets: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the targets on the meta device: tensors with a shape but no memory. Pure."""
    return [name for name, tensor in targets.items() if tensor.device.type == "meta"]


def check_materialized(targets: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse a load into tensors on the meta device, naming them, before a byte is read.

    vLLM builds the weights of online-quantized layers (``quantization="fp8"`` and the other
    online methods on an unquantized checkpoint) on the meta device and materializes each
    layer only inside its weight loaders, which quantize it once all of its weights have
    arrived. A copy into a meta tensor does nothing and raises nothing: the layer would then
    be quantized from memory nobody wrote. This loader fills parameters in place and never
    calls the weight loaders, so such a model is refused instead.
    """
    meta = unmaterialized(targets)
    if meta:
        raise CheckpointMismatch(
            f"{where}: {len(meta)} parameters of the served model are on the meta device and would never be "
            f"filled ({listing(meta)}): vLLM creates them so when it quantizes online (for example "
            "quantization='fp8' on an unquantized checkpoint), materializing each layer inside its weight "
            "loaders, which load_format='sharded_state' does not call. Serve the checkpoint without online "
            "quantization, or load the original model with vLLM's default loader (load_format='auto') and "
            "online quantization, or serve a checkpoint stored already quantized (quantized offline)."
        )


class Destination:
    """Where a target's bytes land: straight in its memory, in a temporary, or via staging."""

    def __init__(self, target: Target, mapped: torch.Tensor | None = None) -> None:
        t = target.tensor
        if t.device.type == "meta":
            # A copy into a meta tensor is a silent no-op; callers refuse these by name first
            # (check_materialized), this is the last line.
            raise CheckpointMismatch(
                f"a target of shape {tuple(t.shape)} ({t.dtype}) is on the meta device: it has no memory to "
                "read into. Materialize it first, or load it through vLLM's weight loaders (load_format='auto')."
            )
        self.target, self.stored, self.filled = t, target.stored, target.filled
        self.temp: torch.Tensor | None = None
        # A mapped target is not written: its bytes are the file's, paged in where they lie.
        self.mapped = mapped
        self.direct = self.cuda = False
        self.view = None
        if mapped is not None:
            self.mapped_bytes = mapped.reshape(-1).view(torch.uint8)
            return
        if not t.is_contiguous():
            # Rare (parameters are contiguous): read whole, copy once at the end.
            self.temp = torch.empty(t.shape, dtype=target.stored)
            self.landing = self.temp
        else:
            self.landing = t
        self.direct = self.landing.device.type == "cpu" and self.landing.dtype == target.stored
        self.view = byte_view(self.landing) if self.direct and self.landing.numel() else None
        self.flat = self.landing.view(-1)
        self.cuda = self.landing.device.type == "cuda"
        for a, b in target.zero_runs:
            self.flat[a:b] = 0


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for transparent huge pages over a CPU tensor's memory; True if the kernel agreed.

    Only the 2 MiB-aligned interior is advised, so no memory outside the tensor changes
    its paging. Pages already touched keep their size; untouched ones (fresh
    parameters) fault in 2 MiB at a time. A no-op where unsupported.
    """
    if tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    return hi > lo and oscalls.madvise_hugepage(lo, hi - lo)


def page_interior(address: int, nbytes: int) -> tuple[int, int] | None:
    """The whole pages inside ``[address, address + nbytes)``, as (start, length), or None if none. Pure."""
    start, end = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    return (start, end - start) if end > start else None


def prefault_pages(ranges: Sequence[tuple[int, int]]) -> None:
    """Fault in the fresh memory of (address, length) ranges about to be written, one system call each.

    A response from object storage is copied into the parameters by a memory copy in this
    process, where every untouched 4 KiB page of a fresh parameter traps on its first
    write: ~90,000 traps per GB. ``MADV_POPULATE_WRITE`` maps the same pages in one call
    (measured on the 2-core VMs here, loading 0.36-0.73 GB ranks from SeaweedFS: 15-20%
    less CPU per byte in the loading process, 5-15% faster loads). Only whole pages inside
    each range are touched, so memory beside a tensor is never written. Best effort.
    """
    for address, nbytes in ranges:
        interior = page_interior(address, nbytes)
        if interior is not None:
            oscalls.populate_write(*interior)


def map_pieces(
    files: Sequence[OpenFile], pieces: Sequence[Piece], dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A new tensor whose pages are, where they can be, private mappings of the files' pages holding its bytes.

    ``pieces`` place byte ranges of ``files`` at byte ``start`` of the tensor (their
    ``dest`` is ignored), disjoint; bytes no piece covers are zero. The tensor lies in one
    anonymous private mapping, and each page whose tensor bytes all come from one piece,
    at the same offset within the page as in the file, is replaced by a ``MAP_FIXED |
    MAP_PRIVATE`` mapping of the file's page: the page cache's page, no copy, no first
    touch (a column-parallel weight joined from two saved ranks, or cut from one). The
    offset within a page is the same for every piece whose file offset minus its tensor
    offset is the same modulo the page size; the most bytes' residue wins. Returns the
    tensor and, per piece, the byte range ``(lo, hi)`` of the tensor that is mapped
    (``lo == hi``: none); the caller writes everything else, and pages in and verifies
    the mapped ranges before use. Writes to the tensor go to private copies, never to
    the files. Mapped from the files' open descriptors. A tensor that one piece fills
    whole is one private mapping of that file range instead, with no region under it.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    sizes = {p.file: os.fstat(files[p.file].fd).st_size for p in pieces}  # now, not when opened
    if len(pieces) == 1 and pieces[0].start == 0 and pieces[0].length == nbytes > 0:
        p = pieces[0]
        if p.offset % dtype.itemsize == 0 and p.end <= sizes[p.file]:
            # The whole tensor from one run of one file (any load at the saved topology): one new
            # private mapping of that range. Laid over an anonymous region instead (below), the
            # warm TP=1 load of a 1.5 GB model inside vLLM took 0.12-0.17 s instead of 0.08-0.10.
            return map_file_range(files[p.file].fd, p.offset, nbytes, dtype, shape), [(0, nbytes)]
    weight: dict[int, int] = {}
    for p in pieces:
        residue = (p.offset - p.start) % PAGE
        # The tensor starts at ``residue`` in the region: a view of its dtype needs that aligned
        # (a float32 scale may lie at any byte of a safetensors file). Others are read instead.
        if residue % dtype.itemsize == 0:
            weight[residue] = weight.get(residue, 0) + p.length
    shift = max(weight, key=lambda r: (weight[r], -r)) if weight else 0
    region = mmap.mmap(-1, max(PAGE, -(-(shift + nbytes) // PAGE) * PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps the region (and what is mapped into it) alive
    base = whole.data_ptr()
    mapped: list[tuple[int, int]] = []
    for p in pieces:
        start, end = p.start, p.start + p.length
        if (p.offset - p.start) % PAGE != shift or p.end > sizes[p.file] or not p.length:
            mapped.append((start, start))
            continue
        # A page at either end is the piece's alone only where the tensor starts or ends in it.
        lo = (shift + start) // PAGE * PAGE if start == 0 else -(-(shift + start) // PAGE) * PAGE
        hi = -(-(shift + end) // PAGE) * PAGE if end == nbytes else (shift + end) // PAGE * PAGE
        if hi <= lo or oscalls.map_file_fixed(base + lo, hi - lo, files[p.file].fd, p.offset + lo - shift - start):
            mapped.append((start, start))
            continue
        mapped.append((max(lo - shift, start), min(hi - shift, end)))
    return whole[shift : shift + nbytes].view(dtype).view(shape), mapped


TOUCH_ENV = "SHARDED_STATE_TOUCH_PAGES"
# The CPU flags under which oneDNN runs a 16-bit matmul, so that vLLM's CPU post-processing repacks
# (reads) every such linear weight after the load; float32 it repacks on any x86 CPU.
REPACKING_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


CPU_FLAGS = _cpu_flags()


def touched_by_the_load(dtype: torch.dtype) -> bool:
    """Whether a mapped load of ``dtype`` reads each page itself (:func:`touch_pages`): where vLLM's
    post-processing reads every weight after it (oneDNN repacks it), the first CPU access is paid
    on the reading threads instead; where the weights serve as loaded (bfloat16 without AVX-512
    BF16 or AMX: oneDNN has no such matmul, vLLM keeps torch's), it is work nobody needs.
    ``SHARDED_STATE_TOUCH_PAGES=1`` or ``0`` decides it."""
    setting = os.environ.get(TOUCH_ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    flags = REPACKING_FLAGS.get(dtype)
    return flags is None or any(flag in CPU_FLAGS for flag in flags)


def touch_pages(data: torch.Tensor) -> None:
    """Read one byte of every page a flat uint8 CPU tensor's memory lies on, on this thread.

    ``MADV_POPULATE_READ`` maps a file's pages but no CPU reads them. In a VM whose host took
    back the guest's free memory (free page reporting), a page cache page just filled by a
    disk read then costs a fault in the host on the first CPU access: left to vLLM's
    post-processing (its repack of every weight), that cost lands after the load. Taken
    here, the faults run on the reading threads while the other streams wait for the disk;
    a warm page costs one cache miss. Releases the GIL (torch).
    """
    if data.numel():
        # The offset of the first page boundary in the tensor; where not 0, byte 0 lies on the page before it.
        first = -data.data_ptr() % PAGE
        data[first::PAGE].sum()
        if first:
            data[:1].sum()


def page_in(path: str, ranges: list[tuple[Destination, Piece]]) -> None:
    """Page in bytes of mapped targets now, so that the load pays for the reads, not the first request.

    Each page is also read by this thread once mapped where vLLM's post-processing would read it
    next (:func:`touched_by_the_load`), so that the load pays for the CPU's first access.
    """
    for dest, p in ranges:
        start, length = p.start, p.length
        address = dest.mapped_bytes.data_ptr() + start
        # madvise takes a page-aligned address; the mapping starts on the page holding the tensor's first byte.
        error = oscalls.populate_read(address - address % PAGE, length + address % PAGE)
        if error == errno.EFAULT:
            raise CheckpointCorrupt(
                f"{path}: file ended before byte {p.end} while reading; it is truncated or was "
                "replaced during the load. Copy or save the checkpoint again."
            )
        if error and error not in (errno.EINVAL, errno.ENOSYS):
            raise ShardedStateError(
                f"{path}: reading it failed ({os.strerror(error)}). Check the storage, "
                "then copy or save the checkpoint again."
            )
        # Also the whole paging-in where the kernel predates MADV_POPULATE_READ (EINVAL, ENOSYS).
        if error or touched_by_the_load(dest.mapped.dtype):
            touch_pages(dest.mapped_bytes[start : start + length])


class BufferPool:
    """Memory for tensors made over and over in the same sizes, taken again once nothing uses it.

    Fresh memory costs a page fault (and the kernel zeroing the page) on its first write: on
    this project's VMs that capped a conversion's making of components at about 1.4 GB/s,
    where memory written before takes ten times less. Each buffer made here is kept; a
    buffer is taken again for a tensor of exactly its size once no tensor (view, slice,
    parameter) refers to its memory any more, which torch's own count of a storage's users
    tells, so memory a writer still reads is never handed out twice. Idle buffers beyond
    ``keep`` bytes are let go. Threads may share a pool.
    """

    def __init__(self, keep: int = POOL_KEEP) -> None:
        self.keep = keep
        self.buffers: list[torch.Tensor] = []  # flat uint8, each the whole of its storage
        self.reused = 0
        self.lock = threading.Lock()
        self.enabled = self._counts_users()

    @staticmethod
    def _idle(buffer: torch.Tensor) -> bool:
        storage = buffer.untyped_storage()
        # This buffer and the wrapper just made: nothing else holds the memory.
        return torch._C._storage_Use_Count(storage._cdata) <= 2

    @classmethod
    def _counts_users(cls) -> bool:
        """Whether this torch counts a storage's users as the pool relies on (a private call): a
        buffer alone is idle, one with a view is not. Otherwise every tensor is new memory."""
        if not hasattr(torch._C, "_storage_Use_Count"):
            return False
        probe = torch.empty(8, dtype=torch.uint8)
        alone = cls._idle(probe)
        view = probe[2:]
        held = cls._idle(probe)
        del view
        return alone and not held and cls._idle(probe)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor, in an idle buffer of its size if there is one."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not nbytes or not self.enabled:
            return torch.empty(shape, dtype=dtype)
        with self.lock:
            return self._take(nbytes).view(dtype).view(shape)

    def _take(self, nbytes: int) -> torch.Tensor:
        idle = [b for b in self.buffers if self._idle(b)]
        for buffer in idle:
            if buffer.numel() == nbytes:
                self.reused += 1
                return buffer
        spare = sum(b.numel() for b in idle)
        dropped = set()
        for buffer in sorted(idle, key=lambda b: b.numel(), reverse=True):
            if spare + nbytes <= self.keep:
                break
            dropped.add(id(buffer))
            spare -= buffer.numel()
        self.buffers = [b for b in self.buffers if id(b) not in dropped]
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append(buffer)
        return buffer
