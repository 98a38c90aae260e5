"""Resharding at load time, checked against an independent reference of vLLM's rules.

Each test builds global tensors, shards them with :func:`reference_shard` (written from
vLLM's layer code, not from the module under test), writes every saved rank's local
tensors at known offsets into per-file byte buffers (junk around them, garbage in the
vocabulary padding), executes the planned reads on those bytes, and compares the result
with the reference shard at the serving TP size. The executor also checks that every
destination element is written exactly once and no saved byte is read twice.
"""

from __future__ import annotations

import json
import math
import types
from dataclasses import dataclass
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.reference import (
    DTYPES,
    PADDING_GARBAGE,
    Model,
    Tensor,
    execute,
    llama_like,
    make_tensor,
    reference_pp_indices,
    reference_shard,
)
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointMismatch, InvalidOption
from vllm_sharded_loader.format.geometry import (
    Segment,
    TensorGeometry,
    column_parallel,
    merged_column_parallel,
    pad_vocab_size,
    qkv_parallel,
    replicated,
    row_parallel,
    vocab_parallel,
    vocab_parallel_bias,
)
from vllm_sharded_loader.planning.layout import shard_layout
from vllm_sharded_loader.planning.pipeline import layer_index, pp_layer_ranges
from vllm_sharded_loader.planning.reads import (
    Read,
    SavedCheckpoint,
    SavedRank,
    SavedTensor,
    Strided,
    TensorPlan,
    plan_reads,
)
from vllm_sharded_loader.planning.topology import RankInfo

TP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2, 4)


# ------------------------------------------------------------ reference of vLLM's rules


# ----------------------------------------------------------------------- test models


# --------------------------------------------------------------- save and execute


@dataclass
class Checkpoint:
    tp_size: int
    pp_size: int
    files: dict[str, bytearray]
    ranks: list[SavedRank]

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for r in self.ranks for t in r.tensors.values())


def save(model: Model, tp_size: int, pp_size: int, seed: int = 1) -> Checkpoint:
    """Every saved rank's local tensors in two files each, at odd offsets between junk bytes."""
    rng = np.random.default_rng(seed)
    files: dict[str, bytearray] = {}
    ranks = []
    for pp_rank in range(pp_size):
        names = model.stage_names(pp_size, pp_rank)
        for tp_rank in range(tp_size):
            saved = {}
            half = (len(names) + 1) // 2
            for part, part_names in enumerate([names[:half], names[half:]]):
                file = f"model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
                buf = bytearray(rng.integers(0, 256, size=int(rng.integers(1, 40)), dtype=np.uint8).tobytes())
                for name in part_names:
                    t = model.tensors[name]
                    # Garbage in the padding: a correct plan zero-fills it and never reads it.
                    local = reference_shard(t.spec, t.data, tp_size, tp_rank, pad_value=PADDING_GARBAGE)
                    saved[name] = SavedTensor(file, len(buf), local.itemsize, local.shape, t.geometry)
                    buf += np.ascontiguousarray(local).tobytes()
                    buf += rng.integers(0, 256, size=int(rng.integers(0, 9)), dtype=np.uint8).tobytes()
                files[file] = buf
            ranks.append(SavedRank(tp_rank, pp_rank, saved))
    return Checkpoint(tp_size, pp_size, files, ranks)


def serve(
    model: Model, checkpoint: Checkpoint, tp_size: int, pp_size: int
) -> dict[tuple[int, int], tuple[int, dict[str, TensorPlan]]]:
    """Plan and execute every serving rank; assert each tensor equals the reference shard."""
    results = {}
    for pp_rank in range(pp_size):
        needed = model.stage_names(pp_size, pp_rank)
        for tp_rank in range(tp_size):
            plan = plan_reads(
                SavedCheckpoint(checkpoint.ranks, checkpoint.tp_size),
                needed,
                RankInfo(tp_rank, tp_size, pp_rank),
                model.tied_groups,
            )
            assert list(plan.tensors) == needed
            read_counts: dict[str, np.ndarray] = {}
            for name, tensor_plan in plan.tensors.items():
                t = model.tensors[name]
                got = execute(tensor_plan, checkpoint.files, read_counts)
                want = reference_shard(t.spec, t.data, tp_size, tp_rank)
                assert got.shape == want.shape, name
                np.testing.assert_array_equal(got, want, err_msg=f"{name} at TP={tp_size} rank {tp_rank}")
            for file, counts in read_counts.items():
                assert counts.max() <= 1, f"pp_rank={pp_rank} tp_rank={tp_rank} read bytes of {file} twice"
            results[(pp_rank, tp_rank)] = (plan.bytes_read, plan.tensors)
    return results


