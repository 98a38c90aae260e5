"""The files a save carries beside its parts (config, tokenizer, ...), replaced last.

A checkpoint's config is part of what loads: the manifest records its hash, and a load
refuses a config that differs. So a save must not replace the old checkpoint's config
before it publishes its own manifest. The non-weight files follow the parts' protocol:

- **stage** (:meth:`CarriedFiles.stage`): each file that differs from what the output
  holds is copied to a hidden staged name at the output's top level (object storage: kept
  aside, in memory); files already identical are left alone, so saving the same model
  again replaces nothing;
- **place** (:meth:`CarriedFiles.place`), just before the manifest's publish: each staged
  file is renamed over its final name (object storage: put). The file it replaces is first
  hard-linked to a backup (object storage: read), so that :meth:`CarriedFiles.restore`
  puts the old files back if the publish then fails;
- after the publish, :meth:`CarriedFiles.finish` drops the backups; the save's cleanup
  removes any staged name of its token that a kill left behind, and the files that the
  checkpoint it replaced carried and the new one does not (:meth:`CarriedFiles.remove_stale`).

Every file carried, staged or already identical, is recorded (:attr:`CarriedFiles.recorded`:
its size and SHA-256, hashed from the very bytes compared or copied), and the manifest lists
them (``carried_files``), so that ``verify`` tells a damaged tokenizer (:func:`check_carried`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..format.errors import (
    CheckpointCorrupt,
    CheckpointMismatch,
    CheckpointNotFound,
    SaveRefused,
    ShardedStateError,
    StorageError,
)
from ..format.manifest import MAX_CARRIED_FILES, CarriedFile, Manifest
from ..format.names import check_carried_name, staged_name
from ..storage.faults import declare, kill_point
from ..storage.local import escapes, file_kind, fsync_directory, open_regular, part_path
from ..storage.location import Store, open_store
from ..storage.lock import missing_folders, remove_empty_folders
from ..storage.model_files import is_weight_file

KILL_CARRIED = declare("local.carried", "checkpoint/carry.py: one non-weight file placed, the manifest not yet")
KILL_BACKED_UP = declare("local.backed_up", "checkpoint/carry.py: a non-weight file's backup linked, not yet replaced")


def _read_bytes(data: bytes | Path) -> bytes:
    if isinstance(data, bytes):
        return data
    # Opened without blocking and refused unless regular: a FIFO there must not hang the save.
    with os.fdopen(open_regular(str(data)), "rb") as f:
        return f.read()


def record_of(directory: str, name: str) -> dict[str, CarriedFile]:
    """``{name: its record}`` for the local file ``name`` of ``directory`` as it is now (empty without
    one): what a save's carry must find there later (:meth:`CarriedFiles.stage`'s ``record``)."""
    try:
        with os.fdopen(open_regular(os.path.join(directory, name)), "rb") as f:
            return {name: CarriedFile.of(f.read())}
    except FileNotFoundError:
        return {}


def _same_local(path: str, data: bytes | Path) -> CarriedFile | None:
    """The record of ``data`` if the regular file at ``path`` holds it, else None (also for no regular file)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with os.fdopen(open_regular(path), "rb") as f:
            if isinstance(data, bytes):
                return CarriedFile.of(data) if f.read(len(data) + 1) == data else None
            digest, size = hashlib.sha256(), 0
            with os.fdopen(open_regular(str(data)), "rb") as g:
                while True:
                    a, b = f.read(1 << 20), g.read(1 << 20)
                    if a != b:
                        return None
                    if not a:
                        return CarriedFile(size, digest.hexdigest())
                    digest.update(b)
                    size += len(b)
    except (OSError, ShardedStateError):
        return None


def _links_out(output: str, name: str) -> str | None:
    """Where the folder of the carried file ``name`` resolves to, if outside ``output`` (a link out of
    it): a file renamed into it, or removed from it, would be in a folder that is not ours."""
    folder = os.path.dirname(os.path.join(output, name))
    real = os.path.realpath(folder)
    return real if escapes(folder, real, output) is not None else None  # (the rule a load's reads keep)


