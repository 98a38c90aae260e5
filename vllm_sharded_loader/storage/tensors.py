"""Tensors over bytes: torch dtypes of safetensors names, byte views, and private file mappings."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator

import torch

from ..format.errors import CheckpointCorrupt, Unsupported

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


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype} cannot be stored in safetensors.") from None


def torch_dtype(name: str, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise CheckpointCorrupt(f"{where}: unknown tensor dtype {name!r}.") from None


@contextlib.contextmanager
def torch_threads(count: int = 1) -> Iterator[None]:
    """Run this thread's torch operations on at most ``count`` threads, then put the setting back: a
    reader's or writer's threads are the parallelism, and an OpenMP team would spin on their cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(count, before)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy)."""
    flat = tensor.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def map_file_range(fd: int, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes ``[offset, offset + length)`` of an open file as a tensor over a private (copy-on-write)
    mapping of their pages, alive as long as the tensor; ``offset`` aligned to the element size."""
    if length == 0:
        return torch.empty(shape, dtype=dtype)
    first = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(
        fd, offset + length - first, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=first
    )
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=length, offset=offset - first)
    return flat.view(dtype).view(shape)


def has_nan(tensor: torch.Tensor) -> bool:
    """Whether any element is NaN (``amax`` propagates it without a bool tensor; float8 takes ``isnan``)."""
    if not tensor.numel():
        return False
    try:
        return bool(tensor.amax().isnan())
    except (RuntimeError, NotImplementedError):
        return bool(tensor.isnan().any())
