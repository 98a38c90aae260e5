"""Saving and loading ranks of a checkpoint with real files and tensors, no engine.

Every error the loader raises at start-up is raised here by its bad input, and a
refused load leaves the target parameters untouched.
"""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tests.support.states import CONFIG, SOURCE, assert_untouched, fresh_targets, load, rank_state, save
from vllm_sharded_loader.checkpoint import RankInfo, saveable_state
from vllm_sharded_loader.format import (
    MANIFEST_NAME,
    ShardedStateError,
    SourceModel,
    config_sha256,
    normalize_config,
)
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointMismatch, CheckpointNotFound
from vllm_sharded_loader.storage.staged import StagedRank, open_staged_tensors


def test_round_trip_every_rank_gets_its_own_bytes(tmp_path):
    manifest = save(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
        MANIFEST_NAME,
    ]
    for r in range(2):
        stats, targets = load(tmp_path, tp_rank=r)
        original = saveable_state(rank_state(r, 2))
        assert set(targets) == set(original)
        for name, t in original.items():
            assert torch.equal(targets[name], t), name
        assert stats.files == (str(tmp_path / f"model-rank-{r}-part-0.safetensors"),)
        payload = sum(t.numel() * t.element_size() for t in original.values())
        assert stats.bytes_read == payload < manifest.rank(r, 0).nbytes


def test_tied_embedding_is_written_once(tmp_path):
    manifest = save(tmp_path)
    names = set(manifest.rank(0, 0).tensors)
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
    assert "model.layers.0.empty" not in names
    # Loading the one saved copy fills both names, which share memory in the model.
    state = {k: torch.full_like(v, 7) for k, v in rank_state(0, 2).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    stats, _ = load(tmp_path, targets=saveable_state(state))
    assert stats.tensors == len(names)
    assert torch.equal(state["model.embed_tokens.weight"], rank_state(0, 2)["model.embed_tokens.weight"])


def test_parts_are_size_capped(tmp_path):
    manifest = save(tmp_path, max_size=300)
    for entry in manifest.ranks:
        assert len(entry.files) > 1
        for f in entry.files:
            tensors = [t for t in entry.tensors.values() if t.file == f.name]
            payload = sum(torch.Size(t.shape).numel() * 2 for t in tensors)
            assert payload <= 300 or len(tensors) == 1
    for r in range(2):
        _, targets = load(tmp_path, tp_rank=r)
        assert torch.equal(
            targets["model.layers.0.qkv_proj.weight"], rank_state(r, 2)["model.layers.0.qkv_proj.weight"]
        )


def test_resave_with_fewer_parts_leaves_no_stale_part(tmp_path):
    save(tmp_path, max_size=300)
    assert len([n for n in os.listdir(tmp_path) if n.startswith("model-rank-0-")]) > 1
    manifest = save(tmp_path, max_size=None)
    # Replaced last: the new parts took part numbers the old save did not use.
    listed = sorted(f.name for entry in manifest.ranks for f in entry.files)
    assert listed == ["model-rank-0-part-4.safetensors", "model-rank-1-part-4.safetensors"]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("model-rank-")) == listed
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []
    # The next save takes the lowest part numbers again, now free.
    manifest = save(tmp_path, max_size=None)
    assert sorted(f.name for entry in manifest.ranks for f in entry.files) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    ]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("model-rank-")) == [
        "model-rank-0-part-0.safetensors",
        "model-rank-1-part-0.safetensors",
    ]


def test_custom_pattern(tmp_path):
    save(tmp_path, pattern="weights-{tp_rank}-{part}.safetensors", max_size=300)
    assert any(n.startswith("weights-1-") for n in os.listdir(tmp_path))
    load(tmp_path, tp_rank=1)


def test_open_staged_tensors_maps_the_saved_bytes(tmp_path):
    manifest = save(tmp_path, max_size=300)
    staged = StagedRank(str(tmp_path), RankInfo(1, 2), manifest.pattern, 300, manifest.rank(1, 0))
    tensors = open_staged_tensors(staged)
    for name, t in saveable_state(rank_state(1, 2)).items():
        assert torch.equal(tensors[name], t), name


@pytest.mark.parametrize(
    ("serving_tp", "message"),
    [(1, "saved with tensor_parallel_size=2 .* runs tensor_parallel_size=1"), (4, "saved with tensor_parallel_size=2")],
)
def test_other_topology_is_refused(tmp_path, serving_tp, message):
    save(tmp_path)
    targets = fresh_targets(0, serving_tp)
    with pytest.raises(CheckpointMismatch, match=message):
        load(tmp_path, tp_rank=0, tp_size=serving_tp, targets=targets)
    assert_untouched(targets)


def test_missing_file_is_refused(tmp_path):
    save(tmp_path)
    os.remove(tmp_path / "model-rank-1-part-0.safetensors")
    with pytest.raises(
        ShardedStateError, match=r"model-rank-1-part-0.safetensors: listed in sharded_state.json .* missing"
    ):
        load(tmp_path, tp_rank=1)


