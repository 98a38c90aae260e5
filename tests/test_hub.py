"""Per-rank fetching from a Hugging Face Hub cache, offline (HF_HUB_OFFLINE=1).

The cache is laid out as huggingface_hub lays it out: content in ``blobs/``, a snapshot of
symlinks per commit, ``refs/main`` naming the commit.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import save_model, stage_state
from tests.support.hub import COMMIT, REPO, lay_out_cache
from tests.support.reference import llama_like
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
from vllm_sharded_loader.format import MANIFEST_NAME
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointNotFound, InvalidOption
from vllm_sharded_loader.storage import hub
from vllm_sharded_loader.storage.location import open_store


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    model = llama_like(num_layers=2)
    save_model(tmp_path / "ckpt", model, 2, 1)
    (tmp_path / "ckpt" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    return model, tmp_path


def test_rank_patterns_name_only_that_ranks_files():
    assert hub.rank_patterns("model-rank-{rank}-part-{part}.safetensors", 1, 0) == ["model-rank-1-part-*.safetensors"]
    pattern = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
    assert hub.rank_patterns(pattern, 0, 3) == ["model-pp-3-tp-0-part-*.safetensors"]


def test_a_rank_resolves_and_opens_only_its_own_files(hub_cache):
    model, root = hub_cache
    manifest = read_manifest(str(root / "ckpt"))
    rank1_files = {f.name for f in manifest.rank(1, 0).files}
    # Rank 1's parts are not in the cache at all: links to blobs that do not exist.
    lay_out_cache(root / "ckpt", root / "cache", leave_out=rank1_files)
    snapshot = hub.fetch(REPO, hub.METADATA_PATTERNS).where
    assert Path(snapshot).name == COMMIT and (Path(snapshot) / MANIFEST_NAME).exists()
    mine = [f.name for f in manifest.rank(0, 0).files]
    assert hub.fetch(REPO, mine).where == snapshot
    assert not set(mine) & rank1_files
    expected = stage_state(model, 2, 1, 0, 0)
    targets = {n: torch.zeros_like(x) for n, x in expected.items()}
    stats = load_rank(
        LoadRequest(open_store(snapshot), read_manifest(snapshot), verify="checksum"), targets, RankInfo(0, 2)
    )
    assert {os.path.basename(f) for f in stats.files} == set(mine)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())
    # Rank 1 would need the files that are not there, and says which.
    with pytest.raises(CheckpointNotFound, match=r"model-rank-1-part-0.safetensors: listed in .* but missing"):
        load_rank(
            LoadRequest(open_store(snapshot), read_manifest(snapshot)), stage_state(model, 2, 1, 1, 0), RankInfo(1, 2)
        )


def test_fetch_patterns_of_each_rank(hub_cache):
    model, root = hub_cache
    manifest = read_manifest(str(root / "ckpt"))
    for t in range(2):
        assert hub.rank_fetch_patterns(manifest, RankInfo(t, 2)) == [f.name for f in manifest.rank(t, 0).files]
    # Serving at TP=4, rank 0 holds a quarter: all of it lies in saved rank 0's files.
    files = hub.rank_fetch_patterns(manifest, RankInfo(0, 4), list(stage_state(model, 4, 1, 0, 0)))
    assert files and all(f.startswith("model-rank-0-") for f in files)
    # Serving at TP=1, the one rank needs every part.
    files = hub.rank_fetch_patterns(manifest, RankInfo(0, 1), list(stage_state(model, 1, 1, 0, 0)))
    assert set(files) == {f.name for r in manifest.ranks for f in r.files}
    assert hub.rank_fetch_patterns(None, RankInfo(1, 2)) == ["model-rank-1-part-*.safetensors"]


def test_symlink_out_of_the_repository_is_refused(hub_cache):
    _, root = hub_cache
    snapshot = lay_out_cache(root / "ckpt", root / "cache")
    part = snapshot / "model-rank-0-part-0.safetensors"
    outside = root / "elsewhere.safetensors"
    outside.write_bytes(part.read_bytes())
    part.unlink()
    os.symlink(outside, part)
    model = llama_like(num_layers=2)
    with pytest.raises(CheckpointCorrupt):
        load_rank(
            LoadRequest(open_store(str(snapshot)), read_manifest(str(snapshot))),
            stage_state(model, 2, 1, 0, 0),
            RankInfo(0, 2),
        )


def _load_rank0(snapshot: str) -> None:
    model = llama_like(num_layers=2)
    expected = stage_state(model, 2, 1, 0, 0)
    targets = {n: torch.zeros_like(x) for n, x in expected.items()}
    load_rank(LoadRequest(open_store(snapshot), read_manifest(snapshot), verify="checksum"), targets, RankInfo(0, 2))
    assert all(torch.equal(targets[n], x) for n, x in expected.items())


def test_a_ranks_parts_come_from_the_commit_its_manifest_came_from_though_the_branch_moved(hub_cache):
    """The load fetches the manifest and config by branch, then each rank's parts: by the snapshot's
    commit. A push between the two (here the cache's ``refs/main`` moved to another commit) fetched the
    parts into the new commit's folder, and the load named them missing; each worker resolving the
    branch on its own could read another commit's parts."""
    _, root = hub_cache
    snapshot = lay_out_cache(root / "ckpt", root / "cache")
    repo = snapshot.parent.parent
    newer = repo / "snapshots" / ("b" * 40)
    shutil.copytree(snapshot, newer, symlinks=True)
    (repo / "refs" / "main").write_text("b" * 40)
    part = read_manifest(str(snapshot)).rank(0, 0).files[0].name
    assert hub.fetch(REPO, [part]).where == str(newer)  # what the branch names now
    assert hub.fetch_more(REPO, open_store(str(snapshot)), [part]).where == str(snapshot)


@pytest.mark.parametrize("where", ["hub", "folder"])
def test_a_manifest_that_is_a_link_to_nothing_is_named_not_taken_for_vllms_own_save(hub_cache, tmp_path, where):
    """A snapshot whose manifest blob is missing (a download cut short, a pruned cache), or a folder
    whose manifest links to nothing: read as "no manifest", the load took the checkpoint for vLLM's
    own save and read its parts without a check of sizes, geometry or source."""
    _, root = hub_cache
    if where == "hub":
        folder = lay_out_cache(root / "ckpt", root / "cache", leave_out={MANIFEST_NAME})
    else:
        folder = tmp_path / "copy"
        shutil.copytree(root / "ckpt", folder)
        (folder / MANIFEST_NAME).unlink()
        os.symlink("gone.json", folder / MANIFEST_NAME)  # (inside the folder: one out of it is refused first)
    target = os.readlink(folder / MANIFEST_NAME)
    with pytest.raises(CheckpointNotFound, match=re.escape(f"a symbolic link to {target}, which does not exist")):
        read_manifest(str(folder))


def test_blobs_on_another_disk_are_read_by_convert_and_load_alike(hub_cache):
    from vllm_sharded_loader.storage.hf_source import resolve_source

    _, root = hub_cache
    snapshot = lay_out_cache(root / "ckpt", root / "cache")
    repo = snapshot.parent.parent
    os.rename(repo / "blobs", root / "disk-blobs")  # moved to a bigger disk, a link left in its place
    os.symlink(root / "disk-blobs", repo / "blobs")
    assert resolve_source(REPO).where == str(snapshot)  # convert's fetch
    _load_rank0(str(snapshot))  # and a load of the same snapshot


def test_a_snapshot_link_elsewhere_is_refused_by_convert_and_load_alike(hub_cache):
    from vllm_sharded_loader.storage.hf_source import resolve_source

    _, root = hub_cache
    snapshot = lay_out_cache(root / "ckpt", root / "cache")
    repo = snapshot.parent.parent
    os.rename(repo / "blobs", root / "disk-blobs")
    os.symlink(root / "disk-blobs", repo / "blobs")
    part = snapshot / "model-rank-0-part-0.safetensors"
    (root / "elsewhere").mkdir()
    outside = root / "elsewhere" / part.name
    outside.write_bytes(part.read_bytes())
    part.unlink()
    os.symlink(outside, part)
    refused = re.escape(f"{part} resolves to {outside}, outside the checkpoint directory {snapshot}")
    with pytest.raises(CheckpointCorrupt, match=refused):
        resolve_source(REPO)
    with pytest.raises(CheckpointCorrupt, match=refused):
        _load_rank0(str(snapshot))


@pytest.mark.parametrize("into", ["another snapshot", "refs"])
def test_a_snapshot_link_into_the_rest_of_its_repository_is_refused(hub_cache, into):
    """Only the snapshot and the repository's blobs/ hold a commit's files: a link into another
    snapshot is another commit's part (same name and size, other values: a size-checked load took
    it silently), one into ``refs/`` no weights."""
    from vllm_sharded_loader.storage.hf_source import resolve_source

    _, root = hub_cache
    snapshot = lay_out_cache(root / "ckpt", root / "cache")
    repo = snapshot.parent.parent
    part = snapshot / "model-rank-0-part-0.safetensors"
    data = bytearray(part.read_bytes())
    data[-1] ^= 1
    folder = repo / "snapshots" / ("b" * 40) if into == "another snapshot" else repo / "refs"
    folder.mkdir(exist_ok=True)
    target = folder / part.name
    target.write_bytes(bytes(data))
    part.unlink()
    os.symlink(os.path.relpath(target, snapshot), part)
    refused = re.escape(f"{part} resolves to {target}, outside the checkpoint directory {snapshot}")
    with pytest.raises(CheckpointCorrupt, match=refused):
        resolve_source(REPO)
    targets = {n: torch.zeros_like(x) for n, x in stage_state(llama_like(num_layers=2), 2, 1, 0, 0).items()}
    with pytest.raises(CheckpointCorrupt, match=refused):  # (size-checked, as loads are by default)
        load_rank(LoadRequest(open_store(str(snapshot)), read_manifest(str(snapshot))), targets, RankInfo(0, 2))


@pytest.fixture
def tiny_hub(tmp_path, monkeypatch):
    """A one-tensor safetensors model laid out as REPO in an offline Hub cache of its own, and a copy
    of it with other weights outside the cache: (snapshot, repository folder, other model)."""
    from safetensors.torch import save_file

    for name, fill in (("model", 1.0), ("other", 9.0)):
        (tmp_path / name).mkdir()
        save_file({"w": torch.full((4,), fill)}, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    snapshot = lay_out_cache(tmp_path / "model", tmp_path / "cache")
    return snapshot, snapshot.parent.parent, tmp_path / "other"


def test_a_revision_or_ref_leading_out_of_the_repository_is_refused(tiny_hub, tmp_path):
    from vllm_sharded_loader.storage.hf_source import resolve_source

    snapshot, repo, other = tiny_hub
    assert resolve_source(REPO).where == str(snapshot)
    # huggingface_hub reads the commit from refs/<revision>, and the snapshot is snapshots/<commit>.
    (tmp_path / "ref").write_text(os.path.relpath(other, repo / "snapshots"))
    with pytest.raises(InvalidOption, match=r"revision '(\.\./)+ref' names a path"):
        resolve_source(REPO, os.path.relpath(tmp_path / "ref", repo / "refs"))
    with pytest.raises(InvalidOption):
        resolve_source(REPO, str(tmp_path / "ref"))
    (repo / "refs" / "main").write_text(os.path.relpath(other, repo / "snapshots"))
    with pytest.raises(CheckpointCorrupt, match=f"resolves to {other}, not a snapshot of {REPO}"):
        resolve_source(REPO)


def test_a_snapshot_link_out_of_the_cache_is_refused_naming_it(tiny_hub):
    from vllm_sharded_loader.storage.hf_source import resolve_source

    snapshot, _, other = tiny_hub
    (snapshot / "model.safetensors").unlink()
    os.symlink(other / "model.safetensors", snapshot / "model.safetensors")
    with pytest.raises(CheckpointCorrupt, match=r"model.safetensors resolves to .*other/model.safetensors, outside"):
        resolve_source(REPO)


def test_a_repository_whose_blobs_live_on_another_disk_still_resolves(tiny_hub, tmp_path):
    from vllm_sharded_loader.storage.hf_source import SourceFiles, resolve_source

    _, repo, _ = tiny_hub
    os.rename(repo / "blobs", tmp_path / "disk-blobs")  # moved away, a link left in its place (a bigger disk)
    os.symlink(tmp_path / "disk-blobs", repo / "blobs")
    source = SourceFiles.open(resolve_source(REPO).where)
    assert source.read("w").tolist() == [1.0] * 4
    source.close()


FETCH = "import sys; from vllm_sharded_loader.storage import hub; print(hub.fetch(sys.argv[1], ['*.json']))"


def test_a_ref_that_is_a_fifo_is_refused_not_hung(tiny_hub):
    _, repo, _ = tiny_hub
    (repo / "refs" / "main").unlink()
    os.mkfifo(repo / "refs" / "main")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", FETCH, REPO],
        capture_output=True,
        text=True,
        timeout=60,  # huggingface_hub opens the FIFO and waits for a writer forever
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode != 0 and "refs/main: not a regular file" in done.stderr, done.stderr
