"""Which files of a model folder a checkpoint carries beside its parts (config, tokenizer, module
folders; not weights, bookkeeping or nested checkpoints), and special files that would hang a reader."""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import shutil
import stat
from collections.abc import Callable

from ..format.errors import CheckpointCorrupt, CheckpointNotFound, ShardedStateError
from ..format.manifest import Manifest
from ..format.names import LOCK_NAME, MANIFEST_NAME, is_staged_name, is_startup_artifacts_name, parse_file_name
from .local import (
    denied,
    directory_holds_checkpoint,
    escapes,
    is_checkpoint_file,
    list_folder,
    not_regular,
    open_regular,
    read_manifest,
)

# Weights of the source model, which the sharded parts replace.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")
SKIPPED_NAMES = (MANIFEST_NAME, LOCK_NAME, ".cache", ".git")


def is_weight_file(name: str) -> bool:
    """Whether a file of the source model is not to copy: a weight file (or index), or our bookkeeping."""
    return (
        any(fnmatch.fnmatch(name, p) for p in WEIGHT_PATTERNS)
        or name in SKIPPED_NAMES
        or is_staged_name(name)
        or name.startswith(LOCK_NAME)
        # Tied to the saved topology: a copy's new manifest would list them nowhere.
        or is_startup_artifacts_name(name)
    )


def module_folders(source: str) -> set[str]:
    """Top-level folders holding modules of a sentence-transformers model (``modules.json``; unreadable:
    none): vLLM's pooler reads their weights from the folder, so they come along whole."""
    try:
        with os.fdopen(open_regular(os.path.join(source, "modules.json")), "rb") as f:
            return modules_in(f.read())
    except (OSError, ShardedStateError):
        return set()


def modules_in(data: bytes) -> set[str]:
    """The top-level module folders that a ``modules.json`` names (:func:`module_folders`)."""
    try:
        modules = json.loads(data)
    except (ValueError, RecursionError):
        return set()
    if not isinstance(modules, list):
        return set()
    paths = (m.get("path") for m in modules if isinstance(m, dict))
    return {p.strip("/").split("/")[0] for p in paths if isinstance(p, str) and p.strip("/")}


def _holds_a_checkpoint(folder: str) -> bool:
    """Whether a folder of the model's holds a checkpoint (or a save into one): never carried."""
    return directory_holds_checkpoint(folder) or os.path.lexists(os.path.join(folder, LOCK_NAME))


def nested_checkpoints(names: list[str]) -> set[str]:
    """The sub-folders of a listing's relative ``names`` that hold a checkpoint or a save into one."""
    folders = set()
    for name in names:
        folder, _, leaf = name.rpartition("/")
        if folder and (leaf == LOCK_NAME or is_checkpoint_file(leaf)):
            folders.add(folder)
    return folders


def own_part_pattern(manifest: Callable[[], Manifest | None]) -> str | None:
    """The part pattern of the checkpoint at the top of a source, or None: parts under a custom pattern
    match no weight file pattern, yet must not be carried."""
    try:
        found = manifest()
    except ShardedStateError:
        return None
    return None if found is None else found.pattern


def is_own_part(name: str, pattern: str | None) -> bool:
    """Whether the top-level ``name`` is a part under ``pattern`` (:func:`own_part_pattern`), listed or not."""
    return pattern is not None and "/" not in name and parse_file_name(pattern, name) is not None


def carried_in_listing(names: list[str], modules: set[str], pattern: str | None = None) -> list[str]:
    """:func:`non_weight_files`'s rule over a listing of relative ``names`` (an object-storage prefix's)."""
    nested = nested_checkpoints(names)

    def carried(name: str) -> bool:
        if is_own_part(name, pattern):
            return False
        parts = name.split("/")
        whole = len(parts) > 1 and parts[0] in modules  # a module folder comes whole, weights too
        left = (lambda p: p in SKIPPED_NAMES) if whole else is_weight_file
        return not any(left(p) or is_staged_name(p) for p in parts)

    return [n for n in names if carried(n) and not any(n.startswith(folder + "/") for folder in nested)]


def _unreadable(e: OSError) -> None:
    """``os.walk``'s error hook: a folder this process may not read is named, never skipped."""
    if isinstance(e, PermissionError):
        raise denied(e.filename) from None


def non_weight_files(source: str) -> list[str]:
    """Relative paths of the source model's files a checkpoint carries alongside its parts: all but
    the weight files outside module folders (which come whole) and nested checkpoints."""
    modules = module_folders(source)
    pattern = own_part_pattern(lambda: read_manifest(source))
    found = []
    for name in sorted(list_folder(source)):
        if is_weight_file(name) or is_own_part(name, pattern):
            continue
        path = os.path.join(source, name)
        if not os.path.isdir(path):
            found.append(name)
            continue
        if _holds_a_checkpoint(path) or escapes(path, os.path.realpath(path), source) is not None:
            continue  # (a link to a folder elsewhere is not the model's)
        whole = name in modules
        for root, dirs, files in os.walk(path, onerror=_unreadable):
            nested = (d for d in dirs if d not in SKIPPED_NAMES)
            dirs[:] = sorted(d for d in nested if not _holds_a_checkpoint(os.path.join(root, d)))
            relative = os.path.relpath(root, source)
            found.extend(
                os.path.join(relative, f)
                for f in sorted(files)
                if f not in SKIPPED_NAMES and (whole or not is_weight_file(f))
            )
    return found


def copy_non_weight_files(source: str, output: str) -> list[str]:
    """Copy the source model's :func:`non_weight_files` to ``output``; returns their relative paths."""
    copied = non_weight_files(source)
    for name in copied:
        os.makedirs(os.path.dirname(os.path.join(output, name)), exist_ok=True)
        # Refused unless regular, opened without blocking: a FIFO must not hang the save.
        with (
            os.fdopen(open_regular(os.path.join(source, name)), "rb") as src,
            open(os.path.join(output, name), "wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
        shutil.copystat(os.path.join(source, name), os.path.join(output, name))
    return copied


def special_files(folder: str) -> list[CheckpointCorrupt]:
    """An error for each FIFO, device or socket among a local model folder's files (top level, and what
    a checkpoint carries), found without opening any: vLLM opens them plainly, and a FIFO hangs it."""
    top = (n for n in list_folder(folder) if not os.path.isdir(os.path.join(folder, n)))
    found = []
    for name in sorted({*top, *non_weight_files(folder)}):
        path = os.path.join(folder, name)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as e:  # a loop of links
            if e.errno != errno.ELOOP:
                raise
            found.append(not_regular(path, None))
            continue
        if not stat.S_ISREG(mode):
            found.append(not_regular(path, mode))
    return found


def check_no_links_to_nothing(folder: str) -> None:
    """Refuse a model folder whose carried files include a link to nothing, before vLLM fails later on it."""
    for name in non_weight_files(folder):
        path = os.path.join(folder, name)
        if os.path.islink(path) and not os.path.exists(path):
            raise CheckpointNotFound(
                f"{path} is a link to nothing ({os.readlink(path)}), where the model's file was expected; nothing "
                "was written. The model is incomplete: fetch the file again (or remove the link), and run again."
            )
