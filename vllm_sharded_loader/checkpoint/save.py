"""Saving a sharded checkpoint, engine-free: staged parts, an exclusive lock, the manifest last.

A save replaces a checkpoint last. Its steps, each visible on disk:

1. **lock**: ``.sharded_state.lock`` is created exclusively. A second save into the
   directory fails while the first runs; an existing checkpoint is refused unless
   ``overwrite`` is asked.
2. **stage**: every rank writes its parts under hidden temporary names
   (``.model-rank-0-part-0.safetensors.<token>.partial``), hashing them as they are written.
3. **place**: every rank renames its staged parts to final names in vLLM's pattern that
   nothing in the directory has (:func:`..format.names.fresh_part_names`): the old
   manifest's parts are never touched, and saves over one checkpoint alternate between two
   ranges of part numbers.
4. **publish**: the manifest is written to a temporary file, fsynced and renamed over
   ``sharded_state.json``: the one atomic step.
5. **clean**: parts the new manifest does not list (the old save's, ranks of a larger TP),
   the staged files of this save, of the interrupted save it took over and of engines
   that captured here and are gone (:func:`..storage.lock.owner_is_gone`) are removed,
   and the lock released.

Before step 4 the previous checkpoint, if any, is the published one and loads and
verifies, whatever fails or dies (loads do not wait for the lock when a manifest exists);
from step 4 on the new one does. A save that dies leaves its lock, and staged or placed
files that no manifest lists; the next save takes the lock over (with overwrite) and
removes them. :func:`save_checkpoint` runs the steps in one process; the vLLM save hook
(:mod:`..engine.capture`) runs them across workers.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..format.errors import SaveRefused, ShardedStateError
from ..format.experts import ExpertPlacement
from ..format.manifest import CarriedFile, Manifest, RankEntry
from ..format.names import (
    DEFAULT_PATTERNS,
    MANIFEST_NAME,
    default_pattern,
    is_part_name,
    is_startup_artifacts_name,
    staged_name,
    staged_token,
    token_name,
    validate_pattern,
)
from ..format.source import SourceModel
from ..planning.topology import RankInfo
from ..storage.faults import declare, kill_point
from ..storage.local import fsync_directory, read_manifest, write_file_durably
from ..storage.location import LocalStore, open_store
from ..storage.lock import (
    SaveLock,
    acquire_save_lock,
    missing_folders,
    owner_is_gone,
    read_lock,
    release_save_lock,
    remove_empty_folders,
)
from ..storage.progress import ByteProgress
from .carry import CarriedFiles, check_carry_source
from .protocol import OneProcess, SaveJob, SaveTarget, run_save
from .remote_save import ObjectTarget
from .staged import (
    StagedRank,
    discard_rank,
    fresh_names,
    new_token,
    open_staged_tensors,
    published_names,
    renamed_entry,
    stage_in_parallel,
    stage_rank,
)

# Re-exported: the save protocol's steps, in the order they run.
__all__ = [
    "DEFAULT_MAX_SIZE",
    "StagedRank",
    "clean_after_publish",
    "discard_rank",
    "new_token",
    "open_staged_tensors",
    "publish_manifest",
    "publish_rank",
    "save_checkpoint",
    "stage_rank",
    "write_manifest",
]

DEFAULT_MAX_SIZE = 5 * 1024**3


# The steps where a test kills a local save (storage/faults.py), in protocol order.
KILL_LOCKED = declare("local.locked", "checkpoint/save.py: the lock is taken, nothing staged")
KILL_STAGED = declare("local.staged", "checkpoint/save.py: a rank's parts are staged under hidden names")
KILL_PLACED = declare("local.placed", "checkpoint/save.py: one staged part was renamed to its fresh final name")
KILL_MANIFEST_WRITTEN = declare("local.manifest_written", "checkpoint/save.py: temporary manifest fsynced, not renamed")
KILL_PUBLISHED = declare("local.published", "checkpoint/save.py: the manifest is renamed into place, nothing cleaned")
KILL_CLEANING = declare("local.cleaning", "checkpoint/save.py: one file of the old save was removed after the publish")
KILL_CLEANED = declare("local.cleaned", "checkpoint/save.py: cleaned, the lock not yet released")


# ------------------------------------------------------------- place and publish


def publish_rank(staged: StagedRank, published: set[str] | None = None) -> RankEntry:
    """Step 3: rename a rank's staged parts to fresh final names; the rank's entry names them.

    The names collide with nothing in the directory, so the published checkpoint's parts
    stay as they are until the new manifest replaces it. Called under the save's lock:
    no other save renames into the directory meanwhile. ``published``: as :func:`.staged.taken_names`.
    """
    directory = staged.directory
    renamed = fresh_names(staged, LocalStore(directory), published)
    for name in renamed:
        if name in staged.temporary:
            final = os.path.join(directory, renamed[name])
            os.replace(staged.temporary[name], final)
            staged.placed.append(final)
            del staged.temporary[name]
            kill_point(KILL_PLACED)
    fsync_directory(directory)
    staged.entry = renamed_entry(staged.entry, renamed)
    return staged.entry


def publish_manifest(
    directory: str, manifest: Manifest, lock: SaveLock | None = None, carried: CarriedFiles | None = None
) -> None:
    """Step 4: publish the manifest atomically (temporary file, fsync, rename).

    Every listed part must be in place with its size first: a manifest never names an
    absent part. ``carried`` non-weight files are renamed into place between the
    manifest's fsync and its rename, the shortest window there is (the caller restores
    them if this fails). An error from here means nothing was published.
    """
    for entry in manifest.ranks:
        for f in entry.files:
            path = os.path.join(directory, f.name)
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise SaveRefused(
                    f"{path}: missing, yet the manifest being published lists it. Nothing was published; the "
                    "previous checkpoint, if any, is intact. Is the directory shared by every worker?"
                ) from None
            if size != f.size:
                raise SaveRefused(
                    f"{path}: {size} bytes, expected {f.size}. Nothing was published; the previous checkpoint, "
                    "if any, is intact."
                )
    path = os.path.join(directory, MANIFEST_NAME)
    tmp = os.path.join(directory, staged_name(MANIFEST_NAME, new_token() if lock is None else lock.token))
    try:
        with open(tmp, "w") as out:
            out.write(manifest.to_json())
            out.flush()
            os.fsync(out.fileno())
        kill_point(KILL_MANIFEST_WRITTEN)
        if carried is not None:
            carried.place()
        os.replace(tmp, path)
    except BaseException as e:  # (an interrupt too: the staged manifest is this save's to take back)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if not isinstance(e, OSError):
            raise
        raise SaveRefused(
            f"Writing the manifest {path} failed: {e}. Nothing was published; the previous checkpoint, if any, "
            "is intact. Free space (or fix the directory) and save again."
        ) from e
    fsync_directory(directory)
    kill_point(KILL_PUBLISHED)


def clean_after_publish(
    directory: str, manifest: Manifest, lock: SaveLock | None = None, replaced: Iterable[str] = ()
) -> None:
    """Step 5: remove what the published manifest does not list (the caller then releases ``lock``).

    Parts of the old save that the new one does not list (and of ranks the new topology
    lacks) go, so vLLM's own loader cannot pick them up either, and so does every file that the
    ``replaced`` manifest listed (whatever its pattern); so do start-up archives that
    no rank of it lists, and the staged files of this save and of the interrupted save whose
    lock it took over; never those of another save. A failure here leaves the new checkpoint
    published and whole.
    """
    listed = manifest.listed_files()
    replaced = set(replaced)
    ours = set() if lock is None else {lock.token, lock.taken_over} - {None}
    failed: list[str] = []
    for name in os.listdir(directory):
        stale_part = name in replaced or is_part_name(name, (manifest.pattern, *DEFAULT_PATTERNS))
        token = staged_token(name)
        # Staged files: this save's, the save it took over, and those of any other owner now gone (a
        # killed engine's start-up capture, a save killed while it took its lock); never a live one's.
        leftover = (token is not None and token in ours) or (lock is not None and owner_is_gone(directory, name))
        if (name not in listed and (stale_part or is_startup_artifacts_name(name))) or leftover:
            try:
                os.remove(os.path.join(directory, name))
            except (FileNotFoundError, IsADirectoryError):  # (a folder so named is no save's: it writes files)
                pass
            except OSError as e:  # the rest is cleaned all the same
                failed.append(f"{name} ({e.strerror})")
            kill_point(KILL_CLEANING)
    kill_point(KILL_CLEANED)
    if failed:
        raise ShardedStateError(f"{directory}: could not remove {', '.join(failed)}")


def write_manifest(directory: str, manifest: Manifest, lock: SaveLock | None = None) -> None:
    """Steps 4 and 5: publish the manifest, then clean and unlock."""
    publish_manifest(directory, manifest, lock)
    try:
        clean_after_publish(directory, manifest, lock)
    finally:
        if lock is not None:
            release_save_lock(lock)


class FolderNotShared(SaveRefused):
    """A local save's folder is not the same folder for every member (each node has its own)."""


