"""Resharding at load time: which bytes of a checkpoint saved at one TP/PP size a rank
serving at another size reads, and where they land. Pure: no torch, no vLLM, no I/O.

Three layers, each a pure function of the one before, in the spirit of PyTorch DCP's
``resharding.py`` (overlap of a saved chunk and a wanted chunk):

- :class:`TensorGeometry` describes one parameter declaratively and independently of any
  TP size: its shape at TP=1, the dimension vLLM splits it along, and for fused
  parameters the logical sub-tensors (*segments*: q/k/v, gate/up, vocabulary) it is made
  of. It is JSON data, recorded beside the tensor in the manifest.
- :func:`shard_layout` applies vLLM's rule for that geometry: which index ranges of each
  segment one rank's local tensor holds, and where.
- :func:`plan_reads` intersects the serving rank's layout with every saved rank's layout
  and returns strided byte runs to read (``count`` runs of ``length`` bytes, ``stride``
  apart) and the element runs they land in, plus the runs to zero-fill (vocabulary
  padding). A rank reads exactly the bytes it keeps, each once.

:func:`pp_layer_ranges` and :func:`layer_index` mirror vLLM's pipeline split, so a
loader can tell which layers a serving stage needs; :func:`plan_reads` finds each tensor
in whichever saved stage wrote it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .format import ShardedStateError

REPLICATED = "replicated"
COLUMN_PARALLEL = "column_parallel"
ROW_PARALLEL = "row_parallel"
QKV_PARALLEL = "qkv_parallel"
MERGED_COLUMN_PARALLEL = "merged_column_parallel"
VOCAB_PARALLEL = "vocab_parallel"
OPAQUE = "opaque"
KINDS = (
    REPLICATED,
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    QKV_PARALLEL,
    MERGED_COLUMN_PARALLEL,
    VOCAB_PARALLEL,
    OPAQUE,
)
SPLIT_KINDS = frozenset(KINDS) - {REPLICATED, OPAQUE}

# vLLM's vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE.
DEFAULT_VOCAB_PADDING_SIZE = 64

_ResultKey = TypeVar("_ResultKey", bound=Hashable)


# ------------------------------------------------------------------------ geometry


@dataclass(frozen=True)
class Segment:
    """One logical sub-tensor of a parameter along its split dimension.

    ``size`` is the number of indices that carry data at TP=1 (rows of q, of gate, of the
    real vocabulary). ``padded_size`` adds vLLM's padding, which holds zeros (vocabulary
    only; it does not depend on the TP size). ``heads`` and ``head_size`` say the segment
    is split by whole attention heads; with ``replicate_heads`` (K and V of a QKV
    projection), a TP size above the head count gives each rank one head, shared by
    ``tp_size // heads`` consecutive ranks.
    """

    name: str
    size: int
    padded_size: int | None = None
    heads: int | None = None
    head_size: int | None = None
    replicate_heads: bool = False

    @property
    def padded(self) -> int:
        """The segment's length along the split dimension at TP=1, padding included."""
        return self.size if self.padded_size is None else self.padded_size

    def to_dict(self) -> dict[str, Any]:
        """JSON data; keys at their default are left out."""
        data: dict[str, Any] = {"name": self.name, "size": self.size}
        if self.padded_size is not None:
            data["padded_size"] = self.padded_size
        if self.heads is not None:
            data["heads"] = self.heads
        if self.head_size is not None:
            data["head_size"] = self.head_size
        if self.replicate_heads:
            data["replicate_heads"] = True
        return data


