"""The save lock of a checkpoint directory: taken exclusively by a save, refused by loads.

``.sharded_state.lock`` lives from a save's start to its publish; its save holds a ``flock`` on it
and it names its holder (pid, host, token, start) for messages. Whether the save still runs is the
``flock``'s answer alone, never the pid or host: a dead save's lock may be taken over (with
overwrite), a running one's never. Where a mount does not share ``flock`` between clients
(:func:`flock_problem`), a lock is never taken over.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ..format.errors import CheckpointLocked, SaveRefused, StorageError
from ..format.names import LOCK_NAME, MANIFEST_NAME, TOKEN_DIGITS, staged_name, staged_token
from .local import (
    check_output_folder,
    directory_holds_checkpoint,
    file_kind,
    make_output_folder,
    open_regular,
    present,
)
from .mounts import flock_problem

MAX_LOCK_BYTES = 64 * 1024  # a lock is one line of JSON; more is not ours
HOLDER_WAIT_S = 2.0  # how long to wait for a lock's new holder to name itself (_running_holder)


@dataclass(frozen=True)
class SaveLock:
    """Proof that this process holds a directory's save lock.

    ``fd`` stays open and ``flock``-ed while the save runs (the kernel drops it when the process
    dies); ``taken_over`` is the token of the dead save whose lock this took over (its staged
    files are this save's to remove).
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
    except (FileNotFoundError, NotADirectoryError):  # (no folder there: no lock either)
        return None
    except StorageError:  # permission denied: a lock of another user's save, or a folder not to be searched
        return {} if present(path, directory) else None
    except (OSError, ValueError, RecursionError):  # (JSON nested past the recursion limit: no one's)
        return {}


def _named_process_runs(holder: dict) -> bool:
    """Whether the process a lock names runs; for messages only, never to decide (the ``flock`` does)."""
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (a pid past C's long: no process, not an error to give)
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _flock(fd: int, operation: int, directory: str) -> bool:
    """``flock`` without blocking: True if taken, False if held; a file system without it is refused."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF):
            raise CheckpointLocked(
                f"{directory}: the file system does not keep flock locks ({os.strerror(e.errno)}), so a running "
                "save cannot be told from an interrupted one. Save to a local disk or to a mount whose flock "
                "works across hosts (NFSv4, or NFSv3 with lockd), then copy the checkpoint."
            ) from e
        raise
    return True


def describe_lock(directory: str, holder: dict) -> str:
    started = holder.get("started")
    when = "?"
    if isinstance(started, (int, float)):
        with contextlib.suppress(ValueError, OverflowError, OSError):  # NaN, or out of range: the file is anyone's
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    return f"{os.path.join(directory, LOCK_NAME)} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, {when})"


def acquire_save_lock(directory: str, token: str, overwrite: bool = False, patterns: tuple[str, ...] = ()) -> SaveLock:
    """Take a directory's save lock, refusing a running save and, unless ``overwrite``, a checkpoint.

    The lock is written and ``flock``-ed under a temporary name, then published with ``link``
    (atomic, fails if one exists), so it is never visible unheld. A dead save's lock is taken over
    with ``overwrite`` by taking its ``flock``, which only one process can win; nothing is removed.
    ``patterns``: the save's own part names, which count as a checkpoint too.
    """
    path = os.path.join(directory, LOCK_NAME)
    check_output_folder(directory)  # a file or FIFO named as such, not as "Not a directory"
    # A refusal changes nothing, not even the folder's mtime: checked before anything is written,
    # and again under the lock (a save may publish meanwhile).
    if not os.path.lexists(path):
        _refuse_a_checkpoint(directory, overwrite, patterns)
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": token, "started": time.time()})
    lock = None
    try:
        make_output_folder(directory)
        for _ in range(8):  # a lock released between our tries makes us try again
            existing = os.path.lexists(path) and _take_over_lock(directory, path, token, info, overwrite)
            lock = existing or _create_lock(path, token, info)
            if lock is not None:
                break
    except OSError as e:  # a full disk, a folder we may not write
        raise SaveRefused(
            f"{directory}: taking the save lock {path} failed: {e}. Nothing was written; any previous checkpoint "
            "there is intact. Free space (or fix the folder) and save again."
        ) from e
    if lock is None:
        raise CheckpointLocked(f"{directory}: could not take {path}: other saves keep taking it. Try again.")
    try:
        _refuse_a_checkpoint(directory, overwrite, patterns)
    except BaseException:  # (an interrupt too: a lock left unheld would need overwrite next time)
        release_save_lock(lock)
        raise
    return lock


def missing_folders(directory: str) -> list[str]:
    """The folders of ``directory``'s path not there yet, deepest first."""
    missing, there = [], os.path.abspath(directory)
    while not os.path.lexists(there):
        missing.append(there)
        there = os.path.dirname(there)
    return missing


def remove_empty_folders(folders: Iterable[str]) -> None:
    """Remove each folder, in the order given (deepest first), if it is empty."""
    for folder in folders:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _refuse_holder(directory: str, holder: dict, held: bool, overwrite: bool) -> None:
    """Refuse a running save, one whose mount cannot tell, or (unless ``overwrite``) a dead one."""
    problem = None if held else flock_problem(directory)
    if held:
        advice = "; wait for it to finish."
    elif problem is not None:  # a free flock proves nothing: the save may run on another host
        advice = (
            f"; {problem}, so whether that save still runs cannot be told. If no save runs, remove "
            f"{os.path.join(directory, LOCK_NAME)} and save again."
        )
    elif overwrite:
        return
    elif "token" not in holder:
        advice = "; that save was interrupted (or is one of an older version). Save again with overwrite."
    else:
        advice = "; that save was interrupted. Save again with overwrite to replace it."
    raise CheckpointLocked(f"{directory}: another save holds {describe_lock(directory, holder)}{advice}")


def refuse_before_save(directory: str, overwrite: bool) -> None:
    """What :func:`acquire_save_lock` would refuse, taking nothing: said before work a save would waste."""
    check_output_folder(directory)
    holder = read_lock(directory)
    if holder is not None:
        held = save_is_running(directory)
        _refuse_holder(directory, _running_holder(directory) if held else holder, held, overwrite)
    _refuse_a_checkpoint(directory, overwrite, ())


def _refuse_a_checkpoint(directory: str, overwrite: bool, patterns: tuple[str, ...]) -> None:
    if not overwrite and directory_holds_checkpoint(directory, patterns):
        raise SaveRefused(
            f"{directory} already holds a checkpoint; refusing to overwrite it. Choose another "
            "directory, or ask for overwrite (--overwrite, or SHARDED_STATE_OVERWRITE=1 for the save hook)."
        )


def _write_holder(fd: int, info: str) -> None:
    data = info.encode()
    os.ftruncate(fd, 0)
    written = os.pwrite(fd, data, 0)
    if written != len(data):  # a short lock reads back as no one's
        raise OSError(errno.ENOSPC, f"the lock file took {written} of {len(data)} bytes")
    os.fsync(fd)


def _create_lock(path: str, token: str, info: str) -> SaveLock | None:
    """A new lock, or None if one exists (or the staging name was lost: try again). A failure takes
    back what it made: an unheld published lock would need overwrite."""
    staging = f"{path}.{token}.new"
    fd, linked = -1, False
    try:
        fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        # Another save's cleanup may find the staging name before our flock and remove it as a dead save's.
        if _flock(fd, fcntl.LOCK_EX, os.path.dirname(path)):
            _write_holder(fd, info)
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.link(staging, path)
                linked = True
        with contextlib.suppress(FileNotFoundError):
            os.remove(staging)
    except BaseException as e:
        if isinstance(e, FileExistsError) and fd < 0:  # the staging name is another's (os.link's is suppressed)
            raise
        with contextlib.suppress(OSError):
            if fd >= 0 and _inode(path) == os.fstat(fd).st_ino:  # ours, even if the stop came as os.link returned
                os.remove(path)
        with contextlib.suppress(OSError):
            os.remove(staging)  # our token's name, even if the stop came as os.open returned
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    if not linked:
        os.close(fd)
        return None
    return SaveLock(path, token, fd)


def _take_over_lock(directory: str, path: str, token: str, info: str, overwrite: bool) -> SaveLock | None:
    """The existing lock, taken over if its save died and ``overwrite``; None if it vanished meanwhile."""
    try:
        # Never through a link (a takeover rewrites the file) and never blocking on a FIFO.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # a socket, a link or a folder, named rather than given as a bare errno
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        kinds = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory"}
        _refuse_lock(directory, path, kinds.get(e.errno) or file_kind(os.lstat(path).st_mode))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            _refuse_lock(directory, path, file_kind(mode))
        held = not _flock(fd, fcntl.LOCK_EX, directory)
        # Read after the flock, so the holder is the one the flock speaks for.
        holder = _running_holder(directory) if held else read_lock(directory) or {}
        if not held and os.fstat(fd).st_ino != _inode(path):
            os.close(fd)  # released and replaced while we looked: try again
            return None
        _refuse_holder(directory, holder, held, overwrite)
        staging = _staging_links(directory, fd)
        links = os.fstat(fd).st_nlink - len(staging)
        if links > 1:  # a takeover rewrites the file: its other names are not ours
            _refuse_lock(directory, path, f"a file with {links - 1} other name(s) (a hard link)")
        for name in staging:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))
        _write_holder(fd, info)
    except BaseException:
        os.close(fd)
        raise
    stale = holder.get("token")
    return SaveLock(path, token, fd, stale if isinstance(stale, str) else None)