# ------------------------------------------------------------------------ resharding


TP_PAIRS = [(a, b) for a in TP_SIZES for b in TP_SIZES]


@pytest.mark.parametrize(("saved_tp", "serving_tp"), TP_PAIRS, ids=[f"tp{a}-to-tp{b}" for a, b in TP_PAIRS])
def test_tensor_parallel_resharding_in_every_direction(saved_tp, serving_tp):
    # 8 query heads and 2 KV heads: KV heads are replicated at TP=4 and TP=8, on both sides.
    model = llama_like(heads=8, kv_heads=2, vocab=1000)
    serve(model, save(model, saved_tp, 1), serving_tp, 1)


PP_PAIRS = [(a, b) for a in PP_SIZES for b in PP_SIZES]


@pytest.mark.parametrize(("saved_pp", "serving_pp"), PP_PAIRS, ids=[f"pp{a}-to-pp{b}" for a, b in PP_PAIRS])
@pytest.mark.parametrize(("saved_tp", "serving_tp"), [(1, 1), (2, 4), (8, 2)])
def test_pipeline_resharding_in_every_direction(saved_pp, serving_pp, saved_tp, serving_tp):
    model = llama_like(num_layers=5, tied=False)
    serve(model, save(model, saved_tp, saved_pp), serving_tp, serving_pp)


@pytest.mark.parametrize(("saved", "serving"), [((1, 1), (2, 2)), ((2, 2), (1, 1)), ((4, 1), (1, 4)), ((1, 4), (8, 2))])
def test_tied_embeddings_are_read_from_the_one_saved_copy(saved, serving):
    # Saved once as lm_head.weight on the last stage; the first serving stage needs it as
    # model.embed_tokens.weight, and a first saved stage holds it under that name.
    model = llama_like(tied=True, num_layers=4)
    checkpoint = save(model, *saved)
    names = {n for r in checkpoint.ranks for n in r.tensors}
    assert "lm_head.weight" in names
    results = serve(model, checkpoint, *serving)
    first_stage = results[(0, 0)][1]
    if serving[1] == 1:
        assert "model.embed_tokens.weight" not in first_stage  # held once, as lm_head.weight
    else:
        expected = "lm_head.weight" if saved[1] == 1 else "model.embed_tokens.weight"
        assert first_stage["model.embed_tokens.weight"].source_name == expected


@pytest.mark.parametrize("vocab", [1000, 100, 64, 1, 1088])
@pytest.mark.parametrize(("saved_tp", "serving_tp"), [(1, 8), (8, 1), (2, 8), (8, 4), (4, 2)])
def test_padded_vocabulary_is_zero_filled_never_read(vocab, saved_tp, serving_tp):
    model = llama_like(vocab=vocab, num_layers=1)
    results = serve(model, save(model, saved_tp, 1), serving_tp, 1)
    padded = pad_vocab_size(vocab)
    rows_zeroed = (
        sum(z.total for _, plans in results.values() for z in plans["lm_head.weight"].zero_fills)
        // model.tensors["lm_head.weight"].data.shape[1]
    )
    assert rows_zeroed == padded - vocab
    if vocab == 100 and serving_tp == 8:
        # Rank 7 holds rows 112..127: all padding, nothing to read.
        assert results[(0, 7)][1]["lm_head.weight"].reads == ()


@pytest.mark.parametrize(("saved_tp", "serving_tp"), [(1, 8), (8, 1), (2, 4), (8, 2), (4, 8)])
def test_added_vocabulary_is_sharded_after_the_base_vocabulary(saved_tp, serving_tp):
    # vLLM's docstring example: 1010 base + 16 added tokens, padded to 1024 + 64.
    model = llama_like(vocab=1010, added_vocab=16, num_layers=1)
    assert model.tensors["lm_head.weight"].geometry.shape == (1088, 32)
    serve(model, save(model, saved_tp, 1), serving_tp, 1)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 1), (8, 8), (16, 4), (8, 2)])
