"""A rank's saved files: every check against the manifest before a byte is read (:func:`check_rank_file`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from ..format.entries import DIGEST_METADATA, RANK_METADATA
from ..format.errors import CheckpointCorrupt, CheckpointMismatch
from ..format.manifest import FileEntry, Manifest, RankEntry
from ..format.names import MANIFEST_NAME
from ..format.safetensors import Header
from ..planning.tensors import TensorSpec
from ..storage.local import read_header
from ..storage.location import Store, StoredFile


@dataclass
class CheckedFile:
    """A part file opened once and checked against the manifest, with its validated header."""

    entry: FileEntry
    file: StoredFile
    header: Header


def check_rank_file(store: Store, f: FileEntry, entry: RankEntry, verify: str) -> CheckedFile:
    """Open one part file of a rank and check it against the manifest; every later read goes through it.

    The file must lie inside the checkpoint with its recorded size, its header holding exactly the
    manifest's tensors at their offsets, dtypes and shapes; with ``verify="checksum"`` the manifest
    must record its checksum. The caller closes the file.
    """
    opened = store.open_part(f)
    try:
        return _check_opened(opened, f, entry, verify)
    except BaseException:
        opened.close()
        raise


def _check_opened(opened: StoredFile, f: FileEntry, entry: RankEntry, verify: str) -> CheckedFile:
    header = read_header(opened)
    check_header_matches_manifest(header, entry, f)
    if verify == "checksum" and f.checksum is None:
        raise CheckpointMismatch(
            f"{header.path}: {MANIFEST_NAME} records no checksum for it, so verify='checksum' "
            "cannot check it; save the checkpoint again, or load with verify='size'."
        )
    return CheckedFile(f, opened, header)


class RankFiles:
    """The part files of one rank, opened and checked, closed on exit."""

    def __init__(self, store: Store, entry: RankEntry, verify: str) -> None:
        opened: list[StoredFile] = []
        try:
            # Every file opened and sized before any header is read.
            for f in entry.files:
                opened.append(store.open_part(f))
            self.files = [_check_opened(o, f, entry, verify) for o, f in zip(opened, entry.files, strict=True)]
        except BaseException:
            for o in opened:
                o.close()
            raise

    @property
    def headers(self) -> list[Header]:
        return [c.header for c in self.files]

    def check_unchanged(self) -> None:
        """Raise if any file was replaced or modified since it was opened."""
        for checked in self.files:
            checked.file.check_unchanged()

    def close(self) -> None:
        for checked in self.files:
            checked.file.close()

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_header_matches_manifest(header: Header, entry: RankEntry, f: FileEntry) -> None:
    """Raise unless part ``f``'s header is the one its save wrote for rank ``entry``: the rank, the
    tensors and their places, and the contents' digest the manifest records."""
    name = os.path.basename(header.path)
    saved_for = header.metadata.get(RANK_METADATA)
    if saved_for is not None and saved_for != entry.label:
        raise CheckpointCorrupt(
            f"{header.path}: holds the slice of rank {saved_for[:40]!r} (its header says so), where {MANIFEST_NAME} "
            f"lists it as a file of rank {entry.label!r}; the checkpoint's files were renamed or copied over each "
            "other. Copy or save the checkpoint again."
        )
    listed = {t: e for t, e in entry.tensors.items() if e.file == name}
    if set(listed) != set(header.tensors):
        extra = sorted(set(header.tensors) - set(listed))
        absent = sorted(set(listed) - set(header.tensors))
        raise CheckpointCorrupt(
            f"{header.path}: holds tensors {extra[:5]} not in {MANIFEST_NAME} and lacks {absent[:5]} "
            "that it lists; the file is not the one that was saved. Copy or save the checkpoint again."
        )
    for tensor_name, e in listed.items():
        h = header.tensors[tensor_name]
        if (h.dtype, h.shape) != (e.dtype, tuple(e.shape)):
            raise CheckpointCorrupt(
                f"{header.path}: tensor {tensor_name!r} is {h.dtype}{list(h.shape)} in the file but "
                f"{e.dtype}{list(e.shape)} in {MANIFEST_NAME}; copy or save the checkpoint again."
            )
    for tensor_name, e in listed.items():
        h = header.tensors[tensor_name]
        # A resharding load reads by the manifest's offset: it must be the header's.
        if e.offset is not None and e.offset != h.begin:
            raise CheckpointCorrupt(
                f"{header.path}: tensor {tensor_name!r} starts at byte {h.begin} in the file but at {e.offset} "
                f"in {MANIFEST_NAME}; the manifest is damaged. Copy or save the checkpoint again."
            )
    # Last: a file of another shape is named as such above.
    digest = header.metadata.get(DIGEST_METADATA)
    if f.digest is not None and digest is None:
        raise CheckpointCorrupt(
            f"{header.path}: holds no digest of its contents, where {MANIFEST_NAME} records {f.digest!r}: not the "
            "part this checkpoint's save wrote, but a stale copy of the same tensors from a save by an earlier "
            "version (or a file of another tool). Copy or save the checkpoint again."
        )
    if f.digest is not None and digest != f.digest:
        raise CheckpointCorrupt(
            f"{header.path}: holds other weights than the save {MANIFEST_NAME} lists it from wrote (its header's "
            f"digest is {digest[:40]!r}, the manifest's {f.digest!r}): a stale copy from an older save, or from "
            "another one, of the same tensors. Copy or save the checkpoint again."
        )
    if f.digest is None and digest is not None:
        # A manifest without digests predates them, so this part is from a later save.
        raise CheckpointCorrupt(
            f"{header.path}: is from a later save than {MANIFEST_NAME}, which records no digest of its contents "
            f"(saved by an earlier version) where its header holds one ({digest[:40]!r}): a stale manifest, or a "
            "part copied in from another save of the same tensors. Copy or save the checkpoint again."
        )


def saved_specs(entry: RankEntry) -> dict[str, TensorSpec]:
    """Shape and dtype of each tensor a rank's manifest entry lists."""
    return {name: TensorSpec(t.shape, t.dtype) for name, t in entry.tensors.items()}


class HeldAdoption:
    """A load's ``adopt`` callbacks, held until its last check passed (:meth:`hand_over`): a load
    refused by the final check that no file changed leaves the parameters as they were."""

    def __init__(self, adopt: Mapping[str, Callable[[torch.Tensor], None]] | None) -> None:
        self.adopt = adopt
        self.held: list[tuple[str, torch.Tensor]] = []

    def callbacks(self) -> dict[str, Callable[[torch.Tensor], None]] | None:
        """What the reads are given in place of ``adopt``: each holds the tensor."""
        return None if self.adopt is None else {name: partial(self._hold, name) for name in self.adopt}

    def _hold(self, name: str, tensor: torch.Tensor) -> None:
        self.held.append((name, tensor))

    def hand_over(self) -> None:
        """Hand every held tensor to its callback, in the order the reads handed them over."""
        adopt = self.adopt or {}
        for name, tensor in self.held:
            adopt[name](tensor)
        self.held.clear()


def check_not_replaced(store: Store, manifest: Manifest, check_files: Callable[[], None]) -> None:
    """After the reads: the files read are still the checkpoint's, and so is the manifest.

    A save during the load is an error here, never weights from two saves.
    """
    store.check_not_locked()
    check_files()
    if store.read_manifest() != manifest:
        raise CheckpointCorrupt(
            f"{store.where}: {MANIFEST_NAME} changed during the load (another save into the directory?); the "
            "weights read may belong to the previous checkpoint. Load again once the save is done."
        )
