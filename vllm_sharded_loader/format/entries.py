"""The entries of a manifest: one rank's files and tensors, a file's checksums, and the files
a save carries beside its parts (:mod:`.manifest` holds the manifest that lists them)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

# The key, in each part's safetensors metadata, of the rank whose slice the part holds (RankEntry.label).
# Two ranks' parts hold the same tensors, shapes and offsets: renamed or copied over each other, only
# their bytes (a checksum) or this tells them apart. Parts written before it have none.
RANK_METADATA = "sharded_state_rank"
# The key, in each part's safetensors metadata, of the digest of the part's contents (FileEntry.digest):
# a part of an older save of the same model and rank (a stale copy) has the same header but for this.
# The writer fills it once the data is written (storage/writer.py), so it depends on the bytes alone and
# two saves of the same weights stay byte for byte the same. Parts written before it have none.
DIGEST_METADATA = "sharded_state_digest"
DIGEST_DIGITS = 32


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of one rank lives: its part file, dtype, shape and byte offset.

    ``offset`` is the absolute position of its first byte in the file (None in manifests
    that did not record it); with it a resharding reader plans reads without headers.
    """

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int | None = None


@dataclass(frozen=True)
class FileChecksum:
    """Digests of consecutive ``block_size`` blocks of one file (the last may be short)."""

    algorithm: str
    block_size: int
    blocks: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"algorithm": self.algorithm, "block_size": self.block_size, "blocks": list(self.blocks)}


@dataclass(frozen=True)
class FileEntry:
    """One part file, its exact byte size and, if recorded, its block checksums and the digest of its
    contents that its header holds (``digest``, as :data:`DIGEST_METADATA`; older manifests have none)."""

    name: str
    size: int
    checksum: FileChecksum | None = None
    digest: str | None = None


@dataclass(frozen=True)
class StartupArtifacts:
    """One rank's start-up (compile) artifacts carried beside its parts: one archive file, its
    SHA-256, and the key that says where they are valid (versions, compile settings and
    vLLM's own cache key, topology, rank, device). See :mod:`..checkpoint.startup_artifacts`."""

    file: str
    size: int
    sha256: str
    key: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {"file": self.file, "size": self.size, "sha256": self.sha256, "key": dict(self.key)}


@dataclass(frozen=True)
class CarriedFile:
    """One non-weight file a save carried beside its parts (config, tokenizer): its size and SHA-256."""

    size: int
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> CarriedFile:
        """The record of a file holding ``data``."""
        return cls(len(data), hashlib.sha256(data).hexdigest())

    def to_dict(self) -> dict[str, object]:
        return {"size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class RankEntry:
    """What one (pp_rank, tp_rank) worker wrote.

    ``dp_rank`` is the data-parallel replica, 0 unless each replica wrote its own experts
    (:attr:`Manifest.replicas`); a later replica's entry holds only its expert tensors.
    ``startup`` is the rank's start-up artifacts, if the save carried them (optional: older
    manifests have none).
    """

    tp_rank: int
    pp_rank: int
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorEntry]
    dp_rank: int = 0
    startup: StartupArtifacts | None = None

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def label(self) -> str:
        """The rank, as its parts' metadata name it (:data:`RANK_METADATA`): ``tp1-pp0``, ``tp0-pp0-dp1``."""
        return f"tp{self.tp_rank}-pp{self.pp_rank}" + (f"-dp{self.dp_rank}" if self.dp_rank else "")


def rank_to_dict(entry: RankEntry) -> dict[str, Any]:
    """JSON data of one rank's entry."""
    return {
        "tp_rank": entry.tp_rank,
        "pp_rank": entry.pp_rank,
        **({"dp_rank": entry.dp_rank} if entry.dp_rank else {}),
        "files": [file_to_dict(f) for f in entry.files],
        "tensors": {
            name: {"file": t.file, "dtype": t.dtype, "shape": list(t.shape)}
            | ({} if t.offset is None else {"offset": t.offset})
            for name, t in entry.tensors.items()
        },
        **({"startup_artifacts": entry.startup.to_dict()} if entry.startup is not None else {}),
    }


def file_to_dict(f: FileEntry) -> dict[str, Any]:
    data: dict[str, Any] = {"name": f.name, "size": f.size}
    if f.checksum is not None:
        data["checksum"] = f.checksum.to_dict()
    if f.digest is not None:
        data["digest"] = f.digest
    return data
