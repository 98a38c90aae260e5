"""The save protocol, written once: a target, a group of members, and the driver that runs one over the other.

Every save runs the same steps, wherever it goes (a local folder, an object-storage prefix)
and however many processes take part (one, or an engine's workers), the way PyTorch DCP
runs one save driver with or without a process group:

1. **lock** (first member): take the target's lock; an existing checkpoint is refused unless
   the save may overwrite it;
2. **join** (every member): adopt the lock's token; the target checks that every member
   reaches the place the first one locked (a local folder that is each node's own disk is
   refused here);
3. **stage** (every member): write its ranks' parts under temporary names, hashed as written;
4. **place** (every member): give them fresh final names (a rename, or an upload);
5. **carry** (first): stage the model's non-weight files (config, tokenizer); the manifest
   records each one's size and SHA-256 (an empty record for a save that carries none), and
   the files the replaced checkpoint carried that these do not (its stale files);
6. **publish** (first): the manifest, the one atomic step; signed first with the key in
   ``SHARDED_STATE_SIGNING_KEY`` where it is set (:mod:`.trust`, read before the lock);
7. **clean** (first): what the new manifest does not list, and the stale files it records;
8. **release** (first): the lock, whatever the clean did (a file that may not be removed must
   not keep every later save out).

A group runs each step on every member or on the first, then exchanges the outcomes, so
that every member learns of a failure anywhere and all fail together. A failure before the
publish **abandons** the save: every member removes what it staged or placed, the first
removes the rest of this save (its records, its lock); the previous checkpoint stands. After
the publish the new checkpoint is complete whatever fails (:class:`SaveFailedAfterPublish`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from ..format.errors import InterruptedAfterPublish, SaveFailedAfterPublish, SaveRefused, ShardedStateError
from ..format.manifest import CarriedFile, Manifest, RankEntry
from ..format.names import LOCK_NAME
from ..storage.location import open_store
from .carry import CarriedFiles
from .staged import StagedRank, discard_rank
from .trust import Signer, configured_signer

T = TypeVar("T")


class SaveGroup(Protocol):
    """The members of one save: one process (:class:`OneProcess`) or an engine's workers."""

    #: Whether this member runs the steps that only the first runs (lock, carry, publish, clean).
    first: bool
    #: This member, for messages ("pp0 tp1 on node-2").
    member: str

    def run(self, step: Callable[[], T], only_first: bool = False) -> list[T]:
        """Run ``step`` here (or only on the first member), exchange the outcomes, and return every
        member's (None from members that did not run it); raise on every member if any failed."""
        ...


class OneProcess:
    """A group of one: the save runs in this process alone (tests, offline tools, ``save_checkpoint``)."""

    first = True
    member = "this process"

    def run(self, step: Callable[[], T], only_first: bool = False) -> list[T]:
        return [step()]


class SaveTarget(Protocol):
    """Where a save goes, as the steps of the protocol (:class:`.save.LocalTarget`,
    :class:`.remote_save.ObjectTarget`). One instance per member; the first's lock token is
    given to the others by :meth:`join`."""

    #: The checkpoint's path or URL, for messages.
    where: str
    #: This save's token: staged names, upload records and the lock carry it.
    token: str
    #: Whether the save may replace what the target holds: a checkpoint, and files it carries.
    overwrite: bool
    #: Whether parts are staged in the target itself and renamed into place (a local folder), so
    #: that the placed files are the checkpoint's; else staged in any local folder and copied.
    stages_in_place: bool
    #: What an abandoned save leaves, for messages ("any previous checkpoint there is intact").
    abandoned: str

    def lock(self) -> str:
        """First member: take the lock (an existing checkpoint needs overwrite); returns its token."""
        ...

    def join(self, token: str, member: str) -> Any:
        """Every member: adopt ``token``; returns what this member sees, for :meth:`check_joined`."""
        ...

    def check_joined(self, seen: list[Any]) -> None:
        """Every member, with every member's :meth:`join`: refuse a target the members do not share."""
        ...

    def staging(self) -> str:
        """The local folder where this member stages its parts."""
        ...

    def place(self, staged: StagedRank) -> RankEntry:
        """Give a staged rank's parts fresh final names; returns the entry that lists them."""
        ...

    def write_rank_file(self, name: str, data: bytes) -> str:
        """Every member, for a rank it placed: one more file of that rank (its start-up artifacts),
        written whole under ``name`` or a fresh name made from it; returns the name to record."""
        ...

    def publish(self, manifest: Manifest, carried: CarriedFiles) -> None:
        """First member: every listed part in place, the carried files, then the manifest."""
        ...

    def clean(self, manifest: Manifest) -> None:
        """First member, after the publish: remove what the manifest does not list."""
        ...

    def release(self) -> None:
        """First member, after the clean (whatever it did): release the lock if it is still this save's."""
        ...

    def abandon(self, entries: Sequence[RankEntry]) -> None:
        """First member, after a failure before the publish: this save's leftovers and its lock."""
        ...

    def close(self) -> None:
        """Every member, once its parts are placed (or the save failed): local resources (a staging
        folder made for the save). May be called again."""
        ...


