"""A checkpoint laid out in a Hugging Face Hub cache, as ``huggingface_hub`` lays it out: content in
``blobs/``, a snapshot of symlinks per commit, ``refs/main`` naming the commit.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO = "acme/tiny-sharded"
# Set with HF_HUB_CACHE by tests/conftest.py to the session's own Hub cache folder.
HUB_CACHE_MARK = "VSL_TEST_HUB_CACHE"


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def session_cache() -> Path:
    """The test session's Hub cache (``HF_HUB_CACHE``, a temporary folder of its own): a repository
    laid out there is served by an engine without a setting of its own."""
    return Path(os.environ[HUB_CACHE_MARK])


def repo_folder(repo_id: str) -> str:
    """The folder of ``repo_id`` in a Hub cache, as huggingface_hub names it."""
    return f"models--{repo_id.replace('/', '--')}"


def lay_out_cache(checkpoint: Path, cache: Path, leave_out: set[str] = frozenset(), repo_id: str = REPO) -> Path:
    """Put a checkpoint into a Hub cache as ``repo_id`` (not there yet); files in ``leave_out`` are
    dangling links (never fetched)."""
    repo = cache / repo_folder(repo_id)
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