class LocalTarget:
    """A local folder as the target of the save protocol (:mod:`.protocol`): the steps above."""

    stages_in_place = True
    abandoned = "Nothing was published; any previous checkpoint there is intact."

    def __init__(self, directory: str, overwrite: bool = False, pattern: str | None = None) -> None:
        self.where = os.path.abspath(directory)
        self.overwrite = overwrite
        # The parts' names: files named so are a checkpoint (its cleanup removes those it does not list).
        self.patterns = () if pattern is None else (pattern,)
        self.token = new_token()
        self.held: SaveLock | None = None
        self.made_folders: list[str] = []  # (deepest first)
        self.replaced: set[str] = set()
        self.published: set[str] | None = None  # what the published manifest lists, read at the first place

    def lock(self) -> str:
        self.made_folders = missing_folders(self.where)  # (its parents too: a refused save leaves none)
        try:
            self.held = acquire_save_lock(self.where, self.token, self.overwrite, self.patterns)
        except BaseException:
            remove_empty_folders(self.made_folders)
            raise
        try:
            kill_point(KILL_LOCKED)
        except BaseException:  # (an interrupt here: the driver has no token yet to abandon with)
            self.abandon([])
            raise
        return self.held.token

    def join(self, token: str, member: str) -> tuple[str, str, bool]:
        """The lock file that the first member just took, with this save's token, is the marker: a
        member that does not find it there sees another folder under the same path (another
        node's disk), where its parts would be written out of the manifest's reach. Decided from
        the file system, not from host names, so that two nodes sharing a file system save, and
        two containers on one host that do not are refused."""
        self.token = token  # every member stages under the lock's token: a takeover finds them
        return socket.gethostname(), member, (read_lock(self.where) or {}).get("token") == token

    def check_joined(self, seen: list[tuple[str, str, bool]]) -> None:
        blind = [f"{member} on {host}" for host, member, sees in seen if not sees]
        if not blind:
            return
        # (None sees it where the lock could not be read back: it names no member then.)
        holder = next((f"{member} on {host}" for host, member, sees in seen if sees), "The first worker")
        error = FolderNotShared(
            f"Refusing to save to {self.where}: the workers do not share that folder. {holder} locked it for this "
            f"save, but {'; '.join(blind)} cannot see that lock there: each of these nodes has its own "
            f"{self.where}, and a checkpoint written there would lack the other nodes' parts. Save to object "
            "storage (s3://, gs://, az://) or to a folder that every node mounts (a shared file system), then copy "
            "the checkpoint to where it is served. Nothing was written"
        )
        error.agreed = True  # every member decides from the same exchanged answers
        raise error

    def staging(self) -> str:
        return self.where

    def place(self, staged: StagedRank) -> RankEntry:
        if self.published is None:
            self.published = published_names(LocalStore(self.where))
        return publish_rank(staged, self.published)

    def write_rank_file(self, name: str, data: bytes) -> str:
        """A fresh name (the save's token in it), written whole: never the published file; :meth:`abandon` drops it."""
        fresh = token_name(name, self.token)
        write_file_durably(self.where, fresh, data, staged_name(fresh, self.token))  # (killed: the next save's)
        return fresh

    def publish(self, manifest: Manifest, carried: CarriedFiles) -> None:
        # The manifest it replaces, read under the lock: its parts go in the cleanup, whatever their names.
        try:
            previous = read_manifest(self.where)
        except ShardedStateError:
            previous = None  # unreadable: its parts are removed by name only
        self.replaced = set() if previous is None else previous.listed_files()
        publish_manifest(self.where, manifest, self.held, carried)

    def clean(self, manifest: Manifest) -> None:
        clean_after_publish(self.where, manifest, self.held, self.replaced)

    def release(self) -> None:
        if self.held is not None:
            release_save_lock(self.held)

    def abandon(self, entries: Sequence[RankEntry]) -> None:
        # Every member's rank files (past the exchange that failed, none is still writing).
        for name in os.listdir(self.where) if os.path.isdir(self.where) else ():
            if is_startup_artifacts_name(name) and name.endswith(token_name(".tar", self.token)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.where, name))
        self.release()
        remove_empty_folders(self.made_folders)

    def close(self) -> None:
        pass