def _in_the_way(output: str, name: str) -> tuple[str, str] | None:
    """What stands where the carried file ``name`` goes, and what kind it is: a folder at its name,
    or something other than a folder where its path needs one (``tok`` a file, for ``tok/vocab.txt``)."""
    parts = name.split("/")
    for depth in range(1, len(parts) + 1):
        path = os.path.join(output, *parts[:depth])
        last = depth == len(parts)
        try:
            # A link at the file's own name is replaced, not followed; a folder of its path is followed.
            mode = os.lstat(path).st_mode if last else os.stat(path).st_mode
        except OSError:
            return None
        if stat.S_ISDIR(mode) == last:
            return path, file_kind(mode, "a file")
    return None


def check_carry_source(source: str | None) -> None:
    """Refuse a local ``source`` (the model whose config and tokenizer a save carries) that is no folder:
    missing, a file, a FIFO. Checked before the save's lock: found only at the carry step, it failed
    with the bare errno of a listing, once every part was written (and then taken back). None: no carry."""
    if source is None or open_store(source).remote or os.path.isdir(source):
        return
    there = os.path.lexists(source)
    kind = f"is {file_kind(os.lstat(source).st_mode, 'a file')}" if there else "does not exist"
    raise SaveRefused(
        f"{source} {kind}, where the model folder whose config and tokenizer the save carries was expected; "
        "nothing was written. Give the model's folder (or none), and save again."
    )


def _check_recordable(source: str, names: list[str]) -> None:
    """Refuse non-weight files that the manifest cannot record as its parser reads it back (a name
    with a backslash, say): the save would publish a manifest that no load or verify reads."""
    if len(names) > MAX_CARRIED_FILES:
        raise SaveRefused(
            f"{source} has {len(names)} non-weight files, more than a checkpoint's manifest records "
            f"({MAX_CARRIED_FILES}); nothing was written. Remove what the model does not need, and save again."
        )
    for name in names:
        try:
            check_carried_name(name, source)
        except CheckpointCorrupt:
            raise SaveRefused(
                f"{source}: its non-weight file {name!r} has a name that a checkpoint's manifest cannot record (a "
                "backslash, or an empty, '.' or '..' part), and a checkpoint listing it could not be read; nothing "
                "was written. Rename or remove it, and save again."
            ) from None


