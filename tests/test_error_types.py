"""The error types a caller branches on, raised by real bad input, no engine.

Each case builds a small real checkpoint in a temporary folder, damages it or asks for
what it cannot give, and asserts the subclass of :class:`ShardedStateError` (and a piece
of the message the troubleshooting page lists for it). Every error stays a
``ShardedStateError`` and a ``ValueError``, so callers that catch those are unchanged.
"""

from __future__ import annotations

import json
import os

import obstore.exceptions
import pytest
import torch

from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest, saveable_state
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import MANIFEST_NAME, ShardedStateError, SourceModel, config_sha256, normalize_config
from vllm_sharded_loader.format.errors import (
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointMismatch,
    CheckpointNotFound,
    InvalidOption,
    SaveRefused,
    StorageError,
    Unsupported,
    agreed_error,
)
from vllm_sharded_loader.storage import objects
from vllm_sharded_loader.storage.local import read_header
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.lock import acquire_save_lock, release_save_lock

CONFIG = {"hidden_size": 8, "vocab_size": 16, "num_hidden_layers": 1}
SOURCE = SourceModel("TinyForCausalLM", config_sha256(CONFIG), normalize_config(CONFIG))
PART = "model-rank-0-part-0.safetensors"


def state(tp_rank: int, tp_size: int, fill: float | None = None) -> dict[str, torch.Tensor]:
    """One rank's tensors: distinct values per rank, or ``fill`` everywhere (fresh targets)."""
    shapes = {"model.embed_tokens.weight": (16 // tp_size, 8), "model.norm.weight": (8,)}
    return {
        name: torch.full(shape, float(tp_rank + 1) if fill is None else fill, dtype=torch.bfloat16)
        for name, shape in shapes.items()
    }


def save(directory, tp_size: int = 1, overwrite: bool = True):
    ranks = {RankInfo(r, tp_size): saveable_state(state(r, tp_size)) for r in range(tp_size)}
    return save_checkpoint(
        str(directory), ranks, dtype="bfloat16", source=SOURCE, options=SaveOptions(overwrite=overwrite)
    )


def load(directory, tp_rank: int = 0, tp_size: int = 1):
    targets = saveable_state(state(tp_rank, tp_size, fill=7))
    rank = RankInfo(tp_rank, tp_size)
    return load_rank(
        LoadRequest(open_store(str(directory)), read_manifest(str(directory)), serving=SOURCE), targets, rank
    )


def raised(kind: type[ShardedStateError], call, *args, **kw) -> ShardedStateError:
    """The error ``call`` raises: of type ``kind``, and still a ShardedStateError and a ValueError."""
    with pytest.raises(kind) as info:
        call(*args, **kw)
    assert isinstance(info.value, ShardedStateError) and isinstance(info.value, ValueError)
    assert not info.value.agreed and info.value.origin is None
    return info.value


def test_a_sound_checkpoint_loads(tmp_path):
    save(tmp_path)
    load(tmp_path)


def test_a_missing_part_is_not_found(tmp_path):
    save(tmp_path)
    os.remove(tmp_path / PART)
    assert "listed in sharded_state.json" in str(raised(CheckpointNotFound, load, tmp_path))


def test_a_folder_without_checkpoint_is_not_found(tmp_path):
    assert "has no file for" in str(raised(CheckpointNotFound, load, tmp_path))


def test_a_truncated_part_is_corrupt(tmp_path):
    save(tmp_path)
    with open(tmp_path / PART, "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / PART) - 4)
    assert "truncated" in str(raised(CheckpointCorrupt, load, tmp_path))


def test_a_file_that_is_not_safetensors_is_corrupt(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    raised(CheckpointCorrupt, read_header, str(tmp_path / "x.safetensors"))


def test_a_manifest_that_is_not_json_is_corrupt(tmp_path):
    save(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    assert "is not valid JSON" in str(raised(CheckpointCorrupt, read_manifest, str(tmp_path)))


def test_a_manifest_of_a_later_format_is_a_mismatch(tmp_path):
    save(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    manifest["format_version"] += 1
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert "is not supported" in str(raised(CheckpointMismatch, read_manifest, str(tmp_path)))


def test_a_damaged_file_pattern_in_the_manifest_is_corrupt(tmp_path):
    save(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    manifest["pattern"] = "../model-rank-{rank}-part-{part}.safetensors"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert "must name a plain file" in str(raised(CheckpointCorrupt, read_manifest, str(tmp_path)))


def test_another_topology_without_geometry_is_a_mismatch(tmp_path):
    save(tmp_path, tp_size=1)
    assert "tensor_parallel_size=1" in str(raised(CheckpointMismatch, load, tmp_path, tp_rank=0, tp_size=2))


def test_another_model_is_a_mismatch(tmp_path):
    save(tmp_path)
    manifest = read_manifest(str(tmp_path))
    other = SourceModel("OtherForCausalLM", config_sha256({"x": 1}), normalize_config({"x": 1}))
    targets = saveable_state(state(0, 1, fill=7))
    raised(
        CheckpointMismatch,
        load_rank,
        LoadRequest(open_store(str(tmp_path)), manifest, serving=other),
        targets,
        RankInfo(0, 1),
    )


def test_a_running_save_locks_the_folder(tmp_path):
    lock = acquire_save_lock(str(tmp_path), "first")
    try:
        # A load of a folder whose first save has not published, and a second save.
        assert "no manifest has been published yet" in str(raised(CheckpointLocked, load, tmp_path))
        assert "another save holds" in str(raised(CheckpointLocked, acquire_save_lock, str(tmp_path), "second"))
    finally:
        release_save_lock(lock)


def test_saving_over_a_checkpoint_without_overwrite_is_refused(tmp_path):
    save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert "refusing to overwrite" in str(raised(SaveRefused, save, tmp_path, overwrite=False))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_file_pattern_without_its_part_field_is_an_invalid_option(tmp_path):
    ranks = {RankInfo(0, 1): saveable_state(state(0, 1))}
    error = raised(
        InvalidOption,
        save_checkpoint,
        str(tmp_path / "out"),
        ranks,
        dtype="bfloat16",
        source=SOURCE,
        options=SaveOptions(pattern="m-{rank}"),
    )
    assert "'m-{rank}'" in str(error)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_an_unknown_verification_mode_is_an_invalid_option(tmp_path):
    save(tmp_path)
    targets = saveable_state(state(0, 1, fill=7))
    request = LoadRequest(open_store(str(tmp_path)), read_manifest(str(tmp_path)), verify="bytes", serving=SOURCE)
    raised(InvalidOption, load_rank, request, targets, RankInfo(0, 1))


def test_a_dtype_safetensors_cannot_store_is_unsupported(tmp_path):
    ranks = {RankInfo(0, 1): {"w": torch.zeros(2, dtype=torch.complex64)}}
    raised(Unsupported, save_checkpoint, str(tmp_path), ranks, dtype="float32", source=SOURCE)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (FileNotFoundError("gone"), CheckpointNotFound),
        (obstore.exceptions.NotFoundError("gone"), CheckpointNotFound),
        (obstore.exceptions.PreconditionError("etag"), CheckpointCorrupt),
        (obstore.exceptions.AlreadyExistsError("there"), CheckpointLocked),
        (obstore.exceptions.PermissionDeniedError("no"), StorageError),
        (ConnectionError("refused"), StorageError),
    ],
)
def test_object_storage_errors_map_onto_the_types(error, kind):
    mapped = objects._fail("s3://bucket/ckpt/sharded_state.json", "HEAD", error)
    assert type(mapped) is kind
    assert mapped.args[0].startswith("s3://bucket/ckpt/sharded_state.json: HEAD failed (")


def test_an_agreed_error_keeps_its_type_and_origin():
    origin = CheckpointCorrupt("rank 1: checksum mismatch")
    error = agreed_error(CheckpointCorrupt, "rank 1: checksum mismatch (no rank's weights were changed)", origin)
    assert isinstance(error, CheckpointCorrupt) and error.agreed and error.origin is origin
