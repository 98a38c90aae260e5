"""An engine's workers as the members of one model (:mod:`..checkpoint.group`): vLLM's groups, and which
worker raises a failure they agree on."""

from __future__ import annotations

from ..checkpoint.group import ProcessGroups
from ..planning.topology import RankInfo


def model_groups(rank: RankInfo) -> ProcessGroups:
    """The exchange of the workers that hold one model between them, over their groups of more than one
    worker: this replica's TP group, then its PP group, then the data-parallel group where each replica
    holds its own experts (:attr:`RankInfo.replicas`).

    Replicas that hold their own experts serve one model between them (a token's experts may
    be on another replica): a load or an update must be the same on all of them, or the
    experts of one checkpoint would serve beside the rest of another. Never the data-parallel
    group otherwise: replicas of the whole model are independent, and need not even be started
    with this load format.
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
    """Whether this worker is the one that raises an agreed failure for all: the last of the engine's workers.

    vLLM 0.32's multiprocessing executor reads the workers' answers in rank order and stops
    at the first failure: the answers of the workers after it stay queued and are taken
    for the answers to the next call (a second save, or ``/pause``, then fails with this
    call's error). Failing on the last worker alone keeps every answer read.
    """
    from vllm.distributed import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return tp.rank_in_group == tp.world_size - 1 and pp.rank_in_group == pp.world_size - 1