@dataclass
class CarriedFiles:
    """The non-weight files of one save into ``output``, staged under ``token``."""

    output: str
    token: str
    #: final relative name -> staged local path, or the bytes to put (object storage)
    staged: dict[str, str | bytes] = field(default_factory=dict)
    #: final relative name -> its backup (a local path or the old bytes), None where there was none
    backups: dict[str, str | bytes | None] = field(default_factory=dict)
    #: object storage: final relative name -> the object's bytes when staged (None: absent)
    previous: dict[str, bytes | None] = field(default_factory=dict)
    #: Whether a file already at the output that differs may be replaced (the save's overwrite):
    #: without it, such a file is someone else's (a folder of the user's), and the save is refused.
    replace: bool = True
    #: final relative name -> the size and SHA-256 the output holds once placed (staged or left as is)
    recorded: dict[str, CarriedFile] = field(default_factory=dict)
    #: the subfolders place() made for new files, outermost first: restore() removes them again
    made: list[str] = field(default_factory=list)
    #: what the replaced checkpoint carried and the source no longer has (set by stage()): the new
    #: manifest records it, and the save removes it once that manifest is out (:meth:`remove_stale`)
    stale: list[str] = field(default_factory=list)

    @functools.cached_property
    def store(self) -> Store:
        return open_store(self.output)

    @property
    def remote(self) -> bool:
        return self.store.remote

    def stage(self, source: str, record: Mapping[str, CarriedFile] | None = None) -> list[str]:
        """Copy ``source``'s non-weight files aside; returns the names that will change. ``record``
        (a checkpoint's own, for a reshard of it; a model's config as convert read it) is what they must
        hold: one that differs from it as copied, or is gone, is refused (the source changed since it was
        checked: another save, an edit)."""
        origin = open_store(source)
        names = origin.non_weight_files()
        _check_recordable(source, names)
        try:
            for index, name in enumerate(names):
                data = origin.read(name)
                if self.remote:
                    self.recorded[name] = self._stage_object(name, data)
                else:
                    self.recorded[name] = self._stage_local(index, name, data)
        except OSError as e:  # a full disk, a permission: the save stops before its manifest
            self.restore()
            raise SaveRefused(
                f"copying the non-weight files of {source} to {self.output} failed: {e}. Nothing was replaced; "
                "free space or fix the permission, and save again."
            ) from e
        except BaseException:
            self.restore()
            raise
        taken = [] if self.replace else [name for name in sorted(self.staged) if self._there(name)]
        if taken:
            self.restore()
            raise SaveRefused(
                f"{self.output} holds files that differ from {source}'s and are no checkpoint's: "
                f"{', '.join(taken)}; refusing to replace them, nothing was written. Choose another output, "
                "remove them, or ask for overwrite (--overwrite, or SHARDED_STATE_OVERWRITE=1 for the save hook)."
            )
        changed = sorted(n for n, r in (record or {}).items() if self.recorded.get(n) != r)
        if changed:
            self.restore()
            raise CheckpointCorrupt(
                f"{source}: {', '.join(changed)} no longer as its manifest records, or as it was read before the "
                f"save (changed since: another save into it, or an edit?); nothing was written to {self.output}. "
                "Try again once it is done."
            )
        self.stale = self._stale(names)
        return sorted(self.staged)

    def _stale(self, names: list[str]) -> list[str]:
        """What the checkpoint being replaced carried that the source's ``names`` lack: another
        model's chat template, say, which would stay beside the new checkpoint, unrecorded, and be
        served with it. Also what that checkpoint's own save meant to remove and a kill left
        (its :attr:`~..format.manifest.Manifest.stale_files`), if still there. Read under the lock,
        as the source's files are; the new manifest records the result before it is published."""
        try:
            previous = self.store.read_manifest()
        except (CheckpointCorrupt, CheckpointMismatch, CheckpointNotFound):  # unreadable: what it carried is unknown
            return []  # (a network error is the save's: failing here, before the publish, loses nothing)
        if previous is None:
            return []
        candidates = set(previous.carried_files or ()) | set(previous.stale_files)
        stale = sorted(n for n in candidates - set(names) if _stale_there(self.store, n))
        return stale[:MAX_CARRIED_FILES]  # (what a manifest records; the rest stay, as before the record)

    def remove_stale(self, manifest: Manifest) -> None:
        """After the publish: remove the files that the replaced checkpoint carried and ``manifest``
        does not (its :attr:`~..format.manifest.Manifest.stale_files`, see :func:`stale_names`), then
        their subfolders left empty; never through a folder that is a link out of the output. A save
        that staged nothing from a source (the engine hook saving into the served model's own folder)
        records none, and removes nothing."""
        if self.remote:
            self.store.remove(stale_names(manifest))
            return
        failed = []
        for name in stale_left(self.store, manifest):  # (not gone, and not through a link out: ours)
            path = os.path.join(self.output, name)
            try:
                os.remove(path)
            except (FileNotFoundError, IsADirectoryError):  # gone, or a folder of the user's now
                continue
            except OSError as e:
                failed.append(f"{name} ({e.strerror})")
                continue
            folders = name.split("/")[:-1]
            remove_empty_folders(os.path.join(self.output, *folders[:depth]) for depth in range(len(folders), 0, -1))
        if failed:
            raise StorageError(
                f"{self.output}: could not remove {', '.join(failed)}, carried by the checkpoint this save replaced "
                "and not by the new one. A server of the checkpoint reads them: remove them by hand, or save again "
                "with overwrite (the checkpoint records them as stale: verify names them, the next save removes them)."
            )

    def _there(self, name: str) -> bool:
        """Whether the output already holds something under ``name`` (the staged copy would replace it)."""
        if self.remote:
            return self.previous.get(name) is not None
        return os.path.lexists(os.path.join(self.output, name))

    def _stage_local(self, index: int, name: str, data: bytes | Path) -> CarriedFile:
        final = os.path.join(self.output, name)
        # A file in a subfolder is renamed into it: a subfolder that is a link out of the output
        # would take the file (and, with overwrite, replace one there) in a folder that is not ours.
        # Refused even where that file is already the same: the checkpoint would not hold what
        # its manifest records, and verify refuses a carried file that resolves outside it.
        folder = _links_out(self.output, name)
        if folder is not None:
            raise SaveRefused(
                f"{os.path.dirname(final)} resolves to {folder}, outside {self.output} (a symbolic link); refusing "
                f"to write {name} there, nothing was written. Replace the link with a folder, or choose another output."
            )
        in_the_way = _in_the_way(self.output, name)
        if in_the_way is not None:
            path, kind = in_the_way
            raise SaveRefused(
                f"{path} is {kind}, where the save carries the model's {name}; refusing to replace it, nothing was "
                "written. Move it away, or choose another output."
            )
        same = _same_local(final, data)
        if same is not None:
            return same
        tmp = os.path.join(self.output, staged_name(f"carried-{index}", self.token))
        self.staged[name] = tmp
        with open(tmp, "wb") as dst:
            if isinstance(data, bytes):
                dst.write(data)
                record = CarriedFile.of(data)
            else:
                digest, size = hashlib.sha256(), 0
                # Opened without blocking and refused unless regular: a FIFO there must not hang the save.
                with os.fdopen(open_regular(str(data)), "rb") as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                record = CarriedFile(size, digest.hexdigest())
            dst.flush()
            os.fsync(dst.fileno())
        return record

    def _stage_object(self, name: str, data: bytes | Path) -> CarriedFile:
        store = self.store
        content = _read_bytes(data)
        old = store.read(name) if store.exists_file(name) else None
        if old != content:
            self.staged[name] = content
            # Read under the lock, so unchanged until place() keeps it as the backup.
            self.previous[name] = old
        return CarriedFile.of(content)

    def place(self) -> None:
        """Put every staged file under its final name, keeping what it replaces; just before the publish."""
        for name in sorted(self.staged):
            if self.remote:
                self._place_object(name)
            else:
                self._place_local(name)
            kill_point(KILL_CARRIED)
        if not self.remote:
            fsync_directory(self.output)

    def _place_local(self, name: str) -> None:
        final = os.path.join(self.output, name)
        missing = missing_folders(os.path.dirname(final))
        os.makedirs(os.path.dirname(final), exist_ok=True)
        self.made += reversed(missing)
        self.backups[name] = None
        # Whatever is at the name is backed up, a link too (a link to a folder is no folder: the rename
        # replaces the link itself, and without its backup, restore() would remove the name for good).
        if os.path.lexists(final) and not stat.S_ISDIR(os.lstat(final).st_mode):
            # Known to restore() before it is made: an interrupt right after the link must not leave it.
            self.backups[name] = os.path.join(self.output, staged_name(f"replaced-{len(self.backups)}", self.token))
            os.link(final, self.backups[name], follow_symlinks=False)  # type: ignore[arg-type]
            kill_point(KILL_BACKED_UP)
        os.replace(self.staged[name], final)  # type: ignore[arg-type]
        del self.staged[name]  # (only once renamed: a failed rename leaves it to restore() to remove)

    def _place_object(self, name: str) -> None:
        self.backups[name] = self.previous.pop(name)
        self.store.put(name, self.staged.pop(name))  # type: ignore[arg-type]

    def restore(self) -> None:
        """After a failure before the publish: the old files back, the staged copies gone. Best effort."""
        for name, backup in self.backups.items():
            with contextlib.suppress(OSError, ShardedStateError):
                if self.remote:
                    if backup is None:
                        self.store.remove([name])
                    else:
                        self.store.put(name, backup)  # type: ignore[arg-type]
                elif backup is None:
                    os.remove(os.path.join(self.output, name))
                else:
                    os.replace(backup, os.path.join(self.output, name))  # type: ignore[arg-type]
                    # (A no-op where the file was not replaced yet: the backup is a hard link of it.)
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(backup)  # type: ignore[arg-type]
        self.backups.clear()
        remove_empty_folders(reversed(self.made))
        self._drop_staged()

    def finish(self) -> None:
        """After the publish: the backups go (the save's cleanup removes any a kill left)."""
        for backup in self.backups.values():
            if isinstance(backup, str):
                with contextlib.suppress(OSError):
                    os.remove(backup)
        self.backups.clear()
        self._drop_staged()

    def _drop_staged(self) -> None:
        self.made.clear()
        for tmp in self.staged.values():
            if isinstance(tmp, str):
                with contextlib.suppress(OSError):
                    os.remove(tmp)
        self.staged.clear()
        self.previous.clear()


