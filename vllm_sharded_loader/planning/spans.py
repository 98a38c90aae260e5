"""Read spans: planned byte ranges of files cut on a fixed grid, the unit reader threads take. Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..format.errors import CheckpointCorrupt, InvalidOption


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + length)`` of file ``file`` that go to byte ``start`` of destination ``dest``
    (indices into the caller's lists); a converting destination receives whole ``itemsize`` elements."""

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
    """How one file is cut into spans (checksum blocks), and which are verified: ``"none"``,
    ``"touched"`` (each span a piece touches, read whole) or ``"all"``."""

    size: int
    span_bytes: int
    verify: str = "none"
    name: str = ""


@dataclass(frozen=True)
class Span:
    """One unit of reading: the pieces (clipped, in file order) in cell ``index`` of a file's grid;
    ``begin``/``end`` bound the bytes read, a verified span's whole cell (one checksum block)."""

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
    """Cut pieces on each file's fixed grid into spans, in file order: reads stay large and
    near-sequential while several are in flight. A piece outside its file is refused."""
    cells: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for p in pieces:
        if p.length <= 0:
            continue
        grid = files[p.file]
        if p.offset < 0 or p.end > grid.size:
            raise CheckpointCorrupt(
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
            raise InvalidOption(f"unknown span verification {grid.verify!r}")
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


def split_streams(spans: Sequence[Span], streams: int) -> list[list[Span]]:
    """Cut spans (in file order) into at most ``streams`` contiguous runs of about equal bytes."""
    total = sum(s.end - s.begin for s in spans)
    runs: list[list[Span]] = [[]]
    done = 0
    for span in spans:
        if runs[-1] and done >= total * len(runs) / streams and len(runs) < streams:
            runs.append([])
        runs[-1].append(span)
        done += span.end - span.begin
    return [r for r in runs if r]
