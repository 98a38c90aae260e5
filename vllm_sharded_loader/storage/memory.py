"""Where a load's bytes land: the targets, their memory, and private file mappings served in their
place (:func:`map_pieces`: no copy, no first touch of fresh memory)."""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..format.errors import CheckpointCorrupt, CheckpointMismatch, StorageError, listing
from ..planning.spans import Piece
from . import oscalls
from .local import OpenFile
from .tensors import byte_view, map_file_range

HUGE_PAGE = 2 * 1024 * 1024
POOL_KEEP = 256 * 1024 * 1024  # idle memory a BufferPool keeps for the next tensors
PAGE = mmap.PAGESIZE


@dataclass
class Target:
    """A tensor to fill, the dtype its bytes are stored in, and element runs to zero first.
    ``mapped``: it lies over a private file mapping, paged in and verified but never written.
    ``filled`` runs on a reader thread once every byte is read, overlapping the other reads."""

    tensor: torch.Tensor
    stored: torch.dtype
    zero_runs: Sequence[tuple[int, int]] = ()
    mapped: bool = False
    filled: Callable[[], None] | None = None


def unmaterialized(targets: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the targets on the meta device: tensors with a shape but no memory. Pure."""
    return [name for name, tensor in targets.items() if tensor.device.type == "meta"]


def check_materialized(targets: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse a load into tensors on the meta device, naming them, before a byte is read: a copy
    into one silently does nothing (vLLM's online quantization materializes them in weight loaders)."""
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
            # The last line behind check_materialized: a copy into a meta tensor is a silent no-op.
            raise CheckpointMismatch(
                f"a target of shape {tuple(t.shape)} ({t.dtype}) is on the meta device: it has no memory to "
                "read into. Materialize it first, or load it through vLLM's weight loaders (load_format='auto')."
            )
        self.target, self.stored, self.filled = t, target.stored, target.filled
        self.temp: torch.Tensor | None = None
        self.mapped = mapped  # never written: paged in where the file's bytes lie
        self.direct = self.cuda = False
        self.view = None
        if mapped is not None:
            self.mapped_bytes = mapped.reshape(-1).view(torch.uint8)
            return
        if not t.is_contiguous():
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
    """Ask for transparent huge pages over a CPU tensor's 2 MiB-aligned interior; True if the kernel agreed."""
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
    """Fault in the whole pages of (address, length) ranges about to be written, a call each. Best effort."""
    for address, nbytes in ranges:
        interior = page_interior(address, nbytes)
        if interior is not None:
            oscalls.populate_write(*interior)


def map_pieces(
    files: Sequence[OpenFile], pieces: Sequence[Piece], dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """A new tensor whose pages are, where they can be, private mappings of the files' pages holding its bytes.

    ``pieces`` place byte ranges of ``files`` at byte ``start``; uncovered bytes are zero. Pages one
    piece fills at the page residue most bytes share are ``MAP_FIXED | MAP_PRIVATE`` file mappings.
    Returns the tensor and, per piece, the mapped byte range ``(lo, hi)``: the caller writes the rest.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    sizes = {p.file: os.fstat(files[p.file].fd).st_size for p in pieces}  # now, not when opened
    if len(pieces) == 1 and pieces[0].start == 0 and pieces[0].length == nbytes > 0:
        p = pieces[0]
        if p.offset % dtype.itemsize == 0 and p.end <= sizes[p.file]:
            # One run of one file: a plain mapping is faster inside vLLM than one over an anonymous region.
            return map_file_range(files[p.file].fd, p.offset, nbytes, dtype, shape), [(0, nbytes)]
    weight: dict[int, int] = {}
    for p in pieces:
        residue = (p.offset - p.start) % PAGE
        # A dtype view needs an aligned start (a float32 scale may lie at any byte); others are read.
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
# CPU flags under which vLLM's CPU post-processing repacks (reads) 16-bit weights; float32 always.
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
    """Whether a mapped load of ``dtype`` reads each page itself: where vLLM's post-processing reads
    every weight next, unless ``SHARDED_STATE_TOUCH_PAGES`` is ``1`` or ``0``."""
    setting = os.environ.get(TOUCH_ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    flags = REPACKING_FLAGS.get(dtype)
    return flags is None or any(flag in CPU_FLAGS for flag in flags)


def touch_pages(data: torch.Tensor) -> None:
    """Read one byte of every page a flat uint8 CPU tensor lies on, on this thread (GIL released):
    in a VM whose host reclaims free memory, the first CPU access faults in the host even after
    ``MADV_POPULATE_READ``; taken here, those faults overlap the other streams' reads."""
    if data.numel():
        # Where the first page boundary is not byte 0, byte 0 lies on the page before it.
        first = -data.data_ptr() % PAGE
        data[first::PAGE].sum()
        if first:
            data[:1].sum()


def page_in(path: str, ranges: list[tuple[Destination, Piece]]) -> None:
    """Page in mapped targets' bytes now, so that the load pays for the reads, not the first request."""
    for dest, p in ranges:
        start, length = p.start, p.length
        address = dest.mapped_bytes.data_ptr() + start
        # madvise takes a page-aligned address.
        error = oscalls.populate_read(address - address % PAGE, length + address % PAGE)
        if error == errno.EFAULT:
            raise CheckpointCorrupt(
                f"{path}: file ended before byte {p.end} while reading; it is truncated or was "
                "replaced during the load. Copy or save the checkpoint again."
            )
        if error and error not in (errno.EINVAL, errno.ENOSYS):
            raise StorageError(
                f"{path}: reading it failed ({os.strerror(error)}). Check the storage, "
                "then copy or save the checkpoint again."
            )
        # Also the whole paging-in where the kernel lacks MADV_POPULATE_READ (EINVAL, ENOSYS).
        if error or touched_by_the_load(dest.stored):  # the mapped tensor is its bytes (uint8)
            touch_pages(dest.mapped_bytes[start : start + length])


class BufferPool:
    """Memory for tensors made over and over in the same sizes, saving fresh pages' faults and zeroing.
    A buffer is reused only once torch's count of its storage's users says nothing refers to it;
    idle buffers beyond ``keep`` bytes are let go. Threads may share a pool."""

    def __init__(self, keep: int = POOL_KEEP) -> None:
        self.keep = keep
        self.buffers: list[torch.Tensor] = []  # flat uint8, each the whole of its storage
        self.reused = 0
        self.lock = threading.Lock()
        self.enabled = self._counts_users()

    @staticmethod
    def _idle(buffer: torch.Tensor) -> bool:
        storage = buffer.untyped_storage()
        # Two users: this buffer and the wrapper just made.
        return torch._C._storage_Use_Count(storage._cdata) <= 2

    @classmethod
    def _counts_users(cls) -> bool:
        """Whether this torch counts a storage's users as the pool relies on (a private call)."""
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
