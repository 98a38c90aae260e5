"""One rank's parts written under temporary names, hashed while written: every save's *stage* step.
A store's *place* step gives them their final names (:func:`fresh_names`)."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..format.entries import RANK_METADATA
from ..format.errors import InvalidOption, SaveRefused, ShardedStateError
from ..format.manifest import FileEntry, Manifest, RankEntry, TensorEntry
from ..format.names import (
    TOKEN_DIGITS,
    default_pattern,
    fresh_part_names,
    render_file_name,
    staged_name,
    validate_pattern,
)
from ..planning.parts import plan_parts
from ..planning.topology import RankInfo
from . import writer
from .local import make_output_folder, read_header
from .tensors import dtype_name, map_file_range, torch_dtype


def new_token() -> str:
    """A unique id for one save's staged files and lock."""
    return uuid.uuid4().hex[:TOKEN_DIGITS]


@dataclass
class StagedRank:
    """One rank's parts, written under temporary names until a store places them."""

    directory: str
    rank: RankInfo
    pattern: str
    max_size: int | None
    entry: RankEntry
    temporary: dict[str, str] = field(default_factory=dict)  # final name -> temporary path
    # Parts under their final names, not yet published: a failed save removes them too.
    placed: list[str] = field(default_factory=list)

    def paths(self) -> list[str]:
        """Where the parts are now: temporary paths until published, final paths after."""
        return [self.temporary.get(f.name, os.path.join(self.directory, f.name)) for f in self.entry.files]


def stage_rank(
    directory: str,
    tensors: Mapping[str, torch.Tensor],
    rank: RankInfo,
    pattern: str | None = None,
    max_size: int | None = None,
    token: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    buffer_bytes: int | None = None,
) -> StagedRank:
    """Write one rank's tensors into size-capped parts under temporary names, hashed while written,
    through staging buffers of ``buffer_bytes``; on any failure the parts so far are removed.
    ``progress`` is called as ``progress(bytes_written_now, bytes_total)``, first with 0."""
    pattern = pattern or default_pattern(rank.pp_size, rank.replicas)
    validate_pattern(pattern, rank.tp_size, rank.pp_size, rank.replicas)
    token = token or new_token()
    make_output_folder(directory)
    sizes = [(name, t.numel() * t.element_size()) for name, t in tensors.items()]
    parts = plan_parts(sizes, max_size)
    dp_rank = rank.saved_dp_rank
    names = [
        render_file_name(pattern, tp_rank=rank.tp_rank, pp_rank=rank.pp_rank, dp_rank=dp_rank, part=i)
        for i in range(len(parts))
    ]
    if len(set(names)) != len(names):
        raise InvalidOption(f"File pattern {pattern!r} renders the same name for two parts of {rank}.")
    files: list[FileEntry] = []
    entries: dict[str, TensorEntry] = {}
    staged = StagedRank(directory, rank, pattern, max_size, RankEntry(rank.tp_rank, rank.pp_rank, (), {}, dp_rank))
    metadata = {"format": "pt", RANK_METADATA: staged.entry.label}
    total = sum(size for _, size in sizes)
    if progress is not None:
        progress(0, total)
    advance = None if progress is None else (lambda n: progress(n, total))
    try:
        for file_name, part in zip(names, parts, strict=True):
            tmp = os.path.join(directory, staged_name(file_name, token))
            staged.temporary[file_name] = tmp
            items = [(name, tensors[name]) for name in part]
            try:
                written = writer.write_file(tmp, items, metadata, advance, buffer_bytes=buffer_bytes)
            except OSError as e:
                raise SaveRefused(
                    f"Writing {tmp} ({rank}) failed: {e}. Nothing was published and the previous "
                    "checkpoint, if any, is intact; free space (or fix the directory) and save again."
                ) from e
            files.append(FileEntry(file_name, written.size, written.checksum, written.digest))
            for name, t in items:
                dtype = dtype_name(t.dtype)
                entries[name] = TensorEntry(file_name, dtype, tuple(t.shape), written.offsets[name])
    except BaseException:
        discard_rank(staged)
        raise
    staged.entry = RankEntry(rank.tp_rank, rank.pp_rank, tuple(files), entries, dp_rank)
    return staged