#: How much of a carried file one read takes while it is hashed (one GET in object storage).
CHECK_CHUNK_BYTES = 16 * 1024 * 1024


def check_carried(store: Store, name: str, record: CarriedFile, hashed: bool = True) -> None:
    """Refuse a carried file that is not what its save recorded: missing, a link out of the
    checkpoint (never opened), no regular file (opened without blocking: a FIFO there must not
    hang the check), another size or, when ``hashed``, another SHA-256. The error names the
    file, what was recorded and what was found."""
    path = store.file_path(name)
    recorded = f"{record.size} bytes, SHA-256 {record.sha256[:16]}..."
    remedy = (
        "Restore it from the model the checkpoint was saved from (or copy the checkpoint again), "
        "or save the checkpoint again."
    )
    try:
        if not store.remote:
            # Containment first, as for a part: a link out of the checkpoint is never opened (a
            # device there, say), nor certified by the bytes of a file that is not the checkpoint's.
            part_path(store.where, name)
        file = store.open_file(name)
    except (CheckpointNotFound, FileNotFoundError):
        raise CheckpointNotFound(
            f"{path}: missing, but the save carried it ({recorded}) and a server of this checkpoint reads it. {remedy}"
        ) from None
    except CheckpointCorrupt as e:  # a FIFO, a device, a folder, a link out of the checkpoint
        raise CheckpointCorrupt(f"{e} The save carried a regular file there ({recorded}).") from None
    except OSError as e:
        raise CheckpointCorrupt(f"{path}: cannot be read ({e}); the save carried it ({recorded}). {remedy}") from e
    try:
        if file.size != record.size:
            raise CheckpointCorrupt(
                f"{path}: {file.size} bytes, but the save recorded {recorded}: the file is truncated or was "
                f"replaced after the save. {remedy}"
            )
        if not hashed:
            return
        digest, position = hashlib.sha256(), 0
        while position < record.size and (chunk := file.read_at(position, CHECK_CHUNK_BYTES)):
            digest.update(chunk)
            position += len(chunk)
        found = f"{position} bytes read" if position != record.size else f"SHA-256 {digest.hexdigest()[:16]}..."
        if position != record.size or digest.hexdigest() != record.sha256:
            raise CheckpointCorrupt(
                f"{path}: {found}, but the save recorded {recorded}: the file was modified after the save. {remedy}"
            )
    finally:
        file.close()