@dataclass
class SaveJob:
    """What the members save: each its staged ranks (with what the manifest needs of them), and
    together one manifest."""

    #: This member's ranks, staged where the target says (``target.staging()``, ``target.token``),
    #: each with a picklable note for :attr:`manifest` (its geometry, say).
    stage: Callable[[SaveTarget], Iterable[tuple[StagedRank, Any]]]
    #: The manifest from every member's (placed entry, note), in member order.
    manifest: Callable[[list[tuple[RankEntry, Any]]], Manifest]
    #: First member, before the lock: checks that need no lock (a file name pattern).
    check: Callable[[], None] | None = None
    #: First member, before the publish: stage the non-weight files to carry.
    carry: Callable[[CarriedFiles], None] | None = None
    #: Every member, for each rank it placed: the entry with what else it records (the start-up
    #: artifacts an engine writes beside the parts).
    placed: Callable[[SaveTarget, RankEntry], RankEntry] | None = None
    #: Every member, after a failure before the publish, for each rank it staged.
    discard: Callable[[StagedRank], None] = discard_rank


def run_save(target: SaveTarget, group: SaveGroup, job: SaveJob) -> tuple[Manifest, list[StagedRank]]:
    """Run the save protocol (see the module doc) on this member; every member calls it.

    Returns the published manifest and this member's placed ranks. A failure before the
    publish is raised as it came (the same on every member when the group exchanged it)
    once the save is abandoned; after the publish, as :class:`SaveFailedAfterPublish`.
    """
    staged: list[StagedRank] = []
    entries: list[tuple[RankEntry, Any]] = []
    carried: CarriedFiles | None = None
    locked = False

    signer: Signer | None = None

    def lock() -> str:
        nonlocal signer
        if job.check is not None:
            job.check()
        signer = configured_signer()  # an unusable key refuses the save before anything is written
        return target.lock()

    def stage() -> list[Any]:
        notes = []
        for rank, note in job.stage(target):  # one at a time: a failure abandons those staged before
            staged.append(rank)
            notes.append(note)
        return notes

    def place(rank: StagedRank) -> RankEntry:
        entry = target.place(rank)
        return entry if job.placed is None else job.placed(target, entry)

    publishing = False
    try:
        token = group.run(lock, only_first=True)[0]
        locked = True
        target.check_joined(group.run(lambda: target.join(token, group.member)))
        carried = CarriedFiles(target.where, token, replace=target.overwrite)
        notes = group.run(stage)
        placed = group.run(lambda: [place(s) for s in staged])
        target.close()  # staged and placed: a staging folder of the save's own is done with
        entries = [pair for es, ns in zip(placed, notes, strict=True) for pair in zip(es, ns, strict=True)]
        manifest = job.manifest(entries)
        if job.carry is not None:
            # Every member learns the first's record, so that each returns the published manifest.
            recorded, stale = group.run(lambda: _carry(job, carried), only_first=True)[0]  # type: ignore[arg-type]
            manifest = replace(manifest, carried_files=recorded, stale_files=stale)
        else:
            manifest = replace(manifest, carried_files={})
        # Every member learns the first's signed manifest: each returns the published one.
        manifest = group.run(lambda: manifest if signer is None else signer.sign(manifest), only_first=True)[0]
        publishing = True
        group.run(lambda: target.publish(manifest, carried), only_first=True)
    except BaseException as e:
        if publishing and _is_published(target, manifest):
            # Stopped once the manifest was out (an interrupt, an fsync after its rename, a lost
            # answer): the new checkpoint is whole, and nothing of it may be taken back.
            carried.finish()  # type: ignore[union-attr]
            for s in staged:
                s.placed.clear()
            target.close()
            if isinstance(e, (ShardedStateError, OSError)):
                # The lock goes (a process that lives on, an engine, would else keep every later
                # save out); what the clean step did not remove, the next save removes.
                _undo(e, [target.release], "Releasing the lock after the publish failed")
                raise _after_publish(target, e, "finishing its publish") from e
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, InterruptedAfterPublish):
                raise InterruptedAfterPublish(target.where) from e
            raise
        undo: list[Callable[[], None]] = [carried.restore] if carried is not None else []
        undo += [lambda s=s: job.discard(s) for s in staged]
        if locked and group.first:
            undo.append(lambda: target.abandon([entry for entry, _ in entries]))
        _undo(e, [*undo, target.close])
        raise
    carried.finish()
    for s in staged:
        s.placed.clear()  # published: the checkpoint's files now, no longer this save's to remove

    def clean() -> None:
        try:
            try:
                target.clean(manifest)
            finally:  # (the next save no longer knows what the replaced checkpoint carried)
                carried.remove_stale(manifest)  # type: ignore[union-attr]
        except Exception as e:
            # A file that may not be removed (EPERM, EROFS, an Azure lease on an old part) must not
            # keep the lock: every later save would be refused as another's until it was deleted
            # by hand. What is left over, the next save removes.
            _undo(e, [target.release], "Releasing the lock after the clean-up failed")
            raise
        target.release()

    try:
        group.run(clean, only_first=True)
    except (ShardedStateError, OSError) as e:  # (a file that cannot be removed: EPERM, EBUSY, EROFS)
        raise _after_publish(target, e) from e
    except KeyboardInterrupt as e:  # (the lock and what is not removed yet stay: the next save's to clean)
        if isinstance(e, InterruptedAfterPublish):
            raise
        raise InterruptedAfterPublish(target.where) from e
    finally:
        target.close()
    return manifest, staged


