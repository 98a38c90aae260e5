"""Which elements of a model's tensors the code run under :class:`WriteRecorder` writes.

Convert finds a weight the checkpoint lacks by filling tensors with NaN, which costs a third of
making them. A tensor that the dry run's contiguous writes cover whole is *proven covered*: only a
few canary elements (:func:`canaries`) are then filled and checked. Any write that cannot be placed
leaves the tensor fully checked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Enough to catch a whole shard, segment or expert that the real load skips.
CANARIES = 64


def covers(intervals: Iterable[tuple[int, int]], length: int) -> bool:
    """Whether half-open ``intervals`` cover ``[0, length)``. Pure.

    >>> covers([(0, 4), (6, 10), (3, 6)], 10), covers([(0, 4), (5, 10)], 10), covers([], 0)
    (True, False, True)
    """
    reached = 0
    for start, end in sorted(intervals):
        if start > reached:
            return False
        reached = max(reached, end)
    return reached >= length


def canaries(numel: int) -> torch.Tensor:
    """Flat indices of a tensor's canary elements: the first, the last and evenly spaced ones between."""
    steps = min(numel, CANARIES)
    if steps < 2:
        return torch.zeros(steps, dtype=torch.long)
    # In integers: a float32 linspace rounds indices of large tensors past their end.
    return torch.arange(steps, dtype=torch.long) * (numel - 1) // (steps - 1)


class WriteRecorder(TorchDispatchMode):
    """Records the elements that in-place operations write into the ``watched`` tensors' storages."""

    def __init__(self, watched: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.storages = {_storage_id(t): name for name, t in watched.items() if t.storage_offset() == 0}
        self.kept = list(watched.values())  # alive, so that no other storage takes a watched one's id
        self.dtype = {name: t.dtype for name, t in watched.items()}
        self.numel = {name: t.numel() for name, t in watched.items()}
        self.written: dict[str, list[tuple[int, int]]] = {}
        self.unplaced: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            tensor = args[i] if i < len(args) else kwargs.get(argument.name)
            if not isinstance(tensor, torch.Tensor):
                continue
            name = self.storages.get(_storage_id(tensor))
            if name is None:
                continue
            if tensor.is_contiguous() and tensor.numel() and tensor.dtype == self.dtype[name]:
                start = tensor.storage_offset()
                self.written.setdefault(name, []).append((start, start + tensor.numel()))
            elif tensor.numel():
                self.unplaced.add(name)  # strided, or through another dtype: not placed, so not proven
        return func(*args, **kwargs)

    def covered(self, final: Mapping[str, torch.Tensor]) -> set[str]:
        """Names of ``final`` tensors proven covered, and still in the storage watched."""
        proven = set()
        for name, tensor in final.items():
            if name in self.unplaced or self.storages.get(_storage_id(tensor)) != name:
                continue
            if tensor.numel() == self.numel.get(name) and covers(self.written.get(name, []), tensor.numel()):
                proven.add(name)
        return proven


def _storage_id(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata
