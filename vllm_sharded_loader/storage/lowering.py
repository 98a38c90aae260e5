"""Read plans lowered to the reader's pieces and targets, and run: every load route ends here. Targets
the caller can swap (``adopt``) are served from private file mappings where their reads allow."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from ..format.manifest import FileChecksum
from ..planning.reads import TensorPlan
from ..planning.runs import Strided
from ..planning.spans import Piece
from . import oscalls
from .local import truncated
from .location import StoredFile
from .memory import PAGE, Target, map_pieces
from .reader import DEFAULT_READ, ReadOptions, ReadStats, read_pieces
from .tensors import map_file_range, torch_threads

GATHER_BYTES = 256 * 1024 * 1024  # saved bytes a load maps at once to join or cut dim-1 rows


@dataclass
class _ReadBatch:
    """One :func:`.read_pieces` call, and the accelerator targets' row copies after it (CPU targets'
    run on the reader thread, overlapping the other reads)."""

    pieces: list[Piece] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    copies: list[Callable[[], None]] = field(default_factory=list)
    gathered: int = 0

    def add(self, target: Target) -> int:
        self.targets.append(target)
        return len(self.targets) - 1

    def copy_rows(self) -> None:
        for copy in self.copies:
            copy()
        self.copies.clear()
        self.targets.clear()  # and with them the mappings


def _copy_rows(source: torch.Tensor, dest_runs: Strided, target: torch.Tensor) -> None:
    rows = target.view(-1).as_strided((dest_runs.count, dest_runs.length), (dest_runs.stride, 1), dest_runs.offset)
    rows.copy_(source)


def _copy_on_reader(copy: Callable[[], None], source: torch.Tensor | None, prefault: torch.Tensor | None) -> None:
    """Copy read rows into their target on the reader thread; then drop ``source``'s pages (a file
    mapping; None for a heap temporary, whose dropped pages would zero the allocator's neighbours)."""
    if prefault is not None:
        start = prefault.data_ptr()
        end = start + prefault.numel() * prefault.element_size()
        lo, hi = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if hi > lo:
            oscalls.populate_write(lo, hi - lo)
    with torch_threads():  # the reader's threads already copy in parallel
        copy()
    # Unmapping paged-in mappings is slow: done here, it overlaps the other reads.
    if source is None:
        return
    start = source.data_ptr()
    end = start + source.numel() * source.element_size()
    lo, hi = start // PAGE * PAGE, -(-end // PAGE) * PAGE
    oscalls.drop_pages(lo, hi - lo)


def placeable(plan: TensorPlan, target: torch.Tensor, stored: torch.dtype) -> bool:
    """Whether a tensor can be served from file mappings: a CPU tensor of the saved dtype, every read one run. Pure."""
    return (
        target.device.type == "cpu"
        and target.dtype == stored
        and target.is_contiguous()
        and target.numel() > 0
        and all(r.source.count == 1 and r.dest.count == 1 for r in plan.reads)
    )


