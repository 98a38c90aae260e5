"""Components of a conversion: source tensors and the model tensors they fill together. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass
class Component:
    sources: list[str]
    targets: list[str]


def fill_components(fills: Mapping[str, set[str]], defaults: Sequence[str]) -> dict[str, Component]:
    """Each model tensor's component: the connected groups of ``fills`` (source -> the model tensors
    it fills), plus each tensor of ``defaults`` (filled by none) alone.

    >>> c = fill_components({"q": {"qkv"}, "k": {"qkv"}, "norm": {"norm"}}, ["scale"])
    >>> sorted(c["qkv"].sources), c["norm"].sources, c["scale"].sources
    (['k', 'q'], ['norm'], [])
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for source, targets in fills.items():
        for t in targets:
            parent[find("s:" + source)] = find("t:" + t)
    for t in defaults:
        find("t:" + t)
    groups: dict[str, Component] = {}
    for key in list(parent):
        root = find(key)
        c = groups.setdefault(root, Component([], []))
        (c.sources if key.startswith("s:") else c.targets).append(key[2:])
    return {t: c for c in groups.values() for t in c.targets}
