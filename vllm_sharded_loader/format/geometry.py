"""How a tensor is split across tensor-parallel ranks, for any TP size, as the manifest records it,
with a constructor for each of vLLM's parallel layers. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointCorrupt, CheckpointMismatch, ShardedStateError
from .experts import MAX_EXPERTS
from .untrusted import MAX_BYTES, MAX_DIMS, JsonReader, is_shape

REPLICATED = "replicated"
COLUMN_PARALLEL = "column_parallel"
ROW_PARALLEL = "row_parallel"
QKV_PARALLEL = "qkv_parallel"
MERGED_COLUMN_PARALLEL = "merged_column_parallel"
GROUPED_COLUMN_PARALLEL = "grouped_column_parallel"  # Mamba-2's in_proj and conv1d
VOCAB_PARALLEL = "vocab_parallel"
OPAQUE = "opaque"
KINDS = (
    REPLICATED,
    COLUMN_PARALLEL,
    ROW_PARALLEL,
    QKV_PARALLEL,
    MERGED_COLUMN_PARALLEL,
    GROUPED_COLUMN_PARALLEL,
    VOCAB_PARALLEL,
    OPAQUE,
)
SPLIT_KINDS = frozenset(KINDS) - {REPLICATED, OPAQUE}

MAX_SEGMENTS = 1 << 16  # segments of one tensor (q/k/v, gate/up, merged expert projections)
DEFAULT_VOCAB_PADDING_SIZE = 64  # vLLM's vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Segment:
    """One logical sub-tensor along the split dimension (q/k/v, gate/up, vocabulary): ``size`` indices
    of data at TP=1, ``padded_size`` with vLLM's vocabulary padding, split by whole heads if ``heads``;
    with ``replicate_heads`` (K, V), TP above the head count shares each head among consecutive ranks."""

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

    ``shape`` is at TP=1 (vocabulary padded); ``split_dim`` None means every rank holds all of it;
    ``segments`` are split each on its own. ``unit`` is how many layer rows one index along
    ``split_dim`` stands for (int4 pack factor, scale group size, else 1): segments count layer rows.
    A 2-D ``[in, out]`` tensor (AWQ, GPTQ) swaps the split dimension of the column and row rules.

    >>> g = TensorGeometry.from_dict({"kind": "row_parallel", "layer_class": "RowParallelLinear",
    ...     "shape": [8, 16], "split_dim": 1, "segments": [{"name": "weight", "size": 16}]}, "o_proj.weight")
    >>> g.segments[0].size
    16
    """

    kind: str
    layer_class: str
    shape: tuple[int, ...]
    split_dim: int | None = None
    segments: tuple[Segment, ...] = ()
    stacked: int = 0  # leading dimensions of one layer each (MoE experts): the rule applies after them
    unit: int = 1

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
        if self.stacked:
            data["stacked"] = self.stacked
        if self.unit != 1:
            data["unit"] = self.unit
        return data

    @classmethod
    def from_dict(cls, data: Any, name: str, where: str = "") -> TensorGeometry:
        """Parse and validate the geometry recorded for tensor ``name``; a defect is an error naming it."""
        what = f"{where}: geometry of {name}" if where else f"geometry of {name}"
        reader = JsonReader(what, "The manifest is damaged: save the checkpoint again.")
        fail = reader.fail

        if not isinstance(data, dict):
            raise fail(f"expected an object, found {type(data).__name__}")
        unknown = set(data) - {"kind", "layer_class", "shape", "split_dim", "segments", "stacked", "unit"}
        if unknown:
            raise fail(f"unknown keys {sorted(unknown)}")
        shape = data.get("shape")
        if not is_shape(shape):
            raise fail(f"'shape' must be a list of at most {MAX_DIMS} sizes up to {MAX_BYTES}, found {shape!r}")
        raw_segments = data.get("segments", [])
        if not isinstance(raw_segments, list) or len(raw_segments) > MAX_SEGMENTS:
            raise fail(f"'segments' must be a list of at most {MAX_SEGMENTS}, found {type(raw_segments).__name__}")
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
                    name=reader.string(raw, "name", non_empty=True),
                    size=reader.integer(raw, "size", 0),
                    padded_size=reader.optional_integer(raw, "padded_size", 0),
                    heads=reader.optional_integer(raw, "heads", 1),
                    head_size=reader.optional_integer(raw, "head_size", 1),
                    replicate_heads=replicate,
                )
            )
        split_dim = data.get("split_dim")
        if split_dim is not None and (isinstance(split_dim, bool) or not isinstance(split_dim, int)):
            raise fail(f"'split_dim' must be an integer or null, found {split_dim!r}")
        geometry = cls(
            kind=reader.string(data, "kind", non_empty=True),
            layer_class=reader.string(data, "layer_class", non_empty=True),
            shape=tuple(shape),
            split_dim=split_dim,
            segments=tuple(segments),
            stacked=reader.integer(data, "stacked", maximum=MAX_DIMS) if "stacked" in data else 0,
            unit=reader.integer(data, "unit", 1) if "unit" in data else 1,
        )
        check_geometry(geometry, name, where)
        return geometry


