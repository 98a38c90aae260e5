"""What a GPU engine relies on, checked on CPU without an engine: no silent load into meta tensors,
file mappings only on vLLM's CPU platform, reader threads on the worker's NUMA nodes."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tests.support.states import assert_untouched, fresh_targets, load, save
from vllm_sharded_loader.format.errors import CheckpointMismatch
from vllm_sharded_loader.planning.spans import Piece
from vllm_sharded_loader.storage import memory, oscalls, reader

# ------------------------------------------------------------------ meta targets (online quantization)


def test_a_load_into_meta_parameters_is_refused_by_name_before_a_byte_is_read(tmp_path):
    save(tmp_path)
    targets = fresh_targets(0, 2)
    # As vLLM builds an online-quantized linear layer: the weight has a shape but no memory.
    name = "model.layers.0.qkv_proj.weight"
    targets[name] = torch.empty(targets[name].shape, dtype=targets[name].dtype, device="meta")
    with pytest.raises(CheckpointMismatch, match=r"meta device.*model\.layers\.0\.qkv_proj\.weight.*quantiz"):
        load(tmp_path, targets=targets)
    assert_untouched({k: v for k, v in targets.items() if k != name})


def test_the_reader_never_copies_into_a_meta_tensor(tmp_path):
    path = tmp_path / "bytes"
    path.write_bytes(bytes(range(64)))
    target = memory.Target(torch.empty(16, dtype=torch.uint8, device="meta"), torch.uint8)
    with pytest.raises(CheckpointMismatch):
        reader.read_pieces([str(path)], [Piece(0, 0, 16, dest=0)], [target])


def test_materialized_targets_pass():
    memory.check_materialized({"a": torch.zeros(2)}, "here")
    assert memory.unmaterialized({"a": torch.zeros(2), "b": torch.empty(2, device="meta")}) == ["b"]


# ------------------------------------------------------------------ platform gates


def test_parameters_are_mapped_only_on_the_cpu_platform(monkeypatch):
    from vllm.config.load import LoadConfig
    from vllm.platforms import current_platform

    from vllm_sharded_loader.engine.loader import ShardedStateLoader

    model = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
    state = model.state_dict()
    loader = ShardedStateLoader(LoadConfig(load_format="sharded_state"))
    assert current_platform.is_cpu()
    assert set(loader.reader.adoptable(model, state) or {}) == {"weight"}
    # A GPU engine's CPU parameters are offloaded ones, kept pinned by vLLM: never mapped.
    # (No GPU platform can run here; only its answer to is_cpu() is changed.)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert loader.reader.adoptable(model, state) is None


def test_cpu_lists_and_numa_binding():
    assert oscalls.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    nodes = {0: frozenset({0, 1, 2, 3}), 1: frozenset({4, 5, 6, 7})}
    assert oscalls.binding_cpus({5}, nodes) == {4, 5, 6, 7}  # a worker pinned to one core of node 1
    assert oscalls.binding_cpus({0, 4}, nodes) == set(range(8))
    assert oscalls.binding_cpus({1, 2}, {}) == {1, 2}  # no node information: the binding itself


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_reader_threads_stay_on_the_numa_nodes_of_the_worker():
    """A thread pinned to one core (as vLLM pins a CPU worker) widens to that core's node, not further."""
    mine = os.sched_getaffinity(0)
    core = min(mine)
    seen: list[set[int]] = []

    def pinned_worker() -> None:
        os.sched_setaffinity(0, {core})
        oscalls.use_binding_cpus()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=pinned_worker)
    thread.start()
    thread.join()
    expected = oscalls.binding_cpus({core}, oscalls.numa_nodes()) & mine
    assert seen == [expected]
    assert core in seen[0]
