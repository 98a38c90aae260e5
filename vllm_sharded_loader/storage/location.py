"""Where a checkpoint lives, behind one interface: a local folder (or Hub snapshot) or an object-storage prefix.

The checks and the planned reads of :mod:`..checkpoint` never look at paths
themselves: they ask this module for the manifest, for an opened part (a
:class:`StoredFile`), for the lock, and for the names beside the parts. A local folder
is served by :mod:`.local` and :mod:`.lock`; ``s3://``, ``gs://`` and ``az://`` prefixes by :mod:`.objects`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from ..format.manifest import FileEntry, Manifest
from ..format.names import is_staged_name
from . import local, lock, objects
from .objects import is_object_url


class ByteStream(Protocol):
    """One reader thread's way into an opened file (:class:`.local.FileStream`, or the object itself)."""

    def readv(self, views: list[memoryview], offset: int) -> None: ...
    def close(self) -> None: ...


class StoredFile(Protocol):
    """A part file opened once (:class:`.local.OpenFile`, :class:`.objects.ObjectFile`).

    ``path`` names it in messages; every read goes through the object; ``mappable``
    says whether the reader may map its bytes instead of reading them, ``remote`` whether
    each read is a request over the network (the reader then runs more of them at once).
    """

    path: str
    size: int
    mappable: bool
    remote: bool

    def stream(self) -> ByteStream: ...
    def read_at(self, offset: int, length: int) -> bytes: ...
    def check_unchanged(self) -> None: ...
    def close(self) -> None: ...


def is_remote(where: str) -> bool:
    """Whether the checkpoint is in object storage (no local files, no mappings, no flock)."""
    return is_object_url(where)


def file_path(where: str, name: str) -> str:
    """The path or URL of a file of the checkpoint, for opening or for a message."""
    return objects.ObjectPrefix.parse(where).url(name) if is_remote(where) else os.path.join(where, name)


def read_manifest(where: str) -> Manifest | None:
    """The checkpoint's manifest, or None when it has none."""
    return objects.read_manifest(objects.ObjectPrefix.parse(where)) if is_remote(where) else local.read_manifest(where)


def open_part(where: str, f: FileEntry) -> StoredFile:
    """Open a part the manifest lists: inside the checkpoint, present, with its recorded size."""
    return objects.open_part(objects.ObjectPrefix.parse(where), f) if is_remote(where) else local.open_part(where, f)


def check_not_locked(where: str) -> None:
    """Refuse a checkpoint that a save holds (running or interrupted)."""
    if is_remote(where):
        objects.check_not_locked(objects.ObjectPrefix.parse(where))
    else:
        lock.check_not_locked(where)


def list_names(where: str) -> list[str]:
    """The names of the files beside the parts (for reports of files the manifest does not list)."""
    return objects.list_names(objects.ObjectPrefix.parse(where)) if is_remote(where) else sorted(os.listdir(where))


def is_locked(where: str) -> bool:
    """Whether a save holds the checkpoint (running or interrupted)."""
    if is_remote(where):
        return objects.read_lock(objects.ObjectPrefix.parse(where)) is not None
    return lock.read_lock(where) is not None


def non_weight_files(where: str) -> list[str]:
    """Relative paths of the checkpoint's (or source model's) files other than weights, manifest and lock."""
    if not is_remote(where):
        return local.non_weight_files(where)
    names = objects.list_tree(objects.ObjectPrefix.parse(where))
    return [n for n in names if not any(local.is_weight_file(part) or is_staged_name(part) for part in n.split("/"))]


def copy_non_weight_files(source: str, output: str) -> list[str]:
    """Copy :func:`non_weight_files` between any two locations (local folders, object prefixes)."""
    if not is_remote(source) and not is_remote(output):
        return local.copy_non_weight_files(source, output)
    names = non_weight_files(source)
    for name in names:
        if is_remote(source):
            data: bytes | Path = objects.read_object(objects.ObjectPrefix.parse(source), name)
        else:
            data = Path(os.path.join(source, name))
        if is_remote(output):
            objects.put(objects.ObjectPrefix.parse(output), name, data)
        else:
            path = os.path.join(output, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data if isinstance(data, bytes) else data.read_bytes())
    return names
