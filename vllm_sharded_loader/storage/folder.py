"""A checkpoint in a local folder (or a Hugging Face cache snapshot): :class:`LocalStore`, read through
:mod:`.local`, locked by :mod:`.lock`.

A save stages parts under hidden names, renames them to names nothing in the folder has, and
publishes by renaming a fsynced manifest into place (carried files just before it, each replaced
one hard-linked aside first); the old parts go after the publish.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..format.errors import InvalidOption, SaveRefused, ShardedStateError, StorageError
from ..format.manifest import CarriedFile, FileEntry, Manifest, RankEntry
from ..format.names import (
    DEFAULT_PATTERNS,
    MANIFEST_NAME,
    is_part_name,
    is_startup_artifacts_name,
    staged_name,
    staged_token,
    token_name,
)
from . import lock, model_files
from .faults import KILL_CARRIED, declare, kill_point
from .local import (
    OpenFile,
    escapes,
    file_kind,
    fsync_directory,
    list_folder,
    make_output_folder,
    not_a_folder,
    open_part,
    open_regular,
    part_path,
    read_manifest,
    write_file_durably,
)
from .staged import StagedRank, fresh_names, listed_names, new_token, renamed_entry

# Where a test kills a local save (:mod:`.faults`), in protocol order.
KILL_LOCKED = declare("local.locked", "storage/folder.py: the lock is taken, nothing staged")
KILL_PLACED = declare("local.placed", "storage/folder.py: one staged part was renamed to its fresh final name")
KILL_MANIFEST_WRITTEN = declare("local.manifest_written", "storage/folder.py: temporary manifest fsynced, not renamed")
KILL_BACKED_UP = declare("local.backed_up", "storage/folder.py: a non-weight file's backup linked, not yet replaced")
KILL_PUBLISHED = declare("local.published", "storage/folder.py: the manifest is renamed into place, nothing cleaned")
KILL_CLEANING = declare("local.cleaning", "storage/folder.py: one file of the old save was removed after the publish")
KILL_CLEANED = declare("local.cleaned", "storage/folder.py: cleaned, the lock not yet released")


class LocalStore:
    """A local folder (or Hub snapshot) as a :class:`.location.Store`."""

    vllm_saves_here = True
    stages_in_place = True
    abandoned = "Nothing was published; any previous checkpoint there is intact."

    def __init__(self, where: str) -> None:
        self.where = where
        self.root = os.path.abspath(where)  # what a save writes into and names
        self.token = new_token()  # the lock's, once a save takes or joins it
        self._begin()

    def _begin(self) -> None:
        """Forget any earlier save's state: a store runs one save at a time."""
        self.held: lock.SaveLock | None = None
        self.made_folders: list[str] = []  # deepest first
        self.replaced: set[str] = set()
        self.published: set[str] | None = None  # the published manifest's files, read at the first place
        self.carried: dict[str, str] = {}  # name -> staged copy
        self.backups: dict[str, str | None] = {}  # name -> hard link of what it replaced
        self.carried_folders: list[str] = []  # made for carried files, outermost first

    # ---------------------------------------------------------------- reading

    def exists(self) -> bool:
        return os.path.isdir(self.where)

    def missing(self) -> str | None:
        return not_a_folder(self.where)

    def canonical(self) -> str:
        return self.root

    def file_path(self, name: str) -> str:
        return os.path.join(self.where, name)

    def read_manifest(self) -> Manifest | None:
        return read_manifest(self.where)

    def open_part(self, f: FileEntry) -> OpenFile:
        return open_part(self.where, f)

    def open_file(self, name: str, contained: bool = False) -> OpenFile:  # containment before the open
        return OpenFile.open(part_path(self.where, name) if contained else os.path.join(self.where, name))

    def list_names(self) -> list[str]:
        return sorted(list_folder(self.where))

    def non_weight_files(self) -> list[str]:
        return model_files.non_weight_files(self.where)

    def read(self, name: str) -> bytes | Path:
        return Path(os.path.join(self.where, name))

    def exists_file(self, name: str) -> bool:
        return os.path.lexists(os.path.join(self.where, name)) and _folder_links_out(self.where, name) is None

    def special_files(self) -> list[ShardedStateError]:
        return list(model_files.special_files(self.where))

    def links_out(self, names: Iterable[str]) -> list[ShardedStateError]:
        found = (escapes(p, os.path.realpath(p), self.where) for p in (os.path.join(self.where, n) for n in names))
        return [error for error in found if error is not None]

    def same_as(self, other: object) -> bool:
        if not isinstance(other, LocalStore):
            return False
        if os.path.realpath(self.where) == os.path.realpath(other.where):
            return True
        with contextlib.suppress(OSError):
            return os.path.samefile(self.where, other.where)
        return False

    def inside(self, other: object) -> bool:
        return isinstance(other, LocalStore) and os.path.realpath(self.where).startswith(
            os.path.join(os.path.realpath(other.where), "")
        )

    # ---------------------------------------------------------------- the lock

    def is_locked(self) -> bool:
        return lock.read_lock(self.where) is not None

    def check_not_locked(self) -> None:
        lock.check_not_locked(self.where)

    def save_is_running(self) -> bool:
        return lock.save_is_running(self.where)

    def describe_lock(self) -> str | None:
        holder = lock.read_lock(self.where)
        return None if holder is None else lock.describe_lock(self.where, holder)

    def owner_is_alive(self, token: str) -> bool:
        return lock.owner_is_alive(self.where, token)

    def refuse_before_save(self, overwrite: bool) -> None:
        lock.refuse_before_save(self.where, overwrite)

    # ---------------------------------------------------------------- writing

    def put(self, name: str, data: bytes | Path) -> None:
        path = os.path.join(self.where, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(_read_bytes(data))

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.where, name))

    # ------------------------------------------------------- the save's steps

    def lock(self, token: str, overwrite: bool, patterns: tuple[str, ...]) -> None:
        self._begin()
        self.token = token
        self.made_folders = lock.missing_folders(self.root)  # a refused save leaves none
        try:
            self.held = lock.acquire_save_lock(self.root, token, overwrite, patterns)
        except BaseException:
            lock.remove_empty_folders(self.made_folders)
            raise
        try:
            kill_point(KILL_LOCKED)
        except BaseException:  # the driver has no token yet to abandon with
            self.abandon([])
            raise

    def join(self, token: str) -> bool:
        """Whether this member sees the lock with this save's token (else: another node's disk)."""
        self.token = token  # every member stages under the lock's token: a takeover finds them
        return (lock.read_lock(self.root) or {}).get("token") == token

    def staging(self) -> str:
        return self.root

    def place(self, staged: StagedRank) -> RankEntry:
        """Rename a rank's staged parts to fresh names: the published parts stay until the publish."""
        if self.published is None:
            self.published = listed_names(self.read_manifest)  # (under the lock: it cannot change)
        directory = staged.directory
        renamed = fresh_names(staged, set(os.listdir(directory)) | self.published)
        for name in renamed:
            if name in staged.temporary:
                final = os.path.join(directory, renamed[name])
                # Recorded first: a stop as the rename returns still takes it back (a fresh name is nobody else's).
                staged.placed.append(final)
                os.replace(staged.temporary[name], final)
                del staged.temporary[name]
                kill_point(KILL_PLACED)
        fsync_directory(directory)
        staged.entry = renamed_entry(staged.entry, renamed)
        return staged.entry

    def write_rank_file(self, name: str, data: bytes) -> str:
        """A fresh name (never the published file), written whole; :meth:`abandon` drops it."""
        fresh = token_name(name, self.token)
        write_file_durably(self.root, fresh, data, staged_name(fresh, self.token))
        return fresh

    def publish(self, manifest: Manifest) -> None:
        """Check every listed part, then the manifest through a staged name, fsync and rename (the
        carried files renamed in between)."""
        try:  # the replaced manifest's parts go in the cleanup, whatever their names
            previous = read_manifest(self.root)
        except ShardedStateError:
            previous = None  # its parts are removed by name only
        self.replaced = set() if previous is None else previous.listed_files()
        for f in (f for entry in manifest.ranks for f in entry.files):
            path = os.path.join(self.root, f.name)
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
        path = os.path.join(self.root, MANIFEST_NAME)
        tmp = os.path.join(self.root, staged_name(MANIFEST_NAME, self.token))
        try:
            with open(tmp, "w") as out:
                out.write(manifest.to_json())
                out.flush()
                os.fsync(out.fileno())
            kill_point(KILL_MANIFEST_WRITTEN)
            self._place_carried()
            os.replace(tmp, path)
        except BaseException as e:  # an interrupt too
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if not isinstance(e, OSError):
                raise
            raise SaveRefused(
                f"Writing the manifest {path} failed: {e}. Nothing was published; the previous checkpoint, if any, "
                "is intact. Free space (or fix the directory) and save again."
            ) from e
        fsync_directory(self.root)
        kill_point(KILL_PUBLISHED)

    def clean(self, manifest: Manifest) -> None:
        """Remove unlisted parts and start-up archives, and the staged files of this save, of the save
        it took over and of owners now gone."""
        listed = manifest.listed_files()
        held = self.held
        ours = set() if held is None else {held.token, held.taken_over} - {None}
        failed: list[str] = []
        for name in os.listdir(self.root):
            stale_part = name in self.replaced or is_part_name(name, (manifest.pattern, *DEFAULT_PATTERNS))
            token = staged_token(name)
            leftover = (token is not None and token in ours) or (
                held is not None and lock.owner_is_gone(self.root, name)
            )
            if (name not in listed and (stale_part or is_startup_artifacts_name(name))) or leftover:
                try:
                    os.remove(os.path.join(self.root, name))
                except (FileNotFoundError, IsADirectoryError):  # a folder is no save's
                    pass
                except OSError as e:  # the rest is cleaned all the same
                    failed.append(f"{name} ({e.strerror})")
                kill_point(KILL_CLEANING)
        kill_point(KILL_CLEANED)
        if failed:
            raise StorageError(f"{self.root}: could not remove {', '.join(failed)}")

    def release(self) -> None:
        if self.held is not None:
            lock.release_save_lock(self.held)

    def abandon(self, entries: Iterable[RankEntry]) -> None:
        # Every member's rank files: past the failed exchange, none is still writing.
        for name in os.listdir(self.root) if os.path.isdir(self.root) else ():
            if is_startup_artifacts_name(name) and name.endswith(token_name(".tar", self.token)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.root, name))
        self.release()
        lock.remove_empty_folders(self.made_folders)

    def close(self) -> None:
        pass

    # ------------------------------------------------------- the carried files

    def stage_carried(self, index: int, name: str, data: bytes | Path) -> tuple[CarriedFile, bool | None]:
        final = os.path.join(self.root, name)
        # A subfolder linking out of the output is refused, even for the same file (verify refuses it).
        folder = _folder_links_out(self.root, name)
        if folder is not None:
            raise SaveRefused(
                f"{os.path.dirname(final)} resolves to {folder}, outside {self.root} (a symbolic link); refusing "
                f"to write {name} there, nothing was written. Replace the link with a folder, or choose another output."
            )
        in_the_way = _in_the_way(self.root, name)
        if in_the_way is not None:
            path, kind = in_the_way
            raise SaveRefused(
                f"{path} is {kind}, where the save carries the model's {name}; refusing to replace it, nothing was "
                "written. Move it away, or choose another output."
            )
        same = _same_local(final, data)
        if same is not None:
            return same, None
        tmp = os.path.join(self.root, staged_name(f"carried-{index}", self.token))
        self.carried[name] = tmp
        digest, size = hashlib.sha256(), 0
        with open(tmp, "wb") as dst:
            chunks = [data] if isinstance(data, bytes) else _chunks(data)
            for chunk in chunks:
                dst.write(chunk)
                digest.update(chunk)
                size += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        return CarriedFile(size, digest.hexdigest()), os.path.lexists(final)

    def _place_carried(self) -> None:
        """Each staged carried file renamed over its name, whatever was there hard-linked aside first."""
        for name in sorted(self.carried):
            final = os.path.join(self.root, name)
            missing = lock.missing_folders(os.path.dirname(final))
            self.carried_folders += reversed(missing)  # recorded first, as the parts are (only empty ones go)
            os.makedirs(os.path.dirname(final), exist_ok=True)
            self.backups[name] = None
            if os.path.lexists(final) and not stat.S_ISDIR(os.lstat(final).st_mode):  # a link too
                # Recorded before the link: an interrupt right after it must not leave it.
                self.backups[name] = os.path.join(self.root, staged_name(f"replaced-{len(self.backups)}", self.token))
                os.link(final, self.backups[name], follow_symlinks=False)  # type: ignore[arg-type]
                kill_point(KILL_BACKED_UP)
            os.replace(self.carried[name], final)
            del self.carried[name]  # only once renamed: a failed rename leaves it to restore_carried
            kill_point(KILL_CARRIED)
        fsync_directory(self.root)

    def restore_carried(self) -> None:
        for name, backup in self.backups.items():
            with contextlib.suppress(OSError):
                if backup is None:
                    os.remove(os.path.join(self.root, name))
                else:
                    os.replace(backup, os.path.join(self.root, name))
                    with contextlib.suppress(FileNotFoundError):  # not replaced yet: a hard link of it
                        os.remove(backup)
        self.backups.clear()
        lock.remove_empty_folders(reversed(self.carried_folders))
        self._drop_carried()

    def finish_carried(self) -> None:
        for backup in self.backups.values():
            if backup is not None:
                with contextlib.suppress(OSError):
                    os.remove(backup)
        self.backups.clear()
        self._drop_carried()

    def _drop_carried(self) -> None:
        self.carried_folders.clear()
        for tmp in self.carried.values():
            with contextlib.suppress(OSError):
                os.remove(tmp)
        self.carried.clear()

    def remove_stale(self, names: Iterable[str]) -> None:
        """Remove each file still there (never through a folder linking out), then its emptied folders."""
        failed = []
        for name in [n for n in names if self.exists_file(n)]:
            try:
                os.remove(os.path.join(self.root, name))
            except (FileNotFoundError, IsADirectoryError):  # gone, or the user's folder now
                continue
            except OSError as e:
                failed.append(f"{name} ({e.strerror})")
                continue
            folders = name.split("/")[:-1]
            lock.remove_empty_folders(os.path.join(self.root, *folders[:d]) for d in range(len(folders), 0, -1))
        if failed:
            raise StorageError(
                f"{self.root}: could not remove {', '.join(failed)}, carried by the checkpoint this save replaced "
                "and not by the new one. A server of the checkpoint reads them: remove them by hand, or save again "
                "with overwrite (the checkpoint records them as stale: verify names them, the next save removes them)."
            )

    # ---------------------------------------------------- before an engine starts

    def local_copy(self, names: list[str], folder: str) -> LocalStore:
        return self

    @contextlib.contextmanager
    def capture_folder(self, source: str, overwrite: bool) -> Iterator[str]:
        """The output folder itself (made now, removed again if a failed save leaves it empty), once it
        is not the source's folder and its lock would be taken."""
        made = lock.missing_folders(self.where)
        try:
            make_output_folder(self.where)
            if os.path.samefile(source, self.where):
                raise InvalidOption(f"--output {self.where!r} is the source model's directory; choose another one.")
            self.refuse_before_save(overwrite)  # the save hook checks again under its lock
            yield self.root
        except BaseException:
            lock.remove_empty_folders(made)  # a non-empty one holds what is not ours
            raise


