"""An engine's workers as the members of one model (:mod:`..checkpoint.group`), and which worker raises
a failure they agree on."""

from __future__ import annotations

from ..checkpoint.group import ProcessGroups
from ..planning.topology import RankInfo


def model_groups(rank: RankInfo) -> ProcessGroups:
    """The exchange of the workers that hold one model between them: TP, then PP, then DP where each
    replica holds its own experts (a load or update must then match on all replicas, or one
    checkpoint's experts would serve beside another's). Replicas of the whole model are independent.
    """
    from vllm.distributed import get_pp_group, get_tp_group
    from vllm.distributed.parallel_state import get_dp_group

    groups = [get_tp_group(), get_pp_group()] + ([get_dp_group()] if rank.replicas > 1 else [])
    return ProcessGroups([g.cpu_group for g in groups if g.world_size > 1])


def replica_group(rank: RankInfo) -> ProcessGroups | None:
    """The exchange of the data-parallel replicas where each holds its own experts; None otherwise."""
    if rank.replicas == 1:
        return None
    from vllm.distributed.parallel_state import get_dp_group

    return ProcessGroups([get_dp_group().cpu_group])


def raises_for_all() -> bool:
    """Whether this worker is the last of the engine's, the one that raises an agreed failure for all.

    vLLM's executor reads answers in rank order and stops at the first failure: the later workers'
    answers would be taken for the next call's. Failing on the last worker alone keeps every answer read.
    """
    from vllm.distributed import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return tp.rank_in_group == tp.world_size - 1 and pp.rank_in_group == pp.world_size - 1