@pytest.mark.parametrize(("saved_tp", "serving_tp"), [(1, 8), (8, 1), (2, 8), (8, 4), (4, 2), (8, 8)])
def test_grouped_query_attention(heads, kv_heads, saved_tp, serving_tp):
    model = llama_like(heads=heads, kv_heads=kv_heads, num_layers=1, itemsize=2)
    serve(model, save(model, saved_tp, 1), serving_tp, 1)


def test_replicated_kv_heads_are_read_once_from_one_holder():
    # 2 KV heads saved at TP=8: saved ranks 0-3 hold head 0 and ranks 4-7 head 1.
    model = llama_like(heads=8, kv_heads=2, head_size=4, num_layers=1)
    checkpoint = save(model, 8, 1)
    plan = plan_reads(
        SavedCheckpoint(checkpoint.ranks, 8), ["model.layers.0.self_attn.qkv_proj.weight"], RankInfo(0, 1)
    )
    reads = plan.tensors["model.layers.0.self_attn.qkv_proj.weight"].reads
    k_reads = [r for r in reads if 32 * 32 <= r.dest.offset < 40 * 32]
    assert len(k_reads) == 2 and len(reads) == 8 + 2 + 2
    layout = shard_layout(model.tensors["model.layers.0.self_attn.qkv_proj.weight"].geometry, 8, 5)
    assert [(p.segment, p.start, p.length, p.local_offset) for p in layout.pieces] == [
        ("q", 20, 4, 0),
        ("k", 4, 4, 4),
        ("v", 4, 4, 8),
    ]


def test_same_topology_reads_each_tensor_in_one_run():
    model = llama_like(num_layers=2)
    checkpoint = save(model, 4, 2)
    for _, plans in serve(model, checkpoint, 4, 2).values():
        for t in plans.values():
            assert len(t.reads) == 1 and t.reads[0].source.count == 1
            assert not t.zero_fills or t.name in ("lm_head.weight", "model.embed_tokens.weight")


def test_reads_are_strided_only_for_splits_along_dimension_1():
    model = llama_like(num_layers=1)
    checkpoint = save(model, 1, 1)
    plan = plan_reads(SavedCheckpoint(checkpoint.ranks, 1), list(model.tensors), RankInfo(1, 2))
    down = plan.tensors["model.layers.0.mlp.down_proj.weight"].reads
    saved = checkpoint.ranks[0].tensors["model.layers.0.mlp.down_proj.weight"]
    assert down == (Read(saved.file, Strided(saved.offset + 24 * 4, 24 * 4, 48 * 4, 32), Strided(0, 24, 24, 32)),)
    gate_up = plan.tensors["model.layers.0.mlp.gate_up_proj.weight"].reads
    assert [r.source.count for r in gate_up] == [1, 1]
    assert [r.source.length for r in gate_up] == [24 * 32 * 4] * 2


