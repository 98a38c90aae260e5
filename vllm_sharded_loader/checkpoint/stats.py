"""What a load did, and the options a load accepts (the loader's ``model_loader_extra_config``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..format.errors import InvalidOption
from ..storage.reader import DEFAULT_THREADS, ReadStats

VERIFY_MODES = ("size", "checksum")
EXTRA_CONFIG_KEYS = frozenset({"pattern", "verify", "threads", "huge_pages", "mmap"})


@dataclass(frozen=True)
class LoadStats:
    """What :func:`load_rank` did, for the log line and for tests."""

    files: tuple[str, ...]
    tensors: int
    bytes_read: int
    seconds: float
    cast: tuple[str, ...]
    with_manifest: bool
    resharded_from: tuple[int, int] | None = None
    checkpoint_bytes: int = 0
    threads: int = 1
    bytes_mapped: int = 0  # of bytes_read, served from file mappings instead of copied


@dataclass(frozen=True)
class LoaderOptions:
    """The ``sharded_state`` loader's read options: ``pattern`` of a manifest-less checkpoint's parts,
    ``verify`` mode, reader ``threads``, ``huge_pages`` on the parameters, and ``mmap`` (serve CPU
    parameters from the files; ``"auto"``: but those vLLM's CPU post-processing repacks).
    """

    pattern: str | None = None
    verify: str = "size"
    threads: int = DEFAULT_THREADS
    huge_pages: bool = False
    mmap: bool | str = True

    @classmethod
    def parse(cls, extra: Any) -> LoaderOptions:
        """The options ``extra`` (vLLM's ``model_loader_extra_config``) asks for, each checked."""
        if not isinstance(extra, dict):
            raise InvalidOption(
                f"model_loader_extra_config for sharded_state must be a dict, got {type(extra).__name__}."
            )
        unknown = set(extra) - EXTRA_CONFIG_KEYS
        if unknown:
            raise InvalidOption(
                f"Unexpected model_loader_extra_config keys {sorted(unknown)} for load format "
                f"sharded_state; supported keys: {sorted(EXTRA_CONFIG_KEYS)}."
            )
        threads = extra.get("threads", DEFAULT_THREADS)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise InvalidOption(
                f"model_loader_extra_config threads={threads!r} for sharded_state must be a positive integer."
            )
        huge_pages = extra.get("huge_pages", False)
        if not isinstance(huge_pages, bool):
            raise InvalidOption(
                f"model_loader_extra_config huge_pages={huge_pages!r} for sharded_state must be true or false."
            )
        mmap = extra.get("mmap", True)
        if not isinstance(mmap, bool) and mmap != "auto":
            raise InvalidOption(
                f'model_loader_extra_config mmap={mmap!r} for sharded_state must be true, false or "auto".'
            )
        return cls(extra.get("pattern"), check_verify_mode(extra.get("verify", "size")), threads, huge_pages, mmap)


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