def check_geometry(geometry: TensorGeometry, name: str, where: str = "") -> None:
    """Raise unless the geometry is self-consistent (``opaque`` is: such a tensor is never resharded)."""
    g = geometry
    where = f"{where + ': ' if where else ''}geometry of {name} ({g.layer_class}, kind {g.kind!r})"

    def fail(what: str) -> ShardedStateError:
        return CheckpointCorrupt(f"{where}: {what}. The manifest is damaged: save the checkpoint again.")

    if g.kind not in KINDS:
        raise CheckpointMismatch(
            f"{where}: unknown sharding kind {g.kind!r}; this version knows {list(KINDS)}. "
            "Upgrade vllm-sharded-loader, or save the checkpoint again with this version."
        )
    if any(d < 0 for d in g.shape):
        raise fail(f"shape {list(g.shape)} has a negative size")
    if g.kind == OPAQUE:
        return
    # A replicated tensor may be all stacked dimensions (one scale per expert).
    if g.stacked and (g.stacked > len(g.shape) or (g.stacked == len(g.shape) and g.kind != REPLICATED)):
        raise fail(f"'stacked' is {g.stacked}, but the shape {list(g.shape)} has {len(g.shape)} dimensions")
    if g.stacked and g.shape[0] > MAX_EXPERTS:
        # The planner lists experts one by one: an unbounded count would allocate without limit.
        raise fail(f"it stacks {g.shape[0]} experts, more than {MAX_EXPERTS}")
    if g.unit < 1:
        raise fail(f"'unit' must be at least 1, found {g.unit}")
    if g.kind == REPLICATED:
        if g.split_dim is not None or g.segments or g.unit != 1:
            raise fail(f"a replicated tensor has no split dimension, segments or unit, found split_dim={g.split_dim}")
        return
    # Row-parallel splits the input dimension, the others the output one; [in, out] tensors swap.
    expected = g.stacked + (1 if g.kind == ROW_PARALLEL else 0)
    allowed = {expected, 1 - expected} if not g.stacked and len(g.shape) == 2 else {expected}
    if g.split_dim not in allowed or len(g.shape) <= g.split_dim:
        raise fail(
            f"vLLM splits a {g.kind} tensor along dimension {expected}, found split_dim={g.split_dim} "
            f"for shape {list(g.shape)}"
        )
    segments = g.segments
    if not segments:
        raise fail("a split tensor needs at least one segment")
    names = [s.name for s in segments]
    if len(set(names)) != len(names):
        raise fail(f"segment names {names} repeat")
    total = sum(s.padded for s in segments)
    if any(s.padded % g.unit for s in segments) or total // g.unit != g.shape[g.split_dim]:
        raise fail(
            f"segments add up to {total} rows in units of {g.unit} along dimension {g.split_dim}, "
            f"but the shape is {list(g.shape)}"
        )
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
    elif g.kind == GROUPED_COLUMN_PARALLEL:
        if any(s.heads is not None and not s.replicate_heads for s in segments):
            raise fail("the groups of a grouped tensor follow the heads: each grouped segment replicates")
    elif any(s.heads is not None for s in segments):
        raise fail("only a QKV or grouped tensor is split by heads")
    if g.kind == VOCAB_PARALLEL:
        if names not in (["vocab"], ["vocab", "added"]):
            raise fail(f"a vocabulary tensor has segments vocab and optionally added, found {names}")
    elif any(s.padded_size not in (None, s.size) for s in segments):
        raise fail("only a vocabulary tensor is padded")
    if g.kind == VOCAB_PARALLEL and g.unit != 1:
        raise fail("a vocabulary tensor has unit 1")
    if g.kind in (COLUMN_PARALLEL, ROW_PARALLEL) and len(segments) != 1:
        raise fail(f"a {g.kind} tensor has a single segment, found {names}")


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


