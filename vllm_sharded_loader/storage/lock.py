"""The save lock of a checkpoint directory: taken exclusively by a save, refused by loads.

``.sharded_state.lock`` appears at the start of a save and is removed when its manifest
is published. Its save holds a ``flock`` on it for as long as it runs, and it names its
holder (pid, host, token, start time) for the messages. Whether its save still runs is
decided by the ``flock`` alone, never by the host name or process id it names: a save
killed on another node of a shared folder, or in a container with its own PID namespace,
leaves a lock whose ``flock`` is free, and the next save allowed to (overwrite) takes it
over; a running save's lock is never taken over, wherever it runs. Where a mount's
``flock`` is not shared between its clients (an NFS mount with ``nolock`` or
``local_lock``, CIFS with ``nobrl``, a FUSE file system), a free ``flock`` proves nothing,
and a lock is never taken over there (:func:`flock_problem`). Everything that reads the
lock goes through :func:`read_lock`.
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

from ..format.errors import CheckpointLocked, SaveRefused
from ..format.names import LOCK_NAME, MANIFEST_NAME, TOKEN_DIGITS, staged_name, staged_token
from .local import check_output_folder, directory_holds_checkpoint, file_kind, make_output_folder, open_regular
from .mounts import flock_problem

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
    except (FileNotFoundError, NotADirectoryError):  # (no folder there: no lock either)
        return None
    except (OSError, ValueError, RecursionError):  # (JSON nested past the recursion limit: no one's)
        return {}


def _named_process_runs(holder: dict) -> bool:
    """Whether the process a lock names runs here: only to name a lock's holder in messages
    (see :func:`_running_holder`), never to decide whether its save runs (its ``flock`` does)."""
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
    """``flock`` without blocking: True if taken, False if another holds it; a file system without
    ``flock`` is refused, saying so (a save cannot run safely where locks are not kept)."""
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

    The lock file is written and ``flock``-ed under a temporary name, then published with
    ``link`` (atomic, fails if a lock exists), so a lock is never visible unheld while its
    save runs. An existing lock whose ``flock`` is free belongs to a save that died; with
    ``overwrite`` it is taken over by taking that ``flock``, which one process only can
    win: any other save gets a clear error. Nothing is ever removed to take a lock over.
    ``patterns``: the save's own part names, which count as a checkpoint too (its cleanup removes them).
    """
    path = os.path.join(directory, LOCK_NAME)
    # An output that is a file or a FIFO is named as such before the rule below lists it (which
    # would fail with the system's bare "Not a directory").
    check_output_folder(directory)
    # A refusal changes nothing, not even the folder's mtime: the rule is checked once before anything
    # is written, and again under the lock (a save may publish meanwhile). A lock there is named first.
    if not os.path.lexists(path):
        _refuse_a_checkpoint(directory, overwrite, patterns)
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": token, "started": time.time()})
    lock = None
    try:
        make_output_folder(directory)
        for _ in range(8):  # a lock released between our tries makes us try again
            # An existing lock first (a running save's is refused without a file written), then a new one.
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
    """The folders of ``directory``'s path that are not there yet, deepest first: those a save makes."""
    missing, there = [], os.path.abspath(directory)
    while not os.path.lexists(there):
        missing.append(there)
        there = os.path.dirname(there)
    return missing


def remove_empty_folders(folders: Iterable[str]) -> None:
    """Remove each folder, in the order given (the deepest first), if it is empty: those a save
    made or emptied, and only if nothing else was put in them meanwhile."""
    for folder in folders:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _refuse_holder(directory: str, holder: dict, held: bool, overwrite: bool) -> None:
    """Refuse a lock's ``holder``: a running save (its flock ``held``), one whose mount cannot tell
    (:func:`flock_problem`), or an interrupted one unless ``overwrite`` (then it may be taken over)."""
    problem = None if held else flock_problem(directory)
    if held:
        advice = "; wait for it to finish."
    elif problem is not None:
        # A free flock proves nothing here: the save may run on another host.
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
    """What :func:`acquire_save_lock` would refuse, taking nothing: said before a save starts work it
    would throw away (vLLM building a model, tens of seconds). The save checks again under its lock."""
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
    if written != len(data):  # (a file size limit, a full disk: a lock read back as no one's)
        raise OSError(errno.ENOSPC, f"the lock file took {written} of {len(data)} bytes")
    os.fsync(fd)


