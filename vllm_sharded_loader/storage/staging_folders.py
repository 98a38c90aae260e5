"""Local staging folders of saves into object storage, removed even after a kill: each holds a marker
its owner ``flock``s (the kernel drops it with the process), and a new folder's maker first removes
those beside it that are ours and unlocked."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..format.errors import SaveRefused
from ..format.names import staged_name, staged_token
from .local import file_kind
from .lock import OWNER_MARKER, owner_is_alive

STAGING_ENV = "SHARDED_STATE_STAGING_DIR"
STAGING_PREFIX = "sharded-state-upload-"
FOLDER_MARKER = ".sharded-state-staging.owner"
_NEW_MARKER = FOLDER_MARKER + ".new"  # while being made: a folder with only this is not judged


def staging_base() -> str:
    """Where staging folders are made: ``$SHARDED_STATE_STAGING_DIR`` (created if missing), else the temp dir."""
    base = os.environ.get(STAGING_ENV) or None
    if base is None:
        return tempfile.gettempdir()
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as e:
        # The setting is what is wrong (a file, a FIFO, a folder we may not write): the error names it.
        there, found = os.path.abspath(base), ""
        while not os.path.lexists(there):
            there = os.path.dirname(there)  # the part of the path that is there
        with contextlib.suppress(OSError):
            if not os.path.isdir(there):
                found = f"; {there} is {file_kind(os.stat(there).st_mode, 'a file')}"
        raise SaveRefused(
            f"{STAGING_ENV}={base}: cannot be made the folder where files are staged for object storage "
            f"({e.strerror}{found}); nothing was staged there. Point {STAGING_ENV} at a folder (or unset it to stage "
            f"under {tempfile.gettempdir()}), and try again."
        ) from e
    return base


@dataclass
class StagingFolder:
    """A staging folder of this process: ``path``, and the ``flock``-ed marker ``fd`` that says it is in use."""

    path: str
    fd: int

    def remove(self) -> None:
        """Delete the folder and everything in it, then let go of its marker (a second call does nothing)."""
        if self.fd < 0:
            return
        # Removed under the lock: a concurrent sweep never sees it half-deleted and free.
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


def make_staging_folder(base: str | None = None) -> StagingFolder:
    """A new staging folder under ``base``, marked as this process's, after removing dead ones beside it."""
    base = base or staging_base()
    remove_dead_staging_folders(base)
    try:
        return _make_marked_folder(base)
    except OSError as e:  # a full disk, a folder we may not write: the error names the folder
        raise SaveRefused(
            f"Making a staging folder under {base} failed: {e.strerror or e}. Nothing was staged there; free space "
            f"(or fix the folder, or point {STAGING_ENV} at another one) and try again."
        ) from e


def _make_marked_folder(base: str) -> StagingFolder:
    """:func:`make_staging_folder`'s folder and its marker, locked before it is renamed into place (a
    folder is never seen marked and unlocked while its owner lives); a failure leaves neither."""
    path = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=base)
    try:
        fd = os.open(os.path.join(path, _NEW_MARKER), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # For a person who finds the folder; the lock, not this, is what counts.
            owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            os.write(fd, json.dumps(owner).encode())
            os.rename(os.path.join(path, _NEW_MARKER), os.path.join(path, FOLDER_MARKER))
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return StagingFolder(path, fd)


@contextlib.contextmanager
def staging_folder(base: str | None = None) -> Iterator[str]:
    """:func:`make_staging_folder` as a context: yields its path, removes it on exit."""
    folder = make_staging_folder(base)
    try:
        yield folder.path
    finally:
        folder.remove()


def remove_dead_staging_folders(base: str) -> list[str]:
    """Remove the staging folders directly under ``base`` whose owner is gone (:func:`_take_if_dead`),
    holding each marker's lock; returns their paths. Never fails: what stays waits for a later sweep."""
    removed = []
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return removed
    try:
        with os.scandir(base_fd) as entries:
            names = [e.name for e in entries if e.name.startswith(STAGING_PREFIX)]
        for name in names:
            marker = _take_if_dead(base_fd, name)
            if marker is None:
                continue
            try:
                # rmtree with dir_fd walks by descriptors and never follows a symbolic link.
                shutil.rmtree(name, dir_fd=base_fd)
                removed.append(os.path.join(base, name))
            except OSError:
                pass
            finally:
                os.close(marker)
    finally:
        os.close(base_fd)
    return removed


def _take_if_dead(base_fd: int, name: str) -> int | None:
    """The locked marker of folder ``name`` if it is ours (this user's directory, our marker a regular
    file) and unused (its ``flock`` free, and every capture marker's inside), else None."""
    try:
        folder = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=base_fd)
    except OSError:
        return None  # gone, a symbolic link, not a directory, or not ours to open
    marker = -1
    try:
        if os.fstat(folder).st_uid != os.geteuid():
            return None
        try:
            marker = os.open(FOLDER_MARKER, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        except OSError:
            return None  # another program's folder, or one whose owner died making it
        if not stat.S_ISREG(os.fstat(marker).st_mode):
            return None
        try:
            fcntl.flock(marker, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # held: a live owner
        if any(_capture_owner_alive(folder, n) for n in os.listdir(folder)):
            return None
        taken, marker = marker, -1
        return taken
    finally:
        if marker >= 0:
            os.close(marker)
        os.close(folder)


def _capture_owner_alive(folder: int, name: str) -> bool:
    """Whether ``name`` in the open ``folder`` is a capture's owner marker that a live process holds."""
    token = staged_token(name)
    return token is not None and name == staged_name(OWNER_MARKER, token) and owner_is_alive("", token, dir_fd=folder)
