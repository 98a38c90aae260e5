"""A weight update's device side, on a GPU (issue 37, item 2): the new weights go from their host staging
(the checkpoint files' mappings) into device tensors, ``auto`` budgets from the device's free memory,
and the memory an update frees goes back to the device.

Runs only where CUDA is available (a lent GPU machine: ``bash scripts/gpu_check.sh``, which needs no
vLLM); everywhere else each test is skipped with the reason. ``tests/test_update_staging.py`` checks
the host side without a GPU, and the engine tests run whole updates on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.states import load, rank_state, save
from vllm_sharded_loader.checkpoint.state import saveable_state, tied_groups
from vllm_sharded_loader.checkpoint.update_staging import (
    BUDGET_ENV,
    StagedWeights,
    fill_tensors,
    held_bytes,
    return_freed_memory,
    update_budget,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (an update's device memory and copies)"
)
GIB = 1 << 30
# What other work on the device (the CUDA context, a neighbour's allocation) may move its free
# memory by between two readings.
SLACK = 128 << 20


def staged_from_files(tmp_path) -> tuple[StagedWeights, dict[str, torch.Tensor], tuple[str, str]]:
    """An update's read of rank 0 of a TP=2 checkpoint: host tensors that took the files' mappings."""
    save(tmp_path)
    state = {name: t.to("meta") for name, t in rank_state(0, 2).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    targets = saveable_state(state)
    staged = StagedWeights(targets, tied_groups(state, targets))
    load(tmp_path, targets=staged.targets(), adopt=staged.adopt(), verify="checksum")
    ((kept, other),) = tied_groups(state, targets)
    return staged, saveable_state(rank_state(0, 2)), (kept, other)


def test_the_new_weights_reach_the_device_from_their_files_mappings(tmp_path):
    staged, expected, (kept, other) = staged_from_files(tmp_path)
    assert staged.mapped == set(expected) and all(t.device.type == "cpu" for t in staged.tensors.values())
    device = torch.device("cuda", torch.cuda.current_device())
    # One materialized layer as vLLM gives it on the GPU: every name of the rank, with the tied head.
    layer = {name: torch.full_like(t, 7, device=device) for name, t in expected.items()}
    layer[other] = torch.full_like(expected[kept], 7, device=device)
    swapped: list[str] = []
    # The loader offers to serve a mapping as it is (CPU only): never taken for a device tensor.
    swappable = {name: swapped.append for name in layer}
    fill_tensors("", layer, staged, swappable, skip={"model.norm.weight"})
    torch.cuda.synchronize()
    assert swapped == []
    for name, t in expected.items():
        if name == "model.norm.weight":
            assert bool((layer[name] == 7).all().item()), "a skipped tensor was written"
            continue
        assert layer[name].device == device
        assert torch.equal(layer[name].cpu(), t), name
    assert torch.equal(layer[other].cpu(), expected[kept])
    # The staging still maps the files: nothing of it moved to the device or was copied on the host.
    assert all(t.device.type == "cpu" for t in staged.tensors.values())


def test_auto_budgets_half_the_devices_free_memory_whatever_the_host(monkeypatch):
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    torch.zeros(1, device="cuda")  # a worker's CUDA context exists before any update
    before = update_budget(ranks_on_host=8)
    assert abs(before - torch.cuda.mem_get_info()[0] // 2) < SLACK  # not the host's memory / 8 ranks
    taken = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    after = update_budget(ranks_on_host=8)
    assert abs((before - after) - 2 * GIB) < SLACK, (before, after)
    del taken
    monkeypatch.setenv(BUDGET_ENV, "1000")
    assert update_budget() == 1000


def test_the_memory_an_update_freed_goes_back_to_the_device():
    torch.cuda.synchronize()
    processed = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    processed.fill_(1)
    del processed  # freed into PyTorch's caching allocator: still the process's, not the device's
    reserved = torch.cuda.memory_reserved()
    free = torch.cuda.mem_get_info()[0]
    assert reserved >= 2 * GIB
    return_freed_memory()
    assert torch.cuda.memory_reserved() <= reserved - 2 * GIB
    assert torch.cuda.mem_get_info()[0] >= free + 2 * GIB - SLACK


def test_held_bytes_count_device_storage_once_and_never_the_mappings(tmp_path):
    staged, _, _ = staged_from_files(tmp_path)
    packed = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    scales = torch.empty(1000, device="cuda")
    # A processed layer's tensors: two views of one packed storage, a scale, and a tensor left mapped.
    tensors = [packed[: 1 << 19], packed[1 << 19 :], scales, next(iter(staged.tensors.values()))]
    assert held_bytes(tensors, staged.mapped_storages()) == packed.untyped_storage().nbytes() + 4000
