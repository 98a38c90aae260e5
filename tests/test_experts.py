"""Expert placement under expert parallelism (issue 13), without an engine: vLLM's placement
rule, the manifest record, and the load-time check that refuses any other placement before
a byte is read."""

import json
import os

import pytest

from tests.support.states import assert_untouched, fresh_targets, load, save
from vllm_sharded_loader.format import Manifest
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointMismatch, Unsupported
from vllm_sharded_loader.format.experts import ExpertPlacement
from vllm_sharded_loader.planning.experts import check_expert_placement, expert_placement


def test_linear_and_round_robin_placements():
    assert expert_placement(8, 2, "linear").experts == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert expert_placement(8, 2, "round_robin").experts == ((0, 2, 4, 6), (1, 3, 5, 7))
    # Uneven: the first ranks take one more (vLLM's rule), never an expert twice.
    assert expert_placement(7, 3, "linear").experts == ((0, 1, 2), (3, 4), (5, 6))
    assert expert_placement(7, 3, "round_robin").experts == ((0, 3, 6), (1, 4), (2, 5))
    assert expert_placement(4, 1, "linear").experts == ((0, 1, 2, 3),)
    assert expert_placement(8, 2, "linear").expert_map(1) == [-1, -1, -1, -1, 0, 1, 2, 3]
    with pytest.raises(Unsupported, match="Unknown expert placement strategy 'random'"):
        expert_placement(8, 2, "random")


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize(("experts", "ep_size"), [(8, 2), (7, 3), (64, 8), (3, 4)])
def test_placement_is_vllms_expert_map(strategy, experts, ep_size):
    """The pure rule gives every rank exactly vLLM's own expert map."""
    expert_map_manager = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager")
    placement = expert_placement(experts, ep_size, strategy)
    for rank in range(ep_size):
        local, expert_map, _ = expert_map_manager.determine_expert_map(ep_size, rank, experts, strategy)
        wanted = list(range(experts)) if expert_map is None else expert_map.tolist()
        assert placement.expert_map(rank) == wanted
        assert len(placement.experts[rank]) == local


def test_the_same_placement_loads_and_any_other_is_refused():
    linear, robin = expert_placement(8, 2, "linear"), expert_placement(8, 2, "round_robin")
    check_expert_placement(None, None)
    check_expert_placement(linear, expert_placement(8, 2, "linear"), serving_ep_rank=1, tp_rank=1)
    # Same shapes on every rank, other experts: the silent re-route this check exists for.
    with pytest.raises(CheckpointMismatch, match=r"saved EP=2 linear .*serves them EP=2 round_robin.*other experts"):
        check_expert_placement(linear, robin)
    with pytest.raises(CheckpointMismatch, match=r"EP=4 linear.*tensor_parallel_size=2"):
        check_expert_placement(linear, expert_placement(8, 4, "linear"))
    with pytest.raises(CheckpointMismatch, match="serves them without expert parallelism"):
        check_expert_placement(linear, None)
    with pytest.raises(CheckpointMismatch, match=r"saved without expert parallelism .*without enable_expert_parallel"):
        check_expert_placement(None, linear)
    # The same EP size made of TP=1 x DP=2: TP rank 0 would read EP rank 0's files as EP rank 1.
    with pytest.raises(CheckpointMismatch, match=r"tp_rank=0 is EP rank 1 \(data parallelism\)"):
        check_expert_placement(linear, linear, serving_ep_rank=1, tp_rank=0)


def test_manifest_records_placement_and_data_parallel_size(tmp_path):
    manifest = save(tmp_path)
    recorded = Manifest(**{**manifest.__dict__, "experts": expert_placement(4, 2, "round_robin"), "dp_size": 2})
    recorded.__dict__.pop("geometries", None)
    again = Manifest.from_json(recorded.to_json())
    assert again.experts == expert_placement(4, 2, "round_robin") and again.dp_size == 2
    assert Manifest.from_json(manifest.to_json()).experts is None  # saved without: no key, None


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"experts": [[0, 1], [1, 2]]}, "does not hold each of the 4 experts exactly once"),
        ({"experts": [[0, 1, 2, 3]]}, "'experts' lists 1 ranks for ep_size 2"),
        ({"ep_size": 0}, "'ep_size' must be an integer >= 1"),
        ({"experts": [[0, 1], ["2", 3]]}, "must be a list of expert ids"),
        ({"extra": 1}, r"unknown keys \['extra'\]"),
    ],
)
def test_a_damaged_placement_is_refused(edit, message):
    data = {**expert_placement(4, 2, "linear").to_dict(), **edit}
    with pytest.raises(CheckpointCorrupt, match=message):
        ExpertPlacement.from_dict(data, "sharded_state.json")


def test_a_load_with_another_placement_reads_nothing(tmp_path):
    save(tmp_path)
    path = os.path.join(tmp_path, "sharded_state.json")
    with open(path) as f:
        data = json.load(f)
    data["expert_placement"] = expert_placement(4, 2, "linear").to_dict()
    with open(path, "w") as f:
        json.dump(data, f)
    load(tmp_path, tp_rank=1, experts=expert_placement(4, 2, "linear"), ep_rank=1)  # the saved placement loads
    for experts in (None, expert_placement(4, 2, "round_robin")):
        targets = fresh_targets(0, 2)
        with pytest.raises(CheckpointMismatch):
            load(tmp_path, tp_rank=0, targets=targets, experts=experts)
        assert_untouched(targets)


def test_whole_experts_are_read_in_runs_and_from_their_holder_only():
    """Saved EP=2 linear, served EP=3 linear: rank 1 holds experts 2 and 3, the last of saved
    rank 0 and the first of saved rank 1; each is one run of its file, and nothing else is read."""
    from vllm_sharded_loader.format.geometry import row_parallel
    from vllm_sharded_loader.planning.reads import SavedCheckpoint, SavedRank, SavedTensor, plan_reads
    from vllm_sharded_loader.planning.topology import RankInfo

    g = row_parallel([6, 4, 8], "FusedMoE", stacked=1)  # 6 experts of 4 x 8 float32: 128 bytes each
    saved = [SavedRank(r, 0, {"w2": SavedTensor(f"f{r}", 1000, 4, (3, 4, 8), g)}) for r in range(2)]
    placement = expert_placement(6, 3, "linear")
    plan = plan_reads(
        SavedCheckpoint(saved, 2, expert_placement(6, 2)), ["w2"], RankInfo(1, 3, experts=placement, ep_rank=1)
    ).tensors["w2"]
    assert plan.shape == (2, 4, 8)
    assert [(r.file, r.source.offset, r.source.total, r.dest.offset) for r in plan.reads] == [
        ("f0", 1000 + 2 * 128, 128, 0),
        ("f1", 1000, 128, 32),
    ]
    # Served without expert parallelism at TP=2: every expert, half of each one's columns,
    # read as one strided run per expert from the one saved rank holding it.
    plan = plan_reads(SavedCheckpoint(saved, 2, expert_placement(6, 2)), ["w2"], RankInfo(0, 2)).tensors["w2"]
    assert plan.shape == (6, 4, 4) and len(plan.reads) == 6
    assert all(r.source.count == 4 and r.source.length == 16 for r in plan.reads)
    with pytest.raises(CheckpointCorrupt):
        plan_reads(SavedCheckpoint(saved, 2, expert_placement(6, 1)), ["w2"], RankInfo(0, 2))