def test_tp1_to_tp2_reads_about_half_the_checkpoint():
    model = llama_like(num_layers=4, vocab=32000 // 16)
    checkpoint = save(model, 1, 1)
    results = serve(model, checkpoint, 2, 1)
    total = checkpoint.tensor_bytes
    for (_, tp_rank), (bytes_read, _) in results.items():
        # Replicated norms, scales and row biases are read whole by both ranks; vocabulary
        # padding by neither.
        assert abs(bytes_read / total - 0.5) < 0.02, (tp_rank, bytes_read / total)
    plans = {
        rank: plan_reads(SavedCheckpoint(checkpoint.ranks, 1), model.stage_names(1, 0), RankInfo(rank[1], 2))
        for rank in results
    }
    assert {k: p.bytes_read for k, p in plans.items()} == {k: v[0] for k, v in results.items()}
    by_file = [r.source.total for t in plans[(0, 0)].tensors.values() for r in t.reads]
    assert sum(by_file) == plans[(0, 0)].bytes_read
    assert len(plans[(0, 0)].tensors) == len(model.tensors)


def test_replicated_tensors_spread_over_saved_copies():
    model = llama_like(num_layers=1)
    checkpoint = save(model, 4, 1)
    files = [
        plan_reads(SavedCheckpoint(checkpoint.ranks, 4), ["model.norm.weight"], RankInfo(r, 4)).tensors[
            "model.norm.weight"
        ]
        for r in range(4)
    ]
    assert [f.reads[0].file for f in files] == [f"model-pp-0-tp-{r}-part-1.safetensors" for r in range(4)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["column", "row", "merged", "qkv", "vocab", "replicated", "grouped"]),
    saved_tp=st.sampled_from(TP_SIZES),
    serving_tp=st.sampled_from(TP_SIZES),
    itemsize=st.sampled_from(sorted(DTYPES)),
    units=st.integers(1, 3),
    trailing=st.sampled_from([(), (3,), (2, 3)]),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    vocab=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_any_geometry_reshards_to_the_reference(
    kind, saved_tp, serving_tp, itemsize, units, trailing, kv_heads, vocab, seed
):
    rng = np.random.default_rng(seed)
    dtype = DTYPES[itemsize]
    rows = 8 * units  # divisible by every TP size
    if kind == "qkv":
        spec, shape = ("qkv", 8 * units, kv_heads, 2), ((8 * units + 2 * kv_heads) * 2, *trailing)
    elif kind == "merged":
        spec, shape = ("merged", [rows, 2 * rows, rows]), (4 * rows, *trailing)
    elif kind == "grouped":
        # Mamba-2's in_proj: one group of B/C states (every rank holds it whole), or 8 (split by group).
        groups = 1 if kv_heads < 4 else 8
        b_c = (groups * units, groups)
        spec, shape = ("grouped", [(rows, None), (rows, None), b_c, b_c, (8, None)]), (2 * rows + 2 * b_c[0] + 8,)
    elif kind == "vocab":
        spec, shape = ("vocab", vocab, 0, 16), (vocab, *trailing[:1])
    elif kind == "row":
        spec, shape = ("row",), (3, rows, *trailing)
    else:
        spec, shape = (kind,), (rows, *trailing)
    tensor = make_tensor(spec, shape, dtype, rng, "Layer")
    model = Model({"model.layers.0.x": tensor}, num_layers=1, tied=False)
    serve(model, save(model, saved_tp, 1, seed=seed), serving_tp, 1)


# ---------------------------------------------------------------------- geometry data


def test_geometry_round_trips_through_json():
    geometries = [
        qkv_parallel([(8 + 2 * 2) * 64, 512], num_heads=8, num_kv_heads=2, head_size=64),
        qkv_parallel([8 * 64 + 2 * 64 + 2 * 32], 8, 2, 64, v_head_size=32),
        merged_column_parallel([2 * 1376, 512], [1376, 1376]),
        row_parallel([512, 1376]),
        column_parallel([16]),
        replicated([], "Attention"),
        vocab_parallel(1010, 32, org_vocab_size=1000),
        vocab_parallel_bias(1000),
        TensorGeometry("opaque", "FusedMoE", (8, 16, 4)),
    ]
    for g in geometries:
        text = json.dumps(g.to_dict())
        assert TensorGeometry.from_dict(json.loads(text), "t") == g
    assert geometries[0].to_dict() == {
        "kind": "qkv_parallel",
        "layer_class": "QKVParallelLinear",
        "shape": [768, 512],
        "split_dim": 0,
        "segments": [
            {"name": "q", "size": 512, "heads": 8, "head_size": 64},
            {"name": "k", "size": 128, "heads": 2, "head_size": 64, "replicate_heads": True},
            {"name": "v", "size": 128, "heads": 2, "head_size": 64, "replicate_heads": True},
        ],
    }
    assert vocab_parallel(1010, 32, org_vocab_size=1000).to_dict()["segments"] == [
        {"name": "vocab", "size": 1000, "padded_size": 1024},
        {"name": "added", "size": 10, "padded_size": 64},
    ]


def good_qkv() -> dict:
    return qkv_parallel([12, 4], 8, 2, 1).to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(shape="12x4"), "'shape' must be a list"),
        (lambda d: d.update(split_dim=2), "along dimension 0, found split_dim=2"),
        # A 2-D tensor may be laid out [in, out] (AWQ, GPTQ), but its segments must then fit dimension 1.
        (lambda d: d.update(split_dim=1), "segments add up to 12 rows in units of 1 along dimension 1"),
        (lambda d: d.update(split_dim=True), "'split_dim' must be an integer"),
        (lambda d: d.pop("layer_class"), "'layer_class' must be a non-empty string"),
        (lambda d: d.update(extra=1), r"unknown keys \['extra'\]"),
        (lambda d: d["segments"][0].update(size=-1), "'size' must be an integer >= 0"),
        (lambda d: d["segments"][0].update(heads=4), "4 heads of 1 but size 8"),
        (lambda d: d["segments"][1].pop("replicate_heads"), "K and V"),
        (lambda d: d["segments"].pop(), "segments add up to 10"),
        (lambda d: d["segments"][0].update(name="k"), "repeat"),
        (lambda d: d["segments"][0].pop("heads"), "both 'heads' and 'head_size'"),
        (lambda d: d["segments"][2].update(replicate_heads="yes"), "must be true or false"),
        (lambda d: d.update(segments={}), "'segments' must be a list"),
        (lambda d: d.update(kind="replicated"), "no split dimension"),
        (lambda d: d.update(kind="column_parallel"), "only a QKV or grouped tensor is split by heads"),
        (lambda d: d.update(kind="grouped_column_parallel"), "each grouped segment replicates"),
    ],
)
def test_bad_geometry_data_is_refused_naming_the_tensor(change, message):
    data = good_qkv()
    change(data)
    with pytest.raises(CheckpointCorrupt, match=message) as info:
        TensorGeometry.from_dict(data, "model.layers.3.self_attn.qkv_proj.weight")
    assert "model.layers.3.self_attn.qkv_proj.weight" in str(info.value)


