"""The entries of a manifest: one rank's files and tensors, a file's checksums, and the files
a save carries beside its parts (:mod:`.manifest` holds the manifest that lists them)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

# Optional part metadata: the rank (two ranks' headers can be identical), the bytes' digest (stale copies).
RANK_METADATA = "sharded_state_rank"
DIGEST_METADATA = "sharded_state_digest"
DIGEST_DIGITS = 32


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of one rank lives: its part file, dtype, shape and absolute byte offset
    (optional; with it a resharding reader plans reads without headers)."""

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
    """One part file: its exact byte size and, if recorded, its block checksums and the digest its
    header holds (:data:`DIGEST_METADATA`)."""

    name: str
    size: int
    checksum: FileChecksum | None = None
    digest: str | None = None


@dataclass(frozen=True)
class StartupArtifacts:
    """One rank's start-up (compile) artifacts: an archive, its SHA-256, and the key that says where
    they are valid (versions, compile settings, vLLM's cache key, topology, rank, device)."""

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
    """What one (pp_rank, tp_rank) worker wrote; ``dp_rank`` is 0 unless each data-parallel replica
    wrote its own experts."""

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
