"""A model's state as a checkpoint holds it: non-empty tensors, each memory once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

import torch

from ..planning.parts import TensorView, unique_tensor_names
from ..planning.tensors import TensorSpec
from ..storage.tensors import dtype_name


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """The memory a tensor lives in: its device and base address (meta tensors: their storage object)."""
    storage = tensor.untyped_storage()
    address = storage.data_ptr()
    return (str(tensor.device), address if address else -storage._cdata)


def _view(name: str, t: torch.Tensor) -> TensorView:
    start = t.storage_offset() * t.element_size()
    return TensorView(name, storage_key(t), start, start + t.numel() * t.element_size(), t.is_contiguous())


def saveable_state(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a state dict that a checkpoint holds: non-empty, each memory once."""
    tensors = {name: t for name, t in state_dict.items() if t.numel()}
    views = [_view(name, t) for name, t in tensors.items()]
    return {name: tensors[name] for name in unique_tensor_names(views)}


def tied_groups(state_dict: Mapping[str, torch.Tensor], kept: Iterable[str]) -> list[list[str]]:
    """Groups of state-dict names sharing one tensor (tied embeddings), the kept name first.

    Names share a tensor when they view the same memory with the same offset and shape.
    """
    kept = list(kept)
    by_memory: dict[tuple[object, ...], list[str]] = {}
    for name, t in state_dict.items():
        if t.numel():
            key = (storage_key(t), t.storage_offset(), tuple(t.shape), t.dtype)
            by_memory.setdefault(key, []).append(name)
    groups = []
    for names in by_memory.values():
        if len(names) > 1:
            first = [n for n in names if n in kept]
            groups.append(first + [n for n in names if n not in first])
    return groups


def manifest_ties(groups: Iterable[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """Tied groups as a manifest records them: each once, sorted, each kept name first."""
    return tuple(sorted({tuple(group) for group in groups}))


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Shape and safetensors dtype name of each tensor."""
    return {name: TensorSpec(tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}


def shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one parameter object (tied embeddings), as served now."""
    by_object: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(param), []).append(name)
    return [names for names in by_object.values() if len(names) > 1]


def _storage_uses(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s memory (torch's count), or None where torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(tensor.untyped_storage()._cdata))


def adoptable_parameters(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> dict[str, Callable[[torch.Tensor], None]]:
    """Callbacks that make a CPU parameter use another tensor as its data, by state-dict name.

    Offered only where nothing else holds the parameter's memory: a layer keeping a view would
    otherwise read the old, never-filled memory after the swap.
    """
    baseline = _storage_uses(torch.nn.Parameter(torch.empty(1), requires_grad=False))
    if baseline is None:
        return {}
    held: dict[int, int] = {}
    for t in {id(t): t for t in state_dict.values()}.values():
        key = t.untyped_storage().data_ptr()
        held[key] = held.get(key, 0) + 1
    setters: dict[str, Callable[[torch.Tensor], None]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in state_dict or param.device.type != "cpu" or not param.numel():
            continue
        if _storage_uses(param) == baseline + held.get(param.untyped_storage().data_ptr(), 0):
            setters[name] = partial(_swap_data, param)
    return setters


def _swap_data(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    param.data = data
