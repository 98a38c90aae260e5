"""The save protocol, written once: a store, a group of members, and the driver that runs one over the other.

Every save runs the same steps, whatever the store and however many processes take part:

1. **lock** (first member): take the store's lock; refuse an existing checkpoint unless overwriting;
2. **join** (every member): every member must see the first's lock, else the folder is not shared
   (:class:`FolderNotShared`), refused before a part is written;
3. **stage** (every member): write its parts under temporary names, hashed as written;
4. **place** (every member): give them final names that neither the store nor its manifest has;
5. **carry** (first): stage the model's non-weight files (:mod:`.carry`) and record them;
6. **publish** (first): check the parts, put the carried files in place, then the (signed) manifest,
   the one atomic step;
7. **clean** (first): remove what the new manifest does not list;
8. **release** (first): the lock, whatever the clean did, so that no later save is kept out.

Each step's outcomes are exchanged, so that all members fail together. A failure before the publish
abandons the save and the previous checkpoint stands; after it, the new one is complete
(:class:`SaveFailedAfterPublish`). A killed save leaves files that the next save removes.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from ..format.errors import InterruptedAfterPublish, SaveFailedAfterPublish, SaveRefused, ShardedStateError
from ..format.manifest import CarriedFile, Manifest, RankEntry
from ..format.names import LOCK_NAME
from ..storage.location import Store
from ..storage.staged import StagedRank, discard_rank, new_token
from .carry import CarriedFiles
from .trust import Signer, configured_signer

T = TypeVar("T")


class SaveGroup(Protocol):
    """The members of one save: one process (:class:`OneProcess`) or an engine's workers."""

    #: Whether this member runs the steps that only the first runs (lock, carry, publish, clean).
    first: bool
    #: This member, for messages ("pp0 tp1 on node-2").
    member: str

    def run(self, step: Callable[[], T], only_first: bool = False) -> list[T]:
        """Run ``step`` here (or only on the first member) and return every member's outcome (None
        where not run); raise on every member if any failed."""
        ...


class OneProcess:
    """A group of one: the save runs in this process alone (tests, offline tools, ``save_checkpoint``)."""

    first = True
    member = "this process"

    def run(self, step: Callable[[], T], only_first: bool = False) -> list[T]:
        return [step()]


class FolderNotShared(SaveRefused):
    """A local save's folder is not the same folder for every member (each node has its own)."""


@dataclass
class SaveJob:
    """What the members save: each its staged ranks, and together one manifest."""

    #: This member's ranks, staged where the store says, each with a picklable note for :attr:`manifest`.
    stage: Callable[[Store], Iterable[tuple[StagedRank, Any]]]
    #: The manifest from every member's (placed entry, note), in member order.
    manifest: Callable[[list[tuple[RankEntry, Any]]], Manifest]
    #: First member, before the lock: checks that need no lock (a file name pattern).
    check: Callable[[], None] | None = None
    #: First member, before the publish: stage the non-weight files to carry.
    carry: Callable[[CarriedFiles], None] | None = None
    #: Every member, for each rank it placed: the entry with what else it records.
    placed: Callable[[Store, RankEntry], RankEntry] | None = None
    #: Every member, after a failure before the publish, for each rank it staged.
    discard: Callable[[StagedRank], None] = discard_rank
    #: Whether the save may replace what the store holds: a checkpoint, and files it carries.
    overwrite: bool = False
    #: The parts' file name pattern (step 7 removes files so named that are unlisted).
    pattern: str | None = None


def run_save(store: Store, group: SaveGroup, job: SaveJob) -> tuple[Manifest, list[StagedRank]]:
    """Run the save protocol on this member; every member calls it with its own ``store`` of one location.

    Returns the published manifest and this member's placed ranks. A failure before the publish is
    raised as it came once the save is abandoned; after it, as :class:`SaveFailedAfterPublish`.
    """
    save = _Save(store, group, job)
    manifest = save.publish()
    save.clean(manifest)
    return manifest, save.staged


