"""A model's state as a checkpoint holds it: non-empty tensors, each memory once."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from ..planning.parts import TensorView, unique_tensor_names
from ..planning.tensors import TensorSpec
from ..storage.tensors import dtype_name


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """What identifies the memory a tensor lives in: its device and base address.

    Memory without an address (meta tensors: every one has ``data_ptr`` 0) is told apart
    by its storage object instead, so that distinct meta tensors never look shared.
    """
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
    """Tied groups as a manifest records them: each once, sorted, each kept name first (every
    writer of a checkpoint records the same ties alike)."""
    return tuple(sorted({tuple(group) for group in groups}))


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Shape and safetensors dtype name of each tensor."""
    return {name: TensorSpec(tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}
