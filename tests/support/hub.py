"""A checkpoint laid out in a Hugging Face Hub cache, as ``huggingface_hub`` lays it out: content in
``blobs/``, a snapshot of symlinks per commit, ``refs/main`` naming the commit.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO = "acme/tiny-sharded"


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_cache(checkpoint: Path, cache: Path, leave_out: set[str] = frozenset()) -> Path:
    """Put a checkpoint into a Hub cache; files in ``leave_out`` are dangling links (never fetched)."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in sorted(checkpoint.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if f.name not in leave_out:
            blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    return snapshot
