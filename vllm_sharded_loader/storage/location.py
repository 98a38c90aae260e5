"""Where a checkpoint lives, resolved once: :func:`open_store` gives the :class:`Store` of a local
folder or Hub snapshot, or of an object-storage prefix, and every operation goes through that value.
:class:`Store` is what a backend implements."""

from __future__ import annotations

import os
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from ..format.errors import ShardedStateError, listing
from ..format.manifest import CarriedFile, FileEntry, Manifest, RankEntry
from ..format.names import MANIFEST_NAME, is_part_name
from . import in_memory
from .folder import LocalStore
from .object_store import ObjectStore
from .staged import StagedRank


class ByteStream(Protocol):
    """One reader thread's way into an opened file (:class:`.local.FileStream`, or the object itself)."""

    def readv(self, views: list[memoryview], offset: int) -> None: ...
    def close(self) -> None: ...


class StoredFile(Protocol):
    """A part file opened once: ``mappable`` if the reader may map its bytes, ``remote`` if each read
    is a network request (the reader then runs more at once)."""

    path: str
    size: int
    mappable: bool
    remote: bool

    def stream(self) -> ByteStream: ...
    def read_at(self, offset: int, length: int) -> bytes: ...
    def check_unchanged(self) -> None: ...
    def close(self) -> None: ...


class Store(Protocol):
    """One checkpoint location, opened once: what a backend implements. A store runs one save at a
    time (its lock, token and staged files are its own until :meth:`close`)."""

    where: str  # the location as given, for messages
    token: str  # the running save's (set by lock or join): its staged names and records carry it
    stages_in_place: bool  # parts staged in the location and renamed into place (else staged aside and copied)
    abandoned: str  # what an abandoned save leaves, for messages
    vllm_saves_here: bool  # whether vLLM's own save (no manifest) may have written here

    # Reading (``contained``: refuse a file resolving out of the location; ``read``: a local path or bytes).
    def exists(self) -> bool: ...
    def missing(self) -> str | None: ...
    def canonical(self) -> str: ...
    def file_path(self, name: str) -> str: ...
    def read_manifest(self) -> Manifest | None: ...
    def open_part(self, f: FileEntry) -> StoredFile: ...
    def open_file(self, name: str, contained: bool = False) -> StoredFile: ...
    def list_names(self) -> list[str]: ...
    def non_weight_files(self) -> list[str]: ...
    def read(self, name: str) -> bytes | Path: ...
    def exists_file(self, name: str) -> bool: ...
    def special_files(self) -> list[ShardedStateError]: ...
    def links_out(self, names: Iterable[str]) -> list[ShardedStateError]: ...
    def same_as(self, other: Store) -> bool: ...
    def inside(self, other: Store) -> bool: ...

    # The lock as loads and checks see it (``save_is_running``: None where it cannot be told).
    def is_locked(self) -> bool: ...
    def check_not_locked(self) -> None: ...
    def save_is_running(self) -> bool | None: ...
    def describe_lock(self) -> str | None: ...
    def owner_is_alive(self, token: str) -> bool: ...
    def refuse_before_save(self, overwrite: bool) -> None: ...

    def put(self, name: str, data: bytes | Path) -> None: ...
    def remove(self, names: Iterable[str]) -> None: ...

    # The save's steps (:mod:`..checkpoint.protocol`: ``join`` says whether this member sees the lock).
    def lock(self, token: str, overwrite: bool, patterns: tuple[str, ...]) -> None: ...
    def join(self, token: str) -> bool: ...
    def staging(self) -> str: ...
    def place(self, staged: StagedRank) -> RankEntry: ...
    def write_rank_file(self, name: str, data: bytes) -> str: ...
    def publish(self, manifest: Manifest) -> None: ...
    def clean(self, manifest: Manifest) -> None: ...
    def release(self) -> None: ...
    def abandon(self, entries: Iterable[RankEntry]) -> None: ...
    def close(self) -> None: ...

    # The carried files (``stage_carried``: the record, and whether it replaces one; None: same there).
    def stage_carried(self, index: int, name: str, data: bytes | Path) -> tuple[CarriedFile, bool | None]: ...
    def restore_carried(self) -> None: ...
    def finish_carried(self) -> None: ...
    def remove_stale(self, names: Iterable[str]) -> None: ...

    # Before an engine starts (it forks later): ``names`` in a local folder, and where workers capture a save.
    def local_copy(self, names: list[str], folder: str) -> Store: ...
    def capture_folder(self, source: str, overwrite: bool) -> AbstractContextManager[str]: ...


# Backends served by obstore beyond the clouds': each registers its URL scheme's client on import.
OBJECT_BACKENDS = (in_memory,)


def open_store(where: str | Store) -> Store:
    """Resolve a checkpoint location once: a local folder (or Hub snapshot) or an object-storage URL
    (a store is returned as it is)."""
    if not isinstance(where, str):
        return where
    return ObjectStore(where) if ObjectStore.accepts(where) else LocalStore(where)


def require_store(store: object, what: str) -> None:
    """Refuse a path or URL given where a resolved store is expected, saying how to resolve it."""
    if isinstance(store, (str, os.PathLike)):
        raise TypeError(f"{what} takes a store, not the location {str(store)!r}: pass open_store({str(store)!r}).")


def read_manifest(where: str | Store) -> Manifest | None:
    """The manifest of the checkpoint at ``where`` (a folder, URL or store), or None (vLLM's own save)."""
    return open_store(where).read_manifest()


def check_no_special_files(store: Store) -> None:
    """Refuse a model or checkpoint with a FIFO, device or socket among its files, naming the first."""
    for error in store.special_files():
        raise error


def no_manifest_here(store: Store) -> str:
    """What a location without a manifest holds instead, said as the error about it."""
    why = store.missing()
    if why is not None:
        return (
            f"{store.where} {why}, where a checkpoint folder (the one that holds {MANIFEST_NAME}) was expected; "
            "check the path."
        )
    names = store.list_names()
    parts = [n for n in names if is_part_name(n)]
    if parts:
        return (
            f"{store.where} has no {MANIFEST_NAME}, only parts named as vLLM's own save names them "
            f"({listing(parts, 2)}): a checkpoint of vLLM's save_sharded_state, which our loader serves at its "
            "saved size but cannot check or reshard; to do that, save it again with `vllm-sharded save`."
        )
    return (
        hugging_face_model_here(store.where, names)
        or f"{store.where} has no {MANIFEST_NAME}: not a checkpoint of vllm-sharded-loader (or an incomplete one)."
    )


def hugging_face_model_here(where: str, names: list[str]) -> str | None:
    """The sentence for a Hugging Face model found where a checkpoint was expected; None if none is there."""
    weights = [n for n in names if n.endswith((".safetensors", ".bin", ".pt", ".pth"))]
    if not weights or "config.json" not in names:
        return None
    how = (
        f"convert it with `vllm-sharded convert {where} -tp N -o OUT`"
        if any(n.endswith(".safetensors") for n in weights)
        else "save it with `vllm-sharded save` (convert reads safetensors only)"
    )
    return (
        f"{where} holds a Hugging Face model ({listing(weights, 2)}), not a sharded checkpoint (no "
        f"{MANIFEST_NAME}): {how}, or serve it as it is with vLLM's default load format."
    )
