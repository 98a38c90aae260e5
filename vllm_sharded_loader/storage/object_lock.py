"""The save lock of an object-storage prefix: one object a conditional put creates. Object storage
cannot tell a running save from a dead one, so a lock is never taken over silently."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any

from ..format import MANIFEST_NAME
from ..format.errors import CheckpointCorrupt, CheckpointLocked, CheckpointNotFound, SaveRefused, ShardedStateError
from ..format.names import LOCK_NAME
from .objects import AlreadyExists, ObjectFile, ObjectPrefix, delete, head, put


def read_lock(where: ObjectPrefix) -> dict[str, Any] | None:
    """The lock object's contents if a save holds (or held, and died holding) the prefix."""
    meta = head(where, LOCK_NAME)
    if meta is None:
        return None
    try:
        data = ObjectFile(where, LOCK_NAME, meta).read_at(0, min(meta["size"], 4096))
    except CheckpointNotFound:  # released meanwhile
        return None
    except CheckpointCorrupt:  # replaced meanwhile: a lock of unknown holder
        return {}
    # (A network error is raised: as "no holder", a release would keep the lock silently.)
    try:
        holder = json.loads(data)
    except (ValueError, RecursionError):  # (nested past the recursion limit: a lock of unknown holder)
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_lock(where: ObjectPrefix, holder: dict[str, Any]) -> str:
    when = holder.get("time")
    since = "?"
    if isinstance(when, (int, float)):
        # NaN or out of range (the object is anyone's): the lock is still named.
        with contextlib.suppress(ValueError, OverflowError, OSError):
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    return f"{where.url(LOCK_NAME)} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {since})"


def acquire_lock(where: ObjectPrefix, token: str) -> None:
    """Take the prefix for one save: a conditional put of the lock object."""
    body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "token": token})
    try:
        put(where, LOCK_NAME, body.encode(), create=True)
    except ShardedStateError as e:
        try:
            holder = read_lock(where) or {}
        except ShardedStateError:
            raise e from None
        if holder.get("token") == token:
            return  # ours: the put's answer was lost, and its retry found the lock it made
        if not isinstance(e, AlreadyExists):
            raise
        raise _held(where, holder) from None


def _held(where: ObjectPrefix, holder: dict[str, Any]) -> CheckpointLocked:
    return CheckpointLocked(
        f"{where.url()}: another save holds {describe_lock(where, holder)}. If it is no longer running (it "
        f"was interrupted), delete {where.url(LOCK_NAME)} and save again."
    )


def refuse_a_checkpoint(where: ObjectPrefix, overwrite: bool) -> None:
    """Refuse a prefix with a published manifest unless ``overwrite``."""
    if not overwrite and head(where, MANIFEST_NAME) is not None:
        raise SaveRefused(
            f"{where.url()} already holds a checkpoint; refusing to overwrite it. Choose another prefix or pass "
            "--overwrite."
        )


def refuse_before_save(where: ObjectPrefix, overwrite: bool) -> None:
    """What a save's :func:`acquire_lock` and its check under the lock would refuse, taking nothing."""
    holder = read_lock(where)
    if holder is not None:
        raise _held(where, holder)
    refuse_a_checkpoint(where, overwrite)


def check_lock_holder(where: ObjectPrefix, token: str) -> None:
    """Fencing: refuse to go on unless the lock is still this save's (``token``), never publishing
    under another save's lock (one deleted by hand and taken while this save stalled)."""
    holder = read_lock(where)
    if holder is None or holder.get("token") != token:
        raise SaveRefused(
            f"{where.url()}: this save's lock was "
            + ("deleted" if holder is None else f"taken over by another save ({describe_lock(where, holder)})")
            + " while it ran; it does not publish. Save again once no other save runs."
        )


def release_lock(where: ObjectPrefix, token: str | None = None) -> None:
    """Delete the lock; with ``token``, only if it is still this save's (two requests, as S3 has no
    conditional delete everywhere: a lock taken between them is not fenced)."""
    if token is not None:
        holder = read_lock(where)
        if holder is None or holder.get("token") != token:
            return
    delete(where, [LOCK_NAME])


def check_not_locked(where: ObjectPrefix) -> None:
    """Refuse a prefix without a manifest that a save holds."""
    holder = read_lock(where)
    if holder is not None and head(where, MANIFEST_NAME) is None:
        raise CheckpointLocked(
            f"{where.url()}: a save is running or was interrupted there ({describe_lock(where, holder)}) and no "
            "manifest has been published yet. Wait for the save to finish, or save the checkpoint again."
        )
