"""A checkpoint under an object-storage prefix: :class:`ObjectStore`, through :mod:`.objects`,
locked by :mod:`.object_lock`.

No rename, no ``flock``: **lock** is a create-only put (a dead save's lock is deleted by hand);
**place** records a rank's upload names under the save's token, then uploads under fresh names;
**publish** checks the parts and the lock (fencing), records the replaced parts, and puts the
manifest conditionally on the one read. What a failed or dead save leaves is removed from its
records alone, never by guessing from names.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..format.errors import CheckpointCorrupt, ShardedStateError
from ..format.manifest import CarriedFile, FileEntry, Manifest, RankEntry
from ..format.names import MANIFEST_NAME, staged_name, staged_token, token_name
from . import model_files, object_lock, objects
from .faults import KILL_CARRIED, declare, kill_point
from .folder import LocalStore
from .fresh_process import copy_objects, in_fresh_process
from .local import open_regular
from .staged import StagedRank, discard_rank, fresh_names, listed_names, new_token, renamed_entry
from .staging_folders import StagingFolder, make_staging_folder

# Where a test kills an object-storage save (:mod:`.faults`), in protocol order.
KILL_LOCKED = declare("s3.locked", "storage/object_store.py: the lock object is put, nothing uploaded")
KILL_RECORDED = declare("s3.recorded", "storage/object_store.py: a rank's upload names recorded, nothing uploaded")
KILL_UPLOADED = declare("s3.uploaded", "storage/object_store.py: one part uploaded under its fresh name")
KILL_FENCING = declare("s3.fencing", "storage/object_store.py: the replaced manifest is read, the lock unchecked")
KILL_PUBLISHED = declare("s3.published", "storage/object_store.py: the manifest is put, nothing cleaned")
KILL_CLEANED = declare("s3.cleaned", "storage/object_store.py: stale parts deleted, the lock not yet released")


class ObjectStore:
    """An object-storage prefix (``s3://``, ``gs://``, ``az://``, :mod:`.in_memory`'s) as a :class:`.location.Store`."""

    vllm_saves_here = False
    stages_in_place = False
    abandoned = "Nothing was published: this save's uploads and lock were deleted."

    def __init__(self, url: str) -> None:
        self.where = url
        self.prefix = objects.ObjectPrefix.parse(url)
        self.token = new_token()  # the lock's, once a save takes or joins it
        self.scratch: StagingFolder | None = None
        self._begin()

    @staticmethod
    def accepts(where: str) -> bool:
        """Whether ``where`` names an object-storage prefix (of a scheme with a client)."""
        return objects.is_object_url(where)

    def _begin(self) -> None:
        """Forget any earlier save's state: a store runs one save at a time."""
        self.replaced: frozenset[str] = frozenset()
        self.published: set[str] | None = None  # the published manifest's files, read at the first place
        self.carried: dict[str, bytes] = {}  # name -> bytes to put
        self.previous: dict[str, bytes | None] = {}  # name -> the object's bytes when staged
        self.backups: dict[str, bytes | None] = {}  # name put -> what it replaced

    # ---------------------------------------------------------------- reading

    def exists(self) -> bool:
        return True  # a prefix is where objects go; an empty one reads as holding no checkpoint

    def missing(self) -> str | None:
        return None

    def canonical(self) -> str:
        return self.where

    def file_path(self, name: str) -> str:
        return self.prefix.url(name)

    def read_manifest(self) -> Manifest | None:
        return objects.read_manifest(self.prefix)

    def open_part(self, f: FileEntry) -> objects.ObjectFile:
        return objects.open_part(self.prefix, f)

    def open_file(self, name: str, contained: bool = False) -> objects.ObjectFile:
        return objects.ObjectFile.open(self.prefix, name)

    def list_names(self) -> list[str]:
        return objects.list_names(self.prefix)

    def non_weight_files(self) -> list[str]:
        names = objects.list_tree(self.prefix)
        # A checkpoint saved under the prefix is not the model's to carry.
        modules = model_files.modules_in(self.read("modules.json")) if "modules.json" in names else set()
        pattern = model_files.own_part_pattern(self.read_manifest) if MANIFEST_NAME in names else None
        return model_files.carried_in_listing(names, modules, pattern)

    def read(self, name: str) -> bytes:
        return objects.read_object(self.prefix, name)

    def exists_file(self, name: str) -> bool:
        return objects.head(self.prefix, name) is not None

    def special_files(self) -> list[ShardedStateError]:
        return []  # an object is bytes, whatever its name

    def links_out(self, names: Iterable[str]) -> list[ShardedStateError]:
        return []  # a key is inside its prefix

    def same_as(self, other: object) -> bool:
        # As parsed: "s3://b/x", "s3://b/x/" and "S3://b//x" are one prefix.
        return isinstance(other, ObjectStore) and self.prefix == other.prefix

    def inside(self, other: object) -> bool:
        if not isinstance(other, ObjectStore):
            return False
        one, two = self.prefix, other.prefix
        same_bucket = (one.scheme, one.account, one.bucket) == (two.scheme, two.account, two.bucket)
        return same_bucket and one.prefix != two.prefix and one.prefix.startswith(two.prefix)

    # ---------------------------------------------------------------- the lock

    def is_locked(self) -> bool:
        return object_lock.read_lock(self.prefix) is not None

    def check_not_locked(self) -> None:
        object_lock.check_not_locked(self.prefix)

    def save_is_running(self) -> bool | None:
        return None  # no flock: a lock object is all there is, whether its save runs or died

    def describe_lock(self) -> str | None:
        holder = object_lock.read_lock(self.prefix)
        return None if holder is None else object_lock.describe_lock(self.prefix, holder)

    def owner_is_alive(self, token: str) -> bool:
        return False  # no engine captures into object storage: staged objects are a dead save's

    def refuse_before_save(self, overwrite: bool) -> None:
        object_lock.refuse_before_save(self.prefix, overwrite)

    # ---------------------------------------------------------------- writing

    def put(self, name: str, data: bytes | Path, *, create: bool = False, match: dict[str, Any] | None = None) -> None:
        objects.put(self.prefix, name, data, create=create, match=match)

    def remove(self, names: Iterable[str]) -> None:
        objects.delete(self.prefix, names)

    # ------------------------------------------------------- the save's steps

    def lock(self, token: str, overwrite: bool, patterns: tuple[str, ...]) -> None:
        self._begin()
        self.token = token
        object_lock.acquire_lock(self.prefix, token)
        try:
            kill_point(KILL_LOCKED)
            object_lock.refuse_a_checkpoint(self.prefix, overwrite)
            self._remove_recorded(lambda t: t != token, keep=self._listed())
        except BaseException:
            object_lock.release_lock(self.prefix, token)
            raise

    def join(self, token: str) -> bool:
        self.token = token  # every member records its uploads under the lock's token
        return True  # every member reaches the same prefix

    def staging(self) -> str:
        if self.scratch is None:
            self.scratch = make_staging_folder()
        return self.scratch.path

    def place(self, staged: StagedRank) -> RankEntry:
        """Upload a rank's staged parts under fresh names, recorded under the save's token first so
        that a cleanup deletes exactly these."""
        if self.published is None:
            self.published = listed_names(self.read_manifest)  # (under the lock: it cannot change)
        renamed = fresh_names(staged, set(self.list_names()) | self.published)
        r = staged.rank
        record = staged_name(f"uploads-pp{r.pp_rank}-dp{r.saved_dp_rank}-tp{r.tp_rank}", self.token)
        self.put(record, json.dumps(sorted(renamed.values())).encode())
        kill_point(KILL_RECORDED)
        uploaded: list[str] = []
        try:
            for name, tmp in list(staged.temporary.items()):
                uploaded.append(renamed[name])
                self.put(renamed[name], Path(tmp))
                kill_point(KILL_UPLOADED)
        except BaseException:
            with contextlib.suppress(ShardedStateError):
                self.remove(uploaded)
                objects.abort_incomplete_uploads(self.prefix, uploaded)
            raise
        discard_rank(staged)
        return renamed_entry(staged.entry, renamed)

    def write_rank_file(self, name: str, data: bytes) -> str:
        """Under a fresh name, recorded under the token first, as the parts are."""
        fresh = token_name(name, self.token)
        self.put(staged_name(f"uploads-{fresh}", self.token), json.dumps([fresh]).encode())
        self.put(fresh, data)
        return fresh

    def publish(self, manifest: Manifest) -> None:
        # Read before the lock is checked: a save publishing after the check fails the conditional put.
        old = objects.head(self.prefix, MANIFEST_NAME)
        kill_point(KILL_FENCING)
        for f in (f for entry in manifest.ranks for f in entry.files):
            self.open_part(f)  # present, with the size recorded
        object_lock.check_lock_holder(self.prefix, self.token)  # last before the first write
        for name in sorted(self.carried):
            self.backups[name] = self.previous.pop(name)
            self.put(name, self.carried.pop(name))
            kill_point(KILL_CARRIED)
        if old is not None:
            # Recorded before the put: a save dying before its cleanup leaves the next one the old parts.
            self.replaced = frozenset(self._listed())
            replaced = sorted(self.replaced - manifest.listed_files())
            self.put(staged_name("replaced", self.token), json.dumps(replaced).encode())
        self._put_manifest(manifest.to_json().encode(), old)
        kill_point(KILL_PUBLISHED)

    def _put_manifest(self, content: bytes, old: dict[str, Any] | None) -> None:
        """The manifest's conditional put. A put whose answer was lost fails on retry: the stored manifest
        then says whether it was published (a published save must not be abandoned)."""
        try:
            self.put(MANIFEST_NAME, content, create=old is None, match=old)
        except ShardedStateError:
            try:
                published = self.read(MANIFEST_NAME) == content
            except ShardedStateError:
                published = False
            if not published:
                raise

    def _listed(self) -> set[str]:
        """Every file the published manifest lists."""
        manifest = self.read_manifest()
        return set() if manifest is None else manifest.listed_files()

    def clean(self, manifest: Manifest) -> None:
        """Only what the old manifest listed goes: anything else is another writer's, whatever its name."""
        self.remove(sorted(self.replaced - manifest.listed_files()))
        self.remove([n for n in self.list_names() if staged_token(n) == self.token])
        kill_point(KILL_CLEANED)

    def release(self) -> None:
        object_lock.release_lock(self.prefix, self.token)

    def abandon(self, entries: Iterable[RankEntry]) -> None:
        """Delete the parts this save uploaded, never one the published manifest lists; then the lock."""
        with contextlib.suppress(ShardedStateError):  # the next save cleans up
            keep = self._listed()
            names = [f.name for e in entries for f in e.files if f.name not in keep]
            self.remove(names)
            objects.abort_incomplete_uploads(self.prefix, names)
            self._remove_recorded(lambda t: t == self.token, keep=keep)
        self.release()

    def close(self) -> None:
        if self.scratch is not None:
            self.scratch.remove()
            self.scratch = None

    def _remove_recorded(self, whose: Callable[[str], bool], keep: set[str]) -> None:
        """Delete what the saves of tokens ``whose`` accepts recorded, but ``keep``; then their records."""
        records = [n for n in self.list_names() if (t := staged_token(n)) is not None and whose(t)]
        for record in records:
            try:
                names = [str(n) for n in json.loads(self.read(record))]
            except (ValueError, TypeError) as e:
                raise CheckpointCorrupt(
                    f"{self.file_path(record)}: not a record of a save's uploads ({e}); delete it."
                ) from e
            names = [n for n in names if "/" not in n and n not in keep]
            objects.abort_incomplete_uploads(self.prefix, names)
            self.remove(names)
        self.remove(records)

    # ------------------------------------------------------- the carried files

    def stage_carried(self, index: int, name: str, data: bytes | Path) -> tuple[CarriedFile, bool | None]:
        if not isinstance(data, bytes):
            with os.fdopen(open_regular(str(data)), "rb") as f:  # a FIFO must not hang the save
                data = f.read()
        old = self.read(name) if self.exists_file(name) else None
        if old == data:
            return CarriedFile.of(data), None
        self.carried[name] = data
        self.previous[name] = old  # under the lock: the backup at publish
        return CarriedFile.of(data), old is not None

    def restore_carried(self) -> None:
        for name, backup in self.backups.items():
            with contextlib.suppress(ShardedStateError):
                if backup is None:
                    self.remove([name])
                else:
                    self.put(name, backup)
        self.finish_carried()

    def finish_carried(self) -> None:
        self.backups.clear()
        self.carried.clear()
        self.previous.clear()

    def remove_stale(self, names: Iterable[str]) -> None:
        self.remove(list(names))

    # ---------------------------------------------------- before an engine starts

    def local_copy(self, names: list[str], folder: str) -> LocalStore:
        # From a fresh process: obstore's runtime would hang the engine vLLM forks from this one.
        copy_objects(self.where, names, folder)
        return LocalStore(folder)

    @contextlib.contextmanager
    def capture_folder(self, source: str, overwrite: bool) -> Iterator[str]:
        """A local staging folder for the save, once the prefix is checked from a fresh process."""
        in_fresh_process(refuse_before_save, self.where, overwrite)
        staging = make_staging_folder()
        try:
            yield staging.path
        finally:
            staging.remove()


def refuse_before_save(url: str, overwrite: bool) -> None:
    """:meth:`ObjectStore.refuse_before_save` of the prefix ``url`` (for :func:`.fresh_process.in_fresh_process`)."""
    ObjectStore(url).refuse_before_save(overwrite)