def stale_names(manifest: Manifest) -> list[str]:
    """The names in ``manifest``'s record of stale files that a save may remove: none that the
    manifest lists or carries, and none that no save carries (the manifest, the lock, a staged
    file, weights), whatever a damaged or hostile record says."""
    keep = manifest.listed_files() | set(manifest.carried_files or ())
    return [n for n in manifest.stale_files if n not in keep and not any(map(is_weight_file, n.split("/")))]


def stale_left(store: Store, manifest: Manifest) -> list[str]:
    """The files of ``manifest``'s record of stale files that are still in the checkpoint: the save
    that published it stopped before its clean-up, and a server would read them with these weights."""
    return [name for name in stale_names(manifest) if _stale_there(store, name)]


def stale_problems(store: Store, manifest: Manifest) -> list[str]:
    """A problem for each of :func:`stale_left`, naming it and what to do (``verify``, ``reshard``)."""
    return [
        f"{store.file_path(name)}: carried by the checkpoint this one replaced and not by this one; the save "
        "that replaced it stopped before removing it, and a server of this checkpoint would read it. Remove it, "
        "or save again with overwrite (which removes it)."
        for name in stale_left(store, manifest)
    ]


def _stale_there(store: Store, name: str) -> bool:
    """Whether the stale file ``name`` is still in the checkpoint (what a folder that links out of
    it holds is not ours to remove, nor to report)."""
    return store.exists_file(name) and (store.remote or _links_out(store.where, name) is None)


def carried_problems(store: Store, carried_files: dict[str, CarriedFile], hashed: bool = True) -> list[str]:
    """:func:`check_carried` of every file a save recorded: a problem for each that the checkpoint
    no longer holds as saved (``verify``'s check, and ``reshard``'s of its source)."""
    problems = []
    for name, record in sorted(carried_files.items()):
        try:
            check_carried(store, name, record, hashed)
        except ShardedStateError as e:
            problems.append(str(e))
    return problems
