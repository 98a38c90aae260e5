"""What the fault tests share: a digest of everything in a directory, to prove that nothing else
changed, and the two-rank saves (``states``) whose publication they check.

A fault test takes :func:`tree_digest` of the checkpoint directory (and of its
neighbours) before the fault and after it, and compares: the previous checkpoint's files
are byte-identical, and nothing appeared or vanished but what the save may add.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

import torch

from tests.support.states import SOURCE
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format.manifest import Manifest
from vllm_sharded_loader.storage.location import Store, open_store


def tree_digest(root: str) -> dict[str, tuple[str, int, str]]:
    """``relative path -> (kind, size, sha256)`` of every entry under ``root``, links not followed.

    ``kind`` is ``file``, ``dir``, ``link`` (the target in place of a hash) or ``other``
    (FIFOs, sockets, devices: never opened, so a hostile tree cannot block the test).
    """
    out: dict[str, tuple[str, int, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", 0, os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", 0, "")
            elif stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                out[rel] = ("file", st.st_size, h.hexdigest())
            else:
                out[rel] = ("other", 0, "")
    return out


def model_folder(root: Path, value: float) -> Path:
    """The non-weight files of model ``value``: a config, a tokenizer, a nested one, one of B's own."""
    folder = root / f"model-{value:g}"
    (folder / "tok").mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(f'{{"value": {value:g}}}')
    (folder / "tokenizer.json").write_text("{}")  # the same in every model: never replaced
    (folder / "tok" / "vocab.txt").write_text(f"vocab of {value:g}")
    if value > 1:
        (folder / "chat_template.jinja").write_text("only in later models")
    return folder


def states(value: float) -> dict[RankInfo, dict[str, torch.Tensor]]:
    """Two ranks of distinct tensors, in parts of one or two tensors (max_size below)."""
    return {RankInfo(r, 2): {f"w{i}": torch.full((64, 32), value + 10 * r + i) for i in range(4)} for r in range(2)}


def save_states(where: str | Store, value: float, carry: str | Store | None = None, **options: Any) -> Manifest:
    """:func:`states` of ``value`` saved into ``where`` by one process, with ``SaveOptions(**options)``
    and ``carry`` (a folder or store) as its carry source."""
    carried = None if carry is None else open_store(carry)
    return save_checkpoint(
        where, states(value), dtype="float32", source=SOURCE, options=SaveOptions(carry=open_store(carried), **options)
    )


def assert_published(directory: Path, value: float) -> None:
    """The directory's manifest is the save of ``value``'s, and every rank loads it bit-exactly."""
    manifest = read_manifest(str(directory))
    assert manifest is not None
    for info, tensors in states(value).items():
        targets = {n: torch.zeros_like(t) for n, t in tensors.items()}
        load_rank(LoadRequest(open_store(str(directory)), manifest, verify="checksum", serving=SOURCE), targets, info)
        assert all(torch.equal(targets[n], t) for n, t in tensors.items()), f"rank {info} is not save {value}'s"


def carried_of(value: float) -> dict[str, str]:
    """The non-weight files a save of model ``value`` leaves, by relative path."""
    files = {"config.json": f'{{"value": {value:g}}}', "tokenizer.json": "{}", "tok/vocab.txt": f"vocab of {value:g}"}
    return files | ({"chat_template.jinja": "only in later models"} if value > 1 else {})
