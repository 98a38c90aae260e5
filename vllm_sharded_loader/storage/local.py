"""A checkpoint in a local directory (or a Hugging Face cache snapshot): its manifest, its part files.

Every path of a part goes through :func:`part_path`, which refuses names that resolve
outside the checkpoint; every header is read through :func:`read_header`.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import struct

from ..format.errors import ShardedStateError
from ..format.manifest import FileEntry, Manifest
from ..format.names import DEFAULT_PATTERNS, LOCK_NAME, MANIFEST_NAME, parse_file_name
from ..format.safetensors import MAX_HEADER_BYTES, Header, parse_header


def read_manifest(directory: str) -> Manifest | None:
    """The checkpoint's manifest, or None for a checkpoint written by vLLM's own save."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return Manifest.from_json(text, where=path)


def containment_root(directory: str) -> str:
    """The folder a checkpoint's files may resolve into.

    The checkpoint folder itself, except in a Hugging Face cache, where a snapshot's
    files are symlinks into the same repository's ``blobs`` folder.
    """
    real = os.path.realpath(directory)
    snapshots, repo = os.path.dirname(real), os.path.dirname(os.path.dirname(real))
    if os.path.basename(snapshots) == "snapshots" and os.path.isdir(os.path.join(repo, "blobs")):
        return repo
    return real


def part_path(directory: str, name: str) -> str:
    """The path of a part file, refusing one that resolves outside the checkpoint directory."""
    path = os.path.join(directory, name)
    real, root = os.path.realpath(path), containment_root(directory)
    if os.path.commonpath([real, root]) != root:
        raise ShardedStateError(
            f"{path} resolves to {real}, outside the checkpoint directory {root} (a symlink or path "
            "that escapes it); refusing to read it. Copy the real file into the checkpoint."
        )
    return path


def check_file_size(directory: str, f: FileEntry) -> None:
    path = part_path(directory, f.name)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise ShardedStateError(
            f"{path}: listed in {MANIFEST_NAME} ({f.size} bytes) but missing. The checkpoint is "
            "incomplete: copy the missing file or save the checkpoint again."
        ) from None
    if size != f.size:
        raise ShardedStateError(
            f"{path}: {size} bytes on disk, but {MANIFEST_NAME} records {f.size}. The file is "
            f"{'truncated' if size < f.size else 'not the one that was saved'}: copy or save the checkpoint again."
        )


def read_header(path: str) -> Header:
    """Read and validate the header of a safetensors file."""
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            raw_length = f.read(8)
            length = struct.unpack("<Q", raw_length)[0] if len(raw_length) == 8 else 0
            raw_header = f.read(length) if length <= min(MAX_HEADER_BYTES, file_size) else b""
    except FileNotFoundError:
        raise ShardedStateError(f"{path}: file is missing. Copy or save the checkpoint again.") from None
    return parse_header(raw_length, raw_header, path, file_size)


def directory_holds_checkpoint(directory: str) -> bool:
    """Whether a directory has a manifest or any part named as vLLM names them."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return False
    return MANIFEST_NAME in names or any(parse_file_name(p, n) is not None for n in names for p in DEFAULT_PATTERNS)


def fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Weights of the source model, which the sharded parts replace.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")
SKIPPED_NAMES = (MANIFEST_NAME, LOCK_NAME, ".cache", ".git")


def is_weight_file(name: str) -> bool:
    """Whether a file of the source model is a weight file (or index) not to copy."""
    return any(fnmatch.fnmatch(name, p) for p in WEIGHT_PATTERNS) or name in SKIPPED_NAMES


def copy_non_weight_files(source: str, output: str) -> list[str]:
    """Copy config, generation config, tokenizer files, chat template, ... to ``output``."""
    copied = []
    for name in sorted(os.listdir(source)):
        if is_weight_file(name):
            continue
        src, dst = os.path.join(source, name), os.path.join(output, name)
        if os.path.isdir(src):
            shutil.copytree(
                src,
                dst,
                dirs_exist_ok=True,
                ignore=lambda _d, names: [n for n in names if is_weight_file(n)],
            )
        else:
            shutil.copy2(src, dst)
        copied.append(name)
    return copied
