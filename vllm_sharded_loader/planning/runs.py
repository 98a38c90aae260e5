"""The strided runs a read plan is made of (file bytes, the tensor elements they fill), and their joining. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strided:
    """``count`` runs of ``length`` units (bytes of a file, or elements of a local tensor), the i-th
    at ``offset + i * stride``; a single run has ``count == 1`` and ``stride == length``."""

    offset: int
    length: int
    stride: int
    count: int = 1

    @property
    def total(self) -> int:
        """Units covered by all runs."""
        return self.length * self.count

    def runs(self) -> list[tuple[int, int]]:
        """Every run as ``(start, stop)``."""
        return [(self.offset + i * self.stride, self.offset + i * self.stride + self.length) for i in range(self.count)]


def strided(offset: int, length: int, stride: int, count: int) -> Strided:
    return Strided(offset, length, length, 1) if count == 1 else Strided(offset, length, stride, count)


@dataclass(frozen=True)
class Read:
    """Copy ``source`` bytes of ``file`` into ``dest`` elements of the local tensor, run by run."""

    file: str
    source: Strided
    dest: Strided


def read_run(
    file: str, source: tuple[int, int], source_stride: int, dest: tuple[int, int], dest_stride: int, count: int
) -> Read:
    (src_offset, src_length), (dst_offset, dst_length) = source, dest
    if count > 1 and src_length == source_stride and dst_length == dest_stride:
        # Whole rows on both sides: one contiguous run.
        src_length, dst_length, count = src_length * count, dst_length * count, 1
    source_runs = strided(src_offset, src_length, source_stride, count)
    return Read(file, source_runs, strided(dst_offset, dst_length, dest_stride, count))


def merge_reads(reads: list[Read]) -> list[Read]:
    """Join reads that continue each other in the same file and in the destination."""
    merged: list[Read] = []
    for r in reads:
        p = merged[-1] if merged else None
        if (
            p is not None
            and p.file == r.file
            and p.source.count == r.source.count
            and (r.source.count == 1 or (p.source.stride, p.dest.stride) == (r.source.stride, r.dest.stride))
            and r.source.offset == p.source.offset + p.source.length
            and r.dest.offset == p.dest.offset + p.dest.length
        ):
            merged[-1] = read_run(
                p.file,
                (p.source.offset, p.source.length + r.source.length),
                p.source.stride,
                (p.dest.offset, p.dest.length + r.dest.length),
                p.dest.stride,
                p.source.count,
            )
        else:
            merged.append(r)
    return merged


def merge_zeros(zeros: list[Strided]) -> list[Strided]:
    merged: list[Strided] = []
    for z in zeros:
        p = merged[-1] if merged else None
        if (
            p is not None
            and p.count == z.count
            and (z.count == 1 or p.stride == z.stride)
            and z.offset == p.offset + p.length
        ):
            length = p.length + z.length
            if p.count > 1 and length == p.stride:
                merged[-1] = strided(p.offset, length * p.count, 0, 1)
            else:
                merged[-1] = strided(p.offset, length, p.stride, p.count)
        else:
            merged.append(z)
    return merged