def test_a_sharding_kind_of_a_later_version_is_refused_as_a_mismatch():
    data = dict(good_qkv(), kind="diagonal")
    with pytest.raises(
        CheckpointMismatch, match=r"unknown sharding kind 'diagonal'.* Upgrade vllm-sharded-loader"
    ) as info:
        TensorGeometry.from_dict(data, "model.layers.3.self_attn.qkv_proj.weight")
    assert "model.layers.3.self_attn.qkv_proj.weight" in str(info.value)


def test_bad_geometry_objects_are_refused():
    with pytest.raises(CheckpointCorrupt):
        TensorGeometry.from_dict([], "t")
    bad_vocab = vocab_parallel(100, 4).to_dict()
    bad_vocab["segments"][0]["padded_size"] = 50
    bad_vocab["shape"] = [50, 4]
    with pytest.raises(CheckpointCorrupt, match="padded_size 50 < size 100"):
        TensorGeometry.from_dict(bad_vocab, "lm_head.weight")


def test_layout_is_the_concatenation_of_segment_pieces():
    g = vocab_parallel(100, 8)
    layout = shard_layout(g, 8, 6, "lm_head.weight")
    assert layout.shape == (16, 8)
    assert layout.pieces[0].start == 96 and layout.pieces[0].data_length == 4 and layout.pieces[0].padding == 12
    q = shard_layout(qkv_parallel([12 * 4], 8, 2, 4), 2, 1)
    assert [(p.segment, p.global_offset, p.local_offset) for p in q.pieces] == [
        ("q", 16, 0),
        ("k", 36, 16),
        ("v", 44, 20),
    ]
    assert shard_layout(replicated([3], "RMSNorm"), 8, 7).shape == (3,)


# --------------------------------------------------------------------------- errors


def single(name: str, geometry: TensorGeometry | None, tp_size: int, shape: tuple[int, ...]) -> list[SavedRank]:
    return [SavedRank(r, 0, {name: SavedTensor(f"f{r}", 8, 2, shape, geometry)}) for r in range(tp_size)]


def test_unknown_or_missing_geometry_is_an_error_when_the_tp_size_changes():
    name = "model.layers.0.mlp.experts.w13_weight"
    opaque = TensorGeometry("opaque", "FusedMoE", (8, 16, 4))
    with pytest.raises(CheckpointMismatch, match=rf"{name} \(FusedMoE\) cannot be resharded from TP=2 to TP=1"):
        plan_reads(SavedCheckpoint(single(name, opaque, 2, (8, 16, 4)), 2), [name], RankInfo(0, 1))
    with pytest.raises(CheckpointMismatch, match=rf"{name} cannot be resharded from TP=2 to TP=4: .* no geometry"):
        plan_reads(SavedCheckpoint(single(name, None, 2, (8, 16, 4)), 2), [name], RankInfo(0, 4))
    # At the same TP size, any tensor is its own shard: copied whole, whatever the PP split.
    for geometry in (opaque, None):
        plan = plan_reads(SavedCheckpoint(single(name, geometry, 2, (8, 16, 4)), 2), [name], RankInfo(1, 2))
        assert plan.tensors[name].reads == (
            Read("f1", Strided(8, 8 * 16 * 4 * 2, 8 * 16 * 4 * 2), Strided(0, 512, 512)),
        )


