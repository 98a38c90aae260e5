"""Resharding loads on real files: saved with `save_checkpoint` at one TP/PP size, loaded
with `load_rank` at another, compared with vLLM's sharding rule applied to the full tensors.

The model and the reference rule come from tests/support/reference.py (checked in test_resharding.py against
vLLM's own weight loaders).
"""

import pytest
import torch

from tests.support.checkpoints import (
    EXPERTS,
    NORM,
    experts_rank,
    flat_rank,
    moe_geometry,
    moe_rank,
    moe_weights,
    save_flat,
    save_model,
    save_replicas,
    serving_ranks,
    source_of,
    stage_state,
)
from tests.support.manifests import edit_manifest
from tests.support.reference import llama_like, reference_pp_indices
from tests.support.states import SOURCE
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointMismatch, InvalidOption
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.reader import ReadOptions


@pytest.mark.parametrize(
    ("saved", "serving"),
    [((1, 1), (2, 1)), ((2, 1), (1, 1)), ((2, 1), (4, 1)), ((4, 1), (2, 1)), ((1, 2), (1, 1)), ((2, 2), (1, 4))],
)
@pytest.mark.parametrize("tied", [False, True])
def test_reshard_load_from_files_matches_vllms_rule(tmp_path, saved, serving, tied):
    model = llama_like(tied=tied, num_layers=4, vocab=1000, kv_heads=2)
    save_model(tmp_path, model, *saved)
    manifest = read_manifest(str(tmp_path))
    tp_size, pp_size = serving
    for p in range(pp_size):
        for t in range(tp_size):
            expected = stage_state(model, tp_size, pp_size, t, p)
            targets = {name: torch.full_like(x, -7) for name, x in expected.items()}
            stats = load_rank(
                LoadRequest(
                    open_store(str(tmp_path)),
                    manifest,
                    verify="checksum",
                    serving=source_of(model),
                    tied=model.tied_groups,
                ),
                targets,
                RankInfo(t, tp_size, p, pp_size),
            )
            assert stats.resharded_from == saved
            for name, x in expected.items():
                assert torch.equal(targets[name], x), (name, t, p)


def test_tp1_to_tp2_reads_about_half_per_rank(tmp_path):
    model = llama_like(num_layers=4, vocab=4096)
    manifest = save_model(tmp_path, model, 1, 1)
    for t in range(2):
        targets = {n: torch.zeros_like(x) for n, x in stage_state(model, 2, 1, t, 0).items()}
        stats = load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, RankInfo(t, 2))
        assert 0.45 < stats.bytes_read / manifest.nbytes < 0.55


def test_layers_move_between_stages(tmp_path):
    model = llama_like(num_layers=5)
    save_model(tmp_path, model, 1, 2)
    start, end = reference_pp_indices(5, 0, 1)
    assert (start, end) == (0, 5)
    targets = {n: torch.zeros_like(x) for n, x in stage_state(model, 1, 1, 0, 0).items()}
    stats = load_rank(LoadRequest(open_store(str(tmp_path)), read_manifest(str(tmp_path))), targets, RankInfo(0, 1))
    # A single stage reads both saved stages' files.
    assert {f.rsplit("/", 1)[1][:12] for f in stats.files} == {"model-pp-0-t", "model-pp-1-t"}


def test_without_geometry_another_topology_is_refused(tmp_path):
    model = llama_like(num_layers=2)
    ranks = {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)}
    save_checkpoint(str(tmp_path), ranks, dtype="int32", source=SOURCE)
    targets = {n: torch.zeros_like(x) for n, x in stage_state(model, 1, 1, 0, 0).items()}
    with pytest.raises(CheckpointMismatch, match=r"saved with tensor_parallel_size=2 .* runs tensor_parallel_size=1"):
        load_rank(LoadRequest(open_store(str(tmp_path)), read_manifest(str(tmp_path))), targets, RankInfo(0, 1))


def test_opaque_tensor_is_refused_naming_its_layer(tmp_path):
    model = llama_like(num_layers=2)
    ranks = {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)}
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    geometry["model.layers.1.mlp.down_proj.weight"] = {
        "kind": "opaque",
        "layer_class": "FusedMoE",
        "shape": [32, 24],
        "split_dim": None,
    }
    save_checkpoint(str(tmp_path), ranks, dtype="int32", source=SOURCE, options=SaveOptions(geometry=geometry))
    targets = {n: torch.zeros_like(x) for n, x in stage_state(model, 1, 1, 0, 0).items()}
    with pytest.raises(CheckpointMismatch, match=r"model.layers.1.mlp.down_proj.weight.*FusedMoE"):
        load_rank(LoadRequest(open_store(str(tmp_path)), read_manifest(str(tmp_path))), targets, RankInfo(0, 1))


def test_joined_rows_are_read_whole_in_bounded_batches(tmp_path, monkeypatch):
    """TP=2 -> 1 joins dim-1 halves: each half is one read and one strided copy, and the
    temporaries of one batch stay under GATHER_BYTES (here tiny, so many batches)."""
    import vllm_sharded_loader.storage.lowering as lowering

    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    manifest = save_model(tmp_path, model, 2, 1)
    batches = []
    read_pieces = lowering.read_pieces

    def counted(*args, **kwargs):
        batches.append(len(args[1]))
        return read_pieces(*args, **kwargs)

    monkeypatch.setattr(lowering, "GATHER_BYTES", 2048)
    monkeypatch.setattr(lowering, "read_pieces", counted)
    expected = stage_state(model, 1, 1, 0, 0)
    targets = {name: torch.full_like(x, -7) for name, x in expected.items()}
    load_rank(
        LoadRequest(open_store(str(tmp_path)), manifest, verify="checksum", serving=source_of(model)),
        targets,
        RankInfo(0, 1),
    )
    assert len(batches) > 4
    for name, x in expected.items():
        assert torch.equal(targets[name], x), name


