"""Save planning: which tensors a rank writes (shared memory once) and in which size-capped parts. Pure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..format.errors import InvalidOption


@dataclass(frozen=True)
class TensorView:
    """Where a state-dict entry lives: its allocation (device, base pointer) and byte range."""

    name: str
    storage: tuple[object, int]
    start: int
    end: int
    contiguous: bool


def unique_tensor_names(views: Iterable[TensorView]) -> list[str]:
    """Names to save so that memory shared by several entries (tied embeddings) is written once, in order:
    as in vLLM, an entry goes when another covers strictly more of it, or the same under an earlier name."""
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
    """Group tensors, in order, into parts of at most ``max_size`` bytes (a larger tensor alone).

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