def _carry(job: SaveJob, carried: CarriedFiles) -> tuple[dict[str, CarriedFile], tuple[str, ...]]:
    """The carry step (first member): stage the files; return what each will hold once placed, and
    the replaced checkpoint's files that the clean step removes (recorded before the publish)."""
    job.carry(carried)  # type: ignore[misc]
    return dict(carried.recorded), tuple(carried.stale)


def _undo(error: BaseException, steps: Iterable[Callable[[], None]], what: str = "Undoing the save") -> None:
    """Run every step that undoes a failed save, each whatever the others did, and add their own
    failures to ``error`` as notes: the reason the save failed stays the error raised (a network
    down mid-upload fails the clean-up too, which must not take the upload's place)."""
    for step in steps:
        try:
            step()
        except Exception as e:  # (an interrupt still stops the undo: it is the user's call)
            error.add_note(
                f"{what} also failed ({e}); what it could not remove (its staged or uploaded parts, "
                f"its lock {LOCK_NAME}) may remain: the next save removes the parts, and says what to do with a lock."
            )


def refusal(target: SaveTarget, error: ShardedStateError) -> SaveRefused:
    """The error a save hook reports for a save abandoned before its publish (keeps ``agreed``)."""
    wrapped = SaveRefused(f"Saving the sharded state to {target.where} failed: {_sentence(error)} {target.abandoned}")
    wrapped.agreed, wrapped.origin = error.agreed, error.origin
    for note in getattr(error, "__notes__", []):  # what its undo could not remove
        wrapped.add_note(note)
    return wrapped


def _is_published(target: SaveTarget, manifest: Manifest) -> bool:
    """Whether the target's manifest is now ``manifest`` (asked after a failure during the publish)."""
    try:
        published = open_store(target.where).read_manifest()
    except Exception:  # unreadable: not known to be out, so the save is abandoned as before
        return False
    return published is not None and published.to_json() == manifest.to_json()


def _after_publish(
    target: SaveTarget, error: ShardedStateError | OSError, what: str = "removing the old save's files"
) -> SaveFailedAfterPublish:
    wrapped = SaveFailedAfterPublish(
        f"Saving the sharded state to {target.where}: the new checkpoint is published and complete, but {what} "
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