def renamed_entry(entry: RankEntry, names: Mapping[str, str]) -> RankEntry:
    """A rank's entry with its files renamed (``old name -> new name``), tensors following their files."""
    return RankEntry(
        entry.tp_rank,
        entry.pp_rank,
        tuple(replace(f, name=names[f.name]) for f in entry.files),
        {n: TensorEntry(names[t.file], t.dtype, t.shape, t.offset) for n, t in entry.tensors.items()},
        entry.dp_rank,
    )


def listed_names(read_manifest: Callable[[], Manifest | None]) -> set[str]:
    """Every file the published manifest lists, there or not (none if unreadable): a part placed under
    a listed but missing name would complete the published checkpoint with this save's bytes."""
    with contextlib.suppress(ShardedStateError):
        published = read_manifest()
        if published is not None:
            return published.listed_files()
    return set()


def fresh_names(staged: StagedRank, taken: set[str]) -> dict[str, str]:
    """``staged name -> final name`` for a rank's parts: vLLM's pattern, colliding with none of
    ``taken`` (every file where they are placed, and every file its published manifest lists)."""
    old = [f.name for f in staged.entry.files]
    rank = staged.rank
    new = fresh_part_names(
        staged.pattern, len(old), taken, tp_rank=rank.tp_rank, pp_rank=rank.pp_rank, dp_rank=rank.saved_dp_rank
    )
    return dict(zip(old, new, strict=True))


def discard_rank(staged: StagedRank) -> None:
    """Remove a rank's staged and placed parts (never published: no manifest lists them)."""
    for path in [*staged.temporary.values(), *staged.placed]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    staged.temporary.clear()
    staged.placed.clear()


def open_staged_tensors(staged: StagedRank) -> dict[str, torch.Tensor]:
    """A staged or published rank's tensors, memory-mapped from its files (no copy)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in staged.paths():
        header = read_header(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            for name, h in header.tensors.items():
                dtype = torch_dtype(h.dtype, path)
                tensors[name] = map_file_range(fd, h.begin, h.end - h.begin, dtype, h.shape)
        finally:
            os.close(fd)  # the mappings stay valid without the descriptor
    return {name: tensors[name] for name in staged.entry.tensors}


def stage_in_parallel(
    stage_one: Callable[[RankInfo, Callable[[int, int], None], int], StagedRank],
    infos: Sequence[RankInfo],
    progress: Callable[[int, int], None] | None = None,
    staged_all: Callable[[], None] = lambda: None,
) -> list[StagedRank]:
    """Stage every rank at once, a thread each, with ``stage_one(rank, progress, buffer_bytes)``; on any
    failure every staged rank is discarded. ``staged_all`` runs once all are staged (a kill point).

    Ctrl-C reaches only the waiting thread, which stops the ranks' threads at their next write. Every
    thread that began is joined before this returns: one left running would recreate the removed folder."""
    stop = threading.Event()
    cond = threading.Condition()
    began: list[threading.Thread] = []  # the threads that took their rank (under cond)
    results: dict[int, StagedRank] = {}
    failures: dict[int, BaseException] = {}
    gave_up = False

    def written(done: int, total: int) -> None:
        if stop.is_set():
            raise KeyboardInterrupt  # (the interrupt, carried into this rank's thread)
        if progress is not None:
            progress(done, total)

    buffers = writer.buffer_bytes_for(len(infos))  # the ranks' writers share one staging budget

    def run(k: int, info: RankInfo) -> None:
        with cond:
            if gave_up:
                return
            began.append(threading.current_thread())
        try:
            results[k] = stage_one(info, written, buffers)
        except BaseException as e:
            failures[k] = e
        finally:
            with cond:
                cond.notify_all()

    errors: list[BaseException] = []
    try:  # (from the first start: an interrupt before the wait must stop the ranks' threads too)
        for k, info in enumerate(infos):
            threading.Thread(target=run, args=(k, info), name=f"stage-{k}").start()
        with cond:
            # Timed: a Ctrl-C delivered to a rank's thread is only seen once this thread wakes.
            while len(results) + len(failures) < len(infos):
                cond.wait(0.1)
    except BaseException as e:
        errors.append(e)
        stop.set()
    finally:
        with cond:
            gave_up = True
        for thread in began:
            thread.join()
    staged = [results[k] for k in sorted(results)]
    errors += [failures[k] for k in sorted(failures)]
    try:
        if errors:
            raise errors[0]
        staged_all()
    except BaseException:  # (an interrupt too: these ranks are not yet the caller's to discard)
        for s in staged:
            discard_rank(s)
        raise
    return staged