def _read_bytes(data: bytes | Path) -> bytes:
    """``data``, or the local file's bytes, opened without blocking (a FIFO must not hang a save)."""
    return data if isinstance(data, bytes) else b"".join(_chunks(data))


def _chunks(path: Path) -> Iterator[bytes]:
    with os.fdopen(open_regular(str(path)), "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


def _same_local(path: str, data: bytes | Path) -> CarriedFile | None:
    """The record of ``data`` if the regular file at ``path`` holds it, else None."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with os.fdopen(open_regular(path), "rb") as f:
            if isinstance(data, bytes):
                return CarriedFile.of(data) if f.read(len(data) + 1) == data else None
            digest, size = hashlib.sha256(), 0
            for chunk in _chunks(data):
                if f.read(len(chunk)) != chunk:
                    return None
                digest.update(chunk)
                size += len(chunk)
            return CarriedFile(size, digest.hexdigest()) if not f.read(1) else None
    except (OSError, ShardedStateError):
        return None


def _folder_links_out(output: str, name: str) -> str | None:
    """Where the folder of the file ``name`` resolves to, if outside ``output`` (a link out of it)."""
    folder = os.path.dirname(os.path.join(output, name))
    real = os.path.realpath(folder)
    return real if escapes(folder, real, output) is not None else None  # the rule a load keeps


def _in_the_way(output: str, name: str) -> tuple[str, str] | None:
    """What stands where the carried file ``name`` goes, and its kind: a folder at its name, or a
    non-folder where its path needs one."""
    parts = name.split("/")
    for depth in range(1, len(parts) + 1):
        path = os.path.join(output, *parts[:depth])
        last = depth == len(parts)
        try:  # a link at the file's own name is replaced, not followed; one on its path is followed
            mode = os.lstat(path).st_mode if last else os.stat(path).st_mode
        except OSError:
            return None
        if stat.S_ISDIR(mode) == last:
            return path, file_kind(mode, "a file")
    return None
