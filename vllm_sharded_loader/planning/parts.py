"""Save planning: which tensors a rank writes (shared memory once) and in which size-capped parts.

Pure: no I/O, no torch, no engine.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..format.errors import InvalidOption


@dataclass(frozen=True)
class TensorView:
    """Where a state-dict entry lives in memory, enough to find shared storage.

    ``storage`` identifies the allocation (device and base pointer), ``start`` and
    ``end`` are byte addresses of the view's first and one-past-last element.
    """

    name: str
    storage: tuple[object, int]
    start: int
    end: int
    contiguous: bool


def unique_tensor_names(views: Iterable[TensorView]) -> list[str]:
    """Names to save so that memory shared by several entries is written once.

    Tied embeddings appear twice in a state dict with the same storage. An entry is
    dropped when another contiguous entry of the same storage covers strictly more
    memory, or the same memory under a name that sorts first; this is vLLM's rule,
    so checkpoints written by either tool name tied tensors the same way.
    Order of the input is kept.
    """
    groups: dict[tuple[object, int], list[TensorView]] = defaultdict(list)
    views = list(views)
    for v in views:
        groups[v.storage].append(v)
    keep: list[str] = []
    for v in views:
        covered = False
        for other in groups[v.storage]:
            if other is v or not other.contiguous:
                continue
            if other.start > v.start or other.end < v.end:
                continue  # `other` does not cover `v`
            if other.start < v.start or other.end > v.end or not v.contiguous or other.name < v.name:
                covered = True
                break
        if not covered:
            keep.append(v.name)
    return keep


def plan_parts(sizes: Sequence[tuple[str, int]], max_size: int | None) -> list[list[str]]:
    """Group tensors, in order, into parts of at most ``max_size`` bytes.

    A tensor larger than ``max_size`` goes alone into its own part; no part is empty.

    >>> plan_parts([("a", 4), ("b", 4), ("c", 9), ("d", 1)], max_size=8)
    [['a', 'b'], ['c'], ['d']]
    """
    if max_size is not None and max_size <= 0:
        raise InvalidOption(f"max_size must be a positive number of bytes, got {max_size}.")
    parts: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, nbytes in sizes:
        if current and max_size is not None and current_size + nbytes > max_size:
            parts.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current:
        parts.append(current)
    return parts
