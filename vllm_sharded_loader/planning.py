"""Pure planning: which tensors a rank writes, in which parts, and whether a saved
rank matches what the serving model expects. No I/O, no torch, no engine.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .format import ShardedStateError


@dataclass(frozen=True)
class TensorView:
    """Where a state-dict entry lives in memory, enough to find shared storage.

    ``storage`` identifies the allocation (device and base pointer), ``start`` and
    ``end`` are byte addresses of the view's first and one-past-last element.
    """

    name: str
    storage: tuple[object, int]
    start: int
    end: int
    contiguous: bool


def unique_tensor_names(views: Iterable[TensorView]) -> list[str]:
    """Names to save so that memory shared by several entries is written once.

    Tied embeddings appear twice in a state dict with the same storage. An entry is
    dropped when another contiguous entry of the same storage covers strictly more
    memory, or the same memory under a name that sorts first; this is vLLM's rule,
    so checkpoints written by either tool name tied tensors the same way.
    Order of the input is kept.
    """
    groups: dict[tuple[object, int], list[TensorView]] = defaultdict(list)
    views = list(views)
    for v in views:
        groups[v.storage].append(v)
    keep: list[str] = []
    for v in views:
        covered = False
        for other in groups[v.storage]:
            if other is v or not other.contiguous:
                continue
            if other.start > v.start or other.end < v.end:
                continue  # `other` does not cover `v`
            if other.start < v.start or other.end > v.end or not v.contiguous or other.name < v.name:
                covered = True
                break
        if not covered:
            keep.append(v.name)
    return keep


def plan_parts(sizes: Sequence[tuple[str, int]], max_size: int | None) -> list[list[str]]:
    """Group tensors, in order, into parts of at most ``max_size`` bytes.

    A tensor larger than ``max_size`` goes alone into its own part; no part is empty.

    >>> plan_parts([("a", 4), ("b", 4), ("c", 9), ("d", 1)], max_size=8)
    [['a', 'b'], ['c'], ['d']]
    """
    if max_size is not None and max_size <= 0:
        raise ShardedStateError(f"max_size must be a positive number of bytes, got {max_size}.")
    parts: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, nbytes in sizes:
        if current and max_size is not None and current_size + nbytes > max_size:
            parts.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current:
        parts.append(current)
    return parts


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor, as saved or as the serving model expects it."""

    shape: tuple[int, ...]
    dtype: str


def check_tensor_sets(
    expected: Mapping[str, TensorSpec],
    saved: Mapping[str, TensorSpec],
    where: str,
    hint: str,
    limit: int = 10,
) -> list[str]:
    """Raise unless ``saved`` has exactly the tensors of ``expected`` with their shapes.

    Returns the names whose dtype differs (the caller casts them). ``where`` names the
    rank and checkpoint, ``hint`` says what to do.
    """

    def listing(names: Sequence[str]) -> str:
        shown = ", ".join(names[:limit])
        return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")

    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors: {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {listing(unexpected)}")
    mismatched = [
        f"{name} saved {list(saved[name].shape)} but the model expects {list(spec.shape)}"
        for name, spec in expected.items()
        if name in saved and tuple(saved[name].shape) != tuple(spec.shape)
    ]
    if mismatched:
        problems.append(f"shape mismatch: {listing(mismatched)}")
    if problems:
        raise ShardedStateError(f"{where}: " + "; ".join(problems) + f". {hint}")
    return [name for name, spec in expected.items() if saved[name].dtype != spec.dtype]


# ------------------------------------------------------------------ read spans


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + length)`` of file ``file`` that go to byte ``start`` of destination ``dest``.

    Files and destinations are indices into the caller's lists. ``itemsize`` is the
    stored element size: a destination that converts (another dtype, another
    device) must receive whole elements, so a span boundary that cuts one is widened.
    """

    file: int
    offset: int
    length: int
    dest: int
    start: int = 0
    itemsize: int = 1

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class FileGrid:
    """How one file is cut into spans: its size, the span (checksum block) size and
    whether its spans are verified: ``"none"``, ``"touched"`` (every span a piece
    touches is read whole and hashed) or ``"all"`` (every span of the file)."""

    size: int
    span_bytes: int
    verify: str = "none"
    name: str = ""


@dataclass(frozen=True)
class Span:
    """One unit of reading: the pieces falling in cell ``index`` of a file's grid.

    ``begin``/``end`` bound the bytes read. A verified span covers its whole cell
    (bytes no piece wants are read into scratch) so that it can be hashed as one
    checksum block; ``pieces`` are clipped to the cell, in file order.
    """

    file: int
    index: int
    begin: int
    end: int
    pieces: tuple[Piece, ...]
    verified: bool

    @property
    def nbytes(self) -> int:
        """Bytes this span delivers to destinations."""
        return sum(p.length for p in self.pieces)


def plan_spans(pieces: Iterable[Piece], files: Sequence[FileGrid]) -> list[Span]:
    """Cut pieces on each file's fixed grid into spans, in file order.

    Spans are the unit that reader threads take: one cell of at most ``span_bytes``
    contiguous bytes, so reads stay large and near-sequential while several are in
    flight, and a verified span is exactly one checksum block. Pure; raises on a
    piece outside its file.
    """
    cells: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for p in pieces:
        if p.length <= 0:
            continue
        grid = files[p.file]
        if p.offset < 0 or p.end > grid.size:
            raise ShardedStateError(
                f"{grid.name or f'file {p.file}'}: a read of bytes {p.offset}..{p.end} falls outside the file's "
                f"{grid.size} bytes; the file is truncated or was replaced. Copy or save the checkpoint again."
            )
        first, last = p.offset // grid.span_bytes, (p.end - 1) // grid.span_bytes
        for index in range(first, last + 1):
            lo = max(p.offset, index * grid.span_bytes)
            hi = min(p.end, (index + 1) * grid.span_bytes)
            cells[(p.file, index)].append(Piece(p.file, lo, hi - lo, p.dest, p.start + (lo - p.offset), p.itemsize))
    for file, grid in enumerate(files):
        if grid.verify == "all":
            for index in range(max(1, -(-grid.size // grid.span_bytes))):
                cells.setdefault((file, index), [])
        elif grid.verify not in ("none", "touched"):
            raise ShardedStateError(f"unknown span verification {grid.verify!r}")
    spans = []
    for (file, index), cell in sorted(cells.items()):
        grid = files[file]
        cell.sort(key=lambda p: (p.offset, p.end))
        verified = grid.verify != "none"
        if verified:
            begin, end = index * grid.span_bytes, min(grid.size, (index + 1) * grid.span_bytes)
        else:
            begin, end = cell[0].offset, max(p.end for p in cell)
        spans.append(Span(file, index, begin, end, tuple(cell), verified))
    return spans
