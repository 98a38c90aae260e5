"""Expert placement: vLLM's rule for which rank holds which expert, and what a rank holds (its experts
whole under expert parallelism, else a TP slice of every expert). Pure."""

from __future__ import annotations

from ..format.errors import CheckpointCorrupt, CheckpointMismatch, InvalidOption, Unsupported
from ..format.experts import PLACEMENTS, ExpertPlacement
from ..format.geometry import TensorGeometry
from ..format.manifest import Manifest
from .layout import ShardLayout, shard_layout
from .topology import RankInfo


def expert_placement(num_experts: int, ep_size: int, strategy: str = "linear") -> ExpertPlacement:
    """vLLM's ``determine_expert_map`` for every rank: the global experts each EP rank holds.

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
    """Whether serving rank ``tp_rank`` (EP rank ``serving_ep_rank``) holds other experts than saved ``tp_rank``;
    without expert parallelism, whether the experts' TP cut (``*_expert_tp``) differs.

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
    return not (same and serving_ep_rank == tp_rank)


def rank_experts_moved(manifest: Manifest, rank: RankInfo) -> bool:
    """:func:`experts_moved` for serving ``rank`` from a checkpoint."""
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
    """The global experts a rank holds of a stacked expert tensor, in local order, and its layout of each:
    every expert split at ``tp_size`` without a ``placement``, else the experts of ``ep_rank``, whole.

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
    """A rank's local shape of a tensor, stacked experts under expert parallelism included."""
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
    """Raise unless the served model places its experts as saved, for a checkpoint that cannot move
    them (``why`` says why); ``saved_tp_size`` (default: the saved EP size) goes into the advice."""
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
