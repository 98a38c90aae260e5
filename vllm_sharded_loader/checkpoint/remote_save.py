"""Saving a sharded checkpoint into object storage (``s3://bucket/prefix``).

Object storage has no rename and no ``flock``, so the steps of :mod:`.save` become:

1. **lock**: the lock object is written with a conditional put (``If-None-Match: *``):
   exactly one save holds the prefix. A manifest already there is refused unless
   ``overwrite``; with it, the manifest is deleted first, so the old checkpoint is
   never served mixed with new parts.
2. **stage and upload**: every rank writes its parts to a local staging folder (hashed as
   written, as for a local save), then uploads each under its final name, large ones as
   parallel multipart uploads, and deletes the staged copy.
3. **publish**: parts of an older save that the new one does not list are deleted, every
   listed part is checked by ``HEAD`` for its size, the manifest is put conditionally
   (never over another save's), and the lock is deleted.

A failure in 1-2 deletes what this save uploaded, aborts its unfinished multipart
uploads and releases the lock: nothing is published. A save killed outright leaves its
lock (and no manifest), so the prefix is refused as interrupted until the lock is deleted;
the next save then aborts the unfinished uploads it left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from ..format.errors import ShardedStateError
from ..format.manifest import Manifest, RankEntry
from ..format.names import DEFAULT_PATTERNS, MANIFEST_NAME, parse_file_name
from ..planning.topology import RankInfo
from ..storage import objects
from ..storage.local import non_weight_files
from .staged import StagedRank, discard_rank, new_token, stage_rank

STAGING_ENV = "SHARDED_STATE_STAGING_DIR"


def staging_base() -> str | None:
    """Where parts wait on their way to object storage: ``$SHARDED_STATE_STAGING_DIR``, else the temp dir."""
    base = os.environ.get(STAGING_ENV) or None
    if base is not None:
        os.makedirs(base, exist_ok=True)
    return base


@contextlib.contextmanager
def staging_directory() -> Iterator[str]:
    """A local folder of its own under :func:`staging_base`, removed on exit."""
    directory = tempfile.mkdtemp(prefix="sharded-state-upload-", dir=staging_base())
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def begin(url: str, token: str, overwrite: bool) -> None:
    """Step 1: hold the prefix (conditional put of the lock) and unpublish an old checkpoint if asked."""
    where = objects.ObjectPrefix.parse(url)
    objects.acquire_lock(where, token)
    try:
        if objects.head(where, MANIFEST_NAME) is not None:
            if not overwrite:
                raise ShardedStateError(
                    f"{url} already holds a checkpoint; refusing to overwrite it. Choose another prefix or pass "
                    "--overwrite."
                )
            objects.delete(where, [MANIFEST_NAME])
        objects.abort_incomplete_uploads(where)  # an interrupted save's
    except BaseException:
        objects.release_lock(where)
        raise


def upload_rank(url: str, staged: StagedRank) -> RankEntry:
    """Step 2: upload a rank's staged parts under their final names, then drop the staged copies.

    On failure the parts this call uploaded are deleted again (and the staged ones kept
    for :func:`abandon` to remove).
    """
    where = objects.ObjectPrefix.parse(url)
    uploaded: list[str] = []
    try:
        for name, tmp in list(staged.temporary.items()):
            uploaded.append(name)
            objects.put(where, name, Path(tmp))
    except BaseException:
        with contextlib.suppress(ShardedStateError):
            objects.delete(where, uploaded)
        raise
    discard_rank(staged)
    return staged.entry


def abandon(url: str, entries: Sequence[RankEntry] = ()) -> None:
    """After a failed save: delete the parts it uploaded, abort its multipart uploads, release the lock."""
    where = objects.ObjectPrefix.parse(url)
    with contextlib.suppress(ShardedStateError):
        objects.delete(where, [f.name for e in entries for f in e.files])
        objects.abort_incomplete_uploads(where)
    objects.release_lock(where)


def publish(url: str, manifest: Manifest) -> None:
    """Step 3: drop parts the manifest does not list, check every listed size, put the manifest, unlock."""
    where = objects.ObjectPrefix.parse(url)
    listed = {f.name for entry in manifest.ranks for f in entry.files}
    stale = [
        name
        for name in objects.list_names(where)
        if name not in listed and any(parse_file_name(p, name) for p in (manifest.pattern, *DEFAULT_PATTERNS))
    ]
    objects.delete(where, stale)
    for entry in manifest.ranks:
        for f in entry.files:
            objects.open_part(where, f)  # present, with the size recorded
    objects.put(where, MANIFEST_NAME, manifest.to_json().encode(), create=True)
    objects.release_lock(where)


def upload_non_weight_files(source: str, url: str) -> list[str]:
    """Upload config, tokenizer, module folders, ... of ``source`` (:func:`..storage.local.non_weight_files`)."""
    where = objects.ObjectPrefix.parse(url)
    names = non_weight_files(source)
    for name in names:
        objects.put(where, name, Path(os.path.join(source, name)))
    return names


def save_ranks_to_objects(
    url: str,
    ranks: Sequence[tuple[RankInfo, Mapping[str, torch.Tensor]]],
    pattern: str,
    max_size: int | None,
    overwrite: bool,
    manifest_of: Callable[[Sequence[RankEntry]], Manifest],
) -> Manifest:
    """The steps above from one process, for :func:`.save.save_checkpoint` given an ``s3://`` URL.

    ``manifest_of`` builds the manifest from the uploaded ranks' entries.
    """
    token = new_token()
    begin(url, token, overwrite)
    entries: list[RankEntry] = []
    try:
        with staging_directory() as staging:
            for info, tensors in ranks:
                staged = stage_rank(staging, tensors, info, pattern, max_size, token)
                entries.append(staged.entry)
                upload_rank(url, staged)
        manifest = manifest_of(entries)
        publish(url, manifest)
    except BaseException:
        abandon(url, entries)
        raise
    return manifest
