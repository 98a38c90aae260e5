"""Where a checkpoint lives, resolved once: :func:`open_store` gives a :class:`Store` for a local folder (or
Hub snapshot) or an object-storage prefix, and every operation goes through it.

The checks, the planned reads and the save protocol of :mod:`..checkpoint` never look at
paths themselves and never ask "is this remote?": they open the location once and ask the
store for the manifest, an opened part (a :class:`StoredFile`), the names beside the parts,
the lock, and to put and remove files. A local folder is served by :mod:`.local` and
:mod:`.lock` (:class:`LocalStore`); ``s3://``, ``gs://`` and ``az://`` prefixes by
:mod:`.objects` (:class:`ObjectStore`). This is the one module that tells them apart.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from ..format.errors import ShardedStateError, listing
from ..format.manifest import FileEntry, Manifest
from ..format.names import MANIFEST_NAME, is_part_name
from . import local, lock, model_files, object_lock, objects
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


class Store(Protocol):
    """One checkpoint location, opened once (:func:`open_store`): what a backend implements.

    ``where`` names it in messages (a path or URL as given); ``remote`` says that each read is
    a request over the network (no mappings, no ``flock``, no rename: a save uploads).
    """

    where: str
    remote: bool

    def exists(self) -> bool:
        """Whether the location can be read as is (a local folder that exists; any object prefix)."""
        ...

    def canonical(self) -> str:
        """The location's full name (an absolute path, or the URL as given), for reports."""
        ...

    def file_path(self, name: str) -> str:
        """The path or URL of a file of the checkpoint, for opening or for a message."""
        ...

    def read_manifest(self) -> Manifest | None:
        """The checkpoint's manifest, or None when it has none."""
        ...

    def open_part(self, f: FileEntry) -> StoredFile:
        """Open a part the manifest lists: inside the checkpoint, present, with its recorded size."""
        ...

    def open_file(self, name: str) -> StoredFile:
        """Open any file of the location by name (a source model's weights): present, whatever its size."""
        ...

    def list_names(self) -> list[str]:
        """The names of the files beside the parts."""
        ...

    def non_weight_files(self) -> list[str]:
        """Relative paths of the files other than weights, manifest and lock (config, tokenizer)."""
        ...

    def read(self, name: str) -> bytes | Path:
        """A file's content: a local path to read, or the object's bytes."""
        ...

    def exists_file(self, name: str) -> bool:
        """Whether a file of that name is there."""
        ...

    def put(self, name: str, data: bytes | Path) -> None:
        """Write a file (parent folders as needed), replacing any of that name."""
        ...

    def remove(self, names: Iterable[str]) -> None:
        """Remove files; absent ones are not an error."""
        ...

    def is_locked(self) -> bool:
        """Whether a save holds the checkpoint (running or interrupted)."""
        ...

    def check_not_locked(self) -> None:
        """Refuse a checkpoint that a save holds (running or interrupted)."""
        ...

    def save_is_running(self) -> bool:
        """Whether a live save holds the lock now (its staged files are its own, not leftovers)."""
        ...

    def refuse_before_save(self, overwrite: bool) -> None:
        """Refuse what a save's lock would refuse here (a local path that is a file or a FIFO, a save
        holding it; a checkpoint, unless ``overwrite``), taking nothing: before a save starts work it
        would throw away."""
        ...

    def owner_is_alive(self, token: str) -> bool:
        """Whether a live process owns the staged files of ``token`` (an engine's start-up capture)."""
        ...

    def special_files(self) -> list[ShardedStateError]:
        """An error for each file that is no regular file (a FIFO, a device), found without opening
        it: vLLM opens a model's config and tokenizer plainly, and a FIFO would hang it."""
        ...


class LocalStore:
    """A local folder (or Hub snapshot): :mod:`.local` and :mod:`.lock`."""

    remote = False

    def __init__(self, directory: str) -> None:
        self.where = directory

    def exists(self) -> bool:
        return os.path.isdir(self.where)

    def canonical(self) -> str:
        return os.path.abspath(self.where)

    def file_path(self, name: str) -> str:
        return os.path.join(self.where, name)

    def read_manifest(self) -> Manifest | None:
        return local.read_manifest(self.where)

    def open_part(self, f: FileEntry) -> StoredFile:
        return local.open_part(self.where, f)

    def open_file(self, name: str) -> StoredFile:
        return local.OpenFile.open(os.path.join(self.where, name))

    def list_names(self) -> list[str]:
        return sorted(os.listdir(self.where))

    def non_weight_files(self) -> list[str]:
        return model_files.non_weight_files(self.where)

    def read(self, name: str) -> bytes | Path:
        return Path(os.path.join(self.where, name))

    def exists_file(self, name: str) -> bool:
        return os.path.lexists(os.path.join(self.where, name))

    def put(self, name: str, data: bytes | Path) -> None:
        path = os.path.join(self.where, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data if isinstance(data, bytes) else data.read_bytes())

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.where, name))

    def is_locked(self) -> bool:
        return lock.read_lock(self.where) is not None

    def check_not_locked(self) -> None:
        lock.check_not_locked(self.where)

    def save_is_running(self) -> bool:
        return lock.save_is_running(self.where)

    def refuse_before_save(self, overwrite: bool) -> None:
        lock.refuse_before_save(self.where, overwrite)

    def owner_is_alive(self, token: str) -> bool:
        return lock.owner_is_alive(self.where, token)

    def special_files(self) -> list[ShardedStateError]:
        return list(model_files.special_files(self.where))


