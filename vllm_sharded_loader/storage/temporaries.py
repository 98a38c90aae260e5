"""Temporary files that their writer ``flock``s while it lives, so that the next writer into the
folder can tell a killed writer's temporary from a live one's, and remove it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator

from .lock import flock_is_held

_RANDOM = r"[a-z0-9_]{8}"
EMPTY_GRACE_SECONDS = 60.0  # an empty temporary may be a live writer's, not yet flock-ed


@contextlib.contextmanager
def held_temporary(folder: str, prefix: str, suffix: str) -> Iterator[tuple[int, str]]:
    """A new temporary ``{prefix}XXXXXXXX{suffix}`` in ``folder``, open and ``flock``-ed before its
    first byte; removed on the way out (unless renamed), before its descriptor and so its lock go."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
    try:
        # (Where flock is not kept, a prober cannot take it either, and leaves the file alone.)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield fd, path
    finally:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        finally:
            os.close(fd)


def remove_dead_temporaries(folder: str, prefix: str, suffix: str) -> list[str]:
    """Remove from ``folder`` the regular files of :func:`held_temporary`'s shape whose ``flock`` is free
    (never through a link), and return their names."""
    shape = re.compile(re.escape(prefix) + _RANDOM + re.escape(suffix) + r"\Z")
    try:
        names = [n for n in os.listdir(folder) if shape.match(n)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_size == 0 and time.time() - st.st_mtime < EMPTY_GRACE_SECONDS:
                continue  # (perhaps a live writer's, not yet held)
            if flock_is_held(folder, name):
                continue
            now = os.lstat(path)  # (mkstemp never gives a name again while it exists)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.remove(path)
                removed.append(name)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed
