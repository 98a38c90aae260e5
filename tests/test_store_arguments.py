"""The engine-free functions that take a resolved store refuse a path or URL given in its place,
with a TypeError that says how to resolve it, before anything is read or written."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.states import SOURCE, save
from vllm_sharded_loader.checkpoint import LoadRequest, read_manifest, verify_checkpoint
from vllm_sharded_loader.checkpoint.save import SaveOptions
from vllm_sharded_loader.checkpoint.startup_artifacts import sign_checkpoint
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.tools.offline import inspect_checkpoint, reshard_checkpoint


def test_a_path_where_a_store_is_expected_is_refused_naming_open_store(tmp_path):
    directory = tmp_path / "ckpt"
    save(directory)
    before = sorted(p.name for p in directory.iterdir())
    manifest = read_manifest(str(directory))
    calls = {
        "LoadRequest": lambda where: LoadRequest(where, manifest, serving=SOURCE),
        "verify_checkpoint": verify_checkpoint,
        "inspect_checkpoint": inspect_checkpoint,
        "reshard_checkpoint": lambda where: reshard_checkpoint(where, str(tmp_path / "out"), 1),
        "sign_checkpoint": lambda where: sign_checkpoint(where, None),
        "SaveOptions.carry": lambda where: SaveOptions(carry=where),
    }
    for name, call in calls.items():
        for where in (str(directory), Path(directory)):
            with pytest.raises(TypeError, match=rf"{name} takes a store.*open_store\("):
                call(where)
    assert sorted(p.name for p in directory.iterdir()) == before
    assert not (tmp_path / "out").exists()
    assert verify_checkpoint(open_store(str(directory))) == []
