"""Loading a checkpoint saved at another TP/PP size: planned reads of exactly the bytes a rank keeps.

:mod:`..planning.reads` decides which byte ranges of which saved files a serving rank
needs and where they land; :class:`ReshardSource` checks the files those plans touch and
executes the plans with the parallel reader: pieces along dimension 0 mapped into place
where the caller can adopt a tensor, rows split along dimension 1 copied out of mappings of
their file ranges in bounded batches. The offline ``vllm-sharded reshard`` uses the same source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from ..format.errors import CheckpointMismatch, listing
from ..format.manifest import Manifest
from ..planning.manifest_plans import files_to_check, plan_manifest_reads, unexpected_tensors
from ..planning.reads import ReadPlan, Strided, TensorPlan
from ..planning.spans import Piece
from ..planning.topology import RankInfo
from ..storage import oscalls
from ..storage.location import StoredFile, file_path
from ..storage.memory import PAGE, Target, map_pieces
from ..storage.reader import DEFAULT_READ, ReadOptions, ReadStats, read_pieces
from ..storage.tensors import map_file_range, torch_dtype
from .rank_files import CheckedFile, check_not_replaced, check_rank_file
from .request import LoadRequest
from .stats import LoadStats, check_verify_mode

# Bytes of saved files a resharding load maps at once to join or cut rows (see ReshardSource.read).
GATHER_BYTES = 256 * 1024 * 1024


@dataclass
class _ReadBatch:
    """One :func:`.read_pieces` call of a resharding load, and the row copies after it.

    A strided read (rows of a dim-1 split, joined or cut) maps the saved file's
    contiguous range holding its rows, which the reader pages in and verifies like read
    bytes; then one strided copy moves the rows from the mapping into the target: on the
    reader thread that read the range's last bytes for a CPU target (so copies overlap
    the other reads), after the batch for an accelerator's.
    """

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
    """Copy read rows into their target on the reader thread; then drop ``source``'s pages (a file mapping).

    ``source`` is None for rows fetched into a temporary from the heap: dropping pages
    there would zero the allocator's neighbouring memory.
    """
    if prefault is not None:
        start = prefault.data_ptr()
        end = start + prefault.numel() * prefault.element_size()
        lo, hi = -(-start // PAGE) * PAGE, end // PAGE * PAGE
        if hi > lo:
            oscalls.populate_write(lo, hi - lo)
    # The reader's threads already copy in parallel: a copy's own OpenMP team would only
    # take the cores from the other readers and from the caller. The setting is this
    # thread's (OpenMP's is per thread), and put back: with one stream the reader runs
    # on the caller's thread.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copy()
    finally:
        torch.set_num_threads(before)
    # Unmapping hundreds of MB of paged-in mappings costs ~0.1 s; here it runs in parallel
    # with the other reads instead of wherever the mapping happens to be freed.
    if source is None:
        return
    start = source.data_ptr()
    end = start + source.numel() * source.element_size()
    lo, hi = start // PAGE * PAGE, -(-end // PAGE) * PAGE
    oscalls.drop_pages(lo, hi - lo)


def _placeable(tensor_plan: TensorPlan, target: torch.Tensor, stored: torch.dtype) -> bool:
    """Whether a tensor can be served from file mappings: a CPU tensor of the saved dtype, every read one run."""
    return (
        target.device.type == "cpu"
        and target.dtype == stored
        and target.is_contiguous()
        and target.numel() > 0
        and all(r.source.count == 1 and r.dest.count == 1 for r in tensor_plan.reads)
    )


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
        return plan_manifest_reads(self.manifest, needed, rank, tied=tied, directory=self.directory)

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
        options: ReadOptions = DEFAULT_READ,
        adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
    ) -> ReadStats:
        """Fill ``targets`` from their :class:`~..planning.reads.TensorPlan` (cast if the saved dtype differs).

        With ``verify="checksum"`` every checksum block the plans touch is read whole and
        verified; blocks they do not touch are not read. ``options`` run the reader
        (:class:`..storage.reader.ReadOptions`). ``adopt`` (tensor name -> callback, as for
        :func:`.load.load_rank`): a CPU target of the saved dtype whose every piece
        is one run of a file (dim-0 splits, replicated tensors) is served from private
        mappings of the files' pages (:func:`..storage.memory.map_pieces`), bytes sharing a
        page with another piece being read; its callback receives that tensor once every
        byte is read and verified.
        """
        files = sorted({r.file for p in plans.values() for r in p.reads})
        index = {name: i for i, name in enumerate(files)}
        opened = [self.check_file(name) for name in files]
        checksums = {index[n]: self.owners[n][0].checksum for n in files} if self.verify == "checksum" else {}
        adopt = adopt or {}
        adopted: list[tuple[Callable[[torch.Tensor], None], torch.Tensor]] = []
        mapped_bytes = 0
        batch = _ReadBatch()
        batches = [batch]
        for name, tensor_plan in plans.items():
            stored, target = self.stored_dtype(tensor_plan), targets[name]
            size = stored.itemsize
            zero_runs = [run for zeros in tensor_plan.zero_fills for run in zeros.runs()]
            taker = adopt.get(name)
            mappable = all(opened[index[r.file]].mappable for r in tensor_plan.reads)
            if taker is not None and mappable and _placeable(tensor_plan, target, stored):
                # Every saved piece is one run of its file: map the pages that hold them in
                # place (dim-0 pieces joined or cut), read only what shares a page.
                placed = [
                    Piece(index[r.file], r.source.offset, r.source.total, 0, r.dest.offset * size, size)
                    for r in tensor_plan.reads
                ]
                tensor, ranges = map_pieces(opened, placed, stored, tuple(target.shape))
                if any(hi > lo for lo, hi in ranges):
                    dest = batch.add(Target(tensor, stored, zero_runs))
                    flat = tensor.view(-1).view(torch.uint8)
                    for p, (lo, hi) in zip(placed, ranges, strict=True):
                        for a, b in (
                            ((p.start, lo), (hi, p.start + p.length)) if hi > lo else ((p.start, p.start + p.length),)
                        ):
                            if b > a:
                                batch.pieces.append(Piece(p.file, p.offset + a - p.start, b - a, dest, a, size))
                        if hi > lo:
                            at = batch.add(Target(flat[lo:hi], stored, mapped=True))
                            batch.pieces.append(Piece(p.file, p.offset + lo - p.start, hi - lo, at, 0, size))
                    adopted.append((taker, tensor))
                    mapped_bytes += sum(hi - lo for lo, hi in ranges)
                    continue
            dest = batch.add(Target(target, stored, zero_runs))
            for r in tensor_plan.reads:
                file = index[r.file]
                if not target.is_contiguous():
                    # Rare (parameters are contiguous): the reader fills a temporary, run by run.
                    for (src, src_end), (dst, _) in zip(r.source.runs(), r.dest.runs(), strict=True):
                        batch.pieces.append(Piece(file, src, src_end - src, dest, dst * size, size))
                    continue
                if r.source.count == 1 and r.dest.count == 1:
                    batch.pieces.append(Piece(file, r.source.offset, r.source.total, dest, r.dest.offset * size, size))
                    continue
                # Rows of a dim-1 split (joined, or cut from longer saved rows): map the file's
                # range holding them, page it in with the reads, then one strided copy.
                # Planning and reading stay per tensor, never per row.
                span = (r.source.count - 1) * r.source.stride + r.source.length
                if batch.gathered and batch.gathered + span > GATHER_BYTES:
                    batch = _ReadBatch()
                    batches.append(batch)
                    dest = batch.add(Target(target, stored))
                handle = opened[file]
                if handle.mappable:
                    source = map_file_range(handle.fd, r.source.offset, span, stored, (span // size,))
                else:  # an object in object storage: fetched into a temporary, then copied the same way
                    source = torch.empty(span // size, dtype=stored)
                dropped = source if handle.mappable else None  # a temporary's pages are the heap's
                rows = source.as_strided((r.source.count, r.source.length // size), (r.source.stride // size, 1))
                copy = partial(_copy_rows, rows, r.dest, target)
                on_cpu = target.device.type == "cpu"
                at = batch.add(
                    Target(
                        source,
                        stored,
                        mapped=handle.mappable,
                        filled=partial(_copy_on_reader, copy, dropped, target) if on_cpu else None,
                    )
                )
                batch.pieces.append(Piece(file, r.source.offset, span, at, 0, size))
                if not on_cpu:
                    batch.copies.append(copy)
                batch.gathered += span
        total, spans, huge, used = 0, 0, False, options.threads
        for batch in batches:
            stats = read_pieces(
                opened, batch.pieces, batch.targets, checksums=checksums, verify="touched", options=options
            )
            batch.copy_rows()
            total, spans, huge = total + stats.bytes_read, spans + stats.spans, huge or stats.huge_pages
            used = stats.threads  # the reader's own count (more for objects in object storage)
        # Only now, with every byte read and verified, do callers take the mapped tensors.
        for taker, tensor in adopted:
            taker(tensor)
        return ReadStats(total, spans, used, huge, mapped_bytes)

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
    request: LoadRequest,
    targets: Mapping[str, torch.Tensor],
    rank: RankInfo,
    options: ReadOptions = DEFAULT_READ,
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
    started: float | None = None,
) -> LoadStats:
    """Fill a rank's tensors from a checkpoint saved at another TP/PP size.

    Plans exactly the byte ranges this rank keeps, checks the files it touches, then
    reads those ranges straight into the parameters, or maps them where ``adopt`` offers
    (see :meth:`ReshardSource.read`). Rows of a dim-1 split are paged in from a mapping
    of the file range holding them, so the pages a rank touches may hold bytes of other
    ranks' rows. Every planned shape is checked against the model before any read.
    """
    started = time.perf_counter() if started is None else started
    directory, manifest, tied = request.directory, request.manifest, request.tied
    assert manifest is not None, "a resharding load has a manifest"
    with ReshardSource(directory, manifest, request.verify) as source:
        plan = source.plan(list(targets), rank, tied)
        wrong = [
            f"{n} planned {list(p.shape)} but the model expects {list(targets[n].shape)}"
            for n, p in plan.tensors.items()
            if tuple(p.shape) != tuple(targets[n].shape)
        ]
        if wrong:
            raise CheckpointMismatch(
                f"{directory} ({rank}, resharded from TP={manifest.tp_size} PP={manifest.pp_size}): shape "
                f"mismatch: {'; '.join(wrong[:5])}. Save the checkpoint again."
            )
        unexpected = unexpected_tensors(manifest, targets, tied, rank.pp_size)
        if unexpected:
            shown = listing(unexpected, 5)
            raise CheckpointMismatch(
                f"{directory} ({rank}, resharded from TP={manifest.tp_size} PP={manifest.pp_size}): the checkpoint "
                f"holds tensors the served model does not have: {shown}. It was saved from another model: save it "
                "again from the model being served."
            )
        for name in files_to_check(plan, manifest):
            source.check_file(name)  # every check before the first byte lands in a parameter
        read = source.read(plan.tensors, targets, options, adopt)
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