def row_parallel(shape: Sequence[int], layer_class: str = "RowParallelLinear", stacked: int = 0) -> TensorGeometry:
    """A RowParallelLinear weight ``[out, in]`` split along dimension 1 (``stacked=1``: experts first);
    its bias is :func:`replicated`."""
    dim = stacked + 1
    return TensorGeometry(ROW_PARALLEL, layer_class, tuple(shape), dim, (Segment("input", shape[dim]),), stacked)


def merged_column_parallel(
    shape: Sequence[int],
    output_sizes: Sequence[int],
    names: Sequence[str] | None = None,
    layer_class: str = "MergedColumnParallelLinear",
    stacked: int = 0,
) -> TensorGeometry:
    """A MergedColumnParallelLinear weight or bias: each of ``output_sizes`` split on its own.

    >>> [s.size for s in merged_column_parallel([8, 4], [4, 4]).segments]
    [4, 4]
    """
    if names is None:
        names = ["gate", "up"] if len(output_sizes) == 2 else [str(i) for i in range(len(output_sizes))]
    segments = tuple(Segment(n, s) for n, s in zip(names, output_sizes, strict=True))
    return TensorGeometry(MERGED_COLUMN_PARALLEL, layer_class, tuple(shape), stacked, segments, stacked)


def grouped_column_parallel(
    shape: Sequence[int], segments: Sequence[Segment], layer_class: str = "ColumnParallelLinear"
) -> TensorGeometry:
    """Mamba-2's ``in_proj`` and ``conv1d``: segments split on their own along dimension 0, those of
    B/C states by whole groups (``heads`` groups of ``head_size`` states, ``replicate_heads``).

    >>> group = dict(heads=1, head_size=3, replicate_heads=True)  # one group of 3 states
    >>> g = grouped_column_parallel([10], [Segment("x", 4), Segment("B", 3, **group), Segment("C", 3, **group)])
    >>> from vllm_sharded_loader.planning.layout import shard_layout
    >>> [(p.segment, p.start, p.length) for p in shard_layout(g, tp_size=2, tp_rank=1).pieces]
    [('x', 2, 2), ('B', 0, 3), ('C', 0, 3)]
    """
    return TensorGeometry(GROUPED_COLUMN_PARALLEL, layer_class, tuple(shape), 0, tuple(segments))


def qkv_parallel(
    shape: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    v_head_size: int | None = None,
    layer_class: str = "QKVParallelLinear",
) -> TensorGeometry:
    """A QKVParallelLinear weight ``[(q+k+v) rows, hidden]`` or bias, from the layer's
    ``total_num_heads`` and ``total_num_kv_heads`` (its ``output_size`` counts replicated KV heads)."""
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
    """A VocabParallelEmbedding or ParallelLMHead weight, padded as vLLM pads it: ``vocab_size`` is
    its ``num_embeddings``; added tokens beyond ``org_vocab_size`` are split separately, after the base.

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
