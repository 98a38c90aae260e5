"""The safetensors file layout (an 8-byte header length, a JSON header, the data): dtype names, and
the header parsed from untrusted bytes. Pure."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import CheckpointCorrupt
from .untrusted import MAX_BYTES, MAX_DIMS, is_int, is_shape, load_json

DTYPE_SIZES: dict[str, int] = {  # element sizes of safetensors dtype names
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E8M0": 1,
}

MAX_HEADER_BYTES = 100 * 1024 * 1024  # as safetensors itself caps it


def dtype_size(name: str, where: str) -> int:
    """The element size of a safetensors dtype name."""
    try:
        return DTYPE_SIZES[name]
    except KeyError:
        raise CheckpointCorrupt(f"{where}: unknown tensor dtype {name!r}.") from None


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


def _element_count(shape: Iterable[int]) -> int:
    """The product of a shape checked by :func:`.untrusted.is_shape`."""
    n = 1
    for d in shape:
        n *= d
    return n


def parse_header(raw_length: bytes, raw_header: bytes, path: str, file_size: int) -> Header:
    """Validate a safetensors header given its bytes; pure, for reuse and fuzzing."""
    if len(raw_length) != 8:
        raise CheckpointCorrupt(
            f"{path}: file is {file_size} bytes, too short for a safetensors header; it is "
            "truncated. Copy or save the checkpoint again."
        )
    (length,) = struct.unpack("<Q", raw_length)
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise CheckpointCorrupt(
            f"{path}: header claims {length} bytes but the file has {file_size}; the file is "
            "truncated or not safetensors. Copy or save the checkpoint again."
        )
    if len(raw_header) != length:
        raise CheckpointCorrupt(f"{path}: could only read {len(raw_header)} of {length} header bytes.")
    data = load_json(raw_header, f"{path}: safetensors header")
    if not isinstance(data, dict):
        raise CheckpointCorrupt(f"{path}: safetensors header is not a JSON object; the file is corrupt.")
    data_start = 8 + length
    metadata = data.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointCorrupt(f"{path}: safetensors __metadata__ is not an object; the file is corrupt.")
    tensors: dict[str, HeaderEntry] = {}
    for name, info in data.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            # Bounded before any arithmetic: big-integer products of a huge shape cost quadratic time.
            ok = (
                isinstance(dtype, str)
                and is_shape(shape)
                and all(is_int(o) and 0 <= o <= MAX_BYTES for o in (begin, end))
            )
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointCorrupt(
                f"{path}: header entry of {str(name)[:200]!r} is malformed (expected a dtype name, a shape of at "
                f"most {MAX_DIMS} dimensions each below 2^60, and two data offsets below 2^60); the file is corrupt "
                "or hostile. Copy or save the checkpoint again."
            )
        element = dtype_size(dtype, f"{path}: tensor {name!r}")
        if end < begin:
            raise CheckpointCorrupt(
                f"{path}: tensor {name!r} claims bytes {begin}..{end} of the data, which end before they begin; "
                "the file is corrupt or hostile. Copy or save the checkpoint again."
            )
        if data_start + end > file_size:
            raise CheckpointCorrupt(
                f"{path}: tensor {name!r} claims bytes {begin}..{end} of the data, but the file "
                f"holds only {file_size - data_start}; the file is truncated. Copy or save it again."
            )
        if (end - begin) != _element_count(shape) * element:
            raise CheckpointCorrupt(
                f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} needs "
                f"{_element_count(shape) * element} bytes but its offsets span {end - begin}; "
                "the file is corrupt."
            )
        tensors[name] = HeaderEntry(dtype, tuple(shape), data_start + begin, data_start + end)
    # As in the safetensors library, tensors tile the data exactly, so checksums cover only tensor bytes.
    position = data_start
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise CheckpointCorrupt(
                f"{path}: tensor {name!r} starts at byte {entry.begin} but the previous data ends at {position} "
                "(tensors overlap or leave a gap); the file is corrupt or not safetensors."
            )
        position = entry.end
    if position != file_size:
        raise CheckpointCorrupt(
            f"{path}: tensor data ends at byte {position} but the file has {file_size}; the file has "
            "trailing bytes. Copy or save it again."
        )
    raw = raw_length + raw_header
    return Header(path, tensors, {str(k): str(v) for k, v in metadata.items()}, data_start, file_size, raw)
