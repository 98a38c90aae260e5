"""Whether a saved rank holds exactly the tensors the serving model expects. Pure."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass

from ..format.errors import CheckpointMismatch, listing


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor, as saved or as the serving model expects it."""

    shape: tuple[int, ...]
    dtype: str


def check_tensor_sets(
    expected: Mapping[str, TensorSpec],
    saved: Mapping[str, TensorSpec],
    where: str,
    hint: str,
    limit: int = 10,
) -> list[str]:
    """Raise unless ``saved`` has exactly the tensors of ``expected`` with their shapes; returns the
    names whose dtype differs (the caller casts them)."""
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors: {listing(missing, limit)}")
    if unexpected:
        problems.append(f"unexpected tensors: {listing(unexpected, limit)}")
    mismatched = [
        f"{name} saved {list(saved[name].shape)} but the model expects {list(spec.shape)}"
        for name, spec in expected.items()
        if name in saved and tuple(saved[name].shape) != tuple(spec.shape)
    ]
    if mismatched:
        problems.append(f"shape mismatch: {listing(mismatched, limit)}")
    if problems:
        raise CheckpointMismatch(f"{where}: " + "; ".join(problems) + f". {hint}")
    return [name for name, spec in expected.items() if saved[name].dtype != spec.dtype]


def tied_source(tied: Iterable[Iterable[str]]) -> Callable[[str, Container[str]], str | None]:
    """A lookup of the name a tensor is saved under: itself, else the first name of its ``tied``
    groups that ``saved`` holds, or None."""
    # Group indices per name, not every other name: one manifest group of n names would cost n^2.
    groups: list[tuple[str, ...]] = []
    groups_of: dict[str, list[int]] = {}
    for group in tied:
        names = tuple(dict.fromkeys(group))  # a name listed twice in a group is one name
        for n in names:
            groups_of.setdefault(n, []).append(len(groups))
        groups.append(names)

    def source(name: str, saved: Container[str]) -> str | None:
        if name in saved:
            return name
        candidates = (n for index in groups_of.get(name, ()) for n in groups[index])
        return next((n for n in candidates if n in saved), None)

    return source
