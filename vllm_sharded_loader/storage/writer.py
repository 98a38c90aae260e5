"""Writing safetensors files straight from tensor memory, hashed as they stream.

We write the format ourselves instead of going through ``safetensors.torch.save_file``
because the library builds each file in memory before writing it. Here a tensor goes
from parameter memory to the file with no intermediate copy (``O_DIRECT`` where the
file system allows it). The files are plain safetensors: ``safe_open`` reads ours.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from ..format.entries import DIGEST_DIGITS, DIGEST_METADATA
from ..format.errors import ShardedStateError, Unsupported
from ..format.manifest import FileChecksum
from . import oscalls
from .integrity import BlockHasher, digest_of
from .tensors import byte_view, dtype_name, torch_threads

# Bytes of one write/read call: large enough to stream at disk speed, small enough
# to bound the staging memory of tensors that need a copy (GPU, dtype cast).
CHUNK_BYTES = 64 * 1024 * 1024
# The O_DIRECT staging memory of writers that one process runs at once (convert writes every rank
# in parallel, one writer each): their buffers share it, down to MIN_BUFFER_BYTES each. A lone
# writer keeps CHUNK_BYTES buffers.
PARALLEL_BUFFER_BYTES = 128 * 1024 * 1024
MIN_BUFFER_BYTES = 8 * 1024 * 1024
# A file with at least this many bytes of tensors starts its data on a page boundary and
# writes first the tensors that are whole pages long, so that (with page-multiple tensors,
# as a model's large weights are) every such tensor starts on a page. A load at another TP
# size then maps each saved rank's piece of a tensor into place instead of copying it
# (storage/memory.py: map_pieces): that needs the piece's offset in its file and in the
# tensor to agree within a page, whichever rank saved it. Smaller files keep 8-byte
# alignment: padding would be a large share of them.
PAGE_ALIGN_FROM = 1024 * 1024
PAGE = 4096
_T = TypeVar("_T")


def buffer_bytes_for(writers: int) -> int:
    """Each staging buffer's size when ``writers`` writers run at once in one process (two buffers each).

    >>> [buffer_bytes_for(n) // 2**20 for n in (1, 2, 8, 64)]
    [64, 32, 8, 8]
    """
    return max(MIN_BUFFER_BYTES, min(CHUNK_BYTES, PARALLEL_BUFFER_BYTES // (2 * max(writers, 1))))


@dataclass(frozen=True)
class LazyTensor:
    """A tensor made only when it is written, so that a writer holds one tensor at a time.

    Has the few tensor attributes a writer needs before the data exists. ``produce`` gives the
    tensor, or its parts: tensors whose bytes, each in row-major order, one after another, are
    the tensor's (a rank's pieces of a fused weight, written without being joined first).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


def build_header(tensors: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str], align: int = 8) -> bytes:
    """The length prefix and JSON header for tensors laid out in the given order.

    The header is padded with spaces (which safetensors allows) so that the data starts
    at a multiple of ``align`` bytes.
    """
    entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        entries[name] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode()
    # Data starts 8-byte aligned, as the safetensors library writes it, or page-aligned.
    header += b" " * (-(len(header) + 8) % align)
    return struct.pack("<Q", len(header)) + header


def write_order(items: list[_T], nbytes: Callable[[_T], int]) -> list[_T]:
    """``items`` in the order :func:`write_file` writes them as the tensors of one file (``nbytes``
    of an item): a file of at least :data:`PAGE_ALIGN_FROM` bytes first takes those that are whole
    pages long, each group in the given order, so that each of them starts on a page; a smaller
    file keeps the given order.

    >>> write_order([3, 4096, 5, 1 << 20], lambda n: n), write_order([3, 4096, 5], lambda n: n)
    ([4096, 1048576, 3, 5], [3, 4096, 5])
    """
    if sum(nbytes(item) for item in items) < PAGE_ALIGN_FROM:
        return list(items)
    return sorted(items, key=lambda item: nbytes(item) % PAGE != 0)


@dataclass(frozen=True)
class WrittenFile:
    """What :func:`write_file` wrote: size, block checksums, each tensor's absolute byte offset, and the
    digest of the contents that its header holds (:data:`DIGEST_METADATA`)."""

    size: int
    checksum: FileChecksum
    offsets: dict[str, int]
    digest: str


