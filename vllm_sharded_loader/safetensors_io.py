"""Bytes in and out of safetensors files.

We write and read the format ourselves instead of going through
``safetensors.torch.save_file`` / ``safe_open`` because the library builds each
file in memory before writing it, and reads each tensor into a new tensor before
we copy it again. Here a tensor goes from parameter memory to the file and from
the file into parameter memory with no intermediate copy. The files are plain
safetensors: ``safe_open`` reads ours and we read the library's.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from . import oscalls
from .format import FileChecksum, ShardedStateError, load_json
from .integrity import BlockHasher

# safetensors dtype names <-> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# A header larger than this is not a weight file (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bytes of one write/read call: large enough to stream at disk speed, small enough
# to bound the staging memory of tensors that need a copy (GPU, dtype cast).
CHUNK_BYTES = 64 * 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ShardedStateError(f"dtype {dtype} cannot be stored in safetensors.") from None


def torch_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ShardedStateError(f"{where}: unknown tensor dtype {name!r}.") from None


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor in a safetensors file; offsets are absolute positions in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed, validated safetensors header."""

    path: str
    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int
    raw: bytes  # the first data_start bytes of the file, for checksums


@dataclass(frozen=True)
class LazyTensor:
    """A tensor made only when it is written, so that a writer holds one tensor at a time.

    Has the few tensor attributes a writer needs before the data exists.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _element_count(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def parse_header(raw_length: bytes, raw_header: bytes, path: str, file_size: int) -> Header:
    """Validate a safetensors header given its bytes; pure, for reuse and fuzzing."""
    if len(raw_length) != 8:
        raise ShardedStateError(
            f"{path}: file is {file_size} bytes, too short for a safetensors header; it is "
            "truncated. Copy or save the checkpoint again."
        )
    (length,) = struct.unpack("<Q", raw_length)
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise ShardedStateError(
            f"{path}: header claims {length} bytes but the file has {file_size}; the file is "
            "truncated or not safetensors. Copy or save the checkpoint again."
        )
    if len(raw_header) != length:
        raise ShardedStateError(f"{path}: could only read {len(raw_header)} of {length} header bytes.")
    data = load_json(raw_header, f"{path}: safetensors header")
    if not isinstance(data, dict):
        raise ShardedStateError(f"{path}: safetensors header is not a JSON object; the file is corrupt.")
    data_start = 8 + length
    metadata = data.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ShardedStateError(f"{path}: safetensors __metadata__ is not an object; the file is corrupt.")
    tensors: dict[str, HeaderEntry] = {}
    for name, info in data.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            ok = (
                isinstance(dtype, str)
                and isinstance(shape, list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                and all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end))
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise ShardedStateError(f"{path}: header entry of {name!r} is malformed; the file is corrupt.")
        element = torch_dtype(dtype, f"{path}: tensor {name!r}").itemsize
        if not 0 <= begin <= end or data_start + end > file_size:
            raise ShardedStateError(
                f"{path}: tensor {name!r} claims bytes {begin}..{end} of the data, but the file "
                f"holds only {file_size - data_start}; the file is truncated. Copy or save it again."
            )
        if (end - begin) != _element_count(shape) * element:
            raise ShardedStateError(
                f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} needs "
                f"{_element_count(shape) * element} bytes but its offsets span {end - begin}; "
                "the file is corrupt."
            )
        tensors[name] = HeaderEntry(dtype, tuple(shape), data_start + begin, data_start + end)
    # Like the safetensors library: tensors tile the data exactly, no gap, no overlap,
    # no trailing bytes. Checksums then cover exactly what the tensors are made of.
    position = data_start
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise ShardedStateError(
                f"{path}: tensor {name!r} starts at byte {entry.begin} but the previous data ends at {position} "
                "(tensors overlap or leave a gap); the file is corrupt or not safetensors."
            )
        position = entry.end
    if position != file_size:
        raise ShardedStateError(
            f"{path}: tensor data ends at byte {position} but the file has {file_size}; the file has "
            "trailing bytes. Copy or save it again."
        )
    raw = raw_length + raw_header
    return Header(path, tensors, {str(k): str(v) for k, v in metadata.items()}, data_start, file_size, raw)


def read_header(path: str) -> Header:
    """Read and validate the header of a safetensors file."""
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            raw_length = f.read(8)
            length = struct.unpack("<Q", raw_length)[0] if len(raw_length) == 8 else 0
            raw_header = f.read(length) if length <= min(MAX_HEADER_BYTES, file_size) else b""
    except FileNotFoundError:
        raise ShardedStateError(f"{path}: file is missing. Copy or save the checkpoint again.") from None
    return parse_header(raw_length, raw_header, path, file_size)


def build_header(tensors: list[tuple[str, torch.Tensor]], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and JSON header for tensors laid out in the given order."""
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
    # Data starts 8-byte aligned, as the safetensors library writes it.
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


@dataclass(frozen=True)
class WrittenFile:
    """What :func:`write_file` wrote: size, block checksums, each tensor's absolute byte offset."""

    size: int
    checksum: FileChecksum
    offsets: dict[str, int]


def write_file(
    path: str,
    tensors: list[tuple[str, torch.Tensor]],
    metadata: Mapping[str, str],
    progress: Callable[[int], None] | None = None,
) -> WrittenFile:
    """Write tensors to ``path`` as safetensors, streaming from their memory.

    Returns the file's size, its block checksums (hashed from the same memory as it is
    written) and where each tensor's bytes start. CPU contiguous tensors are written straight from their storage; other
    tensors are copied one at a time, so extra memory is bounded by the largest such
    tensor. The file is fsynced before returning. The caller picks a temporary name
    and publishes by rename. ``progress`` is called with the bytes of each chunk written.
    """
    hasher = BlockHasher()
    # Hashing runs on a second thread, one chunk behind the writes: both release the
    # GIL, so the checksum costs little more than the write alone.
    with (
        open(path, "wb") as f,
        ThreadPoolExecutor(1, thread_name_prefix="checksum", initializer=oscalls.use_every_cpu) as pool,
    ):
        head = build_header(tensors, metadata)
        f.write(head)
        hashing = pool.submit(hasher.update, head)
        offsets: dict[str, int] = {}
        kicked = 0  # bytes before this are being written back already
        for name, t in tensors:
            offsets[name] = f.tell()
            if isinstance(t, LazyTensor):
                t = t.produce()
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.detach().to("cpu").contiguous()
            view = byte_view(t)
            for start in range(0, len(view), CHUNK_BYTES):
                chunk = view[start : start + CHUNK_BYTES]
                f.write(chunk)
                if f.tell() - kicked >= CHUNK_BYTES:
                    f.flush()
                    oscalls.start_writeback(f.fileno(), kicked, f.tell() - kicked)
                    kicked = f.tell()
                hashing.result()
                hashing = pool.submit(hasher.update, chunk)
                if progress is not None:
                    progress(len(chunk))
        f.flush()
        os.fsync(f.fileno())
        hashing.result()
    return WrittenFile(hasher.position, hasher.finish(), offsets)
