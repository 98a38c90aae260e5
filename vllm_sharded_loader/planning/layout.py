"""vLLM's sharding rule: which index ranges of each segment one rank's local tensor holds. Pure."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, replace

from ..format.errors import CheckpointMismatch, InvalidOption, ShardedStateError, listing
from ..format.geometry import OPAQUE, REPLICATED, ROW_PARALLEL, SPLIT_KINDS, Segment, TensorGeometry
from .tensors import tied_source


@dataclass(frozen=True)
class ShardPiece:
    """The part of one segment a rank holds: ``length`` indices from ``start`` in the segment (offsets
    in the TP=1 and the local tensor), the last ``padding`` of them vLLM's zero padding."""

    segment: str
    start: int
    length: int
    local_offset: int
    global_offset: int
    padding: int = 0

    @property
    def data_length(self) -> int:
        """How many of the piece's indices carry data."""
        return self.length - self.padding


@dataclass(frozen=True)
class ShardLayout:
    """What one rank's local tensor holds: its shape and, if split, a piece of each segment."""

    shape: tuple[int, ...]
    split_dim: int | None
    pieces: tuple[ShardPiece, ...]


def shard_layout(geometry: TensorGeometry, tp_size: int, tp_rank: int, name: str = "the tensor") -> ShardLayout:
    """vLLM's sharding rule: the pieces of each segment rank ``tp_rank`` of ``tp_size`` holds.

    Each rank holds ``n / tp_size`` consecutive heads or indices of a segment; K and V heads fewer than
    ``tp_size`` are replicated. A piece not on whole ``unit`` s (an int32, a group) is refused.

    >>> from vllm_sharded_loader.format.geometry import qkv_parallel
    >>> layout = shard_layout(qkv_parallel([12, 4], num_heads=8, num_kv_heads=2, head_size=1), tp_size=4, tp_rank=3)
    >>> [(p.segment, p.start, p.length) for p in layout.pieces]
    [('q', 6, 2), ('k', 1, 1), ('v', 1, 1)]
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise InvalidOption(f"{name}: tp_rank={tp_rank} is not a rank of TP={tp_size}.")
    g = geometry
    if g.kind == REPLICATED:
        return ShardLayout(g.shape, None, ())
    check_reshardable(g, name)
    assert g.split_dim is not None
    pieces = []
    local_offset = global_offset = 0
    for s in g.segments:
        start, length = _segment_piece(s, tp_size, tp_rank, g, name)
        padding = max(0, min(length, start + length - s.size))
        if g.unit != 1:
            if start % g.unit or length % g.unit:
                raise _split_unit(name, g, s, tp_size, tp_rank, start, length)
            # Padding only exists in vocabularies, whose unit is 1 (check_geometry).
            start, length, padding = start // g.unit, length // g.unit, 0
        pieces.append(ShardPiece(s.name, start, length, local_offset, global_offset + start, padding))
        local_offset += length
        global_offset += s.padded // g.unit
    shape = list(g.shape)
    shape[g.split_dim] = local_offset
    return ShardLayout(tuple(shape), g.split_dim, tuple(pieces))


def _segment_piece(s: Segment, tp_size: int, tp_rank: int, g: TensorGeometry, name: str) -> tuple[int, int]:
    unit, units, what = (s.head_size, s.heads, "heads") if s.heads and s.head_size else (1, s.padded, "indices")
    if s.replicate_heads and tp_size >= units:
        # As vLLM's QKVParallelLinear: kv head tp_rank // (tp_size // total_num_kv_heads).
        if tp_size % units:
            raise _indivisible(name, g, s, f"{units} {what}", tp_size, f"TP={tp_size} is not a multiple of {units}")
        return (tp_rank // (tp_size // units)) * unit, unit
    if units % tp_size:
        raise _indivisible(name, g, s, f"{units} {what}", tp_size, f"{units} is not a multiple of TP={tp_size}")
    per_rank = units // tp_size
    return tp_rank * per_rank * unit, per_rank * unit


def _split_unit(
    name: str, g: TensorGeometry, s: Segment, tp_size: int, tp_rank: int, start: int, length: int
) -> ShardedStateError:
    # A row-parallel layer is split along its weight's columns (inputs), the others along rows.
    rows = "columns" if g.kind == ROW_PARALLEL else "rows"
    return CheckpointMismatch(
        f"{name} ({g.layer_class}) cannot be split across TP={tp_size}: rank {tp_rank} would hold the layer's "
        f"{rows} [{start}, {start + length}) of segment {s.name!r}, but each index of this quantized tensor along "
        f"dimension {g.split_dim} stands for {g.unit} {rows} (values packed into one integer, or one quantization "
        f"group), and {start if start % g.unit else length} is not a multiple of {g.unit}. Serve it at a tensor "
        f"parallel size whose per-rank {rows} are whole multiples of it (the size it was saved at works), or save "
        "the checkpoint again at the new size."
    )


def _indivisible(name: str, g: TensorGeometry, s: Segment, what: str, tp_size: int, why: str) -> ShardedStateError:
    return CheckpointMismatch(
        f"{name} ({g.layer_class}): segment {s.name!r} of {what} cannot be split across TP={tp_size} "
        f"({why}); vLLM itself refuses this size. Serve at a tensor parallel size that divides it."
    )


def check_reshardable(g: TensorGeometry, name: str, why: str = "") -> None:
    """Raise unless the geometry describes how vLLM splits the tensor (``opaque`` does not)."""
    if g.kind == OPAQUE:
        raise CheckpointMismatch(
            f"{name} ({g.layer_class}) cannot be resharded{why}: its sharding is not one this version "
            f"describes (kind {OPAQUE!r}; known: {sorted(SPLIT_KINDS | {REPLICATED})}). Serve it at the tensor "
            "parallel size it was saved with, or save the checkpoint again at the new size."
        )


def same_split(a: TensorGeometry, b: TensorGeometry) -> bool:
    """Whether two geometries split a tensor the same way (the layer class, a label, aside)."""
    return replace(a, layer_class=b.layer_class) == b


def check_served_geometry(
    recorded: Mapping[str, TensorGeometry],
    served: Mapping[str, TensorGeometry],
    saved: Container[str],
    *,
    resharding: bool,
    tied: Iterable[Iterable[str]] = (),
    where: str = "the checkpoint",
) -> None:
    """Raise unless the ``recorded`` geometry of the ``saved`` names is the ``served`` model's wherever both
    describe a split (resharding: wherever the record does): another split would load other rows silently."""
    saved_as = tied_source(tied)
    wrong = []
    regrid = []
    for name, mine in served.items():
        source = saved_as(name, saved)
        if source is None or source not in recorded:
            continue
        theirs = recorded[source]
        if OPAQUE in (mine.kind, theirs.kind):
            # (Recorded opaque and served split: the planner refuses it, naming the tensor.)
            if resharding and mine.kind == OPAQUE and theirs.kind != OPAQUE:
                wrong.append(f"{name}: the checkpoint records {theirs.kind!r}, the served model {mine.kind!r}")
            continue
        if mine.unit != theirs.unit and same_split(replace(mine, shape=theirs.shape, unit=theirs.unit), theirs):
            # The same rows, quantized on another grid: vLLM refines FP8 blocks at some TP sizes.
            regrid.append(f"{name}: one entry per {theirs.unit} rows saved, per {mine.unit} served")
        elif not same_split(mine, theirs):
            wrong.append(f"{name}: the checkpoint records {_split(theirs)}, the served model {_split(mine)}")
    if regrid and not wrong:
        raise CheckpointMismatch(
            f"{where}: the served model keeps quantization scales on another grid than the checkpoint "
            f"({listing(regrid, 5, '; ')}): vLLM refines its FP8 blocks where a rank would hold part of "
            "one, and a saved scale cannot be spread over a finer grid. Serve at a tensor parallel size "
            "with the saved grid (the saved size works), or save the checkpoint again at this one."
        )
    wrong += regrid
    if wrong:
        shown = listing(wrong, 5, "; ")
        raise CheckpointMismatch(
            f"{where}: the manifest's geometry (how each tensor is split across ranks) is not the served "
            f"model's: {shown}. The checkpoint was saved from another model, or its manifest is damaged: "
            "save it again from the model being served."
        )


def _split(g: TensorGeometry) -> str:
    segments = ", ".join(f"{s.name}={s.padded}" for s in g.segments)
    unit = f" in units of {g.unit} rows" if g.unit != 1 else ""
    return f"{g.kind} {list(g.shape)}" + (f" split on dim {g.split_dim} into [{segments}]{unit}" if g.segments else "")
