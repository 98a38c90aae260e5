"""The files a save carries beside its parts (config, tokenizer, ...), replaced last.

A load refuses a config that differs from the manifest's record, so the old checkpoint's files
must not be replaced before the new manifest: they follow the save protocol (stage, put in place
just before the manifest, restore on failure, remove the stale ones after). Each file is recorded
with its size and SHA-256, so that ``verify`` tells a damaged tokenizer (:func:`check_carried`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..format.errors import (
    CheckpointCorrupt,
    CheckpointMismatch,
    CheckpointNotFound,
    SaveRefused,
    ShardedStateError,
)
from ..format.manifest import MAX_CARRIED_FILES, CarriedFile, Manifest
from ..format.names import check_carried_name
from ..storage.local import open_regular
from ..storage.location import Store
from ..storage.model_files import is_weight_file


def record_of(directory: str, name: str) -> dict[str, CarriedFile]:
    """``{name: its record}`` for the local file ``directory/name`` as it is now (empty without one)."""
    try:
        with os.fdopen(open_regular(os.path.join(directory, name)), "rb") as f:
            return {name: CarriedFile.of(f.read())}
    except FileNotFoundError:
        return {}


def check_carry_source(source: Store | None) -> None:
    """Refuse a carry ``source`` that is no folder, before the save's lock rather than after every
    part is written. None: no carry."""
    why = None if source is None else source.missing()
    if why is not None:
        raise SaveRefused(
            f"{source.where} {why}, where the model folder whose config and tokenizer the save carries was "  # type: ignore[union-attr]
            "expected; nothing was written. Give the model's folder (or none), and save again."
        )


def _check_recordable(source: str, names: list[str]) -> None:
    """Refuse non-weight files whose names a manifest cannot record: no load could read it back."""
    if len(names) > MAX_CARRIED_FILES:
        raise SaveRefused(
            f"{source} has {len(names)} non-weight files, more than a checkpoint's manifest records "
            f"({MAX_CARRIED_FILES}); nothing was written. Remove what the model does not need, and save again."
        )
    for name in names:
        try:
            check_carried_name(name, source)
        except CheckpointCorrupt:
            raise SaveRefused(
                f"{source}: its non-weight file {name!r} has a name that a checkpoint's manifest cannot record (a "
                "backslash, or an empty, '.' or '..' part), and a checkpoint listing it could not be read; nothing "
                "was written. Rename or remove it, and save again."
            ) from None


@dataclass
class CarriedFiles:
    """The non-weight files of one save into ``store``."""

    store: Store
    #: Whether a different file already at the output may be replaced (else it is the user's: refused).
    replace: bool = True
    #: final relative name -> the size and SHA-256 the output holds once placed (staged or left as is)
    recorded: dict[str, CarriedFile] = field(default_factory=dict)
    #: what the replaced checkpoint carried and the source no longer has, removed after the publish
    stale: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        """The output, as the save's messages name it."""
        return self.store.canonical()

    def stage(self, source: Store, record: Mapping[str, CarriedFile] | None = None) -> list[str]:
        """Copy ``source``'s non-weight files aside; returns the names that will change. A file that
        differs from ``record`` (what the source must hold) is refused: the source changed since."""
        names = source.non_weight_files()
        _check_recordable(source.where, names)
        replaces: dict[str, bool | None] = {}
        try:
            for index, name in enumerate(names):
                self.recorded[name], replaces[name] = self.store.stage_carried(index, name, source.read(name))
        except OSError as e:  # a full disk, a permission: the save stops before its manifest
            self.restore()
            raise SaveRefused(
                f"copying the non-weight files of {source.where} to {self.output} failed: {e}. Nothing was replaced; "
                "free space or fix the permission, and save again."
            ) from e
        except BaseException:
            self.restore()
            raise
        staged = sorted(n for n, there in replaces.items() if there is not None)
        taken = [] if self.replace else [name for name in staged if replaces[name]]
        if taken:
            self.restore()
            raise SaveRefused(
                f"{self.output} holds files that differ from {source.where}'s and are no checkpoint's: "
                f"{', '.join(taken)}; refusing to replace them, nothing was written. Choose another output, "
                "remove them, or ask for overwrite (--overwrite, or SHARDED_STATE_OVERWRITE=1 for the save hook)."
            )
        changed = sorted(n for n, r in (record or {}).items() if self.recorded.get(n) != r)
        if changed:
            self.restore()
            raise CheckpointCorrupt(
                f"{source.where}: {', '.join(changed)} no longer as its manifest records, or as it was read before "
                f"the save (changed since: another save into it, or an edit?); nothing was written to {self.output}. "
                "Try again once it is done."
            )
        self.stale = self._stale(names)
        return staged

    def _stale(self, names: list[str]) -> list[str]:
        """What the replaced checkpoint carried (or left stale) that ``names`` lack, and is still
        there: it would otherwise be served with the new weights."""
        try:
            previous = self.store.read_manifest()
        except (CheckpointCorrupt, CheckpointMismatch, CheckpointNotFound):  # unreadable: what it carried is unknown
            return []
        if previous is None:
            return []
        candidates = set(previous.carried_files or ()) | set(previous.stale_files)
        stale = sorted(n for n in candidates - set(names) if self.store.exists_file(n))
        return stale[:MAX_CARRIED_FILES]  # (what a manifest records)

    def remove_stale(self, manifest: Manifest) -> None:
        """After the publish: remove ``manifest``'s stale files (see :func:`stale_names`)."""
        self.store.remove_stale(stale_names(manifest))

    def restore(self) -> None:
        """After a failure before the publish: the old files back, the staged copies gone. Best effort."""
        self.store.restore_carried()

    def finish(self) -> None:
        """After the publish: the backups go (the save's cleanup removes any a kill left)."""
        self.store.finish_carried()


