"""Where a mixture-of-experts model's routed experts live across expert-parallel ranks, as the manifest
records it: placements with the same shapes route tokens differently, so a load compares them. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import CheckpointCorrupt
from .untrusted import JsonReader

PLACEMENTS = ("linear", "round_robin")  # vLLM's ExpertPlacementStrategy values
MAX_EXPERTS = 1 << 20
MAX_EP_SIZE = 1 << 16


@dataclass(frozen=True)
class ExpertPlacement:
    """How vLLM placed the routed experts of every MoE layer on its expert-parallel ranks.

    ``ep_size`` is TP x DP; ``experts[ep_rank]`` are the global ids that rank holds, in local order.

    >>> p = ExpertPlacement(2, "linear", 4, ((0, 1), (2, 3)))
    >>> p.expert_map(1)
    [-1, -1, 0, 1]
    """

    ep_size: int
    strategy: str
    num_experts: int
    experts: tuple[tuple[int, ...], ...]

    def expert_map(self, ep_rank: int) -> list[int]:
        """vLLM's ``expert_map`` of rank ``ep_rank``: local index of each global expert, or -1."""
        result = [-1] * self.num_experts
        for local, expert in enumerate(self.experts[ep_rank]):
            result[expert] = local
        return result

    def describe(self) -> str:
        """``EP=2 linear (rank 0: experts [0, 1]; rank 1: experts [2, 3])``, shortened for many ranks."""
        shown = "; ".join(f"rank {r}: experts {list(e)}" for r, e in enumerate(self.experts[:4]))
        more = f"; ... {self.ep_size - 4} more" if self.ep_size > 4 else ""
        return f"EP={self.ep_size} {self.strategy} ({shown}{more})"

    def to_dict(self) -> dict[str, Any]:
        """JSON data; the inverse of :meth:`from_dict`."""
        return {
            "ep_size": self.ep_size,
            "strategy": self.strategy,
            "num_experts": self.num_experts,
            "experts": [list(e) for e in self.experts],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "") -> ExpertPlacement:
        """Parse and validate a recorded placement; every defect is a :class:`ShardedStateError`."""
        reader = JsonReader(f"{where}: expert_placement" if where else "expert_placement")
        obj = reader.mapping(data, "expert_placement")
        unknown = set(obj) - {"ep_size", "strategy", "num_experts", "experts"}
        if unknown:
            raise reader.fail(f"unknown keys {sorted(unknown)}")
        ep_size = reader.integer(obj, "ep_size", minimum=1, maximum=MAX_EP_SIZE)
        num_experts = reader.integer(obj, "num_experts", minimum=1, maximum=MAX_EXPERTS)
        raw = reader.sequence(obj, "experts")
        if len(raw) != ep_size:
            raise reader.fail(f"'experts' lists {len(raw)} ranks for ep_size {ep_size}")
        experts = []
        for ids in raw:
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise reader.fail(f"each rank's experts must be a list of expert ids, found {ids!r}")
            experts.append(tuple(ids))
        placement = cls(ep_size, reader.string(obj, "strategy", non_empty=True), num_experts, tuple(experts))
        check_placement(placement, where)
        return placement


def writing_replicas(experts: ExpertPlacement | None, tp_size: int, dp_size: int, over_dp: bool = False) -> int:
    """How many data-parallel replicas write files of one save: the first only, unless experts span them.

    >>> writing_replicas(ExpertPlacement(2, "linear", 4, ((0, 1), (2, 3))), tp_size=1, dp_size=2)
    2
    >>> writing_replicas(None, tp_size=1, dp_size=2)
    1
    """
    if dp_size > 1 and ((experts is not None and experts.ep_size == tp_size * dp_size) or over_dp):
        return dp_size
    return 1


def check_placement(p: ExpertPlacement, where: str = "") -> None:
    """Raise unless every expert is on exactly one rank (vLLM's placements; EPLB's redundant copies are not)."""
    held = sorted(e for ids in p.experts for e in ids)
    if len(p.experts) != p.ep_size or held != list(range(p.num_experts)):
        raise CheckpointCorrupt(
            f"{where + ': ' if where else ''}expert placement {p.describe()} does not hold each of the "
            f"{p.num_experts} experts exactly once. The manifest is damaged: save the checkpoint again."
        )
