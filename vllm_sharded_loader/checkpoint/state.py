"""A model's state as a checkpoint holds it: non-empty tensors, each memory once."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..planning.parts import TensorView, unique_tensor_names
from ..planning.tensors import TensorSpec
from ..storage.tensors import dtype_name


def saveable_state(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a state dict that a checkpoint holds: non-empty, each memory once."""
    tensors = {name: t for name, t in state_dict.items() if t.numel()}
    views = []
    for name, t in tensors.items():
        start = t.data_ptr()
        views.append(
            TensorView(
                name=name,
                storage=(str(t.device), t.untyped_storage().data_ptr()),
                start=start,
                end=start + t.numel() * t.element_size(),
                contiguous=t.is_contiguous(),
            )
        )
    return {name: tensors[name] for name in unique_tensor_names(views)}


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Shape and safetensors dtype name of each tensor."""
    return {name: TensorSpec(tuple(t.shape), dtype_name(t.dtype)) for name, t in tensors.items()}