def open_target(where: str, overwrite: bool = False, pattern: str | None = None) -> SaveTarget:
    """The save protocol's target for a local folder or an object-storage URL; ``pattern`` names the
    parts (a local folder holding files so named holds a checkpoint)."""
    if isinstance(open_store(where), LocalStore):
        return LocalTarget(where, overwrite, pattern)
    return ObjectTarget(where, overwrite)


def _stage_one(
    ended: Callable[[RankInfo, BaseException | None], None] | None,
    directory: str,
    tensors: Mapping[str, torch.Tensor],
    info: RankInfo,
    pattern: str,
    max_size: int | None,
    token: str,
    progress: Callable[[int, int], None] | None = None,
    buffer_bytes: int | None = None,
) -> StagedRank:
    """:func:`.staged.stage_rank`, then ``ended(info, the error or None)`` however it ended."""
    try:
        staged = stage_rank(
            directory, tensors, info, pattern, max_size, token, buffer_bytes=buffer_bytes, progress=progress
        )
    except BaseException as e:
        if ended is not None:
            ended(info, e)
        raise
    if ended is not None:
        ended(info, None)
    return staged


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
    carry: str | None = None,
    carried_record: Mapping[str, CarriedFile] | None = None,
    parallel: bool = False,
    placed: Callable[[SaveTarget, RankEntry], RankEntry] | None = None,
    ended: Callable[[RankInfo, BaseException | None], None] | None = None,
    progress: ByteProgress | None = None,
) -> Manifest:
    """Save every rank's tensors from one process (tests, offline tools): :func:`.protocol.run_save`
    over :class:`.protocol.OneProcess`; see the module doc.

    ``carry`` names a model (folder or URL) whose files that go with the parts (config,
    tokenizer) the save puts beside them (:mod:`.carry`): staged under the lock, once the
    overwrite rule has passed, and placed just before the publish, so that nothing is
    written into an existing output that the save may not replace, and a failure puts
    back what they replaced; as ``carried_record`` says, where given (:meth:`.carry.CarriedFiles.stage`).

    ``directory`` may be an object-storage URL (``s3://``, ``gs://``, ``az://``: :mod:`.remote_save`). ``geometry``
    (JSON of :class:`~..format.geometry.TensorGeometry` by tensor name) lets the
    checkpoint be served at another TP/PP size; ``tied`` lists names saved once for several;
    ``experts`` is where the ranks' routed experts are placed (expert parallelism; EP rank =
    TP rank, or, with ranks of several data-parallel replicas, ``dp_rank * tp_size + tp_rank``:
    then each replica after the first gives only its expert tensors; likewise when the ranks'
    ``experts_over_dp`` says that their experts are cut across TP x DP).

    ``parallel`` stages the ranks of a local save at once, one thread each (``convert``'s lazy
    tensors are cut from one source tensor for every rank, so the ranks must advance together).
    ``placed`` is :attr:`.protocol.SaveJob.placed`: a file more for each rank placed (``convert``'s
    start-up artifacts). ``ended(rank, error)`` is called in the thread that staged ``rank`` when its
    staging ends, with the error that ended it or None (``convert``'s ranks share the components
    they take: one that stops must not leave the others waiting for it). ``progress`` counts the
    bytes every rank stages, out of their sum.
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
    validate_pattern(pattern, infos[0].tp_size, infos[0].pp_size, replicas)  # before the lock: a refusal changes
    check_carry_source(carry)  # nothing in the output, not even its mtime (as the save hook checks its pattern)

    def stage(target: SaveTarget) -> Iterator[tuple[StagedRank, None]]:
        if progress is not None:
            # One total for every rank, before the first byte and after the lock (a refused save
            # draws no bar): sizes only (convert's and reshard's tensors are lazy, made as the
            # writer takes them).
            progress(0, sum(t.numel() * t.element_size() for tensors in ranks.values() for t in tensors.values()))
        if parallel and len(infos) > 1:
            directory = target.staging()

            def stage_one(info: RankInfo, written: Callable[[int, int], None], buffers: int) -> StagedRank:
                return _stage_one(
                    ended, directory, ranks[info], info, pattern, max_size, target.token, written, buffers
                )

            staged = stage_in_parallel(stage_one, infos, progress, lambda: kill_point(KILL_STAGED))
            yield from ((s, None) for s in staged)
            return
        for info in infos:
            yield (
                _stage_one(ended, target.staging(), ranks[info], info, pattern, max_size, target.token, progress),
                None,
            )
            kill_point(KILL_STAGED)

    def manifest_of(entries: Sequence[tuple[RankEntry, None]]) -> Manifest:
        return Manifest(
            tp_size=infos[0].tp_size,
            pp_size=infos[0].pp_size,
            dtype=dtype,
            pattern=pattern,
            source=source,
            ranks=tuple(entry for entry, _ in entries),
            geometry=dict(geometry or {}),
            tied=tied,
            experts=experts,
            dp_size=infos[0].dp_size,
            experts_over_dp=infos[0].experts_over_dp,
        )

    job = SaveJob(
        stage,
        manifest_of,
        carry=None if carry is None else lambda carried: carried.stage(carry, carried_record),
        placed=placed,
    )
    return run_save(open_target(directory, overwrite, pattern), OneProcess(), job)[0]
