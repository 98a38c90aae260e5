"""Whole tensors of safetensors files, read into tensors by name: where each tensor's bytes lie.

:func:`file_pieces` is the one place that maps a file's tensors to byte ranges, and it
takes them from the file's own header.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..format.manifest import FileChecksum
from ..format.safetensors import Header
from ..planning.spans import Piece
from .local import OpenFile
from .memory import Target
from .reader import DEFAULT_READ, ReadOptions, ReadStats, read_pieces
from .tensors import torch_dtype


def file_pieces(
    headers: Sequence[Header],
    targets: Mapping[str, torch.Tensor],
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> tuple[list[str], list[Piece], list[Target]]:
    """Pieces and targets to read whole tensors of safetensors files into ``targets``.

    Tensors of a file not in ``targets`` are not read (except into scratch when the file is
    verified). ``adopt`` gives the :attr:`Target.adopt` of the tensors that may be mapped.
    """
    adopt = adopt or {}
    paths, pieces, dests = [], [], []
    for file, header in enumerate(headers):
        paths.append(header.path)
        for name, entry in sorted(header.tensors.items(), key=lambda item: item[1].begin):
            target = targets.get(name)
            if target is None:
                continue
            stored = torch_dtype(entry.dtype, header.path)
            pieces.append(Piece(file, entry.begin, entry.end - entry.begin, len(dests), 0, stored.itemsize))
            dests.append(Target(target, stored, adopt=adopt.get(name)))
    return paths, pieces, dests


def read_files(
    headers: Sequence[Header],
    targets: Mapping[str, torch.Tensor],
    checksums: Mapping[str, FileChecksum] | None = None,
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
    files: Sequence[OpenFile] | None = None,
    options: ReadOptions = DEFAULT_READ,
    span_bytes: int | None = None,
) -> ReadStats:
    """Read the tensors of safetensors files named in ``targets`` into them.

    ``checksums`` maps a file's path to its recorded checksum; such a file is verified
    whole. ``adopt`` maps names to callbacks that take a mapped tensor in place of
    reading into the target (see :func:`read_pieces`). ``files`` are the files the headers
    were read from, already open (every read then goes through them); without them the
    headers' paths are opened. ``options`` and ``span_bytes`` go to :func:`read_pieces`.
    """
    paths, pieces, dests = file_pieces(headers, targets, adopt)
    by_index = {i: checksums[p] for i, p in enumerate(paths) if checksums and p in checksums}
    sources: Sequence[str | OpenFile] = paths if files is None else files
    return read_pieces(sources, pieces, dests, checksums=by_index, verify="all", options=options, span_bytes=span_bytes)
