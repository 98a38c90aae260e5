"""Whole tensors of safetensors files, read into tensors by name, their byte ranges taken from the
file's own header and run through the one lowering of every load."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..format.manifest import FileChecksum
from ..format.safetensors import Header, dtype_size
from ..planning.reads import TensorPlan
from ..planning.runs import read_run
from .local import OpenFile
from .location import StoredFile
from .lowering import read_plans
from .reader import DEFAULT_READ, ReadOptions, ReadStats
from .tensors import torch_dtype


def file_plans(headers: Sequence[Header], names: Mapping[str, object]) -> dict[str, TensorPlan]:
    """A read plan per tensor of ``headers`` named in ``names``: its one run in its file, in file and
    byte order, so the reader goes through each file front to back. Pure."""
    plans = {}
    for header in headers:
        for name, entry in sorted(header.tensors.items(), key=lambda item: item[1].begin):
            if name not in names:
                continue
            itemsize = dtype_size(entry.dtype, header.path)
            nbytes = entry.end - entry.begin
            read = read_run(header.path, (entry.begin, nbytes), nbytes, (0, nbytes // itemsize), nbytes // itemsize, 1)
            plans[name] = TensorPlan(name, name, tuple(entry.shape), itemsize, (read,))
    return plans


def read_files(
    headers: Sequence[Header],
    targets: Mapping[str, torch.Tensor],
    checksums: Mapping[str, FileChecksum] | None = None,
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
    files: Sequence[OpenFile] | None = None,
    options: ReadOptions = DEFAULT_READ,
) -> ReadStats:
    """Read the tensors of safetensors files named in ``targets`` into them; a file with ``checksums``
    (by path) is verified whole. ``adopt`` is as for :func:`.lowering.read_plans`; ``files`` are the
    headers' files, already open (else their paths are opened)."""
    opened = [OpenFile.open(h.path) for h in headers] if files is None else []
    try:
        handles: Sequence[StoredFile] = opened or files or []
        plans = file_plans(headers, targets)
        stored = {
            name: torch_dtype(header.tensors[name].dtype, header.path)
            for header in headers
            for name in header.tensors
            if name in plans
        }
        return read_plans(
            {h.path: f for h, f in zip(headers, handles, strict=True)},
            plans,
            targets,
            stored,
            checksums=checksums,
            verify="all",
            options=options,
            adopt=adopt,
        )
    finally:
        for f in opened:
            f.close()
