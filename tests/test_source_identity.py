"""Issue 34, class 2, for a model loaded by another load format from its own local folder: a save that
reads those files again first proves none was written since the load (each file's device, inode,
size, mtime and ctime; the kernel sets ctime on every write), or refuses with ``SaveRefused``."""

from __future__ import annotations

import os

import pytest

from vllm_sharded_loader.checkpoint.save_proof import check_source_files_unchanged, weight_file_identities
from vllm_sharded_loader.format.errors import SaveRefused


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
    loaded = weight_file_identities(str(tmp_path))
    check_source_files_unchanged(str(tmp_path), loaded)  # unchanged: no error
    (tmp_path / "config.json").write_text('{"a": 1}')  # not a weight file: the re-read does not read it
    check_source_files_unchanged(str(tmp_path), loaded)
    change(weights)
    with pytest.raises(SaveRefused, match=r"was written after the served weights were loaded from it .*CAPTURE_DIR"):
        check_source_files_unchanged(str(tmp_path), loaded)


def test_a_weight_named_link_to_nothing_is_an_identity_not_an_error(tmp_path):
    """A model folder with a link to nothing among its weight-named files (a pruned Hub cache blob,
    ``training_args.bin``) or a loop of links: the identities raised a bare FileNotFoundError (or
    OSError ELOOP) at the engine's start-up capture, and every save of that engine was refused, though
    vLLM's loader read nothing through the link. The link's own identity is recorded; a fix of it is a
    change like any other."""
    (tmp_path / "model.safetensors").write_bytes(b"0123456789")
    (tmp_path / "training_args.bin").symlink_to(tmp_path / "gone")
    (tmp_path / "loop.pt").symlink_to("loop.pt")
    loaded = weight_file_identities(str(tmp_path))
    assert sorted(loaded) == ["loop.pt", "model.safetensors", "training_args.bin"]
    check_source_files_unchanged(str(tmp_path), loaded)  # unchanged: no error
    (tmp_path / "gone").write_bytes(b"weights now")  # the link reads a file now: another identity
    (tmp_path / "training_args.bin").unlink()
    (tmp_path / "training_args.bin").symlink_to(tmp_path / "gone")
    with pytest.raises(SaveRefused, match=r"training_args.bin changed"):
        check_source_files_unchanged(str(tmp_path), loaded)


def test_a_sharded_checkpoint_read_again_is_proven_by_its_manifest_or_refused(tmp_path):
    """Class 2 for a sharded checkpoint: the digest of its manifest, with every file's block checksums,
    proves what a re-read gives; another manifest, none, or one without checksums is refused."""
    from dataclasses import replace

    from tests.support.states import save
    from vllm_sharded_loader.checkpoint import read_manifest
    from vllm_sharded_loader.checkpoint.save_proof import check_still_read_from, manifest_proof

    manifest = save(tmp_path / "a")
    proof = manifest_proof(manifest)
    assert proof is not None and manifest_proof(read_manifest(str(tmp_path / "a"))) == proof
    check_still_read_from("A", proof, read_manifest(str(tmp_path / "a")))  # as read: proven
    with pytest.raises(SaveRefused, match=r"A was rewritten after the served weights .*manifest differs"):
        check_still_read_from("A", proof, save(tmp_path / "b", tied=False))
    with pytest.raises(SaveRefused, match=r"A was rewritten after the served weights .*manifest is gone"):
        check_still_read_from("A", proof, None)
    entry = manifest.ranks[0]
    unsummed = replace(manifest, ranks=(replace(entry, files=(replace(entry.files[0], checksum=None),)),))
    assert manifest_proof(unsummed) is None and manifest_proof(None) is None
    with pytest.raises(SaveRefused, match=r"manifest records no checksum for every file"):
        check_still_read_from("A", manifest_proof(unsummed), unsummed)
