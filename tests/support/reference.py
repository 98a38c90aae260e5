"""vLLM's sharding rules, written independently from vLLM's layer code (not from the module under
test), a Llama-like model with every kind of parameter vLLM shards, and an executor of read plans
that checks every destination element is written exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_sharded_loader.format.geometry import (
    Segment,
    TensorGeometry,
    column_parallel,
    grouped_column_parallel,
    merged_column_parallel,
    qkv_parallel,
    replicated,
    row_parallel,
    vocab_parallel,
    vocab_parallel_bias,
)
from vllm_sharded_loader.planning.reads import Strided, TensorPlan

DTYPES = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


PADDING_GARBAGE = 0x5A


def reference_shard(spec: tuple, data: np.ndarray, tp: int, rank: int, pad_value: int = 0) -> np.ndarray:
    """The local tensor of ``rank`` at ``tp``, computed the way vLLM's weight loaders do.

    ``data`` is the tensor as a HF checkpoint holds it (vocabulary unpadded).
    """
    kind = spec[0]
    if kind == "replicated":
        return data.copy()
    if kind == "column":  # ColumnParallelLinear.weight_loader: narrow(0, tp_rank * shard, shard)
        assert data.shape[0] % tp == 0
        size = data.shape[0] // tp
        return data[rank * size : (rank + 1) * size].copy()
    if kind == "row":  # RowParallelLinear.weight_loader: narrow(1, ...)
        assert data.shape[1] % tp == 0
        size = data.shape[1] // tp
        return data[:, rank * size : (rank + 1) * size].copy()
    if kind == "merged":  # MergedColumnParallelLinear: each output size split on its own
        parts, offset = [], 0
        for output_size in spec[1]:
            assert output_size % tp == 0
            shard = output_size // tp
            parts.append(data[offset + rank * shard : offset + (rank + 1) * shard])
            offset += output_size
        return np.concatenate(parts)
    if kind == "grouped":  # MambaMixer2: its mamba_v2_sharded_weight_loader, or merged by groups
        parts, offset = [], 0
        for size, groups in spec[1]:
            if groups == 1 and tp > 1:  # the one group, whole on every rank
                parts.append(data[offset : offset + size])
            else:
                assert size % tp == 0 and (groups is None or groups % tp == 0)
                shard = size // tp
                parts.append(data[offset + rank * shard : offset + (rank + 1) * shard])
            offset += size
        return np.concatenate(parts)
    if kind == "qkv":  # QKVParallelLinear.__init__ and weight_loader
        _, total_heads, total_kv_heads, head_size = spec
        assert total_heads % tp == 0
        num_heads = total_heads // tp
        if tp >= total_kv_heads:
            assert tp % total_kv_heads == 0
            num_kv_heads, replicas = 1, tp // total_kv_heads
        else:
            assert total_kv_heads % tp == 0
            num_kv_heads, replicas = total_kv_heads // tp, 1
        q = data[: total_heads * head_size]
        k = data[total_heads * head_size : (total_heads + total_kv_heads) * head_size]
        v = data[(total_heads + total_kv_heads) * head_size :]
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        kv_rank = rank // replicas
        return np.concatenate(
            [
                q[rank * q_size : (rank + 1) * q_size],
                k[kv_rank * kv_size : (kv_rank + 1) * kv_size],
                v[kv_rank * kv_size : (kv_rank + 1) * kv_size],
            ]
        )
    if kind == "vocab":  # VocabParallelEmbedding._get_indices and weight_loader
        _, org, added, pad_to = spec
        org_padded = -(-org // pad_to) * pad_to
        total_padded = -(-(org_padded + added) // pad_to) * pad_to
        assert org_padded % tp == 0 and total_padded % tp == 0
        org_per_rank = org_padded // tp
        added_per_rank = (total_padded - org_padded) // tp
        org_start = min(rank * org_per_rank, org)
        org_end = min((rank + 1) * org_per_rank, org)
        added_start = min(org + rank * added_per_rank, org + added)
        added_end = min(org + (rank + 1) * added_per_rank, org + added)
        local = np.full((total_padded // tp, *data.shape[1:]), pad_value, dtype=data.dtype)
        local[: org_end - org_start] = data[org_start:org_end]
        local[org_per_rank : org_per_rank + added_end - added_start] = data[added_start:added_end]
        return local
    raise AssertionError(kind)


def reference_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """vllm.distributed.utils.get_pp_indices without VLLM_PP_LAYER_PARTITION."""
    layers_per_partition = num_hidden_layers // pp_size
    partitions = [layers_per_partition for _ in range(pp_size)]
    if remaining_layers := num_hidden_layers % pp_size:
        for i in range(2, remaining_layers + 2):
            partitions[-i] += 1
    start_layer = sum(partitions[:pp_rank])
    return start_layer, start_layer + partitions[pp_rank]


@dataclass(frozen=True)
class Tensor:
    """One parameter of a test model: its reference rule, HF data and recorded geometry."""

    spec: tuple
    data: np.ndarray
    geometry: TensorGeometry


def data_of(shape: tuple[int, ...], dtype: type, rng: np.random.Generator) -> np.ndarray:
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def make_tensor(spec: tuple, shape: tuple[int, ...], dtype: type, rng: np.random.Generator, layer_class: str) -> Tensor:
    kind = spec[0]
    if kind == "replicated":
        geometry = replicated(shape, layer_class)
    elif kind == "column":
        geometry = column_parallel(shape, layer_class)
    elif kind == "row":
        geometry = row_parallel(shape, layer_class)
    elif kind == "merged":
        geometry = merged_column_parallel(shape, spec[1], layer_class=layer_class)
    elif kind == "qkv":
        geometry = qkv_parallel(shape, spec[1], spec[2], spec[3], layer_class=layer_class)
    elif kind == "grouped":
        segments = [
            Segment(f"s{i}", size)
            if groups is None
            else Segment(f"s{i}", size, heads=groups, head_size=size // groups, replicate_heads=True)
            for i, (size, groups) in enumerate(spec[1])
        ]
        geometry = grouped_column_parallel(shape, segments, layer_class)
    else:
        _, org, added, pad_to = spec
        if len(shape) == 2:
            geometry = vocab_parallel(org + added, shape[1], org, pad_to, layer_class)
        else:
            geometry = vocab_parallel_bias(org + added, org, pad_to, layer_class)
    tensor = Tensor(spec, data_of(shape, dtype, rng), geometry)
    # The geometry's TP=1 shape is the reference's TP=1 local shape.
    assert reference_shard(spec, tensor.data, 1, 0).shape == geometry.shape
    return tensor


@dataclass(frozen=True)
class Model:
    tensors: dict[str, Tensor]
    num_layers: int
    tied: bool

    @property
    def tied_groups(self) -> list[tuple[str, str]]:
        return [("model.embed_tokens.weight", "lm_head.weight")] if self.tied else []

    def stage_names(self, pp_size: int, pp_rank: int) -> list[str]:
        """What a stage's state dict holds, tied tensors once (under the name that sorts first)."""
        start, end = reference_pp_indices(self.num_layers, pp_rank, pp_size)
        first, last = pp_rank == 0, pp_rank == pp_size - 1
        names = []
        for name in self.tensors:
            index = name.split(".")[2] if name.startswith("model.layers.") else None
            if index is not None:
                keep = start <= int(index) < end
            elif name == "model.embed_tokens.weight":
                keep = first or (self.tied and last)
            else:
                keep = last
            if keep:
                names.append(name)
        if self.tied and "lm_head.weight" in names and "model.embed_tokens.weight" in names:
            names.remove("model.embed_tokens.weight")
        return names