class ObjectStore:
    """An ``s3://``, ``gs://`` or ``az://`` prefix: :mod:`.objects`, whose other operations (conditional
    puts, the lock object, multipart uploads) the object-storage save uses through :attr:`prefix`."""

    remote = True

    def __init__(self, url: str) -> None:
        self.where = url
        self.prefix = objects.ObjectPrefix.parse(url)

    def exists(self) -> bool:
        return True  # a prefix is where objects go; an empty one reads as holding no checkpoint

    def canonical(self) -> str:
        return self.where

    def file_path(self, name: str) -> str:
        return self.prefix.url(name)

    def read_manifest(self) -> Manifest | None:
        return objects.read_manifest(self.prefix)

    def open_part(self, f: FileEntry) -> StoredFile:
        return objects.open_part(self.prefix, f)

    def open_file(self, name: str) -> StoredFile:
        return objects.ObjectFile.open(self.prefix, name)

    def list_names(self) -> list[str]:
        return objects.list_names(self.prefix)

    def non_weight_files(self) -> list[str]:
        names = objects.list_tree(self.prefix)
        # (A checkpoint saved under the prefix is not the model's: carried, its files would be written
        # over another checkpoint's, recorded as this one's, and removed as stale by a later save.)
        modules = model_files.modules_in(self.read("modules.json")) if "modules.json" in names else set()
        pattern = model_files.own_part_pattern(self.read_manifest) if MANIFEST_NAME in names else None
        return model_files.carried_in_listing(names, modules, pattern)

    def read(self, name: str) -> bytes | Path:
        return objects.read_object(self.prefix, name)

    def exists_file(self, name: str) -> bool:
        return objects.head(self.prefix, name) is not None

    def head(self, name: str) -> dict[str, Any] | None:
        """The object's metadata (size, ETag, version), or None when absent."""
        return objects.head(self.prefix, name)

    def put(self, name: str, data: bytes | Path, *, create: bool = False, match: dict[str, Any] | None = None) -> None:
        objects.put(self.prefix, name, data, create=create, match=match)

    def remove(self, names: Iterable[str]) -> None:
        objects.delete(self.prefix, names)

    def is_locked(self) -> bool:
        return object_lock.read_lock(self.prefix) is not None

    def check_not_locked(self) -> None:
        object_lock.check_not_locked(self.prefix)

    def acquire_lock(self, token: str) -> None:
        """Hold the prefix for a save: a conditional put of the lock object."""
        object_lock.acquire_lock(self.prefix, token)

    def check_lock_holder(self, token: str) -> None:
        """Refuse to go on unless the lock object is still this save's (``token``)."""
        object_lock.check_lock_holder(self.prefix, token)

    def release_lock(self, token: str | None = None) -> None:
        """Delete the lock object (only if still ``token``'s, when given)."""
        object_lock.release_lock(self.prefix, token)

    def abort_incomplete_uploads(self, names: Iterable[str]) -> None:
        """Abort the unfinished multipart uploads of these names."""
        objects.abort_incomplete_uploads(self.prefix, names)

    def save_is_running(self) -> bool:
        return False  # no flock: a lock object is all there is, and the verifier reports what a save left

    def refuse_before_save(self, overwrite: bool) -> None:
        object_lock.refuse_before_save(self.prefix, overwrite)

    def refuse_a_checkpoint(self, overwrite: bool) -> None:
        """Refuse a prefix with a published manifest unless ``overwrite`` (a save's check under its lock)."""
        object_lock.refuse_a_checkpoint(self.prefix, overwrite)

    def owner_is_alive(self, token: str) -> bool:
        return False  # no engine captures into object storage: staged objects are a dead save's

    def special_files(self) -> list[ShardedStateError]:
        return []  # an object is bytes, whatever its name


def refuse_before_save(where: str, overwrite: bool) -> None:
    """:meth:`Store.refuse_before_save` of the checkpoint at ``where`` (a local folder or an object prefix)."""
    open_store(where).refuse_before_save(overwrite)