def load_tp1(directory, model, manifest, **options):
    targets = {n: torch.full_like(x, -7) for n, x in stage_state(model, 1, 1, 0, 0).items()}
    load_rank(LoadRequest(open_store(str(directory)), manifest, **options), targets, RankInfo(0, 1))
    return targets


def test_a_tie_added_to_the_manifest_never_stands_in_for_a_saved_tensor(tmp_path):
    # The LM head is saved; a manifest that drops it and ties it to the embedding would
    # serve the embedding's bytes as the head. Every file's header is checked when a
    # tensor is read under a tied name, and the head's file still lists the head.
    model = llama_like(tied=False, num_layers=2, vocab=128, kv_heads=2)
    save_model(tmp_path, model, 2, 1)

    def tie_and_drop(data):
        data["tied"] = [["lm_head.weight", "model.embed_tokens.weight"]]
        for rank in data["ranks"]:
            rank["tensors"].pop("lm_head.weight")

    edit_manifest(tmp_path, tie_and_drop)
    manifest = read_manifest(str(tmp_path))
    with pytest.raises(CheckpointCorrupt, match=r"holds tensors \['lm_head.weight'\] not in sharded_state.json"):
        load_tp1(tmp_path, model, manifest, tied=[("model.embed_tokens.weight", "lm_head.weight")])
    # A served model that holds the head apart from the embedding refuses the tie before that.
    with pytest.raises(CheckpointMismatch):
        load_tp1(tmp_path, model, manifest)


def test_a_manifest_tie_never_fills_a_tensor_the_served_model_holds_apart(tmp_path):
    # Saved from a model that ties the LM head to the embedding (the head saved once, under the
    # embedding's name); served by one that holds the two apart. At the saved TP size the load
    # is refused (the head is missing); resharded, the manifest's tie must not stand in for it
    # with the embedding's weights.
    model = llama_like(tied=False, num_layers=2, vocab=128, kv_heads=2)
    ranks = {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)}
    for state in ranks.values():
        del state["lm_head.weight"]
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items() if name != "lm_head.weight"}
    tied = (("model.embed_tokens.weight", "lm_head.weight"),)
    save_checkpoint(
        str(tmp_path),
        ranks,
        dtype="int32",
        source=source_of(model),
        options=SaveOptions(geometry=geometry, tied=tied, max_size=4096),
    )
    manifest = read_manifest(str(tmp_path))
    for tp_size in (1, 4):
        expected = stage_state(model, tp_size, 1, 0, 0)
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        with pytest.raises(CheckpointMismatch, match=r"lm_head.weight .*model.embed_tokens.weight.*separate tensors"):
            load_rank(
                LoadRequest(open_store(str(tmp_path)), manifest, serving=source_of(model)),
                targets,
                RankInfo(0, tp_size),
            )
        assert all(bool((x == -7).all()) for x in targets.values())


def test_a_tensor_stored_in_another_dtype_by_one_rank_is_not_resharded_as_one_dtype(tmp_path):
    # Each rank's file is right on its own (the same topology casts each file's tensor); joined
    # at another TP size, one rank's float16 bytes must not be read as the other's bfloat16.
    from vllm_sharded_loader.format.geometry import column_parallel, replicated

    full = torch.randn(8, 4).to(torch.bfloat16)
    norm = torch.randn(4).to(torch.bfloat16)
    ranks = {
        RankInfo(0, 2): {"w": full[:4].to(torch.float16), "norm": norm.to(torch.float16)},
        RankInfo(1, 2): {"w": full[4:].clone(), "norm": norm.clone()},
    }
    geometry = {"w": column_parallel([8, 4]).to_dict(), "norm": replicated([4], "RMSNorm").to_dict()}
    save_checkpoint(str(tmp_path), ranks, dtype="bfloat16", source=SOURCE, options=SaveOptions(geometry=geometry))
    manifest = read_manifest(str(tmp_path))
    for t in range(2):
        targets = {"w": torch.zeros(4, 4, dtype=torch.bfloat16), "norm": torch.zeros(4, dtype=torch.bfloat16)}
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, RankInfo(t, 2))
        assert torch.equal(targets["w"], full[4 * t : 4 * t + 4]) and torch.equal(targets["norm"], norm)
    for tp_size in (1, 4):
        w = torch.zeros(8 // tp_size, 4, dtype=torch.bfloat16)
        targets = {"w": w, "norm": torch.zeros(4, dtype=torch.bfloat16)}
        with pytest.raises(CheckpointMismatch, match=r"w: saved pp_rank=0 tp_rank=\d stores it as (F16|BF16)"):
            load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, RankInfo(tp_size - 1, tp_size))
        assert not targets["w"].any() and not targets["norm"].any()