#: How much of a carried file one read takes while it is hashed (one GET in object storage).
CHECK_CHUNK_BYTES = 16 * 1024 * 1024


def check_carried(store: Store, name: str, record: CarriedFile, hashed: bool = True) -> None:
    """Refuse a carried file that is not what its save recorded: missing, a link out of the
    checkpoint, no regular file, another size or, when ``hashed``, another SHA-256."""
    path = store.file_path(name)
    recorded = f"{record.size} bytes, SHA-256 {record.sha256[:16]}..."
    remedy = (
        "Restore it from the model the checkpoint was saved from (or copy the checkpoint again), "
        "or save the checkpoint again."
    )
    try:
        # Containment first: a link out of the checkpoint is never opened.
        file = store.open_file(name, contained=True)
    except (CheckpointNotFound, FileNotFoundError):
        raise CheckpointNotFound(
            f"{path}: missing, but the save carried it ({recorded}) and a server of this checkpoint reads it. {remedy}"
        ) from None
    except CheckpointCorrupt as e:  # a FIFO, a device, a folder, a link out of the checkpoint
        raise CheckpointCorrupt(f"{e} The save carried a regular file there ({recorded}).") from None
    except OSError as e:
        raise CheckpointCorrupt(f"{path}: cannot be read ({e}); the save carried it ({recorded}). {remedy}") from e
    try:
        if file.size != record.size:
            raise CheckpointCorrupt(
                f"{path}: {file.size} bytes, but the save recorded {recorded}: the file is truncated or was "
                f"replaced after the save. {remedy}"
            )
        if not hashed:
            return
        digest, position = hashlib.sha256(), 0
        while position < record.size and (chunk := file.read_at(position, CHECK_CHUNK_BYTES)):
            digest.update(chunk)
            position += len(chunk)
        found = f"{position} bytes read" if position != record.size else f"SHA-256 {digest.hexdigest()[:16]}..."
        if position != record.size or digest.hexdigest() != record.sha256:
            raise CheckpointCorrupt(
                f"{path}: {found}, but the save recorded {recorded}: the file was modified after the save. {remedy}"
            )
    finally:
        file.close()


def stale_names(manifest: Manifest) -> list[str]:
    """``manifest``'s stale files that a save may remove: never a listed, carried or weight file,
    whatever a damaged or hostile record says."""
    keep = manifest.listed_files() | set(manifest.carried_files or ())
    return [n for n in manifest.stale_files if n not in keep and not any(map(is_weight_file, n.split("/")))]


def stale_left(store: Store, manifest: Manifest) -> list[str]:
    """``manifest``'s stale files still in the checkpoint (its save stopped before the clean-up)."""
    return [name for name in stale_names(manifest) if store.exists_file(name)]


def stale_problems(store: Store, manifest: Manifest) -> list[str]:
    """A problem for each of :func:`stale_left`, naming it and what to do (``verify``, ``reshard``)."""
    return [
        f"{store.file_path(name)}: carried by the checkpoint this one replaced and not by this one; the save "
        "that replaced it stopped before removing it, and a server of this checkpoint would read it. Remove it, "
        "or save again with overwrite (which removes it)."
        for name in stale_left(store, manifest)
    ]


def carried_problems(store: Store, carried_files: dict[str, CarriedFile], hashed: bool = True) -> list[str]:
    """A problem for each recorded carried file that fails :func:`check_carried`."""
    problems = []
    for name, record in sorted(carried_files.items()):
        try:
            check_carried(store, name, record, hashed)
        except ShardedStateError as e:
            problems.append(str(e))
    return problems