def _staging_links(directory: str, fd: int) -> list[str]:
    """Staging names still linked to the lock open as ``fd``, left by a save that died after its link."""
    st = os.fstat(fd)
    if st.st_nlink < 2:
        return []
    found = []
    for name in os.listdir(directory):
        if is_lock_staging_name(name):
            with contextlib.suppress(OSError):
                there = os.lstat(os.path.join(directory, name))
                if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):
                    found.append(name)
    return found


# The lock's name, a save's token (12 to 32 hexadecimal digits), ".new".
_LOCK_STAGING = re.compile(re.escape(LOCK_NAME) + rf"\.[0-9a-f]{{{TOKEN_DIGITS},32}}\.new\Z")


def is_lock_staging_name(name: str) -> bool:
    """Whether ``name`` is one under which :func:`_create_lock` stages a lock (never a user's ``...lock.old.new``)."""
    return _LOCK_STAGING.match(name) is not None


def stale_lock_staging(directory: str, name: str) -> bool:
    """Whether ``name`` is a lock's staging name that no live save holds (:func:`flock_is_held`)."""
    return is_lock_staging_name(name) and not flock_is_held(directory, name)


def _refuse_lock(directory: str, path: str, kind: str) -> None:
    raise CheckpointLocked(
        f"{directory}: {path} is {kind}, where a save's lock file was expected; nothing was written. "
        "Remove it if no save runs, and save again."
    )