def test_a_geometry_the_saved_size_cannot_split_is_named_as_damage(tmp_path):
    # A QKV geometry whose Q heads do not divide the saved TP size cannot describe the saved
    # files: the manifest is damaged, whatever size is served (not "serve at another size").
    model = llama_like(num_layers=2, vocab=128, kv_heads=2)
    save_model(tmp_path, model, 2, 1)
    name = "model.layers.0.self_attn.qkv_proj.weight"

    def one_q_head(data):
        q = data["geometry"][name]["segments"][0]
        q["heads"], q["head_size"] = 1, q["size"]

    edit_manifest(tmp_path, one_q_head)
    manifest = read_manifest(str(tmp_path))
    for tp_size in (1, 4):
        targets = {n: torch.full_like(x, -7) for n, x in stage_state(model, tp_size, 1, 0, 0).items()}
        refused = rf"{name}: its recorded geometry cannot describe the files saved at TP=2 .*'q' of 1 heads.*damaged"
        with pytest.raises(CheckpointCorrupt, match=refused):
            load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, RankInfo(0, tp_size))


def test_resharding_refuses_saved_tensors_the_model_does_not_have(tmp_path):
    saved = llama_like(num_layers=3, vocab=128, kv_heads=2)
    save_model(tmp_path, saved, 2, 1)
    served = llama_like(num_layers=2, vocab=128, kv_heads=2)  # the same model, one layer short
    with pytest.raises(CheckpointMismatch, match=r"holds tensors the served model does not have: model.layers.2"):
        load_tp1(tmp_path, served, read_manifest(str(tmp_path)))


def test_resharding_refuses_a_geometry_that_is_not_the_served_models(tmp_path):
    model = llama_like(num_layers=2, vocab=128, kv_heads=2)
    save_model(tmp_path, model, 2, 1)
    name = "model.layers.0.mlp.gate_up_proj.weight"

    def resize_segments(data):
        gate, up = data["geometry"][name]["segments"]
        gate["size"], up["size"] = gate["size"] - 8, up["size"] + 8  # same total, same local shapes

    edit_manifest(tmp_path, resize_segments)
    manifest = read_manifest(str(tmp_path))
    geometry = {n: t.geometry for n, t in model.tensors.items()}
    with pytest.raises(CheckpointMismatch, match=rf"{name}: the checkpoint records merged_column_parallel"):
        load_tp1(tmp_path, model, manifest, geometry=geometry)


@pytest.mark.parametrize(("saved_tp", "serving_tp"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_stacked_experts_reshard_as_vllm_loads_them(tmp_path, saved_tp, serving_tp):
    from vllm_sharded_loader.format.geometry import merged_column_parallel, row_parallel

    experts, intermediate, hidden = 4, 16, 8
    g = torch.Generator().manual_seed(0)
    w1, w3 = (torch.randn(experts, intermediate, hidden, generator=g) for _ in range(2))
    w2 = torch.randn(experts, hidden, intermediate, generator=g)
    geometry = {
        "model.layers.0.mlp.experts.w13_weight": merged_column_parallel(
            [experts, 2 * intermediate, hidden], [intermediate, intermediate], ["w1", "w3"], "RoutedExperts", stacked=1
        ).to_dict(),
        "model.layers.0.mlp.experts.w2_weight": row_parallel(
            [experts, hidden, intermediate], "RoutedExperts", stacked=1
        ).to_dict(),
    }
    ranks = {RankInfo(t, saved_tp): experts_rank(w1, w3, w2, saved_tp, t) for t in range(saved_tp)}
    save_checkpoint(
        str(tmp_path), ranks, dtype="float32", source=SOURCE, options=SaveOptions(max_size=4096, geometry=geometry)
    )
    manifest = read_manifest(str(tmp_path))
    for t in range(serving_tp):
        expected = experts_rank(w1, w3, w2, serving_tp, t)
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest, verify="checksum"), targets, RankInfo(t, serving_tp))
        for name, x in expected.items():
            assert torch.equal(targets[name], x), (name, t)


# ------------------------------------------------ experts moved between expert-parallel placements

# (TP size, placement strategy): None is no expert parallelism (every rank holds a TP
# slice of every expert); otherwise EP size = TP size, each rank holding whole experts.
PLACEMENTS = [(1, None), (2, None), (2, "linear"), (2, "round_robin"), (3, "linear"), (4, "round_robin")]


def save_moe(directory, weights, tp_size, strategy, opaque_w2=False, max_size=4096):
    ranks = dict(moe_rank(weights, tp_size, strategy, t) for t in range(tp_size))
    experts = next(iter(ranks)).experts
    return save_checkpoint(
        str(directory),
        ranks,
        dtype="float32",
        source=SOURCE,
        options=SaveOptions(
            max_size=max_size, geometry=moe_geometry(*weights[0].shape, opaque_w2=opaque_w2), experts=experts
        ),
    )


@pytest.mark.parametrize("serving", PLACEMENTS, ids=lambda p: f"to-tp{p[0]}-{p[1] or 'noep'}")
@pytest.mark.parametrize("saved", PLACEMENTS, ids=lambda p: f"tp{p[0]}-{p[1] or 'noep'}")
def test_experts_move_between_placements_by_global_id(tmp_path, saved, serving):
    """Every pair of placements, expert parallelism on either side or both (other EP sizes,
    linear against round robin, uneven counts): each serving slot gets its global expert's
    weights, checked byte for byte against the full tensors."""
    weights = moe_weights()
    save_moe(tmp_path, weights, *saved)
    manifest = read_manifest(str(tmp_path))
    for t in range(serving[0]):
        rank, expected = moe_rank(weights, serving[0], serving[1], t)
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        stats = load_rank(LoadRequest(open_store(str(tmp_path)), manifest, verify="checksum"), targets, rank)
        for name, x in expected.items():
            assert torch.equal(targets[name], x), (name, t)
        if saved[1] is not None and serving[1] is not None:
            # Whole experts on both sides: exactly the bytes kept are read.
            assert stats.bytes_read == sum(x.numel() * 4 for x in expected.values())


