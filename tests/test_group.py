"""The members holding one model agreeing, without an engine: the save's group, the load's checks, a
weight update's two-phase commit and the save of a loaded state (``checkpoint/group.py``,
``checkpoint/update.py``, ``checkpoint/loaded_state.py``).

Each member is a thread with an in-process exchange (:mod:`tests.support.members`), as each worker
of an engine exchanges over gloo; the last test runs the same over torch.distributed's gloo groups,
one process per member.
"""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from tests.support.derived import tensors_of
from tests.support.engines import start_python
from tests.support.members import in_threads
from tests.support.states import SOURCE, save
from vllm_sharded_loader.checkpoint import read_manifest
from vllm_sharded_loader.checkpoint.group import (
    LOAD_TIMEOUT_ENV,
    REPLICA_TIMEOUT_ENV,
    Members,
    check_same_checkpoint,
    share_load_outcome,
    wait_for_replicas,
)
from vllm_sharded_loader.checkpoint.loaded_state import LoadedSave, LoadedState
from vllm_sharded_loader.checkpoint.protocol import run_save
from vllm_sharded_loader.checkpoint.update import run_update
from vllm_sharded_loader.format.errors import CheckpointMismatch, SaveRefused, ShardedStateError, WorkerLost
from vllm_sharded_loader.format.names import default_pattern
from vllm_sharded_loader.planning.topology import RankInfo
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.staged import new_token, stage_rank

MEMBERS = 3


def rank(index: int, size: int = MEMBERS) -> RankInfo:
    return RankInfo(index, size)


# ---------------------------------------------------------------- the group


def test_members_run_each_step_together_and_fail_together():
    def member(index: int, exchange: Any) -> Any:
        members = Members(exchange, rank(index))
        every = members.run(lambda: index * 10)
        first = members.run(lambda: "first", only_first=True)

        def step() -> int:
            if index == 1:
                raise OSError("the step failed here")
            return index

        try:
            members.run(step)
        except ShardedStateError as failed:  # every member raises it, agreed
            return every, first, failed

    results = in_threads(MEMBERS, member)
    for every, first, error in results:
        assert every == [0, 10, 20] and first == ["first", None, None]
        assert error.agreed and f"{rank(1)} on " in str(error) and "the step failed here" in str(error)
    assert len({str(error) for *_, error in results}) == 1
    assert results[1][2].origin is not None and results[0][2].origin is None  # the failing member keeps its own


def test_a_member_that_dies_ends_the_others_exchange_as_worker_lost():
    def member(index: int, exchange: Any) -> Any:
        if index == 2:
            exchange.leave()
            return "left"
        return Members(exchange, rank(index)).run(lambda: index)

    results = in_threads(MEMBERS, member)
    assert all(isinstance(r, WorkerLost) and "stopped answering" in str(r) for r in results[:2]), results


def test_members_holding_one_checkpoint_load_and_others_are_refused_naming_each(tmp_path):
    save(tmp_path / "a")
    save(tmp_path / "b", max_size=256)  # the same model, saved in other files: another manifest
    a, b = read_manifest(str(tmp_path / "a")), read_manifest(str(tmp_path / "b"))
    assert in_threads(MEMBERS, lambda i, x: check_same_checkpoint(x, rank(i), "ckpt", a, None)) == [None] * MEMBERS
    results = in_threads(MEMBERS, lambda i, x: check_same_checkpoint(x, rank(i), "ckpt", b if i == 2 else a, None))
    assert all(isinstance(r, CheckpointMismatch) for r in results), results
    assert f"{rank(2)} on " in str(results[0]) and "hold different checkpoints at ckpt" in str(results[0])