class _Save:
    """One member's run of :func:`run_save`: what it staged and placed, for the undo."""

    def __init__(self, store: Store, group: SaveGroup, job: SaveJob) -> None:
        self.store, self.group, self.job = store, group, job
        self.staged: list[StagedRank] = []
        self.entries: list[tuple[RankEntry, Any]] = []
        self.carried = CarriedFiles(store, replace=job.overwrite)
        self.signer: Signer | None = None

    def lock(self) -> str:
        """Step 1, on the first member."""
        if self.job.check is not None:
            self.job.check()
        self.signer = configured_signer()  # an unusable key refuses the save before anything is written
        token = new_token()
        self.store.lock(token, self.job.overwrite, () if self.job.pattern is None else (self.job.pattern,))
        return token

    def join(self, token: str) -> None:
        """Step 2, on every member; each decides the refusal from the same answers."""
        seen = self.group.run(lambda: (socket.gethostname(), self.group.member, self.store.join(token)))
        blind = [f"{member} on {host}" for host, member, sees in seen if not sees]
        if not blind:
            return
        holder = next((f"{member} on {host}" for host, member, sees in seen if sees), "The first worker")
        where = self.store.canonical()
        error = FolderNotShared(
            f"Refusing to save to {where}: the workers do not share that folder. {holder} locked it for this "
            f"save, but {'; '.join(blind)} cannot see that lock there: each of these nodes has its own "
            f"{where}, and a checkpoint written there would lack the other nodes' parts. Save to object "
            "storage (s3://, gs://, az://) or to a folder that every node mounts (a shared file system), then copy "
            "the checkpoint to where it is served. Nothing was written"
        )
        error.agreed = True
        raise error

    def stage_and_place(self) -> Manifest:
        """Steps 3 and 4 on every member; the manifest of every member's placed entries."""

        def stage() -> list[Any]:
            notes = []
            for rank, note in self.job.stage(self.store):  # one at a time: a failure abandons those staged before
                self.staged.append(rank)
                notes.append(note)
            return notes

        def place(rank: StagedRank) -> RankEntry:
            entry = self.store.place(rank)
            return entry if self.job.placed is None else self.job.placed(self.store, entry)

        notes = self.group.run(stage)
        placed = self.group.run(lambda: [place(s) for s in self.staged])
        self.store.close()  # staged and placed: a staging folder of the save's own is done with
        self.entries = [pair for es, ns in zip(placed, notes, strict=True) for pair in zip(es, ns, strict=True)]
        return self.job.manifest(self.entries)

    def carry(self, manifest: Manifest) -> Manifest:
        """Step 5 on the first member; every member learns its record."""
        if self.job.carry is None:
            return replace(manifest, carried_files={})

        def carry() -> tuple[dict[str, CarriedFile], tuple[str, ...]]:
            self.job.carry(self.carried)  # type: ignore[misc]
            return dict(self.carried.recorded), tuple(self.carried.stale)

        recorded, stale = self.group.run(carry, only_first=True)[0]  # type: ignore[misc]
        return replace(manifest, carried_files=recorded, stale_files=stale)

    def publish(self) -> Manifest:
        """Steps 1 to 6; a failure before the manifest is out abandons the save."""
        locked = publishing = False
        manifest: Manifest | None = None
        try:
            token = self.group.run(self.lock, only_first=True)[0]
            locked = True
            self.join(token)
            manifest = self.carry(self.stage_and_place())
            manifest = self.group.run(lambda: self._signed(manifest), only_first=True)[0]
            publishing = True
            self.group.run(lambda: self.store.publish(manifest), only_first=True)
        except BaseException as e:
            if publishing and _is_published(self.store, manifest):  # type: ignore[arg-type]
                self._published_when_stopped(e)
            undo: list[Callable[[], None]] = [self.carried.restore]
            undo += [lambda s=s: self.job.discard(s) for s in self.staged]
            if locked and self.group.first:
                undo.append(lambda: self.store.abandon([entry for entry, _ in self.entries]))
            _undo(e, [*undo, self.store.close])
            raise
        self._done()
        return manifest

    def _signed(self, manifest: Manifest) -> Manifest:
        return manifest if self.signer is None else self.signer.sign(manifest)

    def _done(self) -> None:
        """Published: the backups go, and the placed files are the checkpoint's, no longer this save's."""
        self.carried.finish()
        for s in self.staged:
            s.placed.clear()

    def _published_when_stopped(self, error: BaseException) -> None:
        """Stopped once the manifest was out: the new checkpoint is whole, and nothing of it may be undone."""
        self._done()
        self.store.close()
        where = self.store.canonical()
        if isinstance(error, (ShardedStateError, OSError)):
            # The lock goes, or a live engine would keep every later save out.
            _undo(error, [self.store.release], "Releasing the lock after the publish failed")
            raise _after_publish(where, error, "finishing its publish") from error
        if isinstance(error, KeyboardInterrupt) and not isinstance(error, InterruptedAfterPublish):
            raise InterruptedAfterPublish(where, self.store) from error
        raise error

    def clean(self, manifest: Manifest) -> None:
        """Steps 7 and 8 on the first member: a failure here leaves the new checkpoint published."""

        def clean() -> None:
            try:
                try:
                    self.store.clean(manifest)
                finally:  # (the next save no longer knows what the replaced checkpoint carried)
                    self.carried.remove_stale(manifest)
            except Exception as e:
                # A file that may not be removed (EPERM, EROFS, an Azure lease on an old part) must not keep
                # the lock: every later save would be refused until it was deleted by hand.
                _undo(e, [self.store.release], "Releasing the lock after the clean-up failed")
                raise
            self.store.release()

        try:
            self.group.run(clean, only_first=True)
        except (ShardedStateError, OSError) as e:  # (a file that cannot be removed: EPERM, EBUSY, EROFS)
            raise _after_publish(self.store.canonical(), e) from e
        except KeyboardInterrupt as e:  # (the lock and what is not removed yet stay: the next save's to clean)
            if isinstance(e, InterruptedAfterPublish):
                raise
            raise InterruptedAfterPublish(self.store.canonical(), self.store) from e
        finally:
            self.store.close()


