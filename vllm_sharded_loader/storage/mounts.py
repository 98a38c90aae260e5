"""The mount that holds a folder, read from ``/proc/self/mountinfo``: whether its ``flock`` can tell
a running save from a dead one (:func:`flock_problem`), which the save lock (:mod:`.lock`) relies on."""

from __future__ import annotations

import os

# Mount options under which each host grants flock locally: a free flock says nothing of other hosts.
_LOCAL_FLOCK_OPTIONS = {
    "nfs": ("nolock", "local_lock=flock", "local_lock=all"),
    "nfs4": ("nolock", "local_lock=flock", "local_lock=all"),
    "cifs": ("nobrl", "local_lock"),
    "smb3": ("nobrl", "local_lock"),
}


def _mount_of(path: str, mountinfo: str) -> tuple[str, str, set[str]] | None:
    """(mount point, file system type, options) of the mount that holds ``path``, from ``/proc/self/mountinfo``."""
    best: tuple[str, str, set[str]] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 4 or len(fields) < 6:
            continue
        point = fields[4].encode().decode("unicode_escape")  # spaces are written as \040
        fstype = fields[dash + 1]
        options = set(fields[5].split(",")) | set(fields[dash + 3].split(","))
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, fstype, options)
    return best


def flock_problem(directory: str, mountinfo: str | None = None) -> str | None:
    """Why ``flock`` on ``directory``'s mount cannot tell a running save from a dead one (each host
    grants it on its own), or None."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            return None
    mount = _mount_of(os.path.realpath(directory), mountinfo)
    if mount is None:
        return None
    point, fstype, options = mount
    local = [
        o for o in _LOCAL_FLOCK_OPTIONS.get(fstype, ()) if o in options or any(x.startswith(o + "=") for x in options)
    ]
    if local:
        return f"{point} is a {fstype} mount with {local[0]}: flock is granted by each host on its own"
    if fstype == "fuse" or fstype.startswith("fuse."):
        return f"{point} is a FUSE mount ({fstype}): its flock may be granted by each host on its own"
    return None
