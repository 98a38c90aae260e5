"""The save lock of a checkpoint directory: taken exclusively by a save, refused by loads.

``.sharded_state.lock`` is created with ``O_EXCL`` at the start of a save and removed when
its manifest is published. It names its holder (pid, host, token, start time), so a
second save can tell a running save from an interrupted one. Everything that reads the
lock goes through :func:`read_lock`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass

from ..format.errors import ShardedStateError
from ..format.names import LOCK_NAME
from .local import directory_holds_checkpoint


@dataclass(frozen=True)
class SaveLock:
    """Proof that this process holds a directory's save lock."""

    path: str
    token: str


def read_lock(directory: str) -> dict | None:
    """What the lock file of a directory says about its holder, or None without one."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        with open(path) as f:
            data = json.loads(f.read() or "{}")
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
    """Take a directory's save lock, refusing a running save and, unless ``overwrite``, a checkpoint."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "token": token, "started": time.time()})
    for attempt in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = read_lock(directory) or {}
            alive = _holder_is_alive(holder)
            if alive or not overwrite or attempt:
                raise ShardedStateError(
                    f"{directory}: another save holds {describe_lock(directory, holder)}"
                    + (
                        "; wait for it to finish."
                        if alive
                        else "; that save was interrupted. Save again with overwrite to replace it."
                    )
                ) from None
            # The holder is gone and overwrite was asked: take the stale lock over. (Its
            # partial files are removed when this save publishes: parts this save captured
            # at engine start are partial files too, until then.)
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(info)
            f.flush()
            os.fsync(f.fileno())
        break
    lock = SaveLock(path, token)
    if not overwrite and directory_holds_checkpoint(directory):
        release_save_lock(lock)
        raise ShardedStateError(
            f"{directory} already holds a checkpoint; refusing to overwrite it. Choose another "
            "directory, or ask for overwrite (--overwrite, or SHARDED_STATE_OVERWRITE=1 for the save hook)."
        )
    return lock


def release_save_lock(lock: SaveLock) -> None:
    """Remove the lock if it is still ours."""
    holder = read_lock(os.path.dirname(lock.path))
    if holder is not None and holder.get("token") == lock.token:
        os.remove(lock.path)


def check_not_locked(directory: str) -> None:
    """Refuse a directory whose save is running or was interrupted."""
    holder = read_lock(directory)
    if holder is not None:
        raise ShardedStateError(
            f"{directory} is being saved or its save was interrupted: {describe_lock(directory, holder)} "
            f"exists and the checkpoint may mix two saves. Wait for the save to finish, or save it again "
            "(with overwrite)."
        )