def test_a_data_parallel_replica_reads_the_experts_of_its_ep_rank(tmp_path):
    """EP=2 served as TP=1 x DP=2: the second replica's only worker (tp_rank 0) is EP rank 1,
    so it reads the experts saved by tp_rank 1, not its own TP rank's."""
    from vllm_sharded_loader.planning.experts import expert_placement

    weights = moe_weights()
    save_moe(tmp_path, weights, 2, "linear")
    _, expected = moe_rank(weights, 2, "linear", 1)
    rank = RankInfo(0, 1, experts=expert_placement(EXPERTS, 2, "linear"), ep_rank=1)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    load_rank(LoadRequest(open_store(str(tmp_path)), read_manifest(str(tmp_path)), verify="checksum"), targets, rank)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())


def test_moved_experts_are_mapped_from_the_files(tmp_path):
    """Whole experts, saved with expert parallelism, are contiguous runs of the files: a
    serving rank with another placement is served from mappings of them, as resharded
    dim-0 pieces are."""
    weights = moe_weights(experts=6, intermediate=128, hidden=1024)  # 1 MiB per expert's w13
    save_moe(tmp_path, weights, 2, "round_robin", max_size=64 << 20)
    rank, expected = moe_rank(weights, 3, "linear", 1)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    adopted: dict[str, torch.Tensor] = {}
    adopt = {name: (lambda t, name=name: adopted.__setitem__(name, t)) for name in targets}
    load_rank(
        LoadRequest(open_store(str(tmp_path)), read_manifest(str(tmp_path)), verify="checksum"),
        targets,
        rank,
        adopt=adopt,
    )
    for name, x in expected.items():
        assert torch.equal(adopted.get(name, targets[name]), x), name
    assert "model.layers.0.mlp.experts.w13_weight" in adopted


@pytest.mark.parametrize("serving", [(2, "round_robin"), (2, None), (1, None)])
def test_experts_without_geometry_are_refused_when_they_would_move(tmp_path, serving):
    """An expert tensor recorded opaque is copied only to the placement it was saved with;
    anywhere else the load is refused before a byte lands."""
    weights = moe_weights()
    save_moe(tmp_path, weights, 2, "linear", opaque_w2=True)
    manifest = read_manifest(str(tmp_path))
    rank, expected = moe_rank(weights, serving[0], serving[1], 0)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    with pytest.raises(CheckpointMismatch, match=r"w2_weight \(FusedMoE, kind 'opaque'\) has no geometry|cannot be"):
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, rank)
    assert all(bool((x == -7).all()) for x in targets.values())
    # At the saved placement it loads.
    rank, expected = moe_rank(weights, 2, "linear", 1)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, rank)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())


def test_a_placement_that_is_not_the_geometrys_is_refused(tmp_path):
    from vllm_sharded_loader.planning.experts import expert_placement

    weights = moe_weights()
    save_moe(tmp_path, weights, 2, "linear")
    manifest = read_manifest(str(tmp_path))
    _, expected = moe_rank(weights, 2, None, 0)
    wrong = RankInfo(0, 2, experts=expert_placement(EXPERTS + 2, 2), ep_rank=0)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    with pytest.raises(CheckpointMismatch, match="stacks 6 experts, but the expert placement EP=2 linear"):
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, wrong)
    assert all(bool((x == -7).all()) for x in targets.values())


# ------------------------------------------------ resharded tensors served from file mappings


def big_model():
    """Rows of 4 KiB (hidden 1024, int32), so that dim-0 pieces are whole pages and files pass
    the writer's page-alignment threshold."""
    return llama_like(num_layers=2, vocab=1000, heads=8, kv_heads=2, head_size=128)


