"""What the fault tests share: a digest of everything in a directory, to prove that nothing else changed.

A fault test takes :func:`tree_digest` of the checkpoint directory (and of its
neighbours) before the fault and after it, and compares: the previous checkpoint's files
are byte-identical, and nothing appeared or vanished but what the save may add.
"""

from __future__ import annotations

import hashlib
import os
import stat


def tree_digest(root: str) -> dict[str, tuple[str, int, str]]:
    """``relative path -> (kind, size, sha256)`` of every entry under ``root``, links not followed.

    ``kind`` is ``file``, ``dir``, ``link`` (the target in place of a hash) or ``other``
    (FIFOs, sockets, devices: never opened, so a hostile tree cannot block the test).
    """
    out: dict[str, tuple[str, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", 0, "")
            elif stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                out[rel] = ("file", st.st_size, h.hexdigest())
            else:
                out[rel] = ("other", 0, "")
    return out
