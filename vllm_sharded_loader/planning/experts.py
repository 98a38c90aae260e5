"""Expert placement: vLLM's rule for which rank holds which expert, and the load-time check. Pure.

A checkpoint saved with expert parallelism holds, on each rank, the whole weights of that
rank's experts, stacked in local order. Served with another placement, the same files
have the same shapes and would route tokens to the wrong experts; so
:func:`check_expert_placement` refuses any difference before a byte is read.
"""

from __future__ import annotations

from ..format.errors import ShardedStateError
from ..format.experts import PLACEMENTS, ExpertPlacement


def expert_placement(num_experts: int, ep_size: int, strategy: str = "linear") -> ExpertPlacement:
    """vLLM's ``determine_expert_map`` for every rank: the global experts each EP rank holds.

    ``linear`` gives each rank a contiguous range, the first ``num_experts % ep_size``
    ranks one expert more; ``round_robin`` gives rank ``r`` experts ``r, r + ep_size, ...``.

    >>> expert_placement(5, 2, "linear").experts
    ((0, 1, 2), (3, 4))
    >>> expert_placement(5, 2, "round_robin").experts
    ((0, 2, 4), (1, 3))
    """
    if strategy not in PLACEMENTS:
        raise ShardedStateError(f"Unknown expert placement strategy {strategy!r}; vLLM's are {list(PLACEMENTS)}.")
    if ep_size < 1 or num_experts < 1:
        raise ShardedStateError(f"An expert placement needs ep_size >= 1 and experts >= 1: {ep_size}, {num_experts}.")
    base, remainder = divmod(num_experts, ep_size)
    ranks = []
    for rank in range(ep_size):
        count = base + (1 if rank < remainder else 0)
        if strategy == "linear":
            start = rank * base + min(rank, remainder)
            ranks.append(tuple(range(start, start + count)))
        else:
            ranks.append(tuple(range(rank, num_experts, ep_size)))
    return ExpertPlacement(ep_size, strategy, num_experts, tuple(ranks))


def check_expert_placement(
    saved: ExpertPlacement | None,
    serving: ExpertPlacement | None,
    *,
    serving_ep_rank: int = 0,
    tp_rank: int = 0,
    where: str = "the checkpoint",
) -> None:
    """Raise unless the served model places its experts as the checkpoint was saved.

    ``None`` is a model without expert parallelism (or without experts): each rank then
    holds a tensor-parallel slice of every expert, which the geometry describes. A saved
    rank's files are read by the serving rank of the same ``tp_rank``, so that rank must
    also be the same EP rank (a checkpoint is saved without data parallelism, where the EP
    rank is the TP rank): serving the same EP size as TP x DP instead is refused too.
    """
    if saved is None and serving is None:
        return
    same = saved is not None and serving is not None and saved.experts == serving.experts
    if same and serving_ep_rank == tp_rank:
        # The expert lists fix the EP size and expert count; the strategy's name alone does not matter.
        return
    have = "without expert parallelism (no expert_placement recorded)" if saved is None else saved.describe()
    want = "without expert parallelism" if serving is None else serving.describe()
    if same:
        want += f", where tp_rank={tp_rank} is EP rank {serving_ep_rank} (data parallelism)"
    if saved is None:
        advice = (
            "Serve it without enable_expert_parallel, or save it again from an engine with the serving "
            "expert parallelism."
        )
    else:
        advice = (
            f"Serve it with enable_expert_parallel=True, tensor_parallel_size={saved.ep_size}, "
            f"data_parallel_size=1 and expert_placement_strategy={saved.strategy!r}, or save it again from an "
            "engine with the serving expert parallelism."
        )
    raise ShardedStateError(
        f"{where}: the experts were saved {have}, but the engine serves them {want}. The tensors may have the "
        f"same shapes, but tokens would be routed to other experts' weights; this version does not move "
        f"experts between placements. {advice}"
    )
