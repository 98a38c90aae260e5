"""The save lock of a checkpoint directory: taken exclusively by a save, refused by loads.

``.sharded_state.lock`` appears at the start of a save and is removed when its manifest
is published. Its save holds a ``flock`` on it for as long as it runs, and it names its
holder (pid, host, token, start time), so a second save can tell a running save from an
interrupted one, and only one save can take an interrupted one over. Everything that
reads the lock goes through :func:`read_lock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass

from ..format.errors import CheckpointLocked, SaveRefused
from ..format.names import LOCK_NAME, MANIFEST_NAME, staged_name
from .local import directory_holds_checkpoint, open_regular

# A lock names its holder in a line of JSON; more is not a lock of ours.
MAX_LOCK_BYTES = 64 * 1024

# How long a save that meets a held lock waits for its holder to name itself (see _running_holder).
HOLDER_WAIT_S = 2.0


@dataclass(frozen=True)
class SaveLock:
    """Proof that this process holds a directory's save lock.

    ``fd`` is the lock file, open and ``flock``-ed for as long as the save runs: the kernel
    drops the ``flock`` when the process dies, which is how a later save tells an
    interrupted save from a running one. ``taken_over`` is the token of the interrupted
    save whose lock this one took over (its staged files are this save's to remove).
    """

    path: str
    token: str
    fd: int = -1
    taken_over: str | None = None


def read_lock(directory: str) -> dict | None:
    """What the lock file of a directory says about its holder, or None without one."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        with os.fdopen(open_regular(path)) as f:
            data = json.loads(f.read(MAX_LOCK_BYTES) or "{}")
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _holder_is_alive(holder: dict) -> bool:
    """Whether the save that wrote a lock may still run (on another machine we cannot tell: yes)."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def describe_lock(directory: str, holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"{os.path.join(directory, LOCK_NAME)} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, {when})"


def acquire_save_lock(directory: str, token: str, overwrite: bool = False) -> SaveLock:
    """Take a directory's save lock, refusing a running save and, unless ``overwrite``, a checkpoint.

    The lock file is written and ``flock``-ed under a temporary name, then published with
    ``link`` (atomic, fails if a lock exists), so a lock is never visible unheld while its
    save runs. An existing lock whose ``flock`` is free belongs to a save that died; with
    ``overwrite`` it is taken over by taking that ``flock``, which one process only can
    win: any other save gets a clear error. Nothing is ever removed to take a lock over.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": token, "started": time.time()})
    lock = None
    for _ in range(8):  # a lock released between our tries makes us try again
        lock = _create_lock(path, token, info) or _take_over_lock(directory, path, token, info, overwrite)
        if lock is not None:
            break
    if lock is None:
        raise CheckpointLocked(f"{directory}: could not take {path}: other saves keep taking it. Try again.")
    if not overwrite and directory_holds_checkpoint(directory):
        release_save_lock(lock)
        raise SaveRefused(
            f"{directory} already holds a checkpoint; refusing to overwrite it. Choose another "
            "directory, or ask for overwrite (--overwrite, or SHARDED_STATE_OVERWRITE=1 for the save hook)."
        )
    return lock


def _write_holder(fd: int, info: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, info.encode(), 0)
    os.fsync(fd)


def _create_lock(path: str, token: str, info: str) -> SaveLock | None:
    """A new lock, or None if one exists."""
    staging = f"{path}.{token}.new"
    fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _write_holder(fd, info)
        try:
            os.link(staging, path)
        except FileExistsError:
            os.close(fd)
            return None
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(staging)
    return SaveLock(path, token, fd)


def _take_over_lock(directory: str, path: str, token: str, info: str, overwrite: bool) -> SaveLock | None:
    """The existing lock, taken over if its save died and ``overwrite``; None if it vanished meanwhile."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except BlockingIOError:
            held = True
        # Read after the flock: ours, the holder is the save we take over; another's, its own.
        holder = _running_holder(directory) if held else read_lock(directory) or {}
        if not held and os.fstat(fd).st_ino != _inode(path):
            os.close(fd)  # released and replaced while we looked: try again
            return None
        # A lock written by an older version carries no flock: its holder's pid tells.
        alive = held or _holder_is_alive(holder)
        if alive or not overwrite:
            raise CheckpointLocked(
                f"{directory}: another save holds {describe_lock(directory, holder)}"
                + (
                    "; wait for it to finish."
                    if alive
                    else "; that save was interrupted. Save again with overwrite to replace it."
                )
            )
        _write_holder(fd, info)
    except BaseException:
        os.close(fd)
        raise
    stale = holder.get("token")
    return SaveLock(path, token, fd, stale if isinstance(stale, str) else None)


def _running_holder(directory: str) -> dict:
    """Who holds a lock whose flock is taken, once it has written itself into the lock file.

    A save that has just taken an interrupted save's lock over holds the flock a moment
    before it rewrites the file, which until then names the dead save, or nothing (while
    it is rewritten). Waits that moment (at most HOLDER_WAIT_S) so errors name the holder.
    """
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        holder = read_lock(directory) or {}
        if (isinstance(holder.get("pid"), int) and _holder_is_alive(holder)) or time.monotonic() > deadline:
            return holder
        time.sleep(0.01)


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def release_save_lock(lock: SaveLock) -> None:
    """Remove the lock if it is still ours, then let go of its flock."""
    holder = read_lock(os.path.dirname(lock.path))
    if holder is not None and holder.get("token") == lock.token:
        os.remove(lock.path)
    if lock.fd >= 0:
        with contextlib.suppress(OSError):  # closed already (a second release)
            os.close(lock.fd)


def save_is_running(directory: str) -> bool:
    """Whether a live save holds the directory's lock (its ``flock`` is taken).

    Probed with a shared ``flock``, which conflicts with the holder's exclusive one;
    a lock written by an older version (no ``flock``) is judged by its holder's pid.
    """
    try:
        fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        holder = read_lock(directory) or {}
        return isinstance(holder.get("pid"), int) and "token" not in holder and _holder_is_alive(holder)
    finally:
        os.close(fd)


def check_not_locked(directory: str) -> None:
    """Refuse a directory without a manifest whose save is running or was interrupted.

    A save replaces a checkpoint last (its parts go under names the old manifest does not
    list, and the manifest's rename publishes them): while it runs, or after it died, the
    published manifest still names a complete checkpoint, which loads as usual. Only a
    directory with a lock and no manifest is refused: its first save has not published.
    """
    holder = read_lock(directory)
    if holder is not None and not os.path.lexists(os.path.join(directory, MANIFEST_NAME)):
        raise CheckpointLocked(
            f"{directory} is being saved or its save was interrupted: {describe_lock(directory, holder)} "
            "exists and no manifest has been published yet. Wait for the save to finish, or save it again "
            "(with overwrite)."
        )


# ------------------------------------------------------------------ owner markers
#
# Files staged outside a save (an engine's start-up capture) belong to a live process
# that no lock names. Each such owner holds an exclusive ``flock`` on a marker of its
# token for as long as it lives: a save's cleanup removes staged files whose owner is
# gone, and never those of a live engine.

OWNER_MARKER = "owner"


def hold_owner_marker(directory: str, token: str) -> int:
    """Create and ``flock`` the marker of ``token`` in ``directory``; the descriptor stays open
    (the lock goes with the process, however it ends)."""
    path = os.path.join(directory, staged_name(OWNER_MARKER, token))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def release_owner_marker(directory: str, token: str, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.remove(os.path.join(directory, staged_name(OWNER_MARKER, token)))
    with contextlib.suppress(OSError):
        os.close(fd)


def owner_is_alive(directory: str, token: str, dir_fd: int | None = None) -> bool:
    """Whether a live process holds the marker of ``token`` (staged files of a running engine).

    ``directory`` is relative to the open folder ``dir_fd`` when given (``""``: that folder).
    """
    try:
        fd = os.open(
            os.path.join(directory, staged_name(OWNER_MARKER, token)),
            os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW,
            dir_fd=dir_fd,
        )
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False