def test_a_member_that_read_no_manifest_fails_every_members_load(tmp_path):
    save(tmp_path)
    manifest = read_manifest(str(tmp_path))
    failed = OSError("cannot read sharded_state.json")

    def member(index: int, exchange: Any) -> Any:
        if index == 1:
            check_same_checkpoint(exchange, rank(index), str(tmp_path), None, failed)
            return "raises its own"
        check_same_checkpoint(exchange, rank(index), str(tmp_path), manifest, None)

    results = in_threads(MEMBERS, member)
    assert results[1] == "raises its own"
    for error in (results[0], results[2]):
        assert isinstance(error, ShardedStateError) and error.agreed
        assert "Another worker's load failed" in str(error) and "cannot read sharded_state.json" in str(error)


def test_a_member_that_never_reaches_the_load_ends_the_wait(tmp_path, monkeypatch):
    monkeypatch.setenv(LOAD_TIMEOUT_ENV, "0.5")

    def member(index: int, exchange: Any) -> Any:
        if index == 2:
            return "another load format"
        check_same_checkpoint(exchange, rank(index), "ckpt", None, None)

    results = in_threads(MEMBERS, member)
    assert all(isinstance(r, WorkerLost) and "did not reach the sharded_state load" in str(r) for r in results[:2])


def test_members_hear_each_others_failed_reads():
    failure = ShardedStateError("model-rank-1-part-0.safetensors: 12 bytes, expected 4096")

    def member(index: int, exchange: Any) -> Any:
        share_load_outcome(exchange, rank(index), failure if index == 1 else None)

    results = in_threads(MEMBERS, member)
    assert results[1] is None  # the failing member raises its own error (the caller's)
    assert all(isinstance(r, ShardedStateError) and "expected 4096" in str(r) for r in (results[0], results[2]))


def test_a_replica_that_is_never_called_ends_the_wait(monkeypatch):
    monkeypatch.setenv(REPLICA_TIMEOUT_ENV, "0.5")
    assert wait_for_replicas(None, rank(0), "save_sharded_state", "save", "") is None  # no replicas of their own

    def member(index: int, exchange: Any) -> Any:
        if index == 1:
            return "never called"
        wait_for_replicas(exchange, RankInfo(0, 1, dp_rank=index, dp_size=2), "update_weights", "update", "Kept.")

    results = in_threads(2, member)
    assert isinstance(results[0], ShardedStateError) and "not all of them called update_weights" in str(results[0])


# ---------------------------------------------------------------- a weight update


@dataclass
class Update:
    """One member's update steps, recording what ran; ``fails`` at one step, ``reads`` a digest."""

    fails: str | None = None
    reads: str = "digest-a"

    def __post_init__(self) -> None:
        self.ran: list[str] = []

    def read(self) -> tuple[str, str]:
        self._step("read")
        return "ckpt", self.reads

    def process(self) -> None:
        self._step("process")

    def commit(self) -> None:
        self._step("commit")

    def roll_back(self) -> None:
        self.ran.append("roll_back")

    def _step(self, name: str) -> None:
        self.ran.append(name)
        if name == self.fails:
            raise ShardedStateError(f"{name} failed here")


def update_in_threads(updates: list[Update]) -> list[Any]:
    last = len(updates) - 1
    return in_threads(len(updates), lambda i, x: run_update(updates[i], x, rank(i, len(updates)), i == last))


def test_an_update_commits_only_once_every_member_read_and_processed():
    updates = [Update() for _ in range(MEMBERS)]
    assert update_in_threads(updates) == [True] * MEMBERS
    assert all(u.ran == ["read", "process", "commit"] for u in updates)


@pytest.mark.parametrize("step", ["read", "process"])
def test_an_update_failing_on_one_member_rolls_back_every_member(step):
    updates = [Update(step if i == 1 else None) for i in range(MEMBERS)]
    results = update_in_threads(updates)
    # The last member raises the failure for all (vLLM reads every answer); the others return False.
    assert results[:2] == [False, False]
    assert isinstance(results[2], ShardedStateError) and f"{step} failed here" in str(results[2])
    assert "no rank's weights were changed" in str(results[2])
    for u in updates:
        assert "commit" not in u.ran and u.ran[-1] == "roll_back"
        assert u.ran[:-1] == (["read"] if step == "read" else ["read", "process"])