def write_file(
    path: str,
    tensors: list[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str],
    progress: Callable[[int], None] | None = None,
    direct: bool | None = None,
    buffer_bytes: int | None = None,
) -> WrittenFile:
    """Write tensors to ``path`` as safetensors, streaming from their memory.

    Returns the file's size, its block checksums (hashed from the same memory as it is
    written) and where each tensor's bytes start. CPU tensors that are contiguous, or whose
    rows are (a dim-1 slice of a matrix), are written straight from their memory; other
    tensors are copied one at a time, so extra memory is bounded by the largest such
    tensor. A :class:`LazyTensor` is made when its turn comes, whole or in parts; parts
    that do not add up to its size fail the write. The file is fsynced before returning. The
    caller picks a temporary name and publishes by rename. ``progress`` is called with
    the bytes of each chunk written.

    ``direct`` (default: where the file system allows it) writes with ``O_DIRECT``
    through two aligned staging buffers of at most ``buffer_bytes`` (default :data:`CHUNK_BYTES`;
    :func:`buffer_bytes_for` where several files are written at once), so the bytes go from
    memory to the disk without passing through the page cache: a save then costs no new
    page-cache memory, whose first touch is what slows buffered writes on memory-reclaiming VMs
    (see ``benchmarks/README.md``). ``False`` writes through the page cache, handing each 64 MiB
    to the disk at once.

    The header's metadata gets :data:`DIGEST_METADATA`: the digest of the file's block checksums
    as written with that value all zeros, put in place once the data is written. It depends on the
    bytes alone, so a part of another save of the same tensors, shapes and offsets (a stale copy)
    has another, and the same weights still give the same file.
    """
    data = sum(t.numel() * t.element_size() for _, t in tensors)
    align = PAGE if data >= PAGE_ALIGN_FROM else 8
    tensors = write_order(tensors, lambda item: item[1].numel() * item[1].element_size())
    head = build_header(tensors, {**metadata, DIGEST_METADATA: "0" * DIGEST_DIGITS}, align)
    slot = head.index(f'"{DIGEST_METADATA}":"'.encode()) + len(DIGEST_METADATA) + 4
    size = len(head) + sum(t.numel() * t.element_size() for _, t in tensors)
    sink: _Sink | None = None
    if direct is not False:
        sink = _DirectSink.open(path, size, buffer_bytes)
        if sink is None and direct:
            raise Unsupported(f"{path}: the file system does not support O_DIRECT writes.")
    if sink is None:
        sink = _BufferedSink(path)
    offsets: dict[str, int] = {}
    with sink:
        sink.write(memoryview(head))
        for name, t in tensors:
            offsets[name] = sink.position
            parts = t.produce() if isinstance(t, LazyTensor) else t
            for part in parts if isinstance(parts, tuple) else (parts,):
                sink.write_tensor(part, progress)
            written, expected = sink.position - offsets[name], t.numel() * t.element_size()
            if written != expected:
                raise ShardedStateError(
                    f"{path}: {name} was made with {written} bytes, but the file's header gives it {expected} "
                    f"({list(t.shape)} {t.dtype}). Nothing is published; report this with the command that wrote it."
                )
        sink.finish()
        zeroed = sink.hasher.finish()
        digest = digest_of([memoryview("".join(zeroed.blocks).encode())])[:DIGEST_DIGITS]
        sink.put_and_sync(slot, digest.encode())
        # The first block, which holds the slot, is hashed again, read back from the file: keeping its
        # bytes from the stream instead would hold up to a block (16 MiB) per writer beyond the budget
        # of the staging buffers, which the read-back reuses.
        first = digest_of(sink.read_back(min(size, sink.hasher.block_size)))
        checksum = replace(zeroed, blocks=(first, *zeroed.blocks[1:]))
    return WrittenFile(sink.hasher.position, checksum, offsets, digest)