def test_tp_sizes_vllm_refuses_are_refused():
    g = qkv_parallel([(8 + 2 * 3) * 2, 4], 8, 3, 2)
    with pytest.raises(CheckpointMismatch, match=r"qkv \(QKVParallelLinear\): segment 'q' of 8 heads .* TP=3"):
        shard_layout(g, 3, 0, "qkv")
    with pytest.raises(CheckpointMismatch, match=r"segment 'k' of 3 heads cannot be split across TP=4"):
        shard_layout(g, 4, 0, "qkv")
    with pytest.raises(InvalidOption):
        shard_layout(g, 4, 4, "qkv")
    g = vocab_parallel(100, 4, padding_size=10)
    with pytest.raises(CheckpointMismatch, match="segment 'vocab' of 100 indices"):
        plan_reads(SavedCheckpoint(single("e", g, 1, (100, 4)), 1), ["e"], RankInfo(0, 8))


def test_damaged_or_incomplete_saved_side_is_an_error():
    g = column_parallel([16, 4])
    with pytest.raises(CheckpointMismatch, match=r"needs tensors no saved rank holds: b, c"):
        plan_reads(SavedCheckpoint(single("a", g, 2, (8, 4)), 2), ["a", "b", "c"], RankInfo(0, 1))
    with pytest.raises(CheckpointCorrupt, match=r"a of saved pp_rank=0 tp_rank=0 has shape \[16, 4\]"):
        plan_reads(SavedCheckpoint(single("a", g, 2, (16, 4)), 2), ["a"], RankInfo(0, 1))
    ranks = single("a", g, 2, (8, 4))
    ranks[1] = SavedRank(1, 0, {"a": SavedTensor("f1", 8, 2, (8, 4), column_parallel([16, 4], "Other"))})
    with pytest.raises(CheckpointCorrupt, match="records geometry"):
        plan_reads(SavedCheckpoint(ranks, 2), ["a"], RankInfo(0, 1))
    with pytest.raises(CheckpointCorrupt, match="saved tp_rank=1 does not hold it"):
        plan_reads(SavedCheckpoint(single("a", g, 2, (8, 4))[:1], 2), ["a"], RankInfo(0, 1))
    with pytest.raises(CheckpointCorrupt, match="listed twice"):
        plan_reads(SavedCheckpoint(single("a", g, 2, (8, 4)) * 2, 2), ["a"], RankInfo(0, 1))
    with pytest.raises(CheckpointCorrupt, match="outside TP=1"):
        plan_reads(SavedCheckpoint(single("a", g, 2, (8, 4)), 1), ["a"], RankInfo(0, 1))


# ---------------------------------------------------------------- pipeline stages


@pytest.mark.parametrize("num_layers", [1, 2, 3, 4, 5, 7, 10, 11, 32, 61])
@pytest.mark.parametrize("pp_size", [1, 2, 3, 4, 8])
def test_pp_layer_ranges_mirror_vllm(num_layers, pp_size):
    ranges = pp_layer_ranges(num_layers, pp_size)
    assert [(r.start, r.stop) for r in ranges] == [reference_pp_indices(num_layers, p, pp_size) for p in range(pp_size)]
    for layer in range(num_layers):
        assert sum(layer in r for r in ranges) == 1


def test_pp_layer_ranges_examples_and_explicit_partition():
    assert pp_layer_ranges(5, 4) == (range(0, 1), range(1, 2), range(2, 4), range(4, 5))
    assert pp_layer_ranges(3, 4) == (range(0, 1), range(1, 2), range(2, 3), range(3, 3))
    assert pp_layer_ranges(10, 2, partition=[6, 4]) == (range(0, 6), range(6, 10))
    with pytest.raises(InvalidOption):
        pp_layer_ranges(10, 2, partition=[5, 4])