def test_an_update_from_members_that_read_different_checkpoints_changes_nothing():
    updates = [Update(reads="digest-b" if i == 0 else "digest-a") for i in range(MEMBERS)]
    results = update_in_threads(updates)
    assert results[:2] == [False, False] and isinstance(results[2], ShardedStateError)
    assert "hold different checkpoints at ckpt" in str(results[2]) and "update again" in str(results[2])
    assert all(u.ran == ["read", "roll_back"] for u in updates)


# ---------------------------------------------------------------- the save of a loaded state


def tensors(index: int, value: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((16, 8), value + 10 * index + i) for i in range(2)}


@dataclass
class Weights:
    """What a member serves: ``live`` tensors, or None where they cannot be proven the loaded ones."""

    live_tensors: dict[str, torch.Tensor] | None
    reread_tensors: dict[str, torch.Tensor] | None = None

    def live(self) -> dict[str, torch.Tensor]:
        if self.live_tensors is None:
            raise SaveRefused("post-processing replaced 2 parameters")
        return self.live_tensors

    def reread(self) -> dict[str, torch.Tensor]:
        if self.reread_tensors is None:
            raise OSError("the source folder is gone")
        return self.reread_tensors


def loaded_state(index: int, value: float, capture: str | None = None) -> LoadedState:
    loaded = tensors(index, value)
    state = LoadedState(
        signature={n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in loaded.items()},
        source=SOURCE,
        dtype="float32",
        quantization=None,
        rank=rank(index, 2),
    )
    if capture is not None:
        os.makedirs(capture, exist_ok=True)
        state.capture = stage_rank(capture, loaded, rank(index, 2), default_pattern(1, 1), None, new_token())
    return state


def save_loaded(directory: str, states: list[LoadedState], weights: list[Weights]) -> list[Any]:
    """Every member saves its loaded state into ``directory``, as the save hook does."""

    def member(index: int, exchange: Any) -> Any:
        info, pattern = rank(index, 2), default_pattern(1, 1)
        loaded = LoadedSave(states[index], SaveRefused("no state"), weights[index], info, pattern, None, True)
        target = open_store(directory)
        manifest, (staged,) = run_save(target, Members(exchange, info), loaded.job())
        loaded.keep(staged, target.stages_in_place)
        return manifest

    return in_threads(2, member)


def saved_values(directory: str, index: int) -> dict[str, float]:
    return {name: float(t[0, 0]) for (_, tp, name), t in tensors_of(directory).items() if tp == index}


def test_a_capture_staged_in_the_output_is_published_as_it_is(tmp_path):
    out = str(tmp_path / "out")
    states = [loaded_state(i, 1.0, capture=out) for i in range(2)]
    captured = [s.capture.entry.files[0].name for s in states]
    manifests = save_loaded(out, states, [Weights(None), Weights(None)])  # the live weights are never asked
    assert all(m == manifests[0] for m in manifests), manifests
    assert [e.files[0].name for e in manifests[0].ranks] == captured
    assert all(not s.capture.temporary and s.updates == 0 for s in states)  # the capture is the checkpoint now
    assert saved_values(out, 1) == {"w0": 11.0, "w1": 12.0}


def test_updated_weights_are_saved_live_or_refused_on_every_member(tmp_path):
    out = str(tmp_path / "out")
    states = [loaded_state(i, 1.0, capture=str(tmp_path / "capture")) for i in range(2)]
    for s in states:
        s.updates = 1
    results = save_loaded(out, states, [Weights(tensors(0, 5.0)), Weights(None)])
    # Every member raises it, agreed (the save hook then says it as the save's refusal).
    assert all(isinstance(r, ShardedStateError) and r.agreed for r in results), results
    assert "updated 1 time(s) after loading" in str(results[0]) and "post-processing replaced" in str(results[0])
    assert not os.path.exists(os.path.join(out, "sharded_state.json"))
    save_loaded(out, states, [Weights(tensors(0, 5.0)), Weights(tensors(1, 5.0))])
    assert saved_values(out, 1) == {"w0": 15.0, "w1": 16.0}
    assert all(s.capture is not None and not s.capture.temporary and s.updates == 0 for s in states)
    assert not os.listdir(tmp_path / "capture")  # the stale capture went; the published parts are the capture now


