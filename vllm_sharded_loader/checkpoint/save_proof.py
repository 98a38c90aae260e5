"""What proves that a save re-reading the served model's source reads what is served: a sharded
checkpoint's manifest digest, or a model folder's weight file identities.
"""

from __future__ import annotations

import errno
import hashlib
import os

from ..format.errors import SaveRefused
from ..format.manifest import Manifest

# Where each worker of an engine writes its loaded state at start-up (engine/capture.py).
CAPTURE_DIR_ENV = "SHARDED_STATE_CAPTURE_DIR"


def manifest_proof(manifest: Manifest | None) -> str | None:
    """The digest of a manifest whose every file has block checksums, or None."""
    if manifest is None or any(f.checksum is None for entry in manifest.ranks for f in entry.files):
        return None
    return hashlib.sha256(manifest.to_json().encode()).hexdigest()


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def weight_file_identities(folder: str | None) -> dict[str, tuple[int, ...]] | None:
    """Each weight file's identity in a local model folder (what vLLM's default loader reads), or None."""
    if folder is None or not os.path.isdir(folder):
        return None
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(WEIGHT_SUFFIXES):
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError as e:
                # A dangling link: its own identity tells a later fix of it.
                if e.errno not in (errno.ENOENT, errno.ELOOP):
                    raise
                try:
                    st = os.lstat(path)
                except FileNotFoundError:  # removed since the listing: not there
                    continue
            found[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return found


def check_source_files_unchanged(folder: str | None, loaded: dict[str, tuple[int, ...]] | None) -> None:
    """Refuse to save from ``folder`` if a weight file changed since ``loaded`` was taken (None: no check)."""
    if loaded is None:
        return
    now = weight_file_identities(folder)
    if now != loaded:
        changed = sorted(n for n in (now or {}).keys() | loaded.keys() if (now or {}).get(n) != loaded.get(n))
        raise SaveRefused(
            f"Refusing to save: {folder} was written after the served weights were loaded from it "
            f"({', '.join(changed[:3])} changed): reading it again would not give what is served. Start an engine "
            f"with {CAPTURE_DIR_ENV}=<dir> so that its start-up capture is saved, or save before the folder changes."
        )


def check_still_read_from(checkpoint: str, proof: str | None, manifest: Manifest | None) -> None:
    """Refuse to save from ``checkpoint`` unless its manifest is still the one the served weights were read with."""
    how = (
        "Save right after the update, before anything writes to that folder again (or update from a folder "
        "that is never rewritten, such as one per step), or start an engine with "
        f"{CAPTURE_DIR_ENV}=<dir> so that its start-up capture is saved."
    )
    if proof is None:
        raise SaveRefused(
            f"Refusing to save: the served weights were read from {checkpoint}, whose manifest records no checksum "
            f"for every file, so reading it again cannot be proven to give what is served. {how}"
        )
    now = manifest_proof(manifest)
    if now != proof:
        raise SaveRefused(
            f"Refusing to save: {checkpoint} was rewritten after the served weights were read from it (its "
            f"{'manifest is gone' if manifest is None else 'manifest differs'}): it no longer holds what is "
            f"served, and a save would publish other weights under this engine's name. {how}"
        )
