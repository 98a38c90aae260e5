"""Saving a sharded checkpoint into object storage (``s3://``, ``gs://``, ``az://`` prefixes).

Object storage has no rename and no ``flock``, so the steps of :mod:`.save` become:

1. **lock**: the lock object is written with a conditional put (``If-None-Match: *``; on
   GCS ``x-goog-if-generation-match: 0``): exactly one save holds the prefix. A manifest already there is refused unless
   ``overwrite``; with it, the old checkpoint stays published and untouched.
2. **stage and upload**: every rank writes its parts to a local staging folder (hashed as
   written, as for a local save), then uploads each under a final name in vLLM's pattern
   that no object under the prefix has (:func:`.staged.fresh_names`), large ones as
   parallel multipart uploads, and deletes the staged copy. Each rank first records the
   names it will upload in a small hidden object of the save's token
   (``.uploads-pp0-dp0-tp1.<token>.partial``): what a failed or dead save leaves is
   removed from these records alone, never by guessing from names.
3. **publish**: every listed part is checked by ``HEAD`` for its size, then the manifest
   is put conditionally: created, or replacing exactly the manifest it read
   (``If-Match`` its ETag; on GCS its generation), never another save's: the one atomic step.
4. **clean**: parts of the replaced manifest that the new one does not list are deleted
   (recorded under the save's token before the publish, so that the save after a dead one
   deletes them too), then this save's records, and the lock. An object that no manifest
   of ours listed is never deleted, whatever its name.

Before step 3 the previous checkpoint stays published and whole, whatever fails; a
failure deletes what this save uploaded (only its own keys), aborts its own unfinished
multipart uploads and releases the lock. A save killed outright leaves its lock (and
objects no manifest lists), so the prefix is refused to other saves until the lock is
deleted; loads of a published checkpoint go on meanwhile. The next save removes the
uploads, finished or not, that the dead save recorded. Its local staging folder stays too,
until the next save into object storage on that host removes it
(:mod:`..storage.staging_folders`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ..format.errors import CheckpointCorrupt, ShardedStateError
from ..format.manifest import Manifest, RankEntry
from ..format.names import MANIFEST_NAME, staged_name, staged_token, token_name
from ..storage.faults import declare, kill_point
from ..storage.location import ObjectStore
from ..storage.staging_folders import StagingFolder, make_staging_folder
from .carry import CarriedFiles
from .staged import StagedRank, discard_rank, fresh_names, new_token, published_names, renamed_entry

# The steps where a test kills an object-storage save (storage/faults.py), in protocol order.
KILL_LOCKED = declare("s3.locked", "checkpoint/remote_save.py: the lock object is put, nothing uploaded")
KILL_RECORDED = declare("s3.recorded", "checkpoint/remote_save.py: a rank's upload names recorded, nothing uploaded")
KILL_UPLOADED = declare("s3.uploaded", "checkpoint/remote_save.py: one part uploaded under its fresh name")
KILL_FENCING = declare("s3.fencing", "checkpoint/remote_save.py: the replaced manifest is read, the lock unchecked")
KILL_PUBLISHED = declare("s3.published", "checkpoint/remote_save.py: the manifest is put, nothing cleaned")
KILL_CLEANED = declare("s3.cleaned", "checkpoint/remote_save.py: stale parts deleted, the lock not yet released")


def begin(url: str, token: str, overwrite: bool) -> None:
    """Step 1: hold the prefix (conditional put of the lock); an old checkpoint needs ``overwrite``."""
    store = ObjectStore(url)
    store.acquire_lock(token)
    try:
        kill_point(KILL_LOCKED)
        store.refuse_a_checkpoint(overwrite)
        # An interrupted save's uploads: only those it recorded as its own before it began them.
        manifest = store.read_manifest()
        listed = set() if manifest is None else manifest.listed_files()
        _remove_recorded_uploads(store, lambda t: t != token, keep=listed)
    except BaseException:
        store.release_lock(token)
        raise


def _intent_name(staged: StagedRank, token: str) -> str:
    r = staged.rank
    return staged_name(f"uploads-pp{r.pp_rank}-dp{r.saved_dp_rank}-tp{r.tp_rank}", token)


def _remove_recorded_uploads(store: ObjectStore, whose: Callable[[str], bool], keep: set[str]) -> None:
    """Delete what saves of the tokens ``whose`` accepts recorded as theirs to delete: their uploads,
    finished or not (multipart), and the parts their publish replaced; never a name in ``keep``
    (the published manifest's). Then the records themselves."""
    records = [n for n in store.list_names() if (t := staged_token(n)) is not None and whose(t)]
    for record in records:
        try:
            names = [str(n) for n in json.loads(store.read(record))]  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            raise CheckpointCorrupt(
                f"{store.file_path(record)}: not a record of a save's uploads ({e}); delete it."
            ) from e
        names = [n for n in names if "/" not in n and n not in keep]
        store.abort_incomplete_uploads(names)
        store.remove(names)
    store.remove(records)


def upload_rank(url: str, staged: StagedRank, token: str, published: set[str] | None = None) -> RankEntry:
    """Step 2: upload a rank's staged parts under fresh final names, then drop the staged copies.

    The names collide with no object under the prefix: the published checkpoint's parts
    are never overwritten. Before the first byte, the names are recorded under the save's
    ``token`` (a small hidden object), so that a failure on any rank, or the save that takes
    over after this one died, deletes exactly these uploads and never another writer's.
    On failure the parts this call uploaded are deleted again (and the staged ones kept
    for :func:`abandon` to remove). Returns the entry naming the uploads. ``published``: as
    :func:`.staged.taken_names`.
    """
    store = ObjectStore(url)
    renamed = fresh_names(staged, store, published)
    store.put(_intent_name(staged, token), json.dumps(sorted(renamed.values())).encode())
    kill_point(KILL_RECORDED)
    uploaded: list[str] = []
    try:
        for name, tmp in list(staged.temporary.items()):
            uploaded.append(renamed[name])
            store.put(renamed[name], Path(tmp))
            kill_point(KILL_UPLOADED)
    except BaseException:
        with contextlib.suppress(ShardedStateError):
            store.remove(uploaded)
            store.abort_incomplete_uploads(uploaded)
        raise
    discard_rank(staged)
    return renamed_entry(staged.entry, renamed)


def abandon(url: str, entries: Sequence[RankEntry] = (), token: str | None = None) -> None:
    """After a failed save: delete the parts it uploaded (every rank's, as recorded under its
    ``token``), abort its multipart uploads, release the lock. Never a part that the manifest
    published there lists: the save's records also name the parts its publish was to replace
    (the old checkpoint's, still published when its manifest's put failed)."""
    store = ObjectStore(url)
    with contextlib.suppress(ShardedStateError):
        published = store.read_manifest()  # unreadable: nothing is deleted; the next save cleans up
        keep = set() if published is None else published.listed_files()
        names = [f.name for e in entries for f in e.files if f.name not in keep]
        store.remove(names)
        store.abort_incomplete_uploads(names)
        if token is not None:
            _remove_recorded_uploads(store, lambda t: t == token, keep=keep)
    store.release_lock(token)


def publish(
    url: str, manifest: Manifest, token: str | None = None, carried: CarriedFiles | None = None
) -> frozenset[str]:
    """Step 3: check every listed part, then put the manifest conditionally: the one atomic step.

    With ``token`` (the lock's), a save whose lock was taken over does not publish.
    ``carried`` non-weight files are put just before the manifest (the caller restores
    them if this fails). Returns the part names the replaced manifest listed, for
    :func:`clean_after_publish`.
    """
    store = ObjectStore(url)
    # The manifest this save replaces, read before the lock is checked: another save publishes only
    # once it has taken the lock, so if one did after the check, the put below (conditional on this
    # manifest) fails, and this save does not publish over it.
    old = store.head(MANIFEST_NAME)
    kill_point(KILL_FENCING)
    for entry in manifest.ranks:
        for f in entry.files:
            store.open_part(f)  # present, with the size recorded
    if token is not None:  # (last before the first write: the carried files)
        store.check_lock_holder(token)
    if carried is not None:
        carried.place()
    content = manifest.to_json().encode()
    if old is None:
        replaced: frozenset[str] = frozenset()
        _put_manifest(store, content, None)
    else:
        # Read under the lock: only a save holding it replaces the manifest, and the put below
        # fails if the manifest changed meanwhile all the same (its ETag or generation).
        previous = store.read_manifest()
        replaced = frozenset() if previous is None else frozenset(previous.listed_files())
        if token is not None:
            # Recorded before the put: if this save dies between the put and its cleanup, the
            # next save deletes the old parts from this record (those the manifest then lists stay).
            listed = manifest.listed_files()
            store.put(staged_name("replaced", token), json.dumps(sorted(replaced - listed)).encode())
        _put_manifest(store, content, old)
    kill_point(KILL_PUBLISHED)
    return replaced


def _put_manifest(store: ObjectStore, content: bytes, old: dict | None) -> None:
    """The manifest's conditional put. A put whose answer was lost (the connection cut after the
    store took it) fails on its retry (the condition no longer holds) or after its retries: the
    manifest then in the store says whether it was published, and a save that was must not be
    abandoned (its abandon would delete the parts of the checkpoint it published)."""
    try:
        if old is None:
            store.put(MANIFEST_NAME, content, create=True)
        else:
            store.put(MANIFEST_NAME, content, match=old)
    except ShardedStateError:
        try:
            published = store.read(MANIFEST_NAME) == content
        except ShardedStateError:
            published = False
        if not published:
            raise


def clean_after_publish(url: str, manifest: Manifest, token: str | None = None, replaced: Iterable[str] = ()) -> None:
    """Step 4: delete the parts of the ``replaced`` manifest that the new one does not list, and
    this save's upload records (the caller then releases the lock).

    Only what the old manifest listed goes: an object under the prefix that no manifest of
    ours named is another writer's, even under a name of our pattern. A failure here leaves
    the new checkpoint published and whole, and this save's records, so that the next save
    deletes what is left.
    """
    store = ObjectStore(url)
    store.remove(sorted(set(replaced) - manifest.listed_files()))
    if token is not None:
        store.remove([n for n in store.list_names() if staged_token(n) == token])
    kill_point(KILL_CLEANED)


class ObjectTarget:
    """An object-storage prefix as the target of the save protocol (:mod:`.protocol`): the steps above.

    Every member stages in a local folder of its own (made on first use, removed at the end),
    unless its caller stages elsewhere (an engine's start-up capture).
    """

    stages_in_place = False
    abandoned = "Nothing was published: this save's uploads and lock were deleted."

    def __init__(self, url: str, overwrite: bool = False) -> None:
        self.where = url
        self.overwrite = overwrite
        self.token = new_token()
        self.replaced: frozenset[str] = frozenset()
        self.scratch: StagingFolder | None = None
        self.published: set[str] | None = None  # what the published manifest lists, read at the first place

    def lock(self) -> str:
        begin(self.where, self.token, self.overwrite)
        return self.token

    def join(self, token: str, member: str) -> None:
        self.token = token  # every member records its uploads under the lock's token: cleanups find them all

    def check_joined(self, seen: list[None]) -> None:
        pass  # every member reaches the same prefix

    def staging(self) -> str:
        if self.scratch is None:
            self.scratch = make_staging_folder()
        return self.scratch.path

    def place(self, staged: StagedRank) -> RankEntry:
        if self.published is None:
            self.published = published_names(ObjectStore(self.where))
        return upload_rank(self.where, staged, self.token, self.published)

    def write_rank_file(self, name: str, data: bytes) -> str:
        """Under a fresh name (the save's token in it): the published checkpoint's own file of
        that name is never replaced before the publish. Recorded under the token first, as
        the parts are, so that an abandoned or dead save's copy is removed."""
        fresh = token_name(name, self.token)
        store = ObjectStore(self.where)
        store.put(staged_name(f"uploads-{fresh}", self.token), json.dumps([fresh]).encode())
        store.put(fresh, data)
        return fresh

    def publish(self, manifest: Manifest, carried: CarriedFiles) -> None:
        self.replaced = publish(self.where, manifest, self.token, carried)

    def clean(self, manifest: Manifest) -> None:
        clean_after_publish(self.where, manifest, self.token, self.replaced)

    def release(self) -> None:
        ObjectStore(self.where).release_lock(self.token)

    def abandon(self, entries: Sequence[RankEntry]) -> None:
        abandon(self.where, entries, self.token)

    def close(self) -> None:
        if self.scratch is not None:
            self.scratch.remove()
            self.scratch = None
