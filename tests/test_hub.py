"""Per-rank fetching from a Hugging Face Hub cache, offline (HF_HUB_OFFLINE=1).

The cache is laid out as huggingface_hub lays it out: content in ``blobs/``, a snapshot of
symlinks per commit, ``refs/main`` naming the commit.
"""

import os
from pathlib import Path

import pytest
import torch

from tests.support.checkpoints import save_model, stage_state
from tests.support.hub import COMMIT, REPO, lay_out_cache
from tests.support.reference import llama_like
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
from vllm_sharded_loader.format import MANIFEST_NAME, ShardedStateError
from vllm_sharded_loader.storage import hub


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
    snapshot = hub.fetch(REPO, hub.METADATA_PATTERNS)
    assert Path(snapshot).name == COMMIT and (Path(snapshot) / MANIFEST_NAME).exists()
    mine = [f.name for f in manifest.rank(0, 0).files]
    assert hub.fetch(REPO, mine) == snapshot
    assert not set(mine) & rank1_files
    expected = stage_state(model, 2, 1, 0, 0)
    targets = {n: torch.zeros_like(x) for n, x in expected.items()}
    stats = load_rank(LoadRequest(snapshot, read_manifest(snapshot), verify="checksum"), targets, RankInfo(0, 2))
    assert {os.path.basename(f) for f in stats.files} == set(mine)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())
    # Rank 1 would need the files that are not there, and says which.
    with pytest.raises(ShardedStateError, match=r"model-rank-1-part-0.safetensors: listed in .* but missing"):
        load_rank(LoadRequest(snapshot, read_manifest(snapshot)), stage_state(model, 2, 1, 1, 0), RankInfo(1, 2))


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
    with pytest.raises(ShardedStateError, match="outside the checkpoint directory"):
        load_rank(
            LoadRequest(str(snapshot), read_manifest(str(snapshot))), stage_state(model, 2, 1, 0, 0), RankInfo(0, 2)
        )
