"""Which bytes of a checkpoint saved at one TP/PP size a rank serving at another size reads,
and where they land: strided byte runs and the element runs they fill, plus zero fills for
vocabulary padding. A rank reads exactly the bytes it keeps, each once. Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..format.errors import CheckpointCorrupt, CheckpointMismatch, InvalidOption, ShardedStateError, listing
from ..format.experts import ExpertPlacement
from ..format.geometry import OPAQUE, REPLICATED, TensorGeometry
from ..format.manifest import rank_label
from .experts import check_expert_placement, expert_slots, experts_moved, rank_shape
from .layout import ShardLayout, ShardPiece, check_reshardable, shard_layout
from .runs import Read, Strided, merge_reads, merge_zeros, read_run, strided
from .tensors import tied_source
from .topology import RankInfo


@dataclass(frozen=True)
class TensorPlan:
    """How to fill one local tensor (``shape`` at the serving TP size, ``itemsize`` the saved
    dtype's): reads from saved tensor ``source_name`` (another name when tied), and zero fills."""

    name: str
    source_name: str
    shape: tuple[int, ...]
    itemsize: int
    reads: tuple[Read, ...]
    zero_fills: tuple[Strided, ...] = ()

    @property
    def bytes_read(self) -> int:
        return sum(r.source.total for r in self.reads)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ReadPlan:
    """Everything one serving rank reads, tensor by tensor."""

    tp_size: int
    tp_rank: int
    pp_rank: int
    saved_tp_size: int
    tensors: dict[str, TensorPlan] = field(default_factory=dict)

    @property
    def bytes_read(self) -> int:
        return sum(t.bytes_read for t in self.tensors.values())

    @property
    def files(self) -> list[str]:
        """The saved files this rank opens, sorted."""
        return sorted({r.file for t in self.tensors.values() for r in t.reads})


@dataclass(frozen=True)
class SavedTensor:
    """One tensor of one saved rank: ``offset``, the absolute byte offset of its data in ``file``;
    ``shape``, its local shape as saved; ``geometry``, None where none was recorded; ``dtype``, its
    safetensors dtype name ("": unknown)."""

    file: str
    offset: int
    itemsize: int
    shape: tuple[int, ...]
    geometry: TensorGeometry | None
    dtype: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class SavedRank:
    """The tensors one saved (pp_rank, tp_rank) worker of data-parallel replica ``dp_rank`` wrote."""

    tp_rank: int
    pp_rank: int
    tensors: Mapping[str, SavedTensor]
    dp_rank: int = 0


@dataclass(frozen=True)
class SavedCheckpoint:
    """What a checkpoint saved, as the planner reads it: every saved rank at ``tp_size``; ``experts``, their
    expert placement (None: no expert parallelism); ``replicas``, how many DP replicas wrote experts;
    ``expert_tp``, the TP size experts were cut at without expert parallelism (default ``tp_size``)."""

    ranks: Sequence[SavedRank]
    tp_size: int
    experts: ExpertPlacement | None = None
    replicas: int = 1
    expert_tp: int | None = None


def plan_reads(
    saved: SavedCheckpoint, needed: Iterable[str], rank: RankInfo, tied: Iterable[Iterable[str]] = ()
) -> ReadPlan:
    """The reads that give serving ``rank`` (its ``pp_rank`` only labels the plan) each tensor in
    ``needed``, wherever a saved stage wrote it; ``tied`` lists groups of names sharing one tensor
    (saved once, under one name): a needed name not saved is read from a tied name that is.

    A split tensor is read piece by piece from the saved ranks holding each piece (dim-0
    splits as contiguous ranges, dim-1 splits as one run per row); a replicated one whole
    from a single saved rank; vocabulary padding is zero-filled, never read. A tensor
    without a reshardable geometry is copied whole when the TP size is unchanged, and is
    an error otherwise.

    Stacked experts are planned by global expert id: ``saved.experts`` is the placement
    they were saved with and ``rank.experts`` and ``rank.ep_rank`` the serving one (see
    :func:`.experts.expert_slots`). Another EP size or strategy, or none on either side, gives
    each serving slot its expert's bytes wherever they were saved. Without expert parallelism,
    they are served cut at ``rank.expert_tp``.

    >>> from vllm_sharded_loader.format.geometry import column_parallel
    >>> ranks = [SavedRank(0, 0, {"w": SavedTensor("f0", 100, 2, (4, 2), column_parallel([4, 2]))})]
    >>> (read,) = plan_reads(SavedCheckpoint(ranks, 1), ["w"], RankInfo(1, 2)).tensors["w"].reads
    >>> read.source, read.dest
    (Strided(offset=108, length=8, stride=8, count=1), Strided(offset=0, length=4, stride=4, count=1))
    """
    tp_size, tp_rank, pp_rank = rank.tp_size, rank.tp_rank, rank.pp_rank
    saved_tp_size, saved_replicas, saved_experts = saved.tp_size, saved.replicas, saved.experts
    serving = f"pp_rank={pp_rank} tp_rank={tp_rank} (TP={tp_size})"
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise InvalidOption(f"Serving rank {serving}: tp_rank is not a rank of TP={tp_size}.")
    index = _index_saved(saved.ranks, saved_tp_size, saved_replicas)
    if saved_experts is not None and saved_experts.ep_size != saved_tp_size * saved_replicas:
        raise CheckpointCorrupt(
            f"The experts were saved {saved_experts.describe()}, but TP={saved_tp_size} ranks of {saved_replicas} "
            "data-parallel replica(s) wrote them; the EP size must be their product. The manifest is damaged: "
            "save the checkpoint again."
        )
    places = _Places(
        saved_experts,
        rank.experts,
        rank.ep_rank,
        tp_rank,
        saved_replicas,
        saved.expert_tp or saved_tp_size,
        rank.expert_tp,
    )
    saved_as = tied_source(tied)
    plans: dict[str, TensorPlan] = {}
    missing: list[str] = []
    for name in needed:
        source = saved_as(name, index)
        if source is None:
            missing.append(name)
            continue
        plans[name] = _plan_tensor(name, source, index[source], saved_tp_size, tp_size, tp_rank, places)
    if missing:
        shown = listing(missing)
        raise CheckpointMismatch(
            f"Serving rank {serving} needs tensors no saved rank holds: {shown}. The checkpoint was saved "
            "from another model or is incomplete: save it again from the model being served."
        )
    return ReadPlan(tp_size, tp_rank, pp_rank, saved_tp_size, plans)


def _index_saved(
    saved: Sequence[SavedRank], saved_tp_size: int, saved_replicas: int = 1
) -> dict[str, dict[int, tuple[int, SavedTensor]]]:
    """name -> saved rank (``dp_rank * saved_tp_size + tp_rank``) -> (pp_rank, tensor), the lowest
    pipeline stage winning. Replicas after the first hold only their experts."""
    if saved_tp_size < 1 or saved_replicas < 1:
        raise InvalidOption(
            f"The saved tensor parallel size and replicas must be >= 1, found {saved_tp_size} and {saved_replicas}."
        )
    index: dict[str, dict[int, tuple[int, SavedTensor]]] = {}
    seen: set[tuple[int, int, int]] = set()
    for rank in sorted(saved, key=lambda r: (r.pp_rank, r.dp_rank, r.tp_rank)):
        key = (rank.pp_rank, rank.dp_rank, rank.tp_rank)
        if not (0 <= rank.tp_rank < saved_tp_size and 0 <= rank.dp_rank < saved_replicas) or key in seen:
            raise CheckpointCorrupt(
                f"Saved rank {rank_label(rank.pp_rank, rank.tp_rank, rank.dp_rank)} is "
                f"{'listed twice' if key in seen else 'outside'} TP={saved_tp_size}"
                + (f" x {saved_replicas} replicas" if saved_replicas > 1 else "")
                + ". The manifest is damaged: save the checkpoint again."
            )
        seen.add(key)
        for name, tensor in rank.tensors.items():
            index.setdefault(name, {}).setdefault(rank.dp_rank * saved_tp_size + rank.tp_rank, (rank.pp_rank, tensor))
    return index


@dataclass(frozen=True)
class _Places:
    """Where the routed experts were saved and are served (by this rank: ``ep_rank``, ``tp_rank``)."""

    saved: ExpertPlacement | None = None
    serving: ExpertPlacement | None = None
    ep_rank: int = 0
    tp_rank: int = 0
    replicas: int = 1  # data-parallel replicas that wrote their experts
    # Without expert parallelism: the saved TP cut of the experts, and this rank's (size, rank).
    saved_tp: int = 1
    serving_tp: tuple[int, int] = (1, 0)

    @property
    def moved(self) -> bool:
        """Whether this rank's experts differ (by placement) from those of the saved rank of its TP rank."""
        return experts_moved(self.saved, self.serving, serving_ep_rank=self.ep_rank, tp_rank=self.tp_rank)

    @property
    def own(self) -> int | None:
        """The saved rank holding exactly this rank's experts, or None."""
        if self.saved is not None and self.serving is not None and self.saved.experts == self.serving.experts:
            return self.ep_rank
        if self.saved is None and self.serving is None and self.serving_tp[0] == self.saved_tp:
            return self.serving_tp[1]
        return None


def _plan_tensor(
    name: str,
    source: str,
    holders: dict[int, tuple[int, SavedTensor]],
    saved_tp_size: int,
    tp_size: int,
    tp_rank: int,
    places: _Places,
) -> TensorPlan:
    first = next(iter(holders.values()))[1]
    for saved_rank, (pp, t) in holders.items():
        if t.geometry != first.geometry or t.itemsize != first.itemsize:
            raise CheckpointCorrupt(
                f"{source}: saved {rank_label(pp, *_tp_dp(saved_rank, saved_tp_size))} records geometry "
                f"{_describe(t)}, but another rank records {_describe(first)}. The manifest is damaged: save the "
                "checkpoint again."
            )
        if t.dtype != first.dtype:  # all read as one dtype; float16 read as bfloat16 is other numbers
            raise CheckpointMismatch(
                f"{source}: saved {rank_label(pp, *_tp_dp(saved_rank, saved_tp_size))} stores it as {t.dtype}, "
                f"but another saved rank as {first.dtype}; resharded, their bytes would be joined as one dtype. Serve "
                "it at the topology it was saved with (each rank's file cast on its own), or save it in one dtype."
            )
    g = first.geometry
    reshardable = g is not None and g.kind != OPAQUE
    if not reshardable:
        layer = "unknown layer" if g is None else f"{g.layer_class}, kind {g.kind!r}"
        if max(holders) >= saved_tp_size:
            # Held per replica: only experts are (saved under data parallelism).
            if places.own in holders:
                # Served as saved: the saved rank of this rank's experts wrote exactly its copy.
                return _whole(name, source, holders[places.own][1])
            _refuse_moved_experts(name, layer, places, tp_size, saved_tp_size)
            raise CheckpointMismatch(
                f"{name} ({layer}) holds experts each data-parallel replica saved, with no geometry this version "
                f"can split, and serving rank tp_rank={tp_rank} (TP={tp_size}) holds other experts or another cut "
                "of them. Serve it at the saved topology (tensor, data and expert parallel sizes), or save it "
                "again from an engine with the serving topology."
            )
        # When replicas wrote their experts, a tensor of the first replica alone is no expert.
        if saved_tp_size == tp_size and tp_rank in holders and (not places.moved or places.replicas > 1):
            # The same TP size gives the same shard whatever the pipeline split: copy it as saved.
            return _whole(name, source, holders[tp_rank][1])
        if places.moved:
            # Maybe a (quantized) tensor of experts: copied as saved, it would hold the wrong ones.
            _refuse_moved_experts(name, layer, places, tp_size, saved_tp_size)
        why = f" from TP={saved_tp_size} to TP={tp_size}"
        if g is None:
            raise CheckpointMismatch(
                f"{name} cannot be resharded{why}: the checkpoint records no geometry for it (layer class "
                "unknown), so which rows each rank holds is unknown. Serve it at TP="
                f"{saved_tp_size}, or save the checkpoint again with this version of vllm-sharded-loader."
            )
        check_reshardable(g, name, why)
    assert g is not None
    for saved_rank, (pp, t) in holders.items():
        check_saved_shape(source, g, t.shape, saved_tp_size, saved_rank, pp, places.saved, places.saved_tp)
    by_expert = places.saved is not None or places.serving is not None
    if g.stacked and (by_expert or (places.saved_tp, places.serving_tp) != (saved_tp_size, (tp_size, tp_rank))):
        return _plan_experts(name, source, holders, g, saved_tp_size, tp_size, tp_rank, places)
    if g.kind == REPLICATED:
        # One saved copy is enough; spreading serving ranks over the copies spreads the I/O.
        choice = tp_rank % saved_tp_size
        chosen = holders.get(choice) or holders[min(holders)]
        return _whole(name, source, chosen[1])

    target = shard_layout(g, tp_size, tp_rank, name)
    if not math.prod(target.shape):
        return TensorPlan(name, source, target.shape, first.itemsize, ())
    sources = {}
    for saved_rank in range(saved_tp_size):
        t = _holder(holders, saved_rank, source, saved_tp_size)
        sources[saved_rank] = (t.file, t.offset, shard_layout(g, saved_tp_size, saved_rank, name))
    reads, zeros = _split_reads(target, sources, first.itemsize, 0, tp_rank)
    return TensorPlan(name, source, target.shape, first.itemsize, tuple(merge_reads(reads)), tuple(merge_zeros(zeros)))


def _refuse_moved_experts(name: str, layer: str, places: _Places, tp_size: int, saved_tp_size: int) -> None:
    """Raise, saying how the experts moved, if this rank places experts otherwise than saved."""
    check_expert_placement(
        places.saved,
        places.serving,
        serving_ep_rank=places.ep_rank,
        tp_rank=places.tp_rank,
        saved_tp_size=saved_tp_size,
        where=f"Serving rank tp_rank={places.tp_rank} (TP={tp_size})",
        why=f"{name} ({layer}) has no geometry this version can split",
    )


def _holder(
    holders: Mapping[int, tuple[int, SavedTensor]], saved_rank: int, source: str, saved_tp_size: int
) -> SavedTensor:
    """Saved rank ``saved_rank``'s copy of a tensor every saved rank holds a part of."""
    if saved_rank not in holders:
        tp, dp = _tp_dp(saved_rank, saved_tp_size)
        raise CheckpointCorrupt(
            f"{source} is split across the saved ranks, but saved tp_rank={tp}"
            + (f" of data-parallel replica {dp}" if dp else "")
            + f" does not hold it (EP/TP ranks {sorted(holders)} do). The checkpoint is incomplete: save it again."
        )
    return holders[saved_rank][1]


def _tp_dp(saved_rank: int, saved_tp_size: int) -> tuple[int, int]:
    """(tp_rank, dp_rank) of a saved rank ``dp_rank * saved_tp_size + tp_rank``."""
    dp, tp = divmod(saved_rank, saved_tp_size)
    return tp, dp


def _split_reads(
    target: ShardLayout,
    sources: Mapping[int, tuple[str, int, ShardLayout]],
    isz: int,
    dest_base: int,
    tp_rank: int,
) -> tuple[list[Read], list[Strided]]:
    """The reads and zero fills that fill ``target`` from saved rank -> (file, offset, layout),
    at element ``dest_base``. Each range is read once: saved pieces of a segment are equal or disjoint."""
    d = target.split_dim
    assert d is not None
    shape = target.shape
    outer = math.prod(shape[:d])
    inner = math.prod(shape[d + 1 :])
    dest_row = shape[d] * inner
    reads: list[Read] = []
    zeros: list[Strided] = []
    held: dict[str, list[tuple[int, ShardPiece]]] = {}  # by segment, once (a scan per piece: quadratic)
    for saved_rank, sp in ((rank, sp) for rank, (_, _, layout) in sources.items() for sp in layout.pieces):
        held.setdefault(sp.segment, []).append((saved_rank, sp))
    for piece in target.pieces:
        if piece.padding:
            offset = dest_base + (piece.local_offset + piece.data_length) * inner
            zeros.append(strided(offset, piece.padding * inner, dest_row, outer))
        want_start, want_stop = piece.start, piece.start + piece.data_length
        by_range: dict[tuple[int, int], list[tuple[int, ShardPiece]]] = {}
        for saved_rank, sp in held.get(piece.segment, ()):
            by_range.setdefault((sp.start, sp.start + sp.data_length), []).append((saved_rank, sp))
        for (have_start, have_stop), candidates in sorted(by_range.items()):
            lo, hi = max(want_start, have_start), min(want_stop, have_stop)
            if lo >= hi:
                continue
            saved_rank, sp = candidates[tp_rank % len(candidates)]
            file, offset, layout = sources[saved_rank]
            source_row = layout.shape[d] * inner * isz
            reads.append(
                read_run(
                    file,
                    source=(offset + (sp.local_offset + lo - sp.start) * inner * isz, (hi - lo) * inner * isz),
                    source_stride=source_row,
                    dest=(dest_base + (piece.local_offset + lo - piece.start) * inner, (hi - lo) * inner),
                    dest_stride=dest_row,
                    count=outer,
                )
            )
    return reads, zeros


def _plan_experts(
    name: str,
    source: str,
    holders: dict[int, tuple[int, SavedTensor]],
    g: TensorGeometry,
    saved_tp_size: int,
    tp_size: int,
    tp_rank: int,
    places: _Places,
) -> TensorPlan:
    """Stacked experts, slot by slot: each serving expert's bytes from the saved rank(s) holding it."""
    ids, target = expert_slots(g, *places.serving_tp, places.serving, places.ep_rank, name)
    isz = next(iter(holders.values()))[1].itemsize
    shape = (len(ids), *target.shape)
    if not math.prod(shape):
        return TensorPlan(name, source, shape, isz, ())
    holding: dict[int, dict[int, tuple[str, int, ShardLayout]]] = {}  # expert -> saved rank -> source
    # The saved EP ranks, or without expert parallelism the ranks of the experts' TP cut.
    for saved_rank in range(places.saved_tp if places.saved is None else places.saved.ep_size):
        t = _holder(holders, saved_rank, source, saved_tp_size)
        saved_ids, layout = expert_slots(g, places.saved_tp, saved_rank, places.saved, saved_rank, name)
        expert_bytes = math.prod(layout.shape) * isz
        for local, expert in enumerate(saved_ids):
            holding.setdefault(expert, {})[saved_rank] = (t.file, t.offset + local * expert_bytes, layout)
    slot = math.prod(target.shape)
    reads: list[Read] = []
    zeros: list[Strided] = []
    for local, expert in enumerate(ids):
        sources = holding.get(expert)
        if not sources:
            raise CheckpointCorrupt(
                f"{source}: no saved rank holds expert {expert}. The manifest is damaged: save the checkpoint again."
            )
        if target.split_dim is None:
            # Replicated within an expert (a down projection's bias): one holder's copy, whole.
            file, offset, _ = sources[min(sources)]
            reads.append(read_run(file, (offset, slot * isz), slot * isz, (local * slot, slot), slot, 1))
            continue
        more_reads, more_zeros = _split_reads(target, sources, isz, local * slot, tp_rank)
        reads += more_reads
        zeros += more_zeros
    return TensorPlan(name, source, shape, isz, tuple(merge_reads(reads)), tuple(merge_zeros(zeros)))


def check_saved_shape(
    name: str,
    g: TensorGeometry,
    shape: Sequence[int],
    saved_tp_size: int,
    saved_rank: int,
    pp_rank: int,
    saved_experts: ExpertPlacement | None = None,
    saved_expert_tp: int | None = None,
) -> None:
    try:
        if g.stacked and saved_experts is None and saved_expert_tp:
            # Experts cut across TP x DP: the saved rank is its index there.
            expected = rank_shape(g, saved_expert_tp, saved_rank, name=name)
        else:
            expected = rank_shape(g, saved_tp_size, saved_rank % saved_tp_size, saved_experts, saved_rank, name)
    except ShardedStateError as e:  # no serving size to change: the saved size is a fact, the record is wrong
        raise CheckpointCorrupt(
            f"{name}: its recorded geometry cannot describe the files saved at TP={saved_tp_size} "
            f"({str(e).split('. ')[0]}). The manifest is damaged: save the checkpoint again."
        ) from e
    if tuple(shape) != expected:
        raise CheckpointCorrupt(
            f"{name} of saved {rank_label(pp_rank, *_tp_dp(saved_rank, saved_tp_size))} has shape {list(shape)}, "
            f"but its geometry ({g.layer_class}, shape {list(g.shape)} at TP=1) gives {list(expected)} at "
            f"TP={saved_tp_size}. The manifest is damaged: save the checkpoint again."
        )


def _describe(t: SavedTensor) -> str:
    return "none" if t.geometry is None else f"{t.geometry.to_dict()} itemsize {t.itemsize}"


def _whole(name: str, source: str, t: SavedTensor) -> TensorPlan:
    numel = math.prod(t.shape)
    reads = (Read(t.file, strided(t.offset, t.nbytes, t.nbytes, 1), strided(0, numel, numel, 1)),) if numel else ()
    return TensorPlan(name, source, tuple(t.shape), t.itemsize, reads)