class _Lowering:
    """The pieces, targets and batches of one :func:`read_plans` call, built tensor by tensor."""

    def __init__(self, files: list[StoredFile], index: Mapping[str, int], map_rows: bool = True) -> None:
        self.files, self.index = files, index
        # Map dim-1 rows' file range (else read it): a mapped file truncated meanwhile raises SIGBUS.
        self.map_rows = map_rows
        self.batch = _ReadBatch()
        self.batches = [self.batch]
        self.adopted: list[tuple[Callable[[torch.Tensor], None], torch.Tensor]] = []
        self.mapped_bytes = 0

    def mapped(
        self, plan: TensorPlan, target: torch.Tensor, stored: torch.dtype, taker: Callable[[torch.Tensor], None]
    ) -> bool:
        """Serve a tensor whose every piece is one run from mappings of the files' pages; False if none maps."""
        size = stored.itemsize
        placed = [
            Piece(self.index[r.file], r.source.offset, r.source.total, 0, r.dest.offset * size, size)
            for r in plan.reads
        ]
        tensor, ranges = map_pieces(self.files, placed, stored, tuple(target.shape))
        if not any(hi > lo for lo, hi in ranges):
            return False
        batch = self.batch
        zero_runs = [run for zeros in plan.zero_fills for run in zeros.runs()]
        dest = batch.add(Target(tensor, stored, zero_runs))
        flat = tensor.view(-1).view(torch.uint8)
        for p, (lo, hi) in zip(placed, ranges, strict=True):
            # Read what is not mapped (bytes sharing a page with another piece); page in what is.
            for a, b in ((p.start, lo), (hi, p.start + p.length)) if hi > lo else ((p.start, p.start + p.length),):
                if b > a:
                    batch.pieces.append(Piece(p.file, p.offset + a - p.start, b - a, dest, a, size))
            if hi > lo:
                at = batch.add(Target(flat[lo:hi], stored, mapped=True))
                batch.pieces.append(Piece(p.file, p.offset + lo - p.start, hi - lo, at, 0, size))
        self.adopted.append((taker, tensor))
        self.mapped_bytes += sum(hi - lo for lo, hi in ranges)
        return True

    def read(self, plan: TensorPlan, target: torch.Tensor, stored: torch.dtype) -> None:
        """Read a tensor's runs into it: straight, run by run, or rows through a mapping and a strided copy."""
        size = stored.itemsize
        zero_runs = [run for zeros in plan.zero_fills for run in zeros.runs()]
        dest = self.batch.add(Target(target, stored, zero_runs))
        for r in plan.reads:
            file = self.index[r.file]
            if not target.is_contiguous():
                for (src, src_end), (dst, _) in zip(r.source.runs(), r.dest.runs(), strict=True):
                    self.batch.pieces.append(Piece(file, src, src_end - src, dest, dst * size, size))
                continue
            if r.source.count == 1 and r.dest.count == 1:
                self.batch.pieces.append(Piece(file, r.source.offset, r.source.total, dest, r.dest.offset * size, size))
                continue
            # Rows of a dim-1 split: the file range holding them, then one strided copy (never per row).
            span = (r.source.count - 1) * r.source.stride + r.source.length
            if self.batch.gathered and self.batch.gathered + span > GATHER_BYTES:
                self.batch = _ReadBatch()
                self.batches.append(self.batch)
                dest = self.batch.add(Target(target, stored))
            handle = self.files[file]
            mapped = handle.mappable and self.map_rows
            if mapped:
                fd = handle.fd  # type: ignore[attr-defined]
                try:
                    source = map_file_range(fd, r.source.offset, span, stored, (span // size,))
                except ValueError:  # the file is shorter now than when it was checked
                    raise truncated(handle.path, os.fstat(fd).st_size) from None
            else:  # an object in object storage, or a load that maps nothing: read into a temporary, then copied
                source = torch.empty(span // size, dtype=stored)
            dropped = source if mapped else None  # a temporary's pages are the heap's
            rows = source.as_strided((r.source.count, r.source.length // size), (r.source.stride // size, 1))
            copy = partial(_copy_rows, rows, r.dest, target)
            on_cpu = target.device.type == "cpu"
            filled = partial(_copy_on_reader, copy, dropped, target) if on_cpu else None
            at = self.batch.add(Target(source, stored, mapped=mapped, filled=filled))
            self.batch.pieces.append(Piece(file, r.source.offset, span, at, 0, size))
            if not on_cpu:
                self.batch.copies.append(copy)
            self.batch.gathered += span


def read_plans(
    files: Mapping[str, StoredFile],
    plans: Mapping[str, TensorPlan],
    targets: Mapping[str, torch.Tensor],
    stored: Mapping[str, torch.dtype],
    *,
    checksums: Mapping[str, FileChecksum] | None = None,
    verify: str = "touched",
    options: ReadOptions = DEFAULT_READ,
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> ReadStats:
    """Fill ``targets`` from their plans (cast where the saved dtype ``stored`` differs); returns what was read.

    ``files`` are the plans' files, open; ``checksums`` (by file name) are verified, every block
    (``verify="all"``) or those touched. ``adopt`` maps tensor names to callbacks taking a tensor over
    private file mappings in the target's place, called once every byte is read and verified.
    """
    names = list(files)
    index = {name: i for i, name in enumerate(names)}
    opened = [files[n] for n in names]
    by_index = {index[n]: c for n, c in (checksums or {}).items() if n in index}
    # Without ``adopt``, map nothing: a part truncated during the load is an error, never a SIGBUS.
    lowering = _Lowering(opened, index, map_rows=adopt is not None)
    adopt = adopt or {}
    for name, plan in plans.items():
        target, dtype, taker = targets[name], stored[name], adopt.get(name)
        mappable = taker is not None and all(opened[index[r.file]].mappable for r in plan.reads)
        if mappable and placeable(plan, target, dtype) and lowering.mapped(plan, target, dtype, taker):
            continue
        lowering.read(plan, target, dtype)
    total, spans, huge, used, direct = 0, 0, False, options.threads, False
    for i, batch in enumerate(lowering.batches):
        # "all" verifies every block of every file once; a later batch checks the blocks it touches.
        mode = verify if i == 0 else "touched"
        stats = read_pieces(opened, batch.pieces, batch.targets, checksums=by_index, verify=mode, options=options)
        batch.copy_rows()
        total, spans, huge = total + stats.bytes_read, spans + stats.spans, huge or stats.huge_pages
        used, direct = stats.threads, direct or stats.direct  # the reader's own count (more for objects)
    # Only now, with every byte read and verified, do callers take the mapped tensors.
    for taker, tensor in lowering.adopted:
        taker(tensor)
    return ReadStats(total, spans, used, huge, lowering.mapped_bytes, direct)