def test_layer_index():
    assert layer_index("model.layers.7.mlp.down_proj.weight") == 7
    assert layer_index("model.language_model.layers.12.self_attn.qkv_proj.weight") == 12
    assert layer_index("transformer.h.3.attn.c_attn.weight") == 3
    assert layer_index("model.embed_tokens.weight") is None
    assert layer_index("model.norm.weight") is None
    assert layer_index("lm_head.weight") is None
    assert layer_index("model.layers_extra.3.weight") is None


# ---------------------------------------------------- against vLLM's own code


@pytest.fixture(scope="module")
def vllm_layers():
    """vLLM's layer classes, built on CPU with a fake TP group (importing vLLM takes seconds)."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.layers import linear, vocab_parallel_embedding

    def build(cls, tp_size, tp_rank, *args, **kwargs):
        group = types.SimpleNamespace(world_size=tp_size, rank_in_group=tp_rank)
        with mock.patch.object(parallel_state, "get_tp_group", return_value=group):
            return cls(*args, params_dtype=torch.float32, **kwargs)

    return types.SimpleNamespace(
        torch=torch, build=build, linear=linear, vocab=vocab_parallel_embedding, get_pp_indices=get_pp_indices
    )


def test_reference_and_plans_match_vllms_weight_loaders(vllm_layers):
    """Load HF tensors with vLLM's real weight loaders at every TP size and rank; the
    reference shard and the plan from a TP=1 checkpoint give the same local tensors."""
    torch, build, linear, vocab = vllm_layers.torch, vllm_layers.build, vllm_layers.linear, vllm_layers.vocab
    heads, kv_heads, head_size, hidden, inter, vocab_size = 8, 2, 4, 32, 48, 1000
    rng = np.random.default_rng(3)

    def f32(shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k, v = f32((heads * head_size, hidden)), f32((kv_heads * head_size, hidden)), f32((kv_heads * head_size, hidden))
    gate, up, down, embed = f32((inter, hidden)), f32((inter, hidden)), f32((hidden, inter)), f32((vocab_size, hidden))
    qkv_bias = f32(((heads + 2 * kv_heads) * head_size,))
    hf = {
        "qkv.weight": (("qkv", heads, kv_heads, head_size), np.concatenate([q, k, v])),
        "qkv.bias": (("qkv", heads, kv_heads, head_size), qkv_bias),
        "gate_up.weight": (("merged", [inter, inter]), np.concatenate([gate, up])),
        "down.weight": (("row",), down),
        "embed.weight": (("vocab", vocab_size, 0, 64), embed),
    }
    model = Model(
        {
            name: Tensor(spec, data, make_tensor(spec, data.shape, np.int32, rng, "L").geometry)
            for name, (spec, data) in hf.items()
        },
        num_layers=0,
        tied=False,
    )
    checkpoint = save(model, 1, 1)
    for tp_size in TP_SIZES:
        for tp_rank in range(tp_size):
            qkv_layer = build(linear.QKVParallelLinear, tp_size, tp_rank, hidden, head_size, heads, kv_heads, bias=True)
            mlp_layer = build(linear.MergedColumnParallelLinear, tp_size, tp_rank, hidden, [inter, inter], bias=False)
            down_layer = build(linear.RowParallelLinear, tp_size, tp_rank, inter, hidden, bias=False)
            embed_layer = build(vocab.VocabParallelEmbedding, tp_size, tp_rank, vocab_size, hidden)
            b = np.split(qkv_bias, [heads * head_size, (heads + kv_heads) * head_size])
            for shard_id, w, bias in zip("qkv", (q, k, v), b, strict=True):
                qkv_layer.weight.weight_loader(qkv_layer.weight, torch.from_numpy(w), shard_id)
                qkv_layer.bias.weight_loader(qkv_layer.bias, torch.from_numpy(bias), shard_id)
            for shard_id, w in enumerate((gate, up)):
                mlp_layer.weight.weight_loader(mlp_layer.weight, torch.from_numpy(w), shard_id)
            down_layer.weight.weight_loader(down_layer.weight, torch.from_numpy(down))
            embed_layer.weight.weight_loader(embed_layer.weight, torch.from_numpy(embed))
            loaded = {
                "qkv.weight": qkv_layer.weight,
                "qkv.bias": qkv_layer.bias,
                "gate_up.weight": mlp_layer.weight,
                "down.weight": down_layer.weight,
                "embed.weight": embed_layer.weight,
            }
            plan = plan_reads(SavedCheckpoint(checkpoint.ranks, 1), list(hf), RankInfo(tp_rank, tp_size))
            for name, (spec, data) in hf.items():
                vllm_local = loaded[name].detach().numpy()
                np.testing.assert_array_equal(reference_shard(spec, data, tp_size, tp_rank), vllm_local, err_msg=name)
                got = execute(plan.tensors[name], checkpoint.files, {}).view(np.float32)
                np.testing.assert_array_equal(got, vllm_local, err_msg=f"{name} TP={tp_size} rank {tp_rank}")


@pytest.mark.parametrize("groups", [1, 8])
def test_grouped_plans_match_vllms_mamba2_loader(vllm_layers, groups):
    """Mamba-2's in_proj (gate, x, B, C, dt) planned from a TP=1 checkpoint gives, at every TP size
    and rank, what vLLM's own ``mamba_v2_sharded_weight_loader`` loads from the HF tensor: with one
    group every rank gets the whole group (vLLM's extra groups), with 8 each its own share."""
    torch = vllm_layers.torch
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader

    inner, state, heads = 32, 4, 8
    rng = np.random.default_rng(groups)
    b_c = (groups * state, groups)
    spec = ("grouped", [(inner, None), (inner, None), b_c, b_c, (heads, None)])
    rows = 2 * inner + 2 * groups * state + heads
    tensor = make_tensor(spec, (rows, 3), np.int32, rng, "MambaMixer2")
    checkpoint = save(Model({"in_proj.weight": tensor}, num_layers=0, tied=False), 1, 1)
    for tp_size in TP_SIZES:
        extra = 0 if groups % tp_size == 0 else tp_size - groups  # vLLM's extra_groups_for_head_shards
        group_settings = ((groups + extra) * state, extra * state, groups == 1)
        shard_spec = [(inner, 0, False), (inner, 0, False), group_settings, group_settings, (heads, 0, False)]
        local_rows = sum(full // tp_size for full, _, _ in shard_spec)
        for tp_rank in range(tp_size):
            param = torch.zeros((local_rows, 3), dtype=torch.int32)
            mamba_v2_sharded_weight_loader(shard_spec, tp_size, tp_rank)(param, torch.from_numpy(tensor.data))
            plan = plan_reads(SavedCheckpoint(checkpoint.ranks, 1), ["in_proj.weight"], RankInfo(tp_rank, tp_size))
            got = execute(plan.tensors["in_proj.weight"], checkpoint.files, {}).view(np.int32).reshape(local_rows, 3)
            np.testing.assert_array_equal(got, param.numpy(), err_msg=f"TP={tp_size} rank {tp_rank}")
            np.testing.assert_array_equal(reference_shard(spec, tensor.data, tp_size, tp_rank), param.numpy())


def test_vocab_indices_and_pp_split_match_vllm(vllm_layers):
    vocab, get_pp_indices = vllm_layers.vocab, vllm_layers.get_pp_indices
    for size in (1, 63, 64, 100, 1000, 32000, 151936):
        assert pad_vocab_size(size) == vocab.pad_vocab_size(size)
        for tp_size in TP_SIZES:
            geometry = vocab_parallel(size, 4)
            for tp_rank in range(tp_size):
                padded = pad_vocab_size(size)
                indices = vocab.VocabParallelEmbedding._get_indices(padded, padded, size, size, tp_rank, tp_size)
                (piece,) = shard_layout(geometry, tp_size, tp_rank).pieces
                assert (piece.start, piece.start + piece.length) == (
                    indices.padded_org_vocab_start_index,
                    indices.padded_org_vocab_end_index,
                )
                assert piece.data_length == indices.num_org_elements
    with mock.patch.dict("os.environ", {}, clear=False) as env:
        env.pop("VLLM_PP_LAYER_PARTITION", None)
        for num_layers in (1, 3, 5, 10, 11, 32, 61):
            for pp_size in (1, 2, 3, 4, 8):
                expected = [get_pp_indices(num_layers, p, pp_size) for p in range(pp_size)]
                assert [(r.start, r.stop) for r in pp_layer_ranges(num_layers, pp_size)] == expected


def test_segment_defaults():
    assert Segment("x", 5).padded == 5
    assert Segment("x", 5, padded_size=8).padded == 8
    assert math.prod(()) == 1