def _running_holder(directory: str) -> dict:
    """Who holds a lock whose flock is taken, waiting up to HOLDER_WAIT_S for a save that just took
    it over to rewrite the file (until then it names the dead save, or nothing)."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        holder = read_lock(directory) or {}
        if (isinstance(holder.get("pid"), int) and _named_process_runs(holder)) or time.monotonic() > deadline:
            return holder
        time.sleep(0.01)


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def release_save_lock(lock: SaveLock) -> None:
    """Remove the lock if it is still ours, then let go of its flock."""
    try:
        holder = read_lock(os.path.dirname(lock.path))
        if holder is not None and holder.get("token") == lock.token:
            os.remove(lock.path)
    finally:  # the flock goes even where the file may not be removed
        if lock.fd >= 0:
            with contextlib.suppress(OSError):  # a second release
                os.close(lock.fd)


def save_is_running(directory: str) -> bool:
    """Whether a live save holds the directory's lock (:func:`flock_is_held`)."""
    return flock_is_held(directory, LOCK_NAME)


def flock_is_held(directory: str, name: str, dir_fd: int | None = None) -> bool:
    """Whether a live process holds the ``flock`` of ``directory``'s file ``name`` (relative to ``dir_fd``);
    where the mount's ``flock`` is not kept or not shared (:func:`flock_problem`), it counts as held."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError), or no flock here
        return True
    finally:
        os.close(fd)
    where = directory if dir_fd is None else os.path.join(f"/proc/self/fd/{dir_fd}", directory)
    return flock_problem(where) is not None


def check_not_locked(directory: str) -> None:
    """Refuse a lock without a manifest; a published one still loads while a later save runs or after it died."""
    holder = read_lock(directory)
    if holder is not None and not os.path.lexists(os.path.join(directory, MANIFEST_NAME)):
        raise CheckpointLocked(
            f"{directory} is being saved or its save was interrupted: {describe_lock(directory, holder)} "
            "exists and no manifest has been published yet. Wait for the save to finish, or save it again "
            "(with overwrite)."
        )


# Files staged outside a save (an engine's start-up capture) belong to a process no lock names: it
# holds a ``flock`` on a marker of its token while it lives, so cleanups spare its files.
OWNER_MARKER = "owner"


def hold_owner_marker(directory: str, token: str) -> int:
    """Create and ``flock`` the marker of ``token``; the descriptor stays open for the process's life."""
    path = os.path.join(directory, staged_name(OWNER_MARKER, token))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _flock(fd, fcntl.LOCK_EX, directory)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(path)
        raise
    return fd


def release_owner_marker(directory: str, token: str, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.remove(os.path.join(directory, staged_name(OWNER_MARKER, token)))
    with contextlib.suppress(OSError):
        os.close(fd)


def owner_is_alive(directory: str, token: str, dir_fd: int | None = None) -> bool:
    """Whether a live process holds the marker of ``token``; where that cannot be told, it does."""
    return flock_is_held(directory, staged_name(OWNER_MARKER, token), dir_fd)


def owner_is_gone(directory: str, name: str) -> bool:
    """Whether ``name`` was staged by a process now gone (its marker or lock staging unheld)."""
    token = staged_token(name)
    return stale_lock_staging(directory, name) if token is None else not owner_is_alive(directory, token)