def file_mappings(tensor: torch.Tensor) -> set[str]:
    """Names of the files mapped into a tensor's address range (from /proc/self/maps)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo < end and hi > start and len(fields) > 5 and fields[5].endswith(".safetensors"):
                names.add(fields[5].rsplit("/", 1)[1])
    return names


def saved_rank(file_name: str) -> int:
    """The saved rank of a part file (``model-rank-{rank}-part-{part}.safetensors``)."""
    return int(file_name.split("-rank-")[1].split("-")[0])


def load_adopting(directory, rank, verify="checksum", model=None):
    """A resharding load offering every tensor for adoption: (targets, adopted tensors, stats)."""
    expected = stage_state(model, rank.tp_size, 1, rank.tp_rank, 0)
    targets = {name: torch.full_like(x, -7) for name, x in expected.items()}
    adopted: dict[str, torch.Tensor] = {}
    adopt = {name: (lambda t, name=name: adopted.__setitem__(name, t)) for name in targets}
    stats = load_rank(
        LoadRequest(open_store(str(directory)), read_manifest(str(directory)), verify=verify),
        targets,
        rank,
        adopt=adopt,
    )
    return expected, targets, adopted, stats


@pytest.mark.parametrize(("saved", "serving"), [(2, 1), (1, 2), (2, 4)])
def test_resharded_tensors_are_mapped_and_equal_the_copied_ones(tmp_path, saved, serving):
    model = big_model()
    save_model(tmp_path, model, saved, 1)
    for t in range(serving):
        expected, targets, adopted, stats = load_adopting(tmp_path, RankInfo(t, serving), model=model)
        for name, x in expected.items():
            served = adopted.get(name, targets[name])
            assert torch.equal(served, x), (name, t)
        # dim-0 pieces and replicated tensors are mapped; dim-1 splits (o_proj, down_proj) are copied.
        assert "model.layers.0.self_attn.qkv_proj.weight" in adopted
        assert "model.embed_tokens.weight" in adopted
        assert not any("o_proj.weight" in n or "down_proj.weight" in n for n in adopted)
        assert stats.resharded_from == (saved, 1)
    if (saved, serving) == (2, 1):
        # The joined weight lies over pages of both saved ranks' files.
        qkv = adopted["model.layers.0.self_attn.qkv_proj.weight"]
        assert {saved_rank(n) for n in file_mappings(qkv)} == {0, 1}, file_mappings(qkv)


def test_writes_to_a_mapped_resharded_tensor_never_reach_the_file(tmp_path):
    model = big_model()
    save_model(tmp_path, model, 2, 1)
    before = {p.name: p.read_bytes() for p in tmp_path.glob("*.safetensors")}
    _, _, adopted, _ = load_adopting(tmp_path, RankInfo(0, 1), model=model)
    for tensor in adopted.values():
        tensor.fill_(3)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.safetensors")} == before


def test_misaligned_pieces_fall_back_to_copying(tmp_path, monkeypatch):
    """Saved without page alignment (as before it existed), with headers of other lengths per
    rank: the ranks' pieces disagree within a page, so one of them is read, the other mapped;
    the result is the same."""
    import vllm_sharded_loader.storage.writer as writer

    write_file = writer.write_file

    def longer_header_for_rank_1(path, tensors, metadata, *args, **kwargs):
        pad = "x" * (24 if "-rank-1-" in path else 0)
        return write_file(path, tensors, {**metadata, "pad": pad}, *args, **kwargs)

    monkeypatch.setattr(writer, "PAGE_ALIGN_FROM", 1 << 60)
    monkeypatch.setattr(writer, "write_file", longer_header_for_rank_1)
    model = big_model()
    save_model(tmp_path, model, 2, 1)
    qkv_name = "model.layers.0.self_attn.qkv_proj.weight"
    offsets = {e.tensors[qkv_name].offset % 4096 for e in read_manifest(str(tmp_path)).ranks}
    assert len(offsets) == 2
    expected, targets, adopted, _ = load_adopting(tmp_path, RankInfo(0, 1), model=model)
    for name, x in expected.items():
        assert torch.equal(adopted.get(name, targets[name]), x), name
    assert len({saved_rank(n) for n in file_mappings(adopted[qkv_name])}) == 1


def test_map_pieces_maps_only_pages_a_piece_owns(tmp_path):
    from vllm_sharded_loader.planning.spans import Piece
    from vllm_sharded_loader.storage.local import OpenFile
    from vllm_sharded_loader.storage.memory import PAGE, map_pieces

    data = bytes(range(256)) * (PAGE * 6 // 256)
    (tmp_path / "f").write_bytes(data)
    with OpenFile.open(str(tmp_path / "f")) as f:
        pieces = [
            Piece(0, 0, 2 * PAGE, 0, 0),  # pages 0-1 of the tensor, aligned: mapped
            Piece(0, 3 * PAGE + 8, PAGE, 0, 2 * PAGE),  # another offset within a page: not mapped
            Piece(0, 4 * PAGE, PAGE + 100, 0, 3 * PAGE),  # aligned, ends mid-page where the tensor ends
        ]
        tensor, ranges = map_pieces([f], pieces, torch.uint8, (4 * PAGE + 100,))
        assert ranges == [(0, 2 * PAGE), (2 * PAGE, 2 * PAGE), (3 * PAGE, 4 * PAGE + 100)]
        raw = tensor.numpy().tobytes()
        assert raw[: 2 * PAGE] == data[: 2 * PAGE]
        assert raw[2 * PAGE : 3 * PAGE] == bytes(PAGE)  # left for the reader to fill
        assert raw[3 * PAGE :] == data[4 * PAGE : 5 * PAGE + 100]


@pytest.mark.parametrize(
    "tensor", ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
)
def test_a_corrupt_block_is_refused_on_the_mapped_paths(tmp_path, tensor):
    """A flipped bit under a mapped dim-0 piece, or under the mapped rows of a dim-1 join, is
    caught by verify="checksum"; nothing is adopted."""
    model = big_model()
    manifest = save_model(tmp_path, model, 2, 1)
    entry = manifest.rank(1, 0).tensors[tensor]
    path = tmp_path / entry.file
    data = bytearray(path.read_bytes())
    data[entry.offset + 5000] ^= 0x10
    path.write_bytes(bytes(data))
    expected = stage_state(model, 1, 1, 0, 0)
    targets = {name: torch.full_like(x, -7) for name, x in expected.items()}
    adopted: dict[str, torch.Tensor] = {}
    adopt = {name: (lambda t, name=name: adopted.__setitem__(name, t)) for name in targets}
    with pytest.raises(CheckpointCorrupt, match=rf"{entry.file}: checksum mismatch"):
        load_rank(
            LoadRequest(open_store(str(tmp_path)), read_manifest(str(tmp_path)), verify="checksum"),
            targets,
            RankInfo(0, 1),
            adopt=adopt,
        )
    assert not adopted


@pytest.mark.parametrize(("saved", "serving"), [(1, 2), (2, 1)])
def test_row_splits_are_read_per_tensor_not_per_row(tmp_path, monkeypatch, saved, serving):
    """Cutting (TP=1 -> 2) or joining (TP=2 -> 1) dim-1 splits gives the reader one piece per
    saved range, whatever the number of rows: 1024 rows here."""
    import vllm_sharded_loader.storage.lowering as lowering

    model = big_model()
    manifest = save_model(tmp_path, model, saved, 1)
    pieces = []
    read_pieces = lowering.read_pieces

    def counted(*args, **kwargs):
        pieces.extend(args[1])
        return read_pieces(*args, **kwargs)

    monkeypatch.setattr(lowering, "read_pieces", counted)
    expected = stage_state(model, serving, 1, 0, 0)
    targets = {name: torch.full_like(x, -7) for name, x in expected.items()}
    load_rank(LoadRequest(open_store(str(tmp_path)), manifest, verify="checksum"), targets, RankInfo(0, serving))
    for name, x in expected.items():
        assert torch.equal(targets[name], x), name
    assert model.tensors["model.layers.0.self_attn.o_proj.weight"].data.shape[0] == 1024
    assert len(pieces) < 4 * len(expected)


def test_a_one_thread_resharding_load_leaves_the_callers_torch_threads_alone(tmp_path):
    """With one reader thread the row copies run on the caller's thread, which keeps its setting."""
    model = big_model()
    manifest = save_model(tmp_path, model, 2, 1)
    expected = stage_state(model, 1, 1, 0, 0)
    targets = {name: torch.full_like(x, -7) for name, x in expected.items()}
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        load_rank(
            LoadRequest(open_store(str(tmp_path)), manifest), targets, RankInfo(0, 1), options=ReadOptions(threads=1)
        )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for name, x in expected.items():
        assert torch.equal(targets[name], x), name