@pytest.mark.parametrize(("delta", "word"), [(-5, "truncated"), (3, "not the one that was saved")])
def test_wrong_file_size_is_refused(tmp_path, delta, word):
    save(tmp_path)
    path = tmp_path / "model-rank-0-part-0.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:delta] if delta < 0 else data + b"\0" * delta)
    targets = fresh_targets(0, 2)
    with pytest.raises(CheckpointCorrupt, match=f"model-rank-0-part-0.safetensors: .* bytes on disk.*{word}"):
        load(tmp_path, targets=targets)
    assert_untouched(targets)


def test_missing_and_unexpected_tensors_are_refused(tmp_path):
    save(tmp_path)
    targets = fresh_targets(0, 2)
    targets["model.layers.1.new.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    del targets["model.norm.weight"]
    with pytest.raises(
        ShardedStateError, match=r"missing tensors: model.layers.1.new.weight; unexpected tensors: model.norm.weight"
    ):
        load(tmp_path, targets=targets)


def test_shape_mismatch_is_refused(tmp_path):
    save(tmp_path)
    targets = fresh_targets(0, 2)
    targets["model.norm.weight"] = torch.zeros(17, dtype=torch.bfloat16)
    with pytest.raises(CheckpointMismatch, match=r"model.norm.weight saved \[16\] but the model expects \[17\]"):
        load(tmp_path, targets=targets)
    assert_untouched({k: v for k, v in targets.items() if k != "model.norm.weight"})


def test_another_models_config_is_refused(tmp_path):
    save(tmp_path)
    other = dict(CONFIG, num_hidden_layers=3)
    serving = SourceModel("TinyForCausalLM", config_sha256(other), normalize_config(other))
    with pytest.raises(CheckpointMismatch, match=r"num_hidden_layers: 2 -> 3"):
        load(tmp_path, serving=serving)
    with pytest.raises(CheckpointMismatch, match=r"saved from a TinyForCausalLM .* serves a OtherModel"):
        load(tmp_path, serving=SourceModel("OtherModel", SOURCE.config_sha256, SOURCE.config))


def test_header_disagreeing_with_manifest_is_refused(tmp_path):
    # A part rewritten with other shapes, its size patched into the manifest. (A part
    # with the same header and other bytes is caught by checksums, not by this check.)
    save(tmp_path)
    a = tmp_path / "model-rank-0-part-0.safetensors"
    state = saveable_state(rank_state(0, 2))
    state["model.norm.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
    save_file({k: v.contiguous() for k, v in state.items()}, str(a), metadata={"format": "pt"})
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    manifest["ranks"][0]["files"][0]["size"] = a.stat().st_size
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt, match=r"model.norm.weight' is BF16\[4, 4\] in the file but BF16\[16\]"):
        load(tmp_path)


def test_dtype_is_cast_and_reported(tmp_path):
    save(tmp_path)
    targets = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in saveable_state(rank_state(0, 2)).items()}
    stats, _ = load(tmp_path, targets=targets)
    assert set(stats.cast) == set(targets)
    assert torch.equal(targets["model.norm.weight"], torch.ones(16))


# ------------------------------------------------------- checkpoints of vLLM's own save


def save_like_vllm(directory, tp_size=2):
    """What vLLM's ShardedStateLoader.save_model writes: safetensors' save_file, no manifest."""
    for r in range(tp_size):
        state = {k: v.contiguous() for k, v in saveable_state(rank_state(r, tp_size)).items()}
        save_file(state, os.path.join(directory, f"model-rank-{r}-part-0.safetensors"))


def test_checkpoint_without_manifest_loads(tmp_path):
    save_like_vllm(tmp_path)
    for r in range(2):
        stats, targets = load(tmp_path, tp_rank=r)
        assert not stats.with_manifest
        for name, t in saveable_state(rank_state(r, 2)).items():
            assert torch.equal(targets[name], t)


def test_checkpoint_without_manifest_rewritten_during_the_load_is_refused(tmp_path):
    """vLLM's own save writes its parts in place (``save_file``): one run into the folder while a
    load reads it must fail the load, not hand it the other save's bytes."""
    save_like_vllm(tmp_path)
    part0 = tmp_path / "model-rank-0-part-0.safetensors"
    other = (tmp_path / "model-rank-1-part-0.safetensors").read_bytes()
    rewritten: list[int] = []

    def rewrite_before_the_reads(done: int, total: int) -> None:
        if not rewritten:
            with open(part0, "r+b") as f:
                f.write(other)
            rewritten.append(1)

    with pytest.raises(CheckpointCorrupt, match=r"rank-0-part-0\.safetensors: the file was replaced or modified"):
        load(tmp_path, tp_rank=0, threads=1, progress=rewrite_before_the_reads)
    assert rewritten, "the part was rewritten during the load"


