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
from collections.abc import Mapping, Sequence

import torch

from ..format.errors import ShardedStateError
from ..format.experts import ExpertPlacement
from ..format.manifest import Manifest, RankEntry
from ..format.names import (
    DEFAULT_PATTERNS,
    MANIFEST_NAME,
    default_pattern,
    parse_file_name,
    staged_name,
    staged_token,
)
from ..format.source import SourceModel
from ..planning.topology import RankInfo
from ..storage.local import fsync_directory
from ..storage.location import is_remote
from ..storage.lock import SaveLock, acquire_save_lock, release_save_lock
from .remote_save import save_ranks_to_objects
from .staged import StagedRank, discard_rank, new_token, open_staged_tensors, stage_rank

# Re-exported: the save protocol's steps, in the order they run.
__all__ = [
    "DEFAULT_MAX_SIZE",
    "StagedRank",
    "discard_rank",
    "new_token",
    "open_staged_tensors",
    "publish_rank",
    "remove_manifest",
    "save_checkpoint",
    "stage_rank",
    "write_manifest",
]

DEFAULT_MAX_SIZE = 5 * 1024**3


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
            and (fields.get("tp_rank", 0), fields.get("pp_rank", 0), fields.get("dp_rank", 0))
            == (staged.rank.tp_rank, staged.rank.pp_rank, staged.rank.saved_dp_rank)
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
    TP rank, or, with ranks of several data-parallel replicas, ``dp_rank * tp_size + tp_rank``:
    then each replica after the first gives only its expert tensors; likewise when the ranks'
    ``experts_over_dp`` says that their experts are cut across TP x DP).
    """
    infos = sorted(ranks, key=lambda r: (r.pp_rank, r.dp_rank, r.tp_rank))
    replicas = infos[0].replicas
    if any(r.dp_rank >= replicas for r in infos):
        raise ShardedStateError(
            "Only the first data-parallel replica writes a save, unless its experts are split across the "
            f"replicas (EP size = TP x DP, or experts_over_dp); ranks of replica {max(r.dp_rank for r in infos)} "
            "were given."
        )
    pattern = pattern or default_pattern(infos[0].pp_size, replicas)

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
            dp_size=infos[0].dp_size,
            experts_over_dp=infos[0].experts_over_dp,
        )

    if is_remote(directory):
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