def test_non_contiguous_targets_are_filled_run_by_run(tmp_path):
    model = big_model()
    manifest = save_model(tmp_path, model, 1, 1)
    expected = stage_state(model, 2, 1, 0, 0)
    name = "model.layers.0.self_attn.o_proj.weight"  # a dim-1 cut
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    rows, columns = expected[name].shape
    targets[name] = torch.full((columns, rows), -7, dtype=expected[name].dtype).t()  # transposed memory
    assert not targets[name].is_contiguous()
    load_rank(LoadRequest(open_store(str(tmp_path)), manifest, verify="checksum"), targets, RankInfo(0, 2))
    for n, x in expected.items():
        assert torch.equal(targets[n], x), n


def test_a_piece_at_an_offset_its_dtype_cannot_view_is_read_not_mapped(tmp_path):
    """A float32 tensor may start at any byte of a safetensors file (after int8 weights, say)."""
    from vllm_sharded_loader.planning.spans import Piece
    from vllm_sharded_loader.storage.local import OpenFile
    from vllm_sharded_loader.storage.memory import map_pieces

    path = tmp_path / "unaligned.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with OpenFile.open(str(path)) as opened:
        tensor, ranges = map_pieces([opened], [Piece(0, 1058, 8192, 0, 0, 4)], torch.float32, (2048,))
    assert ranges == [(0, 0)]  # nothing mapped: the caller reads all of it
    assert tensor.shape == (2048,) and bool((tensor == 0).all())


def test_a_hub_rank_fetches_only_the_files_of_its_experts(tmp_path):
    """Per-rank Hub fetches follow the expert plan: an EP=4 rank of experts saved EP=2 linear
    fetches parts of the one saved rank holding its experts."""
    from vllm_sharded_loader.storage.hub import rank_fetch_patterns

    weights = moe_weights()
    manifest = save_moe(tmp_path, weights, 2, "linear")
    rank, expected = moe_rank(weights, 4, "round_robin", 1)  # experts 1 and 5: saved ranks 0 and 1
    both = rank_fetch_patterns(manifest, rank, list(expected))
    rank, expected = moe_rank(weights, 4, "linear", 0)  # experts 0 and 1: saved rank 0 only
    mine = rank_fetch_patterns(manifest, rank, list(expected))
    rank0 = {f.name for f in manifest.rank(0, 0).files}
    assert mine and set(mine) <= rank0
    assert set(both) - rank0


# ------------------------------------------------ experts saved per data-parallel replica (DP x EP)


REPLICA_SAVES = [(1, 2, "linear"), (2, 2, "round_robin"), (1, 4, "linear")]