def test_checkpoint_without_manifest_at_other_topology_is_refused(tmp_path):
    save_like_vllm(tmp_path, tp_size=2)
    targets = fresh_targets(0, 1)
    with pytest.raises(CheckpointMismatch, match=r"files of ranks this engine does not have .*model-rank-1-part-0"):
        load(tmp_path, tp_rank=0, tp_size=1, targets=targets)
    assert_untouched(targets)
    with pytest.raises(CheckpointNotFound, match="no file for pp_rank=0 tp_rank=3"):
        load(tmp_path, tp_rank=3, tp_size=4, targets=fresh_targets(3, 4))


def test_checkpoint_without_manifest_missing_linear_weights_is_refused(tmp_path):
    # vLLM's own save on CPU: linear weights are empty after repacking and skipped.
    for r in range(2):
        state = {k: v.contiguous() for k, v in saveable_state(rank_state(r, 2)).items() if "proj.weight" not in k}
        save_file(state, os.path.join(tmp_path, f"model-rank-{r}-part-0.safetensors"))
    with pytest.raises(
        ShardedStateError,
        match=r"missing tensors: model.layers.0.o_proj.weight, model.layers.0.qkv_proj.weight.*drops every linear",
    ):
        load(tmp_path)


def test_no_checkpoint_at_all(tmp_path):
    with pytest.raises(CheckpointNotFound, match=r"no file for .* and no sharded_state.json"):
        load(tmp_path)


def test_a_hugging_face_model_given_to_our_load_format_is_named_with_what_to_do(tmp_path):
    """``load_format="sharded_state"`` on a Hugging Face model folder said it had no file for the rank
    "and no sharded_state.json", suggesting a save or a smaller topology; it names the model."""
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ShardedStateError,
        match=r"holds a Hugging Face model \(model.safetensors\), not a sharded "
        r"checkpoint .* or serve it as it is with vLLM's default load format",
    ):
        load(tmp_path)


def test_a_sharded_checkpoint_is_told_from_a_model_folder(tmp_path):
    # A speculative drafter's folder: its sharded checkpoint loads by rank, its HF weights by vLLM's loader.
    from vllm_sharded_loader.checkpoint.legacy import holds_sharded_checkpoint
    from vllm_sharded_loader.storage.location import open_store

    hf, ours, vllms, custom = (tmp_path / n for n in ("hf", "ours", "vllm", "custom"))
    for d in (hf, vllms, custom):
        os.makedirs(d)
    save_file({"w": torch.zeros(2)}, os.path.join(hf, "model.safetensors"))
    (hf / "config.json").write_text("{}")
    save(ours)
    save_like_vllm(vllms)
    save_file({"w": torch.zeros(2)}, os.path.join(custom, "draft-1-0.safetensors"))
    assert not holds_sharded_checkpoint(open_store(str(hf)))
    assert not holds_sharded_checkpoint(open_store(str(tmp_path / "absent")))
    assert holds_sharded_checkpoint(open_store(str(ours))) and holds_sharded_checkpoint(open_store(str(vllms)))
    assert not holds_sharded_checkpoint(open_store(str(custom)))
    assert holds_sharded_checkpoint(open_store(str(custom)), "draft-{rank}-{part}.safetensors")


def test_distinct_meta_tensors_never_look_like_shared_memory():
    # Every meta tensor has data_ptr 0: only the storage tells two of them apart.
    from vllm_sharded_loader.checkpoint.state import tied_groups

    a, b = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta")
    state = {"a": a, "b": b, "a_tied": a}
    kept = saveable_state(state)
    assert list(kept) == ["a", "b"]
    assert tied_groups(state, kept) == [["a", "a_tied"]]
    cpu = torch.zeros(4, 4)
    assert tied_groups({"x": cpu, "y": cpu.clone(), "x_view": cpu.view(16).view(4, 4)}, ["x"]) == [["x", "x_view"]]


def test_non_weight_files_and_module_folders_are_copied(tmp_path):
    import json

    from vllm_sharded_loader.storage.model_files import copy_non_weight_files

    source, out = tmp_path / "model", tmp_path / "out"
    files = {
        "config.json": "{}",
        "tokenizer.json": "{}",
        "model.safetensors": "weights",
        "model.safetensors.index.json": "{}",
        "modules.json": json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            ]
        ),
        "1_Pooling/config.json": "{}",
        "2_Dense/config.json": "{}",
        "2_Dense/model.safetensors": "the pooler's projection",
        "original/params.json": "{}",
        "original/consolidated.00.pth": "a second copy of the weights",
        ".git/HEAD": "ref",
        # Checkpoints made into the model's own folder (one published, one being saved): not the model's.
        "tp2/sharded_state.json": "{}",
        "tp2/config.json": "{}",
        "original/tp4/.sharded_state.lock": "{}",
        "original/tp4/config.json": "{}",
    }
    for name, text in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(text)
    out.mkdir()
    copy_non_weight_files(str(source), str(out))
    copied = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert copied == {
        "config.json",
        "tokenizer.json",
        "modules.json",
        "1_Pooling/config.json",
        "2_Dense/config.json",
        "2_Dense/model.safetensors",
        "original/params.json",
    }
    assert (out / "2_Dense/model.safetensors").read_text() == "the pooler's projection"