def _undo(error: BaseException, steps: Iterable[Callable[[], None]], what: str = "Undoing the save") -> None:
    """Run every undo step whatever the others did, adding their failures to ``error`` as notes:
    the save's own failure stays the error raised."""
    for step in steps:
        try:
            step()
        except Exception as e:  # (an interrupt still stops the undo: it is the user's call)
            error.add_note(
                f"{what} also failed ({e}); what it could not remove (its staged or uploaded parts, "
                f"its lock {LOCK_NAME}) may remain: the next save removes the parts, and says what to do with a lock."
            )


def refusal(store: Store, error: ShardedStateError) -> SaveRefused:
    """The error a save hook reports for a save abandoned before its publish (keeps ``agreed``)."""
    wrapped = SaveRefused(
        f"Saving the sharded state to {store.canonical()} failed: {_sentence(error)} {store.abandoned}"
    )
    wrapped.agreed, wrapped.origin = error.agreed, error.origin
    for note in getattr(error, "__notes__", []):  # what its undo could not remove
        wrapped.add_note(note)
    return wrapped


def _is_published(store: Store, manifest: Manifest | None) -> bool:
    """Whether the store's manifest is now ``manifest`` (asked after a failure during the publish)."""
    try:
        published = store.read_manifest()
    except Exception:  # unreadable: not known to be out, so the save is abandoned as before
        return False
    return manifest is not None and published is not None and published.to_json() == manifest.to_json()


def _after_publish(
    where: str, error: ShardedStateError | OSError, what: str = "removing the old save's files"
) -> SaveFailedAfterPublish:
    wrapped = SaveFailedAfterPublish(
        f"Saving the sharded state to {where}: the new checkpoint is published and complete, but {what} "
        f"failed: {_sentence(error)} Save again to clean up."
    )
    if isinstance(error, ShardedStateError):
        wrapped.agreed, wrapped.origin = error.agreed, error.origin
    for note in getattr(error, "__notes__", []):  # what its undo could not remove
        wrapped.add_note(note)
    return wrapped


def _sentence(error: BaseException) -> str:
    """``error``'s message ended by one full stop, inside a longer message."""
    return str(error).rstrip(".") + "."
