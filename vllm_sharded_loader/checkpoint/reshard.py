"""Loading a checkpoint saved at another TP/PP size: planned reads of exactly the bytes a rank keeps.

:mod:`..planning.reads` decides which byte ranges of which saved files a serving rank
needs and where they land; :class:`ReshardSource` checks the files those plans touch and
executes the plans with the parallel reader, joining rows split along dimension 1 in
bounded batches. The offline ``vllm-sharded reshard`` uses the same source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..format.errors import ShardedStateError, listing
from ..format.manifest import Manifest
from ..planning.reads import (
    Read,
    ReadPlan,
    Strided,
    TensorPlan,
    files_to_check,
    plan_manifest_reads,
    unexpected_tensors,
)
from ..planning.spans import Piece
from ..planning.topology import RankInfo
from ..storage.location import StoredFile, file_path
from ..storage.memory import Target
from ..storage.reader import DEFAULT_THREADS, ReadStats, read_pieces
from ..storage.tensors import torch_dtype
from .rank_files import CheckedFile, check_not_replaced, check_rank_file
from .stats import LoadStats, check_verify_mode

# Bytes of temporaries a resharding load holds at once to join rows (see ReshardSource.read).
GATHER_BYTES = 256 * 1024 * 1024


@dataclass
class _ReadBatch:
    """One :func:`.read_pieces` call of a resharding load, and the row joins after it."""

    pieces: list[Piece] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, Strided, torch.Tensor]] = field(default_factory=list)
    gathered: int = 0

    def add(self, target: Target) -> int:
        self.targets.append(target)
        return len(self.targets) - 1


def _gathers(read: Read, target: torch.Tensor) -> bool:
    """Whether a planned read is contiguous in the file but strided (several rows) in the target."""
    # The planner pairs source and destination runs one to one; rows that follow each
    # other in the file (stride == length) are one contiguous range.
    return read.dest.count > 1 and read.source.stride == read.source.length and target.is_contiguous()


class ReshardSource:
    """A checkpoint opened for planned reads at another topology (see :mod:`..planning.reads`).

    Indexes the manifest's tensors with their geometry, plans a serving rank's reads, and
    fills tensors from those plans. Each file is checked (size, header against the
    manifest) the first time a plan touches it; with ``verify="checksum"`` every
    checksum block a read touches is verified as it is read.
    """

    def __init__(self, directory: str, manifest: Manifest, verify: str = "size") -> None:
        self.directory, self.manifest, self.verify = directory, manifest, check_verify_mode(verify)
        self.dtypes = {name: t.dtype for entry in manifest.ranks for name, t in entry.tensors.items()}
        self.owners = {f.name: (f, entry) for entry in manifest.ranks for f in entry.files}
        self.checked: dict[str, CheckedFile] = {}  # file name -> the file, open and checked

    def plan(self, needed: Sequence[str], rank: RankInfo, tied: Sequence[Sequence[str]] = ()) -> ReadPlan:
        """The :class:`~..planning.reads.ReadPlan` giving ``rank`` the tensors ``needed``."""
        return plan_manifest_reads(
            self.manifest,
            needed,
            tp_size=rank.tp_size,
            tp_rank=rank.tp_rank,
            pp_rank=rank.pp_rank,
            tied=tied,
            directory=self.directory,
        )

    def stored_dtype(self, tensor_plan: TensorPlan) -> torch.dtype:
        return torch_dtype(self.dtypes[tensor_plan.source_name], tensor_plan.name)

    def check_file(self, name: str) -> StoredFile:
        """Open and check a saved file the first time a plan touches it (:func:`.rank_files.check_rank_file`)."""
        if name not in self.checked:
            f, entry = self.owners[name]
            self.checked[name] = check_rank_file(self.directory, f, entry, self.verify)
        return self.checked[name].file

    def check_unchanged(self) -> None:
        """Raise if a file read was replaced or modified since it was opened."""
        for checked in self.checked.values():
            checked.file.check_unchanged()

    def read(
        self,
        plans: Mapping[str, TensorPlan],
        targets: Mapping[str, torch.Tensor],
        *,
        threads: int = DEFAULT_THREADS,
        progress: Callable[[int, int], None] | None = None,
        huge_pages: bool = False,
    ) -> ReadStats:
        """Fill ``targets`` from their :class:`~..planning.reads.TensorPlan` (cast if the saved dtype differs).

        With ``verify="checksum"`` every checksum block the plans touch is read whole and
        verified; blocks they do not touch are not read.
        """
        files = sorted({r.file for p in plans.values() for r in p.reads})
        index = {name: i for i, name in enumerate(files)}
        opened = [self.check_file(name) for name in files]
        checksums = {index[n]: self.owners[n][0].checksum for n in files} if self.verify == "checksum" else {}
        batch = _ReadBatch()
        batches = [batch]
        for name, tensor_plan in plans.items():
            stored, target = self.stored_dtype(tensor_plan), targets[name]
            size = stored.itemsize
            zero_runs = [run for zeros in tensor_plan.zero_fills for run in zeros.runs()]
            dest = batch.add(Target(target, stored, zero_runs))
            for r in tensor_plan.reads:
                file = index[r.file]
                if not _gathers(r, target):
                    for (src, src_end), (dst, _) in zip(r.source.runs(), r.dest.runs(), strict=True):
                        batch.pieces.append(Piece(file, src, src_end - src, dest, dst * size, size))
                    continue
                # Contiguous bytes in the file that land as strided rows (a dim-1 split being
                # joined): one read into a temporary, one strided copy, instead of a read per
                # row. Temporaries are bounded per batch.
                if batch.gathered and batch.gathered + r.source.total > GATHER_BYTES:
                    batch = _ReadBatch()
                    batches.append(batch)
                    dest = batch.add(Target(target, stored))
                temp = torch.empty(r.source.total // size, dtype=stored)
                at = batch.add(Target(temp, stored))
                batch.pieces.append(Piece(file, r.source.offset, r.source.total, at, 0, size))
                batch.copies.append((temp, r.dest, target))
                batch.gathered += r.source.total
        total, spans, huge = 0, 0, False
        for batch in batches:
            stats = read_pieces(
                opened,
                batch.pieces,
                batch.targets,
                checksums=checksums,
                verify="touched",
                threads=threads,
                progress=progress,
                huge_pages=huge_pages,
            )
            for temp, dest_runs, target in batch.copies:
                rows = target.view(-1).as_strided(
                    (dest_runs.count, dest_runs.length), (dest_runs.stride, 1), dest_runs.offset
                )
                rows.copy_(temp.view(dest_runs.count, dest_runs.length))
            batch.copies.clear()
            total, spans, huge = total + stats.bytes_read, spans + stats.spans, huge or stats.huge_pages
        return ReadStats(total, spans, threads, huge)

    def fill(self, tensor_plan: TensorPlan, target: torch.Tensor) -> None:
        """Read one planned tensor into ``target`` (cast if its dtype differs from the saved one)."""
        self.read({tensor_plan.name: tensor_plan}, {tensor_plan.name: target})

    def close(self) -> None:
        for checked in self.checked.values():
            checked.file.close()
        self.checked.clear()

    def __enter__(self) -> ReshardSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_resharded(
    directory: str,
    manifest: Manifest,
    targets: Mapping[str, torch.Tensor],
    rank: RankInfo,
    *,
    verify: str = "size",
    tied: Sequence[Sequence[str]] = (),
    started: float | None = None,
    threads: int = DEFAULT_THREADS,
    progress: Callable[[int, int], None] | None = None,
    huge_pages: bool = False,
) -> LoadStats:
    """Fill a rank's tensors from a checkpoint saved at another TP/PP size.

    Plans exactly the byte ranges this rank keeps, checks the files it touches, then
    reads those ranges straight into the parameters: a rank never reads bytes it does
    not keep. Every planned shape is checked against the model before any read.
    """
    started = time.perf_counter() if started is None else started
    with ReshardSource(directory, manifest, verify) as source:
        plan = source.plan(list(targets), rank, tied)
        wrong = [
            f"{n} planned {list(p.shape)} but the model expects {list(targets[n].shape)}"
            for n, p in plan.tensors.items()
            if tuple(p.shape) != tuple(targets[n].shape)
        ]
        if wrong:
            raise ShardedStateError(
                f"{directory} ({rank}, resharded from TP={manifest.tp_size} PP={manifest.pp_size}): shape "
                f"mismatch: {'; '.join(wrong[:5])}. Save the checkpoint again."
            )
        unexpected = unexpected_tensors(manifest, targets, tied, rank.pp_size)
        if unexpected:
            shown = listing(unexpected, 5)
            raise ShardedStateError(
                f"{directory} ({rank}, resharded from TP={manifest.tp_size} PP={manifest.pp_size}): the checkpoint "
                f"holds tensors the served model does not have: {shown}. It was saved from another model: save it "
                "again from the model being served."
            )
        for name in files_to_check(plan, manifest):
            source.check_file(name)  # every check before the first byte lands in a parameter
        read = source.read(plan.tensors, targets, threads=threads, progress=progress, huge_pages=huge_pages)
        check_not_replaced(directory, manifest, source.check_unchanged)
        cast = [n for n, p in plan.tensors.items() if targets[n].dtype != source.stored_dtype(p)]
    return LoadStats(
        files=tuple(file_path(directory, n) for n in plan.files),
        tensors=len(plan.tensors),
        bytes_read=plan.bytes_read,
        seconds=time.perf_counter() - started,
        cast=tuple(cast),
        with_manifest=True,
        resharded_from=(manifest.tp_size, manifest.pp_size),
        checkpoint_bytes=manifest.nbytes,
        threads=read.threads,
    )