@pytest.mark.parametrize(
    "serving",
    [*REPLICA_SAVES, (2, 3, "linear"), ("flat", 1, 2), ("flat", 2, 2), *PLACEMENTS],
    ids=lambda p: "to-" + "-".join(map(str, p)),
)
@pytest.mark.parametrize("saved", REPLICA_SAVES, ids=lambda p: "tp{}-dp{}-{}".format(*p))
def test_experts_saved_per_replica_load_at_every_placement(tmp_path, saved, serving):
    """A save under TP x DP with expert parallelism: each replica wrote its own experts, once,
    and the norm only once. Every serving worker, of any replica, placement or TP size,
    gets its experts byte for byte."""
    weights = moe_weights()
    manifest = save_replicas(tmp_path, weights, *saved)
    tp, dp, _ = saved
    assert manifest.replicas == dp and len(manifest.ranks) == tp * dp
    assert [e.dp_rank for e in manifest.ranks] == [d for d in range(dp) for _ in range(tp)]
    assert sum(NORM in e.tensors for e in manifest.ranks) == tp  # the first replica's ranks only
    files = [f.name for e in manifest.ranks for f in e.files]
    assert len(files) == len(set(files)) and all("-dp-" in f for f in files)
    manifest = read_manifest(str(tmp_path))  # and it parses back, checked
    for rank, expected in serving_ranks(weights, serving):
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest, verify="checksum"), targets, rank)
        for name, x in expected.items():
            assert torch.equal(targets[name], x), (name, rank)


def test_an_opaque_expert_tensor_saved_per_replica_loads_only_at_its_placement(tmp_path):
    """Experts without geometry (a quantized MoE's) saved per replica: each worker of the saved
    placement copies its own EP rank's, a later replica's included, and a tensor outside the
    experts without geometry from the first replica; another placement is refused."""
    weights = moe_weights()
    save_replicas(tmp_path, weights, 1, 2, "linear", opaque_w2=True, opaque_norm=True)
    manifest = read_manifest(str(tmp_path))
    for rank, expected in serving_ranks(weights, (1, 2, "linear")):
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, rank)
        assert all(torch.equal(targets[n], x) for n, x in expected.items()), rank
    rank, expected = serving_ranks(weights, (1, 2, "round_robin"))[1]
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    with pytest.raises(CheckpointMismatch, match=r"w2_weight \(FusedMoE, kind 'opaque'\) has no geometry"):
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, rank)
    assert all(bool((x == -7).all()) for x in targets.values())


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["ranks"].pop(), r"ranks \(pp_rank, dp_rank, tp_rank\) \[\(0, 1, 0\)\] are missing"),
        (lambda d: d["ranks"][1].__setitem__("dp_rank", 0), "listed twice"),
        (lambda d: d["ranks"][1]["tensors"].__setitem__(NORM, d["ranks"][0]["tensors"][NORM]), "points at"),
        (lambda d: d.__setitem__("pattern", "model-rank-{rank}-part-{part}.safetensors"), "data-parallel rank"),
        (lambda d: d["expert_placement"].__setitem__("ep_size", 1), "lists 2 ranks for ep_size 1"),
        (lambda d: d.__setitem__("experts_over_dp", True), "needs data parallelism without expert parallelism"),
        (lambda d: d.__setitem__("experts_over_dp", "yes"), "must be true or false"),
    ],
    ids=["replica-missing", "replica-duplicated", "foreign-file", "pattern-without-dp", "ep-size", "over-dp", "bool"],
)
def test_a_damaged_replica_manifest_is_refused(tmp_path, edit, match):
    save_replicas(tmp_path, moe_weights(), 1, 2, "linear")
    edit_manifest(tmp_path, edit)
    with pytest.raises(CheckpointCorrupt, match=match):
        read_manifest(str(tmp_path))


