"""A rank's saved files: every check before a byte is read.

:func:`check_rank_file` is the one place that checks a saved file against the manifest
(presence, containment, size, header, checksum record); the same-topology load, the
resharding load and ``vllm-sharded verify`` all go through it.
"""

from __future__ import annotations

import os

from ..format.errors import ShardedStateError
from ..format.manifest import FileEntry, RankEntry
from ..format.names import MANIFEST_NAME
from ..format.safetensors import Header
from ..planning.tensors import TensorSpec
from ..storage.local import check_file_size, part_path, read_header


def check_rank_file(directory: str, f: FileEntry, entry: RankEntry, verify: str) -> Header:
    """Check one part file of a rank against the manifest; its validated header.

    The file must lie inside the checkpoint, exist with its recorded size, and have a
    header holding exactly the tensors the manifest places in it, with their dtypes
    and shapes. With ``verify="checksum"`` the manifest must record its checksum.
    """
    check_file_size(directory, f)
    header = read_header(part_path(directory, f.name))
    check_header_matches_manifest(header, entry)
    if verify == "checksum" and f.checksum is None:
        raise ShardedStateError(
            f"{header.path}: {MANIFEST_NAME} records no checksum for it, so verify='checksum' "
            "cannot check it; save the checkpoint again, or load with verify='size'."
        )
    return header


def check_rank_files(directory: str, entry: RankEntry, verify: str) -> list[Header]:
    """:func:`check_rank_file` for every part of a rank: sizes of all of them first, then headers."""
    for f in entry.files:
        check_file_size(directory, f)
    return [check_rank_file(directory, f, entry, verify) for f in entry.files]


def check_header_matches_manifest(header: Header, entry: RankEntry) -> None:
    name = os.path.basename(header.path)
    listed = {t: e for t, e in entry.tensors.items() if e.file == name}
    if set(listed) != set(header.tensors):
        extra = sorted(set(header.tensors) - set(listed))
        absent = sorted(set(listed) - set(header.tensors))
        raise ShardedStateError(
            f"{header.path}: holds tensors {extra[:5]} not in {MANIFEST_NAME} and lacks {absent[:5]} "
            "that it lists; the file is not the one that was saved. Copy or save the checkpoint again."
        )
    for tensor_name, e in listed.items():
        h = header.tensors[tensor_name]
        if (h.dtype, h.shape) != (e.dtype, tuple(e.shape)):
            raise ShardedStateError(
                f"{header.path}: tensor {tensor_name!r} is {h.dtype}{list(h.shape)} in the file but "
                f"{e.dtype}{list(e.shape)} in {MANIFEST_NAME}; copy or save the checkpoint again."
            )


def saved_specs(entry: RankEntry) -> dict[str, TensorSpec]:
    """Shape and dtype of each tensor a rank's manifest entry lists."""
    return {name: TensorSpec(t.shape, t.dtype) for name, t in entry.tensors.items()}