class _Sink:
    """What both writers share: the file's block hasher, fed on its own thread, and the bytes taken so far.

    Both the writes and BLAKE3 release the GIL, so the checksum costs little more than the
    write alone.
    """

    # O_DIRECT for read_back (else the page cache) and the alignment its reads need.
    READ_FLAGS, READ_ALIGN = 0, 1

    def __init__(self, path: str) -> None:
        self.path = path
        self.hasher = BlockHasher()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="checksum", initializer=oscalls.use_every_cpu)
        self.position = 0  # bytes handed to write()

    def _hash(self, chunk: memoryview) -> None:
        """Hash the next bytes (on the checksum thread)."""
        self.hasher.update(chunk)

    def put_and_sync(self, offset: int, data: bytes) -> None:
        """Write ``data`` over the written file at ``offset``, then make the file durable."""
        raise NotImplementedError

    def _read_buffer(self) -> memoryview:
        """Where :meth:`read_back` reads, a piece at a time."""
        raise NotImplementedError

    def read_back(self, length: int) -> Iterator[memoryview]:
        """The written file's first ``length`` bytes, read back a buffer at a time (each view is valid
        until the next is asked for), so that hashing them holds no more memory than the buffer."""
        buffer = self._read_buffer()
        for offset in range(0, length, len(buffer)):
            yield self._read_file(buffer, offset, min(len(buffer), length - offset))

    def _read_file(self, buffer: memoryview, offset: int, length: int) -> memoryview:
        """The written file's ``length`` bytes at ``offset``, read into ``buffer`` (which holds them
        rounded up to :attr:`READ_ALIGN`)."""
        fd = os.open(self.path, os.O_RDONLY | self.READ_FLAGS)
        try:
            view, done = buffer[: -(-length // self.READ_ALIGN) * self.READ_ALIGN], 0
            while done < length:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got <= 0:
                    raise OSError(
                        errno.EIO, f"the file ends at {offset + done}, read back to {offset + length}", self.path
                    )
                done += got
        finally:
            os.close(fd)
        return buffer[:length]

    @staticmethod
    def _put(fd: int, data: bytes, offset: int, path: str) -> None:
        if os.pwrite(fd, data, offset) != len(data):
            raise OSError(errno.EIO, f"short write of {len(data)} bytes at {offset}", path)
        os.fsync(fd)

    def __enter__(self) -> _Sink:
        return self

    def write(self, chunk: memoryview) -> None:
        raise NotImplementedError

    def write_tensor(self, tensor: torch.Tensor, progress: Callable[[int], None] | None) -> None:
        """Write a tensor's bytes in row-major order, :data:`CHUNK_BYTES` at a time (copied first
        into contiguous CPU memory if they are not)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.detach().to("cpu").contiguous()
        view = byte_view(tensor)
        for start in range(0, len(view), CHUNK_BYTES):
            chunk = view[start : start + CHUNK_BYTES]
            self.write(chunk)
            if progress is not None:
                progress(len(chunk))

    def finish(self) -> None:
        """Write out what is buffered and wait for every hash."""
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown()


class _BufferedSink(_Sink):
    """Writes through the page cache, hashing one chunk behind the writes.

    Each 64 MiB is handed to the disk at once (``sync_file_range``) instead of waiting in
    the page cache for the final ``fsync``.
    """

    # The first block is read back a MiB at a time: from the page cache, which the writes went through.
    READ_BACK_BYTES = 1024 * 1024

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.file = open(path, "wb")  # noqa: SIM115 (closed in __exit__)
        self.hashing: Future[None] | None = None
        self.kicked = 0

    def write(self, chunk: memoryview) -> None:
        self.file.write(chunk)
        self.position += len(chunk)
        if self.position - self.kicked >= CHUNK_BYTES:
            self.file.flush()
            oscalls.start_writeback(self.file.fileno(), self.kicked, self.position - self.kicked)
            self.kicked = self.position
        if self.hashing is not None:
            self.hashing.result()
        self.hashing = self.pool.submit(self._hash, chunk)

    def finish(self) -> None:
        self.file.flush()
        if self.hashing is not None:
            self.hashing.result()

    def put_and_sync(self, offset: int, data: bytes) -> None:
        self._put(self.file.fileno(), data, offset, self.file.name)

    def _read_buffer(self) -> memoryview:
        return memoryview(bytearray(self.READ_BACK_BYTES))

    def __exit__(self, *exc: object) -> None:
        super().__exit__()
        self.file.close()


class _DirectSink(_Sink):
    """Writes with ``O_DIRECT`` from two page-aligned staging buffers, taking turns.

    The caller's bytes are copied into one buffer (memory already touched, so at memory
    speed) while the other is written by the writer thread and hashed by the checksum
    thread; the last buffer is padded to the alignment and the file cut to its size.
    """

    ALIGN = 4096  # covers every logical block size in use
    # The first block is read back with O_DIRECT into a staging buffer: no memory beyond the buffers, and
    # no page cache (which the writes did not touch either).
    READ_FLAGS, READ_ALIGN = getattr(os, "O_DIRECT", 0), ALIGN

    def __init__(self, fd: int, path: str, size: int, buffer_bytes: int | None = None) -> None:
        super().__init__(path)
        self.fd = fd
        capacity = min(buffer_bytes or CHUNK_BYTES, max(self.ALIGN, -(-size // self.ALIGN) * self.ALIGN))
        # Anonymous mappings are page-aligned, as O_DIRECT needs.
        self.buffers = [mmap.mmap(-1, capacity), mmap.mmap(-1, capacity)]
        self.staging = [torch.frombuffer(b, dtype=torch.uint8) for b in self.buffers]
        self.pending: list[list[Future[None]]] = [[], []]
        self.turn = self.fill = 0
        # (offset, buffer): where read_back finds the file's first bytes without reading the disk (O_DIRECT left
        # none in the page cache; a read would double the time of writing a small file): a file that fits in
        # the two staging buffers stays in them.
        self.copy = [(0, self.buffers[0]), (capacity, self.buffers[1])] if size <= 2 * capacity else []
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="direct-write", initializer=oscalls.use_every_cpu)

    @classmethod
    def open(cls, path: str, size: int, buffer_bytes: int | None = None) -> _DirectSink | None:
        """A sink for a new file at ``path``, or None where O_DIRECT is unavailable (tmpfs, other OSes)."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return None
            raise
        return cls(fd, path, size, buffer_bytes)

    def write(self, data: memoryview) -> None:
        self.position += len(data)
        while len(data):
            buffer = self.buffers[self.turn]
            take = min(len(data), len(buffer) - self.fill)
            buffer[self.fill : self.fill + take] = data[:take]
            self.fill += take
            data = data[take:]
            if self.fill == len(buffer):
                self._flush()

    def write_tensor(self, tensor: torch.Tensor, progress: Callable[[int], None] | None) -> None:
        """Copy a CPU tensor's bytes into the staging buffers with torch (which lets go of the GIL);
        a matrix whose rows are contiguous but not each other's neighbours (a dim-1 slice) is
        copied row-block by row-block, never joined first. Other tensors go the common way."""
        if tensor.device.type != "cpu" or not (tensor.is_contiguous() or (tensor.dim() == 2 and tensor.stride(1) == 1)):
            super().write_tensor(tensor, progress)
            return
        if not tensor.numel():
            return
        rows = tensor.detach().reshape(1, -1) if tensor.is_contiguous() else tensor.detach()
        data = rows.view(torch.uint8)  # [rows, row bytes], each row contiguous
        count, width = data.shape
        total, done = count * width, 0
        self.position += total
        with torch_threads():  # the other ranks' writers and the checksums have the other cores
            while done < total:
                staging = self.staging[self.turn]
                space = len(staging) - self.fill
                row, column = divmod(done, width)
                if column == 0 and space >= width:
                    whole = min(space // width, count - row)
                    n = whole * width
                    staging[self.fill : self.fill + n].view(whole, width).copy_(data[row : row + whole])
                else:  # a row's start or end, where a buffer fills up
                    n = min(width - column, space)
                    staging[self.fill : self.fill + n].copy_(data[row, column : column + n])
                self.fill += n
                done += n
                if progress is not None:
                    progress(n)
                if self.fill == len(staging):
                    self._flush()

    def _flush(self) -> None:
        """Hand the current buffer to the writer and hasher; take the other one once it is free."""
        buffer, n = self.buffers[self.turn], self.fill
        padded = -(-n // self.ALIGN) * self.ALIGN
        if padded > n:
            buffer[n:padded] = bytes(padded - n)  # O_DIRECT writes whole blocks; the file is cut after
        view = memoryview(buffer)
        self.pending[self.turn] = [
            self.pool.submit(self._hash, view[:n]),
            self.writer.submit(self._write_all, view[:padded]),
        ]
        self.turn ^= 1
        self.fill = 0
        for job in self.pending[self.turn]:
            job.result()
        self.pending[self.turn] = []

    def _write_all(self, view: memoryview) -> None:
        while len(view):
            try:
                written = os.write(self.fd, view)
            except OSError as e:
                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                if e.errno != errno.EINVAL or not flags & os.O_DIRECT:
                    raise
                # A write the kernel cut off a block boundary (a file size limit; after a short
                # write, a disk full) fails under O_DIRECT with a bare EINVAL. Through the page
                # cache, the kernel says why it stops (EFBIG, ENOSPC), or takes the rest.
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                continue
            if written <= 0:
                raise OSError(errno.EIO, f"write returned {written}", self.path)
            view = view[written:]

    def finish(self) -> None:
        if self.fill:
            self._flush()
        for jobs in self.pending:
            for job in jobs:
                job.result()
        os.ftruncate(self.fd, self.position)  # drop the padding of the last block

    def put_and_sync(self, offset: int, data: bytes) -> None:
        # A few bytes at any offset: O_DIRECT takes whole blocks only, the page cache the rest.
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._put(self.fd, data, offset, self.path)
        for start, buffer in self.copy:  # the copy that read_back gives, as the file now is
            low, high = max(offset, start), min(offset + len(data), start + len(buffer))
            if low < high:
                buffer[low - start : high - start] = data[low - offset : high - offset]

    def read_back(self, length: int) -> Iterator[memoryview]:
        if sum(len(buffer) for _, buffer in self.copy) < length:
            yield from super().read_back(length)
            return
        for start, buffer in self.copy:
            if start < length:
                yield memoryview(buffer)[: min(len(buffer), length - start)]

    def _read_buffer(self) -> memoryview:
        return memoryview(self.buffers[0])  # free: finish() waited for every job

    def __exit__(self, *exc: object) -> None:
        # Let in-flight jobs end before their buffers are unmapped, even after an error.
        self.writer.shutdown()
        super().__exit__()
        os.close(self.fd)
        self.staging.clear()  # the tensors over the buffers, which would keep them exported
        for buffer in self.buffers:
            with contextlib.suppress(BufferError):  # a view still exported by a failed job
                buffer.close()
