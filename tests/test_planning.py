"""Pure planning: deduplication of shared memory, size-capped parts, tensor-set checks."""

import pytest

from vllm_sharded_loader.format.errors import CheckpointMismatch, InvalidOption
from vllm_sharded_loader.planning.parts import TensorView, plan_parts, unique_tensor_names
from vllm_sharded_loader.planning.tensors import TensorSpec, check_tensor_sets


def test_parts_respect_the_cap():
    sizes = [(f"t{i}", s) for i, s in enumerate([3, 3, 3, 10, 1, 1, 7])]
    parts = plan_parts(sizes, max_size=7)
    assert parts == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    by_name = dict(sizes)
    for part in parts:
        assert len(part) == 1 or sum(by_name[n] for n in part) <= 7


def test_parts_without_cap_and_empty():
    assert plan_parts([("a", 5), ("b", 6)], None) == [["a", "b"]]
    assert plan_parts([], 10) == []
    with pytest.raises(InvalidOption):
        plan_parts([("a", 1)], 0)


def view(name, storage, start, end, contiguous=True):
    return TensorView(name, ("cpu", storage), start, end, contiguous)


def test_tied_tensors_are_written_once_under_the_name_that_sorts_first():
    # vLLM's rule, so that checkpoints of either tool name tied tensors alike.
    views = [
        view("model.embed_tokens.weight", 1, 100, 200),
        view("lm_head.weight", 1, 100, 200),
        view("model.norm.weight", 2, 0, 10),
    ]
    assert unique_tensor_names(views) == ["lm_head.weight", "model.norm.weight"]


def test_subviews_of_a_larger_tensor_are_dropped():
    views = [view("whole", 1, 0, 100), view("half", 1, 0, 50), view("other", 3, 0, 5)]
    assert unique_tensor_names(views) == ["whole", "other"]
    # A non-contiguous view never stands in for another tensor.
    assert unique_tensor_names([view("a", 1, 0, 100, contiguous=False), view("b", 1, 10, 20)]) == ["a", "b"]


def test_tensor_set_checks():
    expected = {"a": TensorSpec((2, 3), "BF16"), "b": TensorSpec((4,), "F32")}
    assert check_tensor_sets(expected, expected, "here", "hint") == []
    assert check_tensor_sets(expected, dict(expected, b=TensorSpec((4,), "F16")), "here", "hint") == ["b"]
    with pytest.raises(CheckpointMismatch, match=r"here: missing tensors: b\. do this"):
        check_tensor_sets(expected, {"a": expected["a"]}, "here", "do this")
    with pytest.raises(CheckpointMismatch, match="unexpected tensors: c"):
        check_tensor_sets(expected, dict(expected, c=TensorSpec((1,), "F32")), "here", "hint")
    with pytest.raises(CheckpointMismatch, match=r"a saved \[1, 3\] but the model expects \[2, 3\]"):
        check_tensor_sets(expected, dict(expected, a=TensorSpec((1, 3), "BF16")), "here", "hint")
