"""Temporary files that their writer holds by ``flock`` for as long as it lives, so that a writer
killed before it renamed or removed one (``SIGKILL``, the OOM killer, a node's power) leaves a file
that the next writer into the folder can tell from a live one's, and removes.

The start-up artifact restore (:func:`..checkpoint.startup_artifacts.restore`) writes each entry of
vLLM's cache to such a temporary and links it into place: without this, a restore killed mid-write
left its temporary (as large as the entry) in vLLM's cache folder for good.
"""

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

# mkstemp's random part: 8 of these characters (tempfile's _RandomNameSequence).
_RANDOM = r"[a-z0-9_]{8}"
# An empty temporary may be a live writer's in the instant between its creation and its flock:
# only one left this long is taken for a dead writer's.
EMPTY_GRACE_SECONDS = 60.0


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
    """Remove from ``folder`` the temporaries of :func:`held_temporary` (by ``prefix`` and ``suffix``)
    whose writer is gone (their ``flock`` is free), and return their names. Never a live writer's,
    nor anything but a regular file of exactly that shape of name, nor through a link, nor on a
    mount whose ``flock`` is not shared between its hosts (a free lock there proves nothing)."""
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
            now = os.lstat(path)  # (still that file: a name mkstemp gave is never given again while it exists)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.remove(path)
                removed.append(name)
        except OSError:  # gone meanwhile (its writer finished), or not ours to remove: left as it is
            continue
    return removed