def llama_like(
    *,
    itemsize: int = 4,
    heads: int = 8,
    kv_heads: int = 2,
    head_size: int = 4,
    vocab: int = 1000,
    added_vocab: int = 0,
    tied: bool = False,
    num_layers: int = 5,
    seed: int = 0,
) -> Model:
    """A small Llama-style model with every kind of parameter vLLM shards."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[itemsize]
    hidden, inter, extra = heads * head_size, 48, 16
    qkv_rows = (heads + 2 * kv_heads) * head_size
    tensors: dict[str, Tensor] = {}

    def add(name: str, spec: tuple, shape: tuple[int, ...], layer_class: str) -> None:
        tensors[name] = make_tensor(spec, shape, dtype, rng, layer_class)

    vocab_spec = ("vocab", vocab, added_vocab, 64)
    add("model.embed_tokens.weight", vocab_spec, (vocab + added_vocab, hidden), "VocabParallelEmbedding")
    qkv = ("qkv", heads, kv_heads, head_size)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", ("replicated",), (hidden,), "RMSNorm")
        add(p + "self_attn.qkv_proj.weight", qkv, (qkv_rows, hidden), "QKVParallelLinear")
        add(p + "self_attn.qkv_proj.bias", qkv, (qkv_rows,), "QKVParallelLinear")
        add(p + "self_attn.o_proj.weight", ("row",), (hidden, heads * head_size), "RowParallelLinear")
        add(p + "self_attn.o_proj.bias", ("replicated",), (hidden,), "RowParallelLinear")
        add(p + "self_attn.attn.k_scale", ("replicated",), (), "Attention")
        add(p + "post_attention_layernorm.weight", ("replicated",), (hidden,), "RMSNorm")
        add(
            p + "mlp.gate_up_proj.weight", ("merged", [inter, inter]), (2 * inter, hidden), "MergedColumnParallelLinear"
        )
        add(p + "mlp.gate_up_proj.bias", ("merged", [inter, inter]), (2 * inter,), "MergedColumnParallelLinear")
        add(p + "mlp.down_proj.weight", ("row",), (hidden, inter), "RowParallelLinear")
        add(p + "mlp.extra_proj.weight", ("column",), (extra, hidden), "ColumnParallelLinear")
        add(p + "mlp.extra_proj.bias", ("column",), (extra,), "ColumnParallelLinear")
    add("model.norm.weight", ("replicated",), (hidden,), "RMSNorm")
    if tied:
        embed = tensors["model.embed_tokens.weight"]
        tensors["lm_head.weight"] = Tensor(
            vocab_spec, embed.data, vocab_parallel(vocab + added_vocab, hidden, vocab, 64, "ParallelLMHead")
        )
    else:
        add("lm_head.weight", vocab_spec, (vocab + added_vocab, hidden), "ParallelLMHead")
    return Model(tensors, num_layers, tied)


def strided_view(array: np.ndarray, runs: Strided) -> np.ndarray:
    """``runs`` of a flat array as a (count, length) view."""
    assert array.ndim == 1 and runs.count >= 1 and runs.length > 0
    assert runs.count == 1 or runs.length <= runs.stride, "runs overlap"
    assert runs.offset >= 0 and runs.offset + (runs.count - 1) * runs.stride + runs.length <= array.size
    step = array.strides[0]
    return np.lib.stride_tricks.as_strided(
        array[runs.offset :], shape=(runs.count, runs.length), strides=(runs.stride * step, step)
    )


def execute(plan: TensorPlan, files: dict[str, bytearray], read_counts: dict[str, np.ndarray]) -> np.ndarray:
    """Run one tensor's plan on the saved bytes; counts every byte read in ``read_counts``."""
    dtype = DTYPES[plan.itemsize]
    out = np.full(plan.numel, -7, dtype=dtype)
    written = np.zeros(plan.numel, dtype=np.int64)
    for read in plan.reads:
        assert read.source.count == read.dest.count
        assert read.source.length == read.dest.length * plan.itemsize
        source = np.frombuffer(files[read.file], dtype=np.uint8)
        chunk = strided_view(source, read.source).copy().view(dtype)
        strided_view(out, read.dest)[...] = chunk
        strided_view(written, read.dest)[...] += 1
        counts = read_counts.setdefault(read.file, np.zeros(source.size, dtype=np.int64))
        strided_view(counts, read.source)[...] += 1
    for zeros in plan.zero_fills:
        strided_view(out, zeros)[...] = 0
        strided_view(written, zeros)[...] += 1
    assert (written == 1).all(), f"{plan.name}: elements written {sorted(set(written.tolist()))} times"
    zero_count = sum(z.total for z in plan.zero_fills)
    assert plan.bytes_read == (plan.numel - zero_count) * plan.itemsize
    return out.reshape(plan.shape)