def test_without_a_capture_the_source_is_read_again_or_both_reasons_are_said(tmp_path):
    out = str(tmp_path / "out")
    states = [loaded_state(i, 1.0) for i in range(2)]
    results = save_loaded(out, states, [Weights(None, tensors(0, 1.0)), Weights(None)])
    assert all(isinstance(r, ShardedStateError) and r.agreed for r in results), results
    assert "post-processing replaced 2 parameters (Reading the source again failed too" in str(results[0])
    save_loaded(out, states, [Weights(None, tensors(0, 1.0)), Weights(tensors(1, 1.0))])
    assert saved_values(out, 0) == {"w0": 1.0, "w1": 2.0} and saved_values(out, 1) == {"w0": 11.0, "w1": 12.0}


def test_ranks_placing_their_experts_differently_are_refused(tmp_path):
    from vllm_sharded_loader.planning.experts import expert_placement

    states = [loaded_state(i, 1.0) for i in range(2)]
    for i, strategy in enumerate(("linear", "round_robin")):
        states[i].rank = replace(states[i].rank, experts=expert_placement(4, 2, strategy), ep_rank=i)
    weights = [Weights(tensors(i, 1.0)) for i in range(2)]
    results = save_loaded(str(tmp_path / "out"), states, weights)
    assert all(isinstance(r, ShardedStateError) and "place their experts differently" in str(r) for r in results)


# ---------------------------------------------------------------- over gloo, one process per member

CHILD = textwrap.dedent(
    """
    import dataclasses, datetime, json, os, sys, torch
    from vllm_sharded_loader.checkpoint import read_manifest
    from vllm_sharded_loader.checkpoint.group import Members, ProcessGroups, check_same_checkpoint
    from vllm_sharded_loader.format.errors import CheckpointMismatch, ShardedStateError, WorkerLost
    from vllm_sharded_loader.planning.topology import RankInfo

    index, store, where = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", world_size=2, rank=index, timeout=datetime.timedelta(seconds=60)
    )
    exchange, rank, out = ProcessGroups([torch.distributed.group.WORLD]), RankInfo(index, 2), {}
    members = Members(exchange, rank)
    out["gathered"] = members.run(lambda: index * 10)
    try:
        members.run(lambda: 1 / index)
    except ShardedStateError as e:
        out["failed"] = [e.agreed, "division by zero" in str(e)]
    manifest = read_manifest(where)
    check_same_checkpoint(exchange, rank, where, manifest, None)
    try:
        check_same_checkpoint(exchange, rank, where, dataclasses.replace(manifest, dtype=f"d{index}"), None)
    except CheckpointMismatch as e:
        out["different"] = "hold different checkpoints" in str(e)
    if index == 1:
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)  # dies: the other's next exchange fails at once
    try:
        members.run(lambda: 0)
    except WorkerLost as e:
        out["lost"] = "stopped answering" in str(e)
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def test_members_over_gloo_process_groups(tmp_path):
    save(tmp_path / "ckpt")
    logs = [tmp_path / f"member-{i}.log" for i in range(2)]
    procs = [
        start_python(
            ["-c", CHILD, str(i), str(tmp_path / "store"), str(tmp_path / "ckpt")], dict(os.environ), str(log), True
        )
        for i, log in enumerate(logs)
    ]
    codes = [p.wait(120) for p in procs]
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs
    results = [json.loads(out.split("RESULT ", 1)[1]) for out in outputs]
    for result in results:
        assert result["gathered"] == [0, 10] and result["failed"] == [True, True] and result["different"]
    assert results[0]["lost"]