def check_no_special_files(where: str) -> None:
    """Refuse a model or checkpoint with a FIFO, device or socket among its files (:meth:`Store.special_files`),
    naming the first, before vLLM reads its config (which it opens plainly: a FIFO would hang it)."""
    for error in open_store(where).special_files():
        raise error


def open_store(where: str) -> Store:
    """Resolve a checkpoint location once: a local folder (or Hub snapshot) or an object-storage URL."""
    return ObjectStore(where) if is_object_url(where) else LocalStore(where)


def lies_inside(a: str, b: str) -> bool:
    """Whether the location ``a`` lies inside ``b`` (a subfolder, under any name; a longer prefix in
    the same bucket), not being ``b`` itself."""
    first, second = open_store(a), open_store(b)
    if isinstance(first, ObjectStore) and isinstance(second, ObjectStore):
        one, two = first.prefix, second.prefix
        same_bucket = (one.scheme, one.account, one.bucket) == (two.scheme, two.account, two.bucket)
        return same_bucket and one.prefix != two.prefix and one.prefix.startswith(two.prefix)
    if first.remote or second.remote:
        return False
    return os.path.realpath(a).startswith(os.path.join(os.path.realpath(b), ""))


def same_location(a: str, b: str) -> bool:
    """Whether two locations are one: the same URL, or the same local folder under any name (a
    symbolic link to it, a bind mount of it)."""
    first, second = open_store(a), open_store(b)
    if isinstance(first, ObjectStore) and isinstance(second, ObjectStore):
        # As parsed: "s3://b/x", "s3://b/x/" and "S3://b//x" are one prefix, which a save would write into.
        return first.prefix == second.prefix
    if first.remote or second.remote:
        return False
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    with contextlib.suppress(OSError):
        return os.path.samefile(a, b)
    return False


def file_path(where: str, name: str) -> str:
    """The path or URL of a file of the checkpoint, for opening or for a message."""
    return open_store(where).file_path(name)


def read_manifest(where: str) -> Manifest | None:
    """The checkpoint's manifest, or None when it has none."""
    return open_store(where).read_manifest()


def no_checkpoint_folder(where: str) -> str | None:
    """The message for a checkpoint named by a local path that is no folder (a path mistyped, a
    file, a FIFO, a link to nothing), or None (a folder, or an object-storage prefix)."""
    if open_store(where).remote or (why := local.not_a_folder(where)) is None:
        return None
    return (
        f"{where} {why}, where a checkpoint folder (the one that holds {MANIFEST_NAME}) was expected; check the path."
    )


def no_manifest_here(where: str) -> str:
    """What a location without a manifest holds instead, said as the error about it: no folder,
    vLLM's own save, a Hugging Face model (given where a checkpoint was expected: an easy slip), or
    nothing of ours."""
    if (why := no_checkpoint_folder(where)) is not None:
        return why
    names = list_names(where)
    parts = [n for n in names if is_part_name(n)]
    if parts:
        return (
            f"{where} has no {MANIFEST_NAME}, only parts named as vLLM's own save names them ({listing(parts, 2)}): "
            "a checkpoint of vLLM's save_sharded_state, which our loader serves at its saved size but cannot "
            "check or reshard; to do that, save it again with `vllm-sharded save`."
        )
    return (
        hugging_face_model_here(where, names)
        or f"{where} has no {MANIFEST_NAME}: not a checkpoint of vllm-sharded-loader (or an incomplete one)."
    )


def hugging_face_model_here(where: str, names: list[str]) -> str | None:
    """The sentence for a Hugging Face model (``names``: the files at ``where``) found where a sharded
    checkpoint was expected, with the command it needs; None if it holds none."""
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


def open_part(where: str, f: FileEntry) -> StoredFile:
    """Open a part the manifest lists: inside the checkpoint, present, with its recorded size."""
    return open_store(where).open_part(f)


def check_not_locked(where: str) -> None:
    """Refuse a checkpoint that a save holds (running or interrupted)."""
    open_store(where).check_not_locked()


def list_names(where: str) -> list[str]:
    """The names of the files beside the parts (for reports of files the manifest does not list)."""
    return open_store(where).list_names()


def is_locked(where: str) -> bool:
    """Whether a save holds the checkpoint (running or interrupted)."""
    return open_store(where).is_locked()


def non_weight_files(where: str) -> list[str]:
    """Relative paths of the checkpoint's (or source model's) files other than weights, manifest and lock."""
    return open_store(where).non_weight_files()


def copy_non_weight_files(source: str, output: str) -> list[str]:
    """Copy :func:`non_weight_files` between any two locations (local folders, object prefixes)."""
    src, dst = open_store(source), open_store(output)
    if not src.remote and not dst.remote:
        return model_files.copy_non_weight_files(source, output)
    names = src.non_weight_files()
    for name in names:
        dst.put(name, src.read(name))
    return names