@dataclass(frozen=True)
class TensorGeometry:
    """How one parameter is sharded across tensor-parallel ranks, for every TP size.

    ``shape`` is the parameter's shape at TP=1 (vocabulary rows padded as vLLM pads them),
    ``split_dim`` the dimension split across ranks (None: every rank holds all of it),
    ``segments`` the consecutive sub-tensors along ``split_dim`` (each split on its own,
    a rank's local tensor being the concatenation of its piece of each), ``kind`` the
    sharding rule and ``layer_class`` the vLLM layer it comes from, for messages.
    ``quantization`` names a quantized layout, which is never resharded: packed and
    blocked dimensions follow other rules.

    >>> g = TensorGeometry.from_dict({"kind": "row_parallel", "layer_class": "RowParallelLinear",
    ...     "shape": [8, 16], "split_dim": 1, "segments": [{"name": "weight", "size": 16}]}, "o_proj.weight")
    >>> shard_layout(g, tp_size=2, tp_rank=1).shape
    (8, 8)
    """

    kind: str
    layer_class: str
    shape: tuple[int, ...]
    split_dim: int | None = None
    segments: tuple[Segment, ...] = ()
    quantization: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON data; the inverse of :meth:`from_dict`."""
        data: dict[str, Any] = {
            "kind": self.kind,
            "layer_class": self.layer_class,
            "shape": list(self.shape),
            "split_dim": self.split_dim,
        }
        if self.segments:
            data["segments"] = [s.to_dict() for s in self.segments]
        if self.quantization is not None:
            data["quantization"] = self.quantization
        return data

    @classmethod
    def from_dict(cls, data: Any, name: str) -> TensorGeometry:
        """Parse and validate the geometry recorded for tensor ``name``.

        Every defect is a :class:`ShardedStateError` naming the tensor.
        """
        where = f"geometry of {name}"

        def fail(what: str) -> ShardedStateError:
            return ShardedStateError(f"{where}: {what}. The manifest is damaged: save the checkpoint again.")

        def integer(obj: dict[str, Any], key: str, minimum: int) -> int:
            value = obj.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise fail(f"{key!r} must be an integer >= {minimum}, found {value!r}")
            return value

        def optional_integer(obj: dict[str, Any], key: str, minimum: int) -> int | None:
            return None if obj.get(key) is None else integer(obj, key, minimum)

        def string(obj: dict[str, Any], key: str) -> str:
            value = obj.get(key)
            if not isinstance(value, str) or not value:
                raise fail(f"{key!r} must be a non-empty string, found {value!r}")
            return value

        if not isinstance(data, dict):
            raise fail(f"expected an object, found {type(data).__name__}")
        unknown = set(data) - {"kind", "layer_class", "shape", "split_dim", "segments", "quantization"}
        if unknown:
            raise fail(f"unknown keys {sorted(unknown)}")
        shape = data.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise fail(f"'shape' must be a list of sizes, found {shape!r}")
        raw_segments = data.get("segments", [])
        if not isinstance(raw_segments, list):
            raise fail(f"'segments' must be a list, found {type(raw_segments).__name__}")
        segments = []
        for raw in raw_segments:
            if not isinstance(raw, dict):
                raise fail(f"a segment must be an object, found {raw!r}")
            unknown = set(raw) - {"name", "size", "padded_size", "heads", "head_size", "replicate_heads"}
            if unknown:
                raise fail(f"segment {raw.get('name')!r} has unknown keys {sorted(unknown)}")
            replicate = raw.get("replicate_heads", False)
            if not isinstance(replicate, bool):
                raise fail(f"'replicate_heads' must be true or false, found {replicate!r}")
            segments.append(
                Segment(
                    name=string(raw, "name"),
                    size=integer(raw, "size", 0),
                    padded_size=optional_integer(raw, "padded_size", 0),
                    heads=optional_integer(raw, "heads", 1),
                    head_size=optional_integer(raw, "head_size", 1),
                    replicate_heads=replicate,
                )
            )
        split_dim = data.get("split_dim")
        if split_dim is not None and (isinstance(split_dim, bool) or not isinstance(split_dim, int)):
            raise fail(f"'split_dim' must be an integer or null, found {split_dim!r}")
        geometry = cls(
            kind=string(data, "kind"),
            layer_class=string(data, "layer_class"),
            shape=tuple(shape),
            split_dim=split_dim,
            segments=tuple(segments),
            quantization=None if data.get("quantization") is None else string(data, "quantization"),
        )
        check_geometry(geometry, name)
        return geometry


def check_geometry(geometry: TensorGeometry, name: str) -> None:
    """Raise a :class:`ShardedStateError` unless the geometry is self-consistent.

    An ``opaque`` or quantized geometry is valid (the tensor is simply never resharded).
    """
    g = geometry
    where = f"geometry of {name} ({g.layer_class}, kind {g.kind!r})"

    def fail(what: str) -> ShardedStateError:
        return ShardedStateError(f"{where}: {what}. The manifest is damaged: save the checkpoint again.")

    if g.kind not in KINDS:
        raise ShardedStateError(
            f"{where}: unknown sharding kind {g.kind!r}; this version knows {list(KINDS)}. "
            "Upgrade vllm-sharded-loader, or save the checkpoint again with this version."
        )
    if any(d < 0 for d in g.shape):
        raise fail(f"shape {list(g.shape)} has a negative size")
    if g.kind == OPAQUE:
        return
    if g.kind == REPLICATED:
        if g.split_dim is not None or g.segments:
            raise fail(f"a replicated tensor has no split dimension or segments, found split_dim={g.split_dim}")
        return
    expected_dim = 1 if g.kind == ROW_PARALLEL else 0
    if g.split_dim != expected_dim or len(g.shape) <= expected_dim:
        raise fail(
            f"vLLM splits a {g.kind} tensor along dimension {expected_dim}, found split_dim={g.split_dim} "
            f"for shape {list(g.shape)}"
        )
    segments = g.segments
    if not segments:
        raise fail("a split tensor needs at least one segment")
    names = [s.name for s in segments]
    if len(set(names)) != len(names):
        raise fail(f"segment names {names} repeat")
    total = sum(s.padded for s in segments)
    if total != g.shape[expected_dim]:
        raise fail(f"segments add up to {total} along dimension {expected_dim}, but the shape is {list(g.shape)}")
    for s in segments:
        if s.padded < s.size:
            raise fail(f"segment {s.name!r} has padded_size {s.padded_size} < size {s.size}")
        if (s.heads is None) != (s.head_size is None):
            raise fail(f"segment {s.name!r} needs both 'heads' and 'head_size' or neither")
        if s.heads is not None and s.head_size is not None:
            if s.heads * s.head_size != s.size:
                raise fail(f"segment {s.name!r} has {s.heads} heads of {s.head_size} but size {s.size}")
            if s.padded_size not in (None, s.size):
                raise fail(f"segment {s.name!r} is split by heads and cannot be padded")
        elif s.replicate_heads:
            raise fail(f"segment {s.name!r} replicates heads but has none")
    if g.kind == QKV_PARALLEL:
        if names != ["q", "k", "v"] or any(s.heads is None for s in segments):
            raise fail(f"a QKV tensor has segments q, k, v with heads, found {names}")
        q, k, v = segments
        if q.replicate_heads or not (k.replicate_heads and v.replicate_heads) or k.heads != v.heads:
            raise fail("in a QKV tensor K and V (same head count) replicate heads and Q does not")
    elif any(s.heads is not None for s in segments):
        raise fail("only a QKV tensor is split by heads")
    if g.kind == VOCAB_PARALLEL:
        if names not in (["vocab"], ["vocab", "added"]):
            raise fail(f"a vocabulary tensor has segments vocab and optionally added, found {names}")
    elif any(s.padded_size not in (None, s.size) for s in segments):
        raise fail("only a vocabulary tensor is padded")
    if g.kind in (COLUMN_PARALLEL, ROW_PARALLEL) and len(segments) != 1:
        raise fail(f"a {g.kind} tensor has a single segment, found {names}")


# ------------------------------------------------ geometry of vLLM's parallel layers


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """vLLM's ``pad_vocab_size``: round up to a multiple of ``pad_to`` (not of the TP size).

    >>> pad_vocab_size(1000)
    1024
    """
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


def replicated(shape: Sequence[int], layer_class: str) -> TensorGeometry:
    """A tensor every rank holds whole: norms, scalar scales, a RowParallelLinear bias.

    >>> replicated([64], "RMSNorm").to_dict()
    {'kind': 'replicated', 'layer_class': 'RMSNorm', 'shape': [64], 'split_dim': None}
    """
    return TensorGeometry(REPLICATED, layer_class, tuple(shape))


def column_parallel(shape: Sequence[int], layer_class: str = "ColumnParallelLinear") -> TensorGeometry:
    """A ColumnParallelLinear weight ``[out, in]`` or bias ``[out]``, split along dimension 0."""
    return TensorGeometry(COLUMN_PARALLEL, layer_class, tuple(shape), 0, (Segment("output", shape[0]),))


def row_parallel(shape: Sequence[int], layer_class: str = "RowParallelLinear") -> TensorGeometry:
    """A RowParallelLinear weight ``[out, in]``, split along dimension 1 (its bias is :func:`replicated`)."""
    return TensorGeometry(ROW_PARALLEL, layer_class, tuple(shape), 1, (Segment("input", shape[1]),))


def merged_column_parallel(
    shape: Sequence[int],
    output_sizes: Sequence[int],
    names: Sequence[str] | None = None,
    layer_class: str = "MergedColumnParallelLinear",
) -> TensorGeometry:
    """A MergedColumnParallelLinear weight or bias: each of ``output_sizes`` (gate, up) split on its own.

    >>> [p.start for p in shard_layout(merged_column_parallel([8, 4], [4, 4]), 2, 1).pieces]
    [2, 2]
    """
    if names is None:
        names = ["gate", "up"] if len(output_sizes) == 2 else [str(i) for i in range(len(output_sizes))]
    segments = tuple(Segment(n, s) for n, s in zip(names, output_sizes, strict=True))
    return TensorGeometry(MERGED_COLUMN_PARALLEL, layer_class, tuple(shape), 0, segments)


def qkv_parallel(
    shape: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    v_head_size: int | None = None,
    layer_class: str = "QKVParallelLinear",
) -> TensorGeometry:
    """A QKVParallelLinear weight ``[(q+k+v) rows, hidden]`` or bias, from the layer's *total* head counts.

    Use ``total_num_heads`` and ``total_num_kv_heads``: the layer's ``output_size`` counts a
    replicated KV head once per rank and is larger than the tensor at TP=1.
    """
    v_head_size = head_size if v_head_size is None else v_head_size
    segments = (
        Segment("q", num_heads * head_size, heads=num_heads, head_size=head_size),
        Segment("k", num_kv_heads * head_size, heads=num_kv_heads, head_size=head_size, replicate_heads=True),
        Segment("v", num_kv_heads * v_head_size, heads=num_kv_heads, head_size=v_head_size, replicate_heads=True),
    )
    return TensorGeometry(QKV_PARALLEL, layer_class, tuple(shape), 0, segments)


def vocab_parallel(
    vocab_size: int,
    embedding_dim: int,
    org_vocab_size: int | None = None,
    padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
    layer_class: str = "VocabParallelEmbedding",
) -> TensorGeometry:
    """A VocabParallelEmbedding or ParallelLMHead weight, padded as vLLM pads it.

    ``vocab_size`` is the layer's ``num_embeddings``, ``org_vocab_size`` its
    ``org_vocab_size`` (the rest are added, e.g. LoRA, tokens, sharded separately and placed
    after the base vocabulary on every rank). A ParallelLMHead bias is
    :func:`vocab_parallel_bias`.

    >>> vocab_parallel(1000, 32).shape
    (1024, 32)
    """
    return _vocab(vocab_size, (embedding_dim,), org_vocab_size, padding_size, layer_class)


def vocab_parallel_bias(
    vocab_size: int,
    org_vocab_size: int | None = None,
    padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
    layer_class: str = "ParallelLMHead",
) -> TensorGeometry:
    """A ParallelLMHead bias ``[vocab]``, padded and split like the weight."""
    return _vocab(vocab_size, (), org_vocab_size, padding_size, layer_class)


def _vocab(
    vocab_size: int, trailing: tuple[int, ...], org_vocab_size: int | None, padding_size: int, layer_class: str
) -> TensorGeometry:
    org = vocab_size if org_vocab_size is None else org_vocab_size
    org_padded = pad_vocab_size(org, padding_size)
    total_padded = pad_vocab_size(org_padded + vocab_size - org, padding_size)
    segments = [Segment("vocab", org, padded_size=org_padded)]
    if total_padded > org_padded:
        segments.append(Segment("added", vocab_size - org, padded_size=total_padded - org_padded))
    return TensorGeometry(VOCAB_PARALLEL, layer_class, (total_padded, *trailing), 0, tuple(segments))


# -------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class ShardPiece:
    """The part of one segment a rank holds: ``length`` indices along the split dimension.

    ``start`` counts from the segment's first index, ``global_offset`` from the first
    index of the TP=1 tensor, ``local_offset`` from the first index of the rank's local
    tensor. The last ``padding`` of the ``length`` indices are vLLM's zero padding.
    """

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

    A segment of ``n`` units (heads, or single indices) gives each rank ``n / tp_size``
    consecutive units; vLLM asserts divisibility, and so do we, with a message. K and V
    heads are replicated when ``tp_size`` exceeds their count: rank ``r`` holds head
    ``r // (tp_size // heads)``. Vocabulary padding is split like data.

    >>> layout = shard_layout(qkv_parallel([12, 4], num_heads=8, num_kv_heads=2, head_size=1), tp_size=4, tp_rank=3)
    >>> [(p.segment, p.start, p.length) for p in layout.pieces]
    [('q', 6, 2), ('k', 1, 1), ('v', 1, 1)]
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ShardedStateError(f"{name}: tp_rank={tp_rank} is not a rank of TP={tp_size}.")
    g = geometry
    if g.kind == REPLICATED:
        return ShardLayout(g.shape, None, ())
    _check_reshardable(g, name)
    assert g.split_dim is not None
    pieces = []
    local_offset = global_offset = 0
    for s in g.segments:
        start, length = _segment_piece(s, tp_size, tp_rank, g, name)
        padding = max(0, min(length, start + length - s.size))
        pieces.append(ShardPiece(s.name, start, length, local_offset, global_offset + start, padding))
        local_offset += length
        global_offset += s.padded
    shape = list(g.shape)
    shape[g.split_dim] = local_offset
    return ShardLayout(tuple(shape), g.split_dim, tuple(pieces))


def _segment_piece(s: Segment, tp_size: int, tp_rank: int, g: TensorGeometry, name: str) -> tuple[int, int]:
    unit, units, what = (s.head_size, s.heads, "heads") if s.heads and s.head_size else (1, s.padded, "indices")
    if s.replicate_heads and tp_size >= units:
        # vLLM's QKVParallelLinear: num_kv_head_replicas = divide(tp_size, total_num_kv_heads),
        # and a rank loads kv head tp_rank // num_kv_head_replicas.
        if tp_size % units:
            raise _indivisible(name, g, s, f"{units} {what}", tp_size, f"TP={tp_size} is not a multiple of {units}")
        return (tp_rank // (tp_size // units)) * unit, unit
    if units % tp_size:
        raise _indivisible(name, g, s, f"{units} {what}", tp_size, f"{units} is not a multiple of TP={tp_size}")
    per_rank = units // tp_size
    return tp_rank * per_rank * unit, per_rank * unit


def _indivisible(name: str, g: TensorGeometry, s: Segment, what: str, tp_size: int, why: str) -> ShardedStateError:
    return ShardedStateError(
        f"{name} ({g.layer_class}): segment {s.name!r} of {what} cannot be split across TP={tp_size} "
        f"({why}); vLLM itself refuses this size. Serve at a tensor parallel size that divides it."
    )


def _check_reshardable(g: TensorGeometry, name: str, why: str = "") -> None:
    if g.quantization is not None:
        raise ShardedStateError(
            f"{name} ({g.layer_class}) holds a {g.quantization}-quantized layout, which cannot be resharded"
            f"{why}: packed and blocked dimensions follow other rules than its shape says. Serve it at the "
            "tensor parallel size it was saved with, or save the checkpoint again at the new size."
        )
    if g.kind == OPAQUE:
        raise ShardedStateError(
            f"{name} ({g.layer_class}) cannot be resharded{why}: its sharding is not one this version "
            f"describes (kind {OPAQUE!r}; known: {sorted(SPLIT_KINDS | {REPLICATED})}). Serve it at the tensor "
            "parallel size it was saved with, or save the checkpoint again at the new size."
        )


# ------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Strided:
    """``count`` runs of ``length`` units, the i-th starting at ``offset + i * stride``.

    Bytes of a file on the source side of a :class:`Read`, elements of the row-major
    local tensor on the destination side. A single run has ``count == 1`` and
    ``stride == length``.
    """

    offset: int
    length: int
    stride: int
    count: int = 1

    @property
    def total(self) -> int:
        """Units covered by all runs."""
        return self.length * self.count

    def runs(self) -> list[tuple[int, int]]:
        """Every run as ``(start, stop)``."""
        return [(self.offset + i * self.stride, self.offset + i * self.stride + self.length) for i in range(self.count)]


def _strided(offset: int, length: int, stride: int, count: int) -> Strided:
    return Strided(offset, length, length, 1) if count == 1 else Strided(offset, length, stride, count)


@dataclass(frozen=True)
class Read:
    """Copy ``source`` bytes of ``file`` into ``dest`` elements of the local tensor, run by run."""

    file: str
    source: Strided
    dest: Strided


@dataclass(frozen=True)
class TensorPlan:
    """How to fill one local tensor: reads from saved files, and zero-filled element runs.

    ``shape`` is the local shape at the serving TP size; ``itemsize`` is the saved dtype's
    (a loader casting to another dtype converts after reading). ``source_name`` is the
    saved tensor read, which differs from ``name`` for tied tensors.
    """

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
    """One tensor of one saved rank: where its data starts and how it was sharded.

    ``offset`` is the absolute byte offset of its first element in ``file`` (for
    safetensors: the header length plus the tensor's ``data_offsets`` begin), ``shape``
    its local shape as saved, ``geometry`` None for a checkpoint that recorded none.
    """

    file: str
    offset: int
    itemsize: int
    shape: tuple[int, ...]
    geometry: TensorGeometry | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class SavedRank:
    """The tensors one saved (pp_rank, tp_rank) worker wrote."""

    tp_rank: int
    pp_rank: int
    tensors: Mapping[str, SavedTensor]


def plan_reads(
    saved: Sequence[SavedRank],
    saved_tp_size: int,
    needed: Iterable[str],
    *,
    tp_size: int,
    tp_rank: int,
    pp_rank: int = 0,
    tied: Iterable[Iterable[str]] = (),
) -> ReadPlan:
    """The reads that give serving rank ``tp_rank`` of ``tp_size`` each tensor in ``needed``.

    ``saved`` are all the saved ranks (any pipeline stage: a tensor is looked up by name
    wherever it was written). ``tied`` lists groups of names sharing one tensor (tied
    embeddings are saved once, under one name): a needed name not saved is read from a
    tied name that is. ``pp_rank`` only labels the plan and its messages.

    A split tensor is read piece by piece from the saved ranks holding each piece (dim-0
    splits as contiguous ranges, dim-1 splits as one run per row); a replicated one whole
    from a single saved rank; vocabulary padding is zero-filled, never read. A tensor
    without a reshardable geometry is copied whole when the TP size is unchanged, and is
    an error otherwise.

    >>> saved = [SavedRank(0, 0, {"w": SavedTensor("f0", 100, 2, (4, 2), column_parallel([4, 2]))})]
    >>> (read,) = plan_reads(saved, 1, ["w"], tp_size=2, tp_rank=1).tensors["w"].reads
    >>> read.source, read.dest
    (Strided(offset=108, length=8, stride=8, count=1), Strided(offset=0, length=4, stride=4, count=1))
    """
    serving = f"pp_rank={pp_rank} tp_rank={tp_rank} (TP={tp_size})"
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ShardedStateError(f"Serving rank {serving}: tp_rank is not a rank of TP={tp_size}.")
    index = _index_saved(saved, saved_tp_size)
    aliases: dict[str, list[str]] = {}
    for group in tied:
        names = list(group)
        for n in names:
            aliases.setdefault(n, []).extend(m for m in names if m != n)
    plans: dict[str, TensorPlan] = {}
    missing: list[str] = []
    for name in needed:
        source = next((n for n in [name, *aliases.get(name, [])] if n in index), None)
        if source is None:
            missing.append(name)
            continue
        plans[name] = _plan_tensor(name, source, index[source], saved_tp_size, tp_size, tp_rank)
    if missing:
        shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ShardedStateError(
            f"Serving rank {serving} needs tensors no saved rank holds: {shown}. The checkpoint was saved "
            "from another model or is incomplete: save it again from the model being served."
        )
    return ReadPlan(tp_size, tp_rank, pp_rank, saved_tp_size, plans)


def _index_saved(saved: Sequence[SavedRank], saved_tp_size: int) -> dict[str, dict[int, tuple[int, SavedTensor]]]:
    """name -> saved tp_rank -> (pp_rank, tensor), the lowest pipeline stage winning."""
    if saved_tp_size < 1:
        raise ShardedStateError(f"The saved tensor parallel size must be >= 1, found {saved_tp_size}.")
    index: dict[str, dict[int, tuple[int, SavedTensor]]] = {}
    seen: set[tuple[int, int]] = set()
    for rank in sorted(saved, key=lambda r: (r.pp_rank, r.tp_rank)):
        if not 0 <= rank.tp_rank < saved_tp_size or (rank.pp_rank, rank.tp_rank) in seen:
            raise ShardedStateError(
                f"Saved rank pp_rank={rank.pp_rank} tp_rank={rank.tp_rank} is "
                f"{'listed twice' if (rank.pp_rank, rank.tp_rank) in seen else 'outside'} TP={saved_tp_size}. "
                "The manifest is damaged: save the checkpoint again."
            )
        seen.add((rank.pp_rank, rank.tp_rank))
        for name, tensor in rank.tensors.items():
            index.setdefault(name, {}).setdefault(rank.tp_rank, (rank.pp_rank, tensor))
    return index


def _plan_tensor(
    name: str,
    source: str,
    holders: dict[int, tuple[int, SavedTensor]],
    saved_tp_size: int,
    tp_size: int,
    tp_rank: int,
) -> TensorPlan:
    first = next(iter(holders.values()))[1]
    for saved_rank, (pp, t) in holders.items():
        if t.geometry != first.geometry or t.itemsize != first.itemsize:
            raise ShardedStateError(
                f"{source}: saved tp_rank={saved_rank} pp_rank={pp} records geometry {_describe(t)}, but another "
                f"rank records {_describe(first)}. The manifest is damaged: save the checkpoint again."
            )
    g = first.geometry
    reshardable = g is not None and g.quantization is None and g.kind != OPAQUE
    if not reshardable:
        if saved_tp_size == tp_size and tp_rank in holders:
            # The same TP size gives the same shard whatever the pipeline split: copy it as saved.
            return _whole(name, source, holders[tp_rank][1])
        why = f" from TP={saved_tp_size} to TP={tp_size}"
        if g is None:
            raise ShardedStateError(
                f"{name} cannot be resharded{why}: the checkpoint records no geometry for it (layer class "
                "unknown), so which rows each rank holds is unknown. Serve it at TP="
                f"{saved_tp_size}, or save the checkpoint again with this version of vllm-sharded-loader."
            )
        _check_reshardable(g, name, why)
    assert g is not None
    for saved_rank, (pp, t) in holders.items():
        expected = shard_layout(g, saved_tp_size, saved_rank, name).shape
        if tuple(t.shape) != expected:
            raise ShardedStateError(
                f"{source} of saved pp_rank={pp} tp_rank={saved_rank} has shape {list(t.shape)}, but its "
                f"geometry ({g.layer_class}, shape {list(g.shape)} at TP=1) gives {list(expected)} at "
                f"TP={saved_tp_size}. The manifest is damaged: save the checkpoint again."
            )
    if g.kind == REPLICATED:
        # One saved copy is enough; spreading serving ranks over the copies spreads the I/O.
        choice = tp_rank % saved_tp_size
        chosen = holders.get(choice) or holders[min(holders)]
        return _whole(name, source, chosen[1])

    target = shard_layout(g, tp_size, tp_rank, name)
    if not math.prod(target.shape):
        return TensorPlan(name, source, target.shape, first.itemsize, ())
    saved_layouts = {}
    for saved_rank in range(saved_tp_size):
        if saved_rank not in holders:
            raise ShardedStateError(
                f"{source} is split across TP={saved_tp_size}, but saved tp_rank={saved_rank} does not hold it "
                f"(ranks {sorted(holders)} do). The checkpoint is incomplete: save it again."
            )
        saved_layouts[saved_rank] = shard_layout(g, saved_tp_size, saved_rank, name)
    d = g.split_dim
    assert d is not None
    outer = math.prod(g.shape[:d])
    inner = math.prod(g.shape[d + 1 :])
    isz = first.itemsize
    dest_row = target.shape[d] * inner
    reads: list[Read] = []
    zeros: list[Strided] = []
    for piece in target.pieces:
        if piece.padding:
            offset = (piece.local_offset + piece.data_length) * inner
            zeros.append(_strided(offset, piece.padding * inner, dest_row, outer))
        want_start, want_stop = piece.start, piece.start + piece.data_length
        # Saved pieces of one segment are equal (replicated heads) or disjoint: group equal
        # ones and read each range from one holder only.
        by_range: dict[tuple[int, int], list[tuple[int, ShardPiece]]] = {}
        for saved_rank, layout in saved_layouts.items():
            for sp in layout.pieces:
                if sp.segment == piece.segment:
                    by_range.setdefault((sp.start, sp.start + sp.data_length), []).append((saved_rank, sp))
        for (have_start, have_stop), candidates in sorted(by_range.items()):
            lo, hi = max(want_start, have_start), min(want_stop, have_stop)
            if lo >= hi:
                continue
            saved_rank, sp = candidates[tp_rank % len(candidates)]
            t = holders[saved_rank][1]
            source_row = t.shape[d] * inner * isz
            reads.append(
                _read(
                    t.file,
                    source=(t.offset + (sp.local_offset + lo - sp.start) * inner * isz, (hi - lo) * inner * isz),
                    source_stride=source_row,
                    dest=((piece.local_offset + lo - piece.start) * inner, (hi - lo) * inner),
                    dest_stride=dest_row,
                    count=outer,
                )
            )
    return TensorPlan(name, source, target.shape, isz, tuple(_merge_reads(reads)), tuple(_merge_zeros(zeros)))


def _describe(t: SavedTensor) -> str:
    return "none" if t.geometry is None else f"{t.geometry.to_dict()} itemsize {t.itemsize}"


def _whole(name: str, source: str, t: SavedTensor) -> TensorPlan:
    numel = math.prod(t.shape)
    reads = (Read(t.file, _strided(t.offset, t.nbytes, t.nbytes, 1), _strided(0, numel, numel, 1)),) if numel else ()
    return TensorPlan(name, source, tuple(t.shape), t.itemsize, reads)


def _read(
    file: str, source: tuple[int, int], source_stride: int, dest: tuple[int, int], dest_stride: int, count: int
) -> Read:
    (src_offset, src_length), (dst_offset, dst_length) = source, dest
    if count > 1 and src_length == source_stride and dst_length == dest_stride:
        # Whole rows on both sides: one contiguous run.
        src_length, dst_length, count = src_length * count, dst_length * count, 1
    source_runs = _strided(src_offset, src_length, source_stride, count)
    return Read(file, source_runs, _strided(dst_offset, dst_length, dest_stride, count))


def _merge_reads(reads: list[Read]) -> list[Read]:
    """Join reads that continue each other in the same file and in the destination."""
    merged: list[Read] = []
    for r in reads:
        p = merged[-1] if merged else None
        if (
            p is not None
            and p.file == r.file
            and p.source.count == r.source.count
            and (r.source.count == 1 or (p.source.stride, p.dest.stride) == (r.source.stride, r.dest.stride))
            and r.source.offset == p.source.offset + p.source.length
            and r.dest.offset == p.dest.offset + p.dest.length
        ):
            merged[-1] = _read(
                p.file,
                (p.source.offset, p.source.length + r.source.length),
                p.source.stride,
                (p.dest.offset, p.dest.length + r.dest.length),
                p.dest.stride,
                p.source.count,
            )
        else:
            merged.append(r)
    return merged


def _merge_zeros(zeros: list[Strided]) -> list[Strided]:
    merged: list[Strided] = []
    for z in zeros:
        p = merged[-1] if merged else None
        if (
            p is not None
            and p.count == z.count
            and (z.count == 1 or p.stride == z.stride)
            and z.offset == p.offset + p.length
        ):
            length = p.length + z.length
            if p.count > 1 and length == p.stride:
                merged[-1] = _strided(p.offset, length * p.count, 0, 1)
            else:
                merged[-1] = _strided(p.offset, length, p.stride, p.count)
        else:
            merged.append(z)
    return merged


@dataclass(frozen=True)
class ReadSummary:
    """Totals of one serving rank's plan, for its log line."""

    tensors: int
    reads: int
    bytes_read: int
    bytes_zero_filled: int
    bytes_by_file: dict[str, int]


def summarize_reads(plans: Mapping[_ResultKey, ReadPlan]) -> dict[_ResultKey, ReadSummary]:
    """Bytes read (per file) and zero-filled by each serving rank's plan.

    >>> summarize_reads({(0, 0): ReadPlan(1, 0, 0, 1)})[(0, 0)].bytes_read
    0
    """
    out: dict[_ResultKey, ReadSummary] = {}
    for key, plan in plans.items():
        by_file: dict[str, int] = {}
        for t in plan.tensors.values():
            for r in t.reads:
                by_file[r.file] = by_file.get(r.file, 0) + r.source.total
        out[key] = ReadSummary(
            tensors=len(plan.tensors),
            reads=sum(len(t.reads) for t in plan.tensors.values()),
            bytes_read=plan.bytes_read,
            bytes_zero_filled=sum(z.total * t.itemsize for t in plan.tensors.values() for z in t.zero_fills),
            bytes_by_file=dict(sorted(by_file.items())),
        )
    return out


# ------------------------------------------------------------------ pipeline stages


def pp_layer_ranges(num_hidden_layers: int, pp_size: int, partition: Sequence[int] | None = None) -> tuple[range, ...]:
    """The layer indices each pipeline stage holds, as vLLM's ``get_pp_indices`` splits them.

    Without ``partition`` (vLLM's ``VLLM_PP_LAYER_PARTITION``), every stage gets
    ``num_hidden_layers // pp_size`` layers and the remainder goes one each to the stages
    before the last, from the second-to-last backwards (the last stage holds the final
    norm and the LM head).

    >>> pp_layer_ranges(11, 4)
    (range(0, 3), range(3, 6), range(6, 9), range(9, 11))
    >>> pp_layer_ranges(10, 4)
    (range(0, 2), range(2, 5), range(5, 8), range(8, 10))
    """
    if num_hidden_layers < 0 or pp_size < 1:
        raise ShardedStateError(
            f"Cannot split {num_hidden_layers} layers into {pp_size} pipeline stages: both must be positive."
        )
    if partition is not None:
        sizes = list(partition)
        if len(sizes) != pp_size or sum(sizes) != num_hidden_layers or any(s < 0 for s in sizes):
            raise ShardedStateError(
                f"Layer partition {sizes} does not split {num_hidden_layers} layers into {pp_size} stages "
                "(one non-negative count per stage, adding up to the layer count)."
            )
    else:
        sizes = [num_hidden_layers // pp_size] * pp_size
        for i in range(2, num_hidden_layers % pp_size + 2):
            sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp_size)]
    return tuple(range(start, start + size) for start, size in zip(starts, sizes, strict=True))


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter belongs to, or None for embeddings, final norm, LM head.

    >>> layer_index("model.layers.7.mlp.down_proj.weight")
    7
    >>> layer_index("lm_head.weight") is None
    True
    """
    match = _LAYER_INDEX.search(name)
    return None if match is None else int(match.group(1))


def pp_stage_of_layer(layer: int, num_hidden_layers: int, pp_size: int, partition: Sequence[int] | None = None) -> int:
    """The pipeline stage that holds decoder layer ``layer``.

    >>> pp_stage_of_layer(5, 11, 4)
    1
    """
    for stage, layers in enumerate(pp_layer_ranges(num_hidden_layers, pp_size, partition)):
        if layer in layers:
            return stage
    raise ShardedStateError(f"Layer {layer} is not one of the model's {num_hidden_layers} layers.")
