"""Writing safetensors files straight from tensor memory (``O_DIRECT`` where allowed), hashed as they stream."""

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

CHUNK_BYTES = 64 * 1024 * 1024  # one write: disk speed, with bounded staging
PARALLEL_BUFFER_BYTES = 128 * 1024 * 1024  # O_DIRECT staging shared by one process's writers
MIN_BUFFER_BYTES = 8 * 1024 * 1024
# Files this large start data on a page, whole-page tensors first, so a load at another TP size can
# map pieces (file and tensor offsets must agree within a page).
PAGE_ALIGN_FROM = 1024 * 1024
PAGE = 4096
_T = TypeVar("_T")


def buffer_bytes_for(writers: int) -> int:
    """Each staging buffer's size when ``writers`` writers (two buffers each) run in one process.

    >>> [buffer_bytes_for(n) // 2**20 for n in (1, 2, 8, 64)]
    [64, 32, 8, 8]
    """
    return max(MIN_BUFFER_BYTES, min(CHUNK_BYTES, PARALLEL_BUFFER_BYTES // (2 * max(writers, 1))))


@dataclass(frozen=True)
class LazyTensor:
    """A tensor made only when written; ``produce`` gives it, or parts whose bytes in turn are its bytes."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


def build_header(tensors: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str], align: int = 8) -> bytes:
    """The length prefix and JSON header for tensors in the given order, data aligned to ``align``."""
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
    header += b" " * (-(len(header) + 8) % align)
    return struct.pack("<Q", len(header)) + header


def write_order(items: list[_T], nbytes: Callable[[_T], int]) -> list[_T]:
    """``items`` in :func:`write_file`'s order: whole-page ones first from :data:`PAGE_ALIGN_FROM` bytes.

    >>> write_order([3, 4096, 5, 1 << 20], lambda n: n), write_order([3, 4096, 5], lambda n: n)
    ([4096, 1048576, 3, 5], [3, 4096, 5])
    """
    if sum(nbytes(item) for item in items) < PAGE_ALIGN_FROM:
        return list(items)
    return sorted(items, key=lambda item: nbytes(item) % PAGE != 0)


@dataclass(frozen=True)
class WrittenFile:
    """What :func:`write_file` wrote: size, block checksums, tensor offsets, and the header's digest."""

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
    """Write tensors to ``path`` as safetensors, streaming from their memory, and fsync it.

    A :class:`LazyTensor` is made when its turn comes. ``progress`` gets each chunk's bytes.
    ``direct`` (default: where allowed) writes with ``O_DIRECT`` through two staging buffers of
    ``buffer_bytes``; ``False`` through the page cache. The header's :data:`DIGEST_METADATA`, the
    digest of the block checksums with it zeroed, is put in place last.
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
        # The slot's block is hashed again, read back: keeping it would hold a block per writer beyond budget.
        first = digest_of(sink.read_back(min(size, sink.hasher.block_size)))
        checksum = replace(zeroed, blocks=(first, *zeroed.blocks[1:]))
    return WrittenFile(sink.hasher.position, checksum, offsets, digest)


class _Sink:
    """What both writers share: the block hasher on its own thread, and the bytes taken so far."""

    READ_FLAGS, READ_ALIGN = 0, 1

    def __init__(self, path: str) -> None:
        self.path = path
        self.hasher = BlockHasher()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="checksum", initializer=oscalls.use_every_cpu)
        self.position = 0  # bytes handed to write()

    def _hash(self, chunk: memoryview) -> None:
        self.hasher.update(chunk)

    def put_and_sync(self, offset: int, data: bytes) -> None:
        """Write ``data`` over the written file at ``offset``, then make the file durable."""
        raise NotImplementedError

    def _read_buffer(self) -> memoryview:
        raise NotImplementedError

    def read_back(self, length: int) -> Iterator[memoryview]:
        """The written file's first ``length`` bytes, a buffer at a time (each valid until the next)."""
        buffer = self._read_buffer()
        for offset in range(0, length, len(buffer)):
            yield self._read_file(buffer, offset, min(len(buffer), length - offset))

    def _read_file(self, buffer: memoryview, offset: int, length: int) -> memoryview:
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
        """Write a tensor's bytes in row-major order, :data:`CHUNK_BYTES` at a time."""
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
    """Writes through the page cache, hashing one chunk behind, each chunk handed to the disk at once."""

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
    """Writes with ``O_DIRECT`` from two staging buffers: one fills while the other is written and hashed."""

    ALIGN = 4096  # covers every logical block size in use
    READ_FLAGS, READ_ALIGN = getattr(os, "O_DIRECT", 0), ALIGN

    def __init__(self, fd: int, path: str, size: int, buffer_bytes: int | None = None) -> None:
        super().__init__(path)
        self.fd = fd
        capacity = min(buffer_bytes or CHUNK_BYTES, max(self.ALIGN, -(-size // self.ALIGN) * self.ALIGN))
        self.buffers = [mmap.mmap(-1, capacity), mmap.mmap(-1, capacity)]
        self.staging = [torch.frombuffer(b, dtype=torch.uint8) for b in self.buffers]
        self.pending: list[list[Future[None]]] = [[], []]
        self.turn = self.fill = 0
        # (offset, buffer): a file that fits in the buffers is read back from them.
        self.copy = [(0, self.buffers[0]), (capacity, self.buffers[1])] if size <= 2 * capacity else []
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="direct-write", initializer=oscalls.use_every_cpu)

    @classmethod
    def open(cls, path: str, size: int, buffer_bytes: int | None = None) -> _DirectSink | None:
        """A sink for a new file at ``path``, or None where O_DIRECT is unavailable."""
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
        """Copy a CPU tensor into the staging buffers with torch (off the GIL), a row-sliced matrix by rows."""
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
        with torch_threads():  # other writers and the checksums have the other cores
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
        """Hand the buffer to the writer and hasher; take the other once it is free."""
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
                # A short O_DIRECT write is a bare EINVAL; the page cache says why (EFBIG, ENOSPC).
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
        # A few bytes at any offset: O_DIRECT takes whole blocks only.
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
        self.writer.shutdown()  # in-flight jobs end before their buffers are unmapped
        super().__exit__()
        os.close(self.fd)
        self.staging.clear()  # the tensors over the buffers, which would keep them exported
        for buffer in self.buffers:
            with contextlib.suppress(BufferError):  # a view still exported by a failed job
                buffer.close()