def _create_lock(path: str, token: str, info: str) -> SaveLock | None:
    """A new lock, or None if one exists (or the staging name was not ours to trust: try again). A
    failure (an interrupt too) takes back what it made: the staging name, the lock if it was published
    (left unheld, it would need overwrite), and the flock."""
    staging = f"{path}.{token}.new"
    fd = os.open(staging, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    linked = False
    try:
        # Nobody else knows the staging name, but a save's cleanup may probe it before our flock, find
        # it free, and remove it as a dead save's (stale_lock_staging): then we start again.
        if _flock(fd, fcntl.LOCK_EX, os.path.dirname(path)):
            _write_holder(fd, info)
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.link(staging, path)
                linked = True
        with contextlib.suppress(FileNotFoundError):
            os.remove(staging)
    except BaseException:
        with contextlib.suppress(OSError):
            if linked and _inode(path) == os.fstat(fd).st_ino:
                os.remove(path)
        with contextlib.suppress(OSError):
            os.remove(staging)
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
        # Never through a link (taking a lock over rewrites it: a link's target is not ours), and
        # without blocking on a FIFO; only a regular file can be a lock.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        # open(2) refuses a socket (ENXIO) as it refuses a link (ELOOP) or a folder (EISDIR): each is
        # named, not given as a bare errno that reads like a full disk.
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        kinds = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory"}
        _refuse_lock(directory, path, kinds.get(e.errno) or file_kind(os.lstat(path).st_mode))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            _refuse_lock(directory, path, file_kind(mode))
        held = not _flock(fd, fcntl.LOCK_EX, directory)
        # Read after the flock: ours, the holder is the save we take over; another's, its own.
        holder = _running_holder(directory) if held else read_lock(directory) or {}
        if not held and os.fstat(fd).st_ino != _inode(path):
            os.close(fd)  # released and replaced while we looked: try again
            return None
        _refuse_holder(directory, holder, held, overwrite)
        staging = _staging_links(directory, fd)
        links = os.fstat(fd).st_nlink - len(staging)
        if links > 1:
            # Taking over rewrites the file: a hard link's other names are files elsewhere, not ours.
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
    """The names under which :func:`_create_lock` staged the lock open as ``fd``, still linked to it:
    a save that died (or failed to remove them) between the lock's link and that removal left them."""
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


# A lock's staging name: the lock's, a save's token (hexadecimal digits: 12 now, 32 from earlier versions), ".new".
_LOCK_STAGING = re.compile(re.escape(LOCK_NAME) + rf"\.[0-9a-f]{{{TOKEN_DIGITS},32}}\.new\Z")


def is_lock_staging_name(name: str) -> bool:
    """Whether ``name`` is one under which :func:`_create_lock` stages a lock before linking it (never
    a user's ``.sharded_state.lock.old.new``, which a save's clean-up would take for a dead save's)."""
    return _LOCK_STAGING.match(name) is not None


def stale_lock_staging(directory: str, name: str) -> bool:
    """Whether ``name`` is a lock's staging name that no live save holds (:func:`flock_is_held`): its
    save was killed before it linked the lock, or before it removed the name. (Its creator holds its
    ``flock`` from just after creating it; see :func:`_create_lock` for the moment before.)"""
    return is_lock_staging_name(name) and not flock_is_held(directory, name)


def _refuse_lock(directory: str, path: str, kind: str) -> None:
    raise CheckpointLocked(
        f"{directory}: {path} is {kind}, where a save's lock file was expected; nothing was written. "
        "Remove it if no save runs, and save again."
    )


def _running_holder(directory: str) -> dict:
    """Who holds a lock whose flock is taken, once it has written itself into the lock file.

    A save that has just taken an interrupted save's lock over holds the flock a moment
    before it rewrites the file, which until then names the dead save, or nothing (while
    it is rewritten). Waits that moment (at most HOLDER_WAIT_S) so errors name the holder.
    """
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
    finally:  # (a lock file that may not be removed must not keep this process's flock for its life)
        if lock.fd >= 0:
            with contextlib.suppress(OSError):  # closed already (a second release)
                os.close(lock.fd)


def save_is_running(directory: str) -> bool:
    """Whether a live save holds the directory's lock: its ``flock`` is taken (:func:`flock_is_held`)."""
    return flock_is_held(directory, LOCK_NAME)


def flock_is_held(directory: str, name: str, dir_fd: int | None = None) -> bool:
    """Whether a live process holds the ``flock`` of ``directory``'s file ``name`` (False: no such file).

    Probed with a shared ``flock``, which conflicts with the holder's exclusive one. Where
    the mount's ``flock`` is not kept, or not shared between hosts (:func:`flock_problem`), it
    is taken to be held: whether its process lives (maybe on another host) cannot be told.
    ``directory`` is relative to the open folder ``dir_fd`` when given (``""``: that folder).
    """
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
    """Whether a live process holds the marker of ``token`` (staged files of a running engine); where
    that cannot be told (:func:`flock_is_held`), its files are kept. ``dir_fd`` as there."""
    return flock_is_held(directory, staged_name(OWNER_MARKER, token), dir_fd)


def owner_is_gone(directory: str, name: str) -> bool:
    """Whether ``name`` is a file that a process now gone left in ``directory`` (a save's cleanup
    removes it): staged under a token whose owner no longer holds its marker (:func:`owner_is_alive`),
    or a lock's staging name whose save was killed (:func:`stale_lock_staging`)."""
    token = staged_token(name)
    return stale_lock_staging(directory, name) if token is None else not owner_is_alive(directory, token)
