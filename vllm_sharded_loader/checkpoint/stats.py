"""What a load did, and the verification modes it accepts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..format.errors import InvalidOption
from ..storage.reader import ReadStats

VERIFY_MODES = ("size", "checksum")


@dataclass(frozen=True)
class LoadStats:
    """What :func:`load_rank` did, for the log line and for tests."""

    files: tuple[str, ...]
    tensors: int
    bytes_read: int
    seconds: float
    cast: tuple[str, ...]
    with_manifest: bool
    # (tp_size, pp_size) the checkpoint was saved at, when this load resharded it.
    resharded_from: tuple[int, int] | None = None
    checkpoint_bytes: int = 0
    threads: int = 1
    bytes_mapped: int = 0  # of bytes_read, served from file mappings instead of copied


def check_verify_mode(verify: str) -> str:
    if verify not in VERIFY_MODES:
        raise InvalidOption(
            f"verify={verify!r} is not a verification mode; use 'size' (the default: manifest, file sizes "
            "and headers) or 'checksum' (also the checksum of every byte read)."
        )
    return verify


def whole_file_stats(
    paths: Sequence[str], tensors: int, read: ReadStats, started: float, cast: Sequence[str], with_manifest: bool
) -> LoadStats:
    """The stats of a load that read whole files (same topology, with or without a manifest)."""
    return LoadStats(
        files=tuple(paths),
        tensors=tensors,
        bytes_read=read.bytes_read,
        seconds=time.perf_counter() - started,
        cast=tuple(cast),
        with_manifest=with_manifest,
        threads=read.threads,
        bytes_mapped=read.bytes_mapped,
    )
