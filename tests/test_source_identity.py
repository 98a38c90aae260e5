"""Issue 34, class 2, for a model loaded by another load format from its own local folder: a save that
reads those files again first proves none was written since the load (each file's device, inode,
size, mtime and ctime; the kernel sets ctime on every write), or refuses with ``SaveRefused``."""

from __future__ import annotations

import os

import pytest

from vllm_sharded_loader.engine.capture import (
    LoadedState,
    _check_source_files_unchanged,
    _weight_file_identities,
)
from vllm_sharded_loader.format.errors import SaveRefused


def loaded_from(folder) -> LoadedState:
    state = LoadedState(signature={}, source=None, dtype="float32", quantization=None, model_dir=str(folder))
    state.source_files = _weight_file_identities(str(folder))
    return state


@pytest.mark.parametrize(
    "change",
    [
        lambda f: f.write_bytes(f.read_bytes()),  # rewritten in place with the same bytes
        lambda f: (f.rename(f.with_name("x")), f.with_name("x").rename(f)),  # replaced (renamed away and back)
        lambda f: os.truncate(f, 3),
        lambda f: f.with_name("model-00002.safetensors").write_bytes(b"new"),  # a weight file added
        lambda f: f.unlink(),
    ],
    ids=["same-bytes", "renamed-back", "truncated", "added", "removed"],
)
def test_a_written_model_folder_is_refused(tmp_path, change):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"0123456789")
    (tmp_path / "config.json").write_text("{}")
    state = loaded_from(tmp_path)
    _check_source_files_unchanged(state)  # unchanged: no error
    (tmp_path / "config.json").write_text('{"a": 1}')  # not a weight file: the re-read does not read it
    _check_source_files_unchanged(state)
    change(weights)
    with pytest.raises(SaveRefused, match=r"was written after the served weights were loaded from it .*CAPTURE_DIR"):
        _check_source_files_unchanged(state)