def test_a_stacked_tensor_of_more_experts_than_any_placement_is_named_as_damage(tmp_path):
    """A stacked tensor recorded with 2^40 experts (geometry and the ranks' shapes agreeing): an
    offline reshard of experts cut across TP x DP listed every expert id before a file was checked,
    a bare MemoryError (with a smaller absurd count, gigabytes). The count is bounded as a
    placement's is, and the manifest is refused as damaged."""
    from vllm_sharded_loader.format.experts import MAX_EXPERTS
    from vllm_sharded_loader.tools.offline import reshard_checkpoint

    name = "model.layers.0.mlp.experts.w2_bias"
    save_flat(tmp_path / "ckpt", moe_weights(), 1, 2)

    def stack_more(data):
        data["geometry"][name]["shape"][0] = 2**40
        for entry in data["ranks"]:
            if name in entry["tensors"]:
                entry["tensors"][name]["shape"][0] = 2**40

    edit_manifest(tmp_path / "ckpt", stack_more)
    damaged = rf"geometry of {name} .* stacks {2**40} experts, more than {MAX_EXPERTS}\. The manifest is damaged"
    with pytest.raises(CheckpointCorrupt, match=damaged):
        reshard_checkpoint(open_store(str(tmp_path / "ckpt")), str(tmp_path / "out"), 1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit", [lambda d: d.pop("dp_size"), lambda d: d.__setitem__("dp_size", 4)])
def test_a_pattern_that_does_not_fit_the_recorded_replicas_is_named_as_damage(tmp_path, edit):
    # The pattern check's own advice is for a save ("Use '...'"); in a published manifest the
    # refusal names the manifest and says it is damaged.
    save_replicas(tmp_path, moe_weights(), 1, 2, "linear")
    edit_manifest(tmp_path, edit)
    with pytest.raises(CheckpointCorrupt, match=r"sharded_state.json: .*data-parallel rank.*The manifest is damaged"):
        read_manifest(str(tmp_path))


def test_a_later_replica_holding_more_than_its_experts_is_refused(tmp_path):
    """A later replica's entry may hold only what the first replica's same rank holds (its
    experts): a tensor only it lists is refused when the manifest is read."""
    save_replicas(tmp_path, moe_weights(), 1, 2, "linear")

    def add(data):
        entry = data["ranks"][1]
        entry["tensors"]["model.extra"] = dict(next(iter(entry["tensors"].values())))

    edit_manifest(tmp_path, add)
    with pytest.raises(CheckpointCorrupt, match=r"replica 1 .* lists tensors replica 0 does not: \['model.extra'\]"):
        read_manifest(str(tmp_path))


def test_only_the_first_replica_saves_without_experts_placed_across_replicas(tmp_path):
    weights = moe_weights()
    ranks = dict(moe_rank(weights, 1, None, 0) for _ in range(1))
    (rank,) = ranks
    ranks[RankInfo(0, 1, dp_rank=1, dp_size=2)] = ranks[rank]
    with pytest.raises(InvalidOption):
        save_checkpoint(str(tmp_path), ranks, dtype="float32", source=SOURCE)
    assert not list(tmp_path.iterdir())


def test_a_hub_rank_of_a_later_replica_fetches_its_own_experts(tmp_path):
    """Per-rank Hub fetches of a checkpoint saved per replica (TP=2 x DP=2): a worker of the
    second replica at the saved placement fetches its own expert parts and the first
    replica's parts of its TP rank (the norm), never another rank's; a worker of the first
    replica only its own parts."""
    from vllm_sharded_loader.storage.hub import rank_fetch_patterns

    weights = moe_weights()
    manifest = save_replicas(tmp_path, weights, 2, 2, "linear")
    files = {(d, t): {f.name for f in manifest.rank(t, 0, d).files} for d in range(2) for t in range(2)}
    workers = serving_ranks(weights, (2, 2, "linear"))
    for rank, expected in workers:
        fetched = set(rank_fetch_patterns(manifest, rank, list(expected)))
        own = files[(rank.dp_rank, rank.tp_rank)]
        assert own <= fetched, rank
        assert fetched - own <= files[(0, rank.tp_rank)], rank  # only the first replica's, for the norm


# ------------------------------------------------ experts cut across TP x DP (data parallelism without EP)


FLAT = [(1, 2), (2, 2), (1, 4)]


@pytest.mark.parametrize(
    "serving",
    [*FLAT, (2, 1), (1, 1), (4, 1), (2, 2, "round_robin"), (1, 2, "linear")],
    ids=lambda p: "to-" + "-".join(map(str, p)),
)
@pytest.mark.parametrize("saved", FLAT, ids=lambda p: "tp{}-dp{}".format(*p))
def test_experts_cut_across_tp_and_dp_load_at_every_topology(tmp_path, saved, serving):
    """Saved under data parallelism without expert parallelism (each expert cut across TP x DP,
    each replica writing its slices): every serving worker, whether its experts are cut across
    TP x DP, TP only, or placed whole under expert parallelism, gets them byte for byte."""
    weights = moe_weights(intermediate=32)
    manifest = save_flat(tmp_path, weights, *saved)
    assert manifest.experts_over_dp and manifest.replicas == saved[1] and manifest.expert_tp_size == saved[0] * saved[1]
    manifest = read_manifest(str(tmp_path))
    if len(serving) == 3:
        workers = serving_ranks(weights, serving)
    elif serving[1] > 1:
        workers = [
            flat_rank(weights, serving[0], serving[1], d, t) for d in range(serving[1]) for t in range(serving[0])
        ]
    else:
        workers = serving_ranks(weights, (serving[0], None))
    for rank, expected in workers:
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest, verify="checksum"), targets, rank)
        for name, x in expected.items():
            assert torch.equal(targets[name], x), (name, rank)


def test_a_checkpoint_without_dp_serves_experts_cut_across_tp_and_dp(tmp_path):
    """A TP=2 checkpoint served at TP=1 x DP=2 without expert parallelism: each replica's worker
    holds half of every expert (vLLM's TP x DP cut), read from the saved rank of its index."""
    weights = moe_weights(intermediate=32)
    save_moe(tmp_path, weights, 2, None)
    manifest = read_manifest(str(tmp_path))
    for d in range(2):
        rank, expected = flat_rank(weights, 1, 2, d, 0)
        del expected[NORM]  # save_moe saves the experts only
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest, verify="checksum"), targets, rank)
        assert all(torch.equal(targets[n], x) for n, x in expected.items()), d


def test_an_opaque_expert_tensor_cut_across_tp_and_dp_loads_only_at_its_cut(tmp_path):
    """Experts without geometry saved cut across TP x DP=2: each worker of the saved topology
    copies its own index's cut, the second replica's included, and so does TP=2 without DP (the
    same cut); another cut (TP=1) is refused before a byte lands, never served one rank's cut."""
    weights = moe_weights(intermediate=32)
    save_flat(tmp_path, weights, 1, 2, opaque_w2=True)
    manifest = read_manifest(str(tmp_path))
    workers = [flat_rank(weights, 1, 2, d, 0) for d in range(2)] + serving_ranks(weights, (2, None))
    for rank, expected in workers:
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, rank)
        assert all(torch.equal(targets[n], x) for n, x in expected.items()), rank
    rank, expected = serving_ranks(weights, (1, None))[0]
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    with pytest.raises(CheckpointMismatch):
        load_rank(LoadRequest(open_store(str(tmp_path)), manifest), targets, rank)
    assert all(bool((x == -7).all()) for x in targets.values())
