"""Saving a sharded checkpoint, engine-free: staged parts, an exclusive lock, the manifest last.

A save goes through four steps, each visible on disk:

1. **lock**: ``.sharded_state.lock`` is created exclusively (O_EXCL). A second save into
   the directory fails while the first runs; an existing checkpoint is refused unless
   ``overwrite`` is asked. A loader refuses a directory holding the lock.
2. **stage**: every rank writes its parts under hidden temporary names
   (``.model-rank-0-part-0.safetensors.<token>.partial``), hashing them as they are written.
   The previous checkpoint, if any, is still intact: a failure here (disk full) removes
   the staged files and the lock, and loses nothing.
3. **swap**: the old manifest is removed, every rank renames its staged parts into place
   and removes its parts of the old save that the new one does not have.
4. **publish**: files of ranks the new topology does not have are removed, the manifest is
   written (temporary file, fsync, rename) and the lock released.

A crash in 3 or 4 leaves the lock in place, so the directory is refused as interrupted,
never loaded as a mix. :func:`save_checkpoint` runs the steps in one process; the vLLM
save hook (:mod:`..engine.capture`) runs them across workers.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..format.errors import ShardedStateError
from ..format.experts import ExpertPlacement
from ..format.manifest import FileEntry, Manifest, RankEntry, TensorEntry
from ..format.names import (
    DEFAULT_PATTERNS,
    MANIFEST_NAME,
    default_pattern,
    parse_file_name,
    render_file_name,
    staged_name,
    staged_token,
    validate_pattern,
)
from ..format.source import SourceModel
from ..planning.parts import plan_parts
from ..planning.topology import RankInfo
from ..storage import writer
from ..storage.local import fsync_directory, read_header
from ..storage.location import is_remote
from ..storage.lock import SaveLock, acquire_save_lock, release_save_lock
from ..storage.tensors import dtype_name, map_file_range, torch_dtype

DEFAULT_MAX_SIZE = 5 * 1024**3


def new_token() -> str:
    """A unique id for one save's staged files and lock."""
    return uuid.uuid4().hex[:12]


# ----------------------------------------------------------------------- stage


@dataclass
class StagedRank:
    """One rank's parts, written under temporary names until :func:`publish_rank`."""

    directory: str
    rank: RankInfo
    pattern: str
    max_size: int | None
    entry: RankEntry
    temporary: dict[str, str] = field(default_factory=dict)  # final name -> temporary path

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
) -> StagedRank:
    """Write one rank's tensors into size-capped parts under temporary names.

    Each part is hashed while it is written. On any failure (disk full) the parts
    written so far are removed and the error names the file and what to do.
    ``progress`` is called as ``progress(bytes_written_now, bytes_total)``, first with 0.
    """
    pattern = pattern or default_pattern(rank.pp_size)
    validate_pattern(pattern, rank.tp_size, rank.pp_size)
    token = token or new_token()
    os.makedirs(directory, exist_ok=True)
    sizes = [(name, t.numel() * t.element_size()) for name, t in tensors.items()]
    parts = plan_parts(sizes, max_size)
    names = [render_file_name(pattern, tp_rank=rank.tp_rank, pp_rank=rank.pp_rank, part=i) for i in range(len(parts))]
    if len(set(names)) != len(names):
        raise ShardedStateError(f"File pattern {pattern!r} renders the same name for two parts of {rank}.")
    files: list[FileEntry] = []
    entries: dict[str, TensorEntry] = {}
    staged = StagedRank(directory, rank, pattern, max_size, RankEntry(rank.tp_rank, rank.pp_rank, (), {}))
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
                written = writer.write_file(tmp, items, {"format": "pt"}, advance)
            except OSError as e:
                raise ShardedStateError(
                    f"Writing {tmp} ({rank}) failed: {e}. Nothing was published and the previous "
                    "checkpoint, if any, is intact; free space (or fix the directory) and save again."
                ) from e
            files.append(FileEntry(file_name, written.size, written.checksum))
            for name, t in items:
                dtype = dtype_name(t.dtype)
                entries[name] = TensorEntry(file_name, dtype, tuple(t.shape), written.offsets[name])
    except BaseException:
        discard_rank(staged)
        raise
    staged.entry = RankEntry(rank.tp_rank, rank.pp_rank, tuple(files), entries)
    return staged


def discard_rank(staged: StagedRank) -> None:
    """Remove a rank's staged (unpublished) parts."""
    for tmp in staged.temporary.values():
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    staged.temporary.clear()


def open_staged_tensors(staged: StagedRank) -> dict[str, torch.Tensor]:
    """A staged or published rank's tensors, memory-mapped from its files (no copy).

    Used to rewrite a captured state elsewhere or with another size cap; the tensors
    stay valid as long as they are referenced.
    """
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


# ------------------------------------------------------------- swap and publish


def remove_manifest(directory: str) -> None:
    """Unpublish the previous checkpoint, just before its parts are replaced."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, MANIFEST_NAME))


def publish_rank(staged: StagedRank) -> RankEntry:
    """Rename a rank's staged parts into place and remove its parts of an older save."""
    for name, tmp in list(staged.temporary.items()):
        os.replace(tmp, os.path.join(staged.directory, name))
        del staged.temporary[name]
    keep = {f.name for f in staged.entry.files}
    for name in os.listdir(staged.directory):
        fields = parse_file_name(staged.pattern, name)
        if (
            fields is not None
            and name not in keep
            and (fields.get("tp_rank", 0), fields.get("pp_rank", 0)) == (staged.rank.tp_rank, staged.rank.pp_rank)
        ):
            os.remove(os.path.join(staged.directory, name))
    fsync_directory(staged.directory)
    return staged.entry


def write_manifest(directory: str, manifest: Manifest, lock: SaveLock | None = None) -> None:
    """Publish a checkpoint: drop parts it does not list, write the manifest atomically, unlock.

    Parts of ranks the new topology does not have (an older save at a larger TP) are
    removed, so vLLM's own loader cannot pick them up either, and so are the staged files
    of this save and of the interrupted save whose lock it took over; never those of
    another save. The manifest goes through a temporary file, fsync and rename: a
    directory without it is incomplete.
    """
    listed = {f.name for entry in manifest.ranks for f in entry.files}
    for entry in manifest.ranks:
        for f in entry.files:
            size = os.path.getsize(os.path.join(directory, f.name))
            if size != f.size:
                raise ShardedStateError(f"{os.path.join(directory, f.name)}: {size} bytes, expected {f.size}.")
    ours = set() if lock is None else {lock.token, lock.taken_over} - {None}
    for name in os.listdir(directory):
        stale_part = any(parse_file_name(p, name) for p in (manifest.pattern, *DEFAULT_PATTERNS))
        # Every rank of this save has renamed its staged parts by now: staged files left
        # with our tokens are those of the interrupted save this one took over.
        if (name not in listed and stale_part) or staged_token(name) in ours:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, name))
    path = os.path.join(directory, MANIFEST_NAME)
    tmp = os.path.join(directory, staged_name(MANIFEST_NAME, new_token() if lock is None else lock.token))
    with open(tmp, "w") as out:
        out.write(manifest.to_json())
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_directory(directory)
    if lock is not None:
        release_save_lock(lock)


def save_checkpoint(
    directory: str,
    ranks: Mapping[RankInfo, Mapping[str, torch.Tensor]],
    *,
    dtype: str,
    source: SourceModel,
    pattern: str | None = None,
    max_size: int | None = None,
    overwrite: bool = False,
    geometry: Mapping[str, dict] | None = None,
    tied: tuple[tuple[str, ...], ...] = (),
    experts: ExpertPlacement | None = None,
) -> Manifest:
    """Save every rank's tensors from one process (tests, offline tools); see the module doc.

    ``directory`` may be an ``s3://bucket/prefix`` URL (:mod:`.remote_save`). ``geometry``
    (JSON of :class:`~..format.geometry.TensorGeometry` by tensor name) lets the
    checkpoint be served at another TP/PP size; ``tied`` lists names saved once for several;
    ``experts`` is where the ranks' routed experts are placed (expert parallelism; EP rank =
    TP rank).
    """
    infos = sorted(ranks, key=lambda r: (r.pp_rank, r.tp_rank))
    pattern = pattern or default_pattern(infos[0].pp_size)

    def manifest_of(entries: Sequence[RankEntry]) -> Manifest:
        return Manifest(
            tp_size=infos[0].tp_size,
            pp_size=infos[0].pp_size,
            dtype=dtype,
            pattern=pattern,
            source=source,
            ranks=tuple(entries),
            geometry=dict(geometry or {}),
            tied=tied,
            experts=experts,
        )

    if is_remote(directory):
        from .remote_save import save_ranks_to_objects

        return save_ranks_to_objects(
            directory, [(info, ranks[info]) for info in infos], pattern, max_size, overwrite, manifest_of
        )
    token = new_token()
    lock = acquire_save_lock(directory, token, overwrite)
    staged: list[StagedRank] = []
    try:
        for info in infos:
            staged.append(stage_rank(directory, ranks[info], info, pattern, max_size, token))
    except BaseException:
        for s in staged:
            discard_rank(s)
        release_save_lock(lock)
        raise
    remove_manifest(directory)
    manifest = manifest_of([publish_rank(s) for s in staged])
    write_manifest(directory, manifest, lock)
    return manifest
