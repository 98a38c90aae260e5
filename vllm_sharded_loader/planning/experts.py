"""Expert placement: vLLM's rule for which rank holds which expert, and what a rank holds. Pure.

A checkpoint saved with expert parallelism holds, on each rank, the whole weights of that
rank's experts, stacked in local order; without it, every rank holds a tensor-parallel
slice of every expert. Served with another placement, the same files can have the same
shapes and would route tokens to the wrong experts. So a load that places experts
otherwise than the save (:func:`experts_moved`) is planned by global expert id
(:func:`expert_slots`, used by :mod:`.reads`), which needs the recorded geometry of every
stacked expert tensor; without it, :func:`check_expert_placement` refuses before a byte
is read.
"""

from __future__ import annotations

from ..format.errors import CheckpointCorrupt, CheckpointMismatch, InvalidOption, Unsupported
from ..format.experts import PLACEMENTS, ExpertPlacement
from ..format.geometry import TensorGeometry
from ..format.manifest import Manifest
from .layout import ShardLayout, shard_layout
from .topology import RankInfo


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
        raise Unsupported(f"Unknown expert placement strategy {strategy!r}; vLLM's are {list(PLACEMENTS)}.")
    if ep_size < 1 or num_experts < 1:
        raise InvalidOption(f"An expert placement needs ep_size >= 1 and experts >= 1: {ep_size}, {num_experts}.")
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


def experts_moved(
    saved: ExpertPlacement | None,
    serving: ExpertPlacement | None,
    *,
    serving_ep_rank: int = 0,
    tp_rank: int = 0,
    saved_expert_tp: int | None = None,
    serving_expert_tp: tuple[int, int] | None = None,
) -> bool:
    """Whether serving rank ``tp_rank`` (EP rank ``serving_ep_rank``) holds other experts than saved ``tp_rank``.

    A load at the saved topology reads the saved rank of its own TP rank (of the first
    data-parallel replica). Without expert parallelism on either side, the experts are cut
    at ``saved_expert_tp`` and served at ``serving_expert_tp`` (size, rank), which differ from
    the TP split when vLLM cuts them across TP x DP (:attr:`..planning.topology.RankInfo.expert_tp`).

    >>> experts_moved(expert_placement(4, 2), expert_placement(4, 2, "round_robin"))
    True
    >>> experts_moved(None, None, tp_rank=0, saved_expert_tp=2, serving_expert_tp=(2, 1))
    True
    """
    if saved is None and serving is None:
        if saved_expert_tp is None or serving_expert_tp is None:
            return False
        return serving_expert_tp != (saved_expert_tp, tp_rank)
    same = saved is not None and serving is not None and saved.experts == serving.experts
    # The expert lists fix the EP size and expert count; the strategy's name alone does not matter.
    return not (same and serving_ep_rank == tp_rank)


def rank_experts_moved(manifest: Manifest, rank: RankInfo) -> bool:
    """:func:`experts_moved` for serving ``rank`` from a checkpoint: whether it must be planned
    by expert rather than read from the files of its own TP rank."""
    return experts_moved(
        manifest.experts,
        rank.experts,
        serving_ep_rank=rank.ep_rank,
        tp_rank=rank.tp_rank,
        saved_expert_tp=manifest.expert_tp_size,
        serving_expert_tp=rank.expert_tp,
    )


def expert_slots(
    geometry: TensorGeometry,
    tp_size: int,
    tp_rank: int,
    placement: ExpertPlacement | None,
    ep_rank: int = 0,
    name: str = "the tensor",
) -> tuple[tuple[int, ...], ShardLayout]:
    """The global experts a rank holds of a stacked expert tensor, in local order, and its layout of each.

    Without expert parallelism (``placement`` None) a rank holds every expert, each split
    by the geometry's rule at ``tp_size``; with it, the experts of ``ep_rank``, each whole
    (vLLM's fused-MoE layers run at TP=1 within an EP group).

    >>> from ..format.geometry import row_parallel
    >>> ids, layout = expert_slots(row_parallel([4, 8, 6], "FusedMoE", stacked=1), 2, 1, expert_placement(4, 2), 1)
    >>> ids, layout.shape
    ((2, 3), (8, 6))
    """
    if geometry.stacked != 1:
        raise CheckpointCorrupt(
            f"{name} ({geometry.layer_class}) stacks {geometry.stacked} dimensions; only one (the experts) is "
            "known. The manifest is damaged: save the checkpoint again."
        )
    inner = TensorGeometry(
        geometry.kind,
        geometry.layer_class,
        geometry.shape[1:],
        None if geometry.split_dim is None else geometry.split_dim - 1,
        geometry.segments,
        unit=geometry.unit,
    )
    if placement is None:
        return tuple(range(geometry.shape[0])), shard_layout(inner, tp_size, tp_rank, name)
    if placement.num_experts != geometry.shape[0] or not 0 <= ep_rank < placement.ep_size:
        raise CheckpointMismatch(
            f"{name} ({geometry.layer_class}) stacks {geometry.shape[0]} experts, but the expert placement "
            f"{placement.describe()} places {placement.num_experts} (EP rank {ep_rank}). The checkpoint was saved "
            "from another model, or its manifest is damaged: save it again."
        )
    return placement.experts[ep_rank], shard_layout(inner, 1, 0, name)


def rank_shape(
    geometry: TensorGeometry,
    tp_size: int,
    tp_rank: int,
    placement: ExpertPlacement | None = None,
    ep_rank: int = 0,
    name: str = "the tensor",
) -> tuple[int, ...]:
    """A rank's local shape of a tensor: :func:`.layout.shard_layout`'s, or, for stacked experts under
    expert parallelism, its experts (:func:`expert_slots`) stacked."""
    if geometry.stacked and placement is not None:
        ids, layout = expert_slots(geometry, tp_size, tp_rank, placement, ep_rank, name)
        return (len(ids), *layout.shape)
    return shard_layout(geometry, tp_size, tp_rank, name).shape


def check_expert_placement(
    saved: ExpertPlacement | None,
    serving: ExpertPlacement | None,
    *,
    serving_ep_rank: int = 0,
    tp_rank: int = 0,
    saved_tp_size: int | None = None,
    where: str = "the checkpoint",
    why: str = "",
) -> None:
    """Raise unless the served model places its experts as the checkpoint was saved (:func:`experts_moved`).

    For a checkpoint that cannot move experts between placements: one without recorded
    geometry, or a tensor of experts whose layout it does not describe (``why`` says
    which). ``None`` is a model without expert parallelism (or without experts): each rank
    then holds a tensor-parallel slice of every expert. Serving the saved EP size as TP x DP
    puts another EP rank on the saved TP rank, and is refused too. ``saved_tp_size`` (default:
    the saved EP size, no data parallelism) names the saved topology in the advice.
    """
    if not experts_moved(saved, serving, serving_ep_rank=serving_ep_rank, tp_rank=tp_rank):
        return
    same = saved is not None and serving is not None and saved.experts == serving.experts
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
        tp = saved_tp_size or saved.ep_size
        advice = (
            f"Serve it with enable_expert_parallel=True, tensor_parallel_size={tp}, "
            f"data_parallel_size={saved.ep_size // tp} and expert_placement_strategy={saved.strategy!r}, or save "
            "it again from an engine with the serving expert parallelism."
        )
    why = why or "the checkpoint records no geometry"
    raise CheckpointMismatch(
        f"{where}: the experts were saved {have}, but the engine serves them {want}. The tensors may have the "
        f"same shapes, but tokens would be routed to other experts' weights, and {why}, so its experts cannot "
        f"be moved between placements. {advice}"
    )
