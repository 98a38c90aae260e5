"""Shared-memory segments that engines killed by the tests leave in ``/dev/shm``.

vLLM's message queues (``multiprocessing.shared_memory``: ``psm_*``) and its CPU communicator
(``vllm_dist_*``) are unlinked by the process that made them when it ends normally. The engine,
node and fault tests end engines with ``SIGKILL``, so their segments stay, run after run: one
machine of ours held 2,043 of them, 3.7 GB of memory (``/dev/shm`` is memory), after a day of runs.
The test session removes, when it ends, the segments of those kinds that appeared while it ran
and that no live process has open or mapped: nothing it did not make, and nothing in use. A
segment younger than a minute stays too: another test session's engine may be starting, and a
segment between its creation and its mapping is in no process's list yet.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

SHM_DIR = "/dev/shm"
# Segment names of vLLM's message queues and CPU communicator; nothing else is touched.
PREFIXES = ("psm_", "vllm_dist_")
# Seconds a segment must have existed before a sweep may take it for a dead engine's.
MIN_AGE = 60.0


def segments(folder: str = SHM_DIR) -> set[str]:
    """The names of vLLM's segments in ``folder``."""
    try:
        return {name for name in os.listdir(folder) if name.startswith(PREFIXES)}
    except FileNotFoundError:
        return set()


def in_use(folder: str = SHM_DIR) -> set[str]:
    """The paths under ``folder`` that a live process (any we may read) has open or mapped."""
    prefix = folder.rstrip("/") + "/"
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                used.update(line.split(None, 5)[-1].strip() for line in maps if prefix in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    used.add(target)
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return {path.removesuffix(" (deleted)") for path in used}


def remove_left(before: Iterable[str], folder: str = SHM_DIR, min_age: float = MIN_AGE) -> list[str]:
    """Remove vLLM's segments in ``folder`` that are not in ``before``, that no live process has
    open or mapped, and that are at least ``min_age`` seconds old; the names removed."""
    # Listed before the processes are read: a segment made after the read is never a candidate.
    candidates = sorted(segments(folder) - set(before))
    used = in_use(folder)
    removed = []
    for name in candidates:
        path = os.path.join(folder, name)
        if path in used:
            continue
        try:
            if time.time() - os.stat(path).st_mtime < min_age:
                continue
            os.unlink(path)
        except FileNotFoundError:  # its maker ended and unlinked it meanwhile
            continue
        removed.append(name)
    return removed
