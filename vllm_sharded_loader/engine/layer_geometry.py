"""How each parameter of a vLLM model is split across tensor-parallel ranks, read off its layer.

The :class:`~..format.geometry.TensorGeometry` of each saved tensor goes into the manifest so that a
checkpoint can be served at another TP/PP size. It is derived from vLLM's layer classes only, and
conservatively: a layer not known exactly, or a geometry that does not reproduce the rank's actual
shape, is ``opaque`` and loads only at the TP size it was saved at.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ..format import geometry as rs
from ..format.errors import ShardedStateError
from ..format.experts import ExpertPlacement
from ..planning.experts import rank_shape

# Layers whose parameters every rank holds whole, matched on the class and its bases.
REPLICATED_LAYERS = frozenset(
    {"RMSNorm", "GemmaRMSNorm", "LayerNorm", "RMSNormGated", "Attention", "Embedding", "NemotronLayerNorm1P"}
)
# Bases of every tensor-parallel layer: a subclass not handled exactly below is opaque.
PARALLEL_BASES = frozenset({"LinearBase", "VocabParallelEmbedding", "FusedMoE", "RoutedExperts"})
UNQUANTIZED_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
UNQUANTIZED_EXPERT_METHODS = frozenset({"UnquantizedFusedMoEMethod"})
# Quantized experts with one value per weight (int8, FP8), cut like unquantized ones; each checked
# against vLLM's loaders in tests/test_quantized_experts.py. Others (int4, MXFP4, NVFP4) stay opaque.
QUANTIZED_EXPERT_METHODS = frozenset(
    {"CompressedTensorsW8A8Int8MoEMethod", "CompressedTensorsW8A8Fp8MoEMethod", "Fp8MoEMethod"}
)
# Parameter classes with one entry per group of inputs along their input_dim.
GROUPED_PARAMETERS = frozenset({"GroupQuantScaleParameter", "PackedvLLMParameter"})
LINEAR_LAYERS = frozenset(
    {"QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear"}
)


def _class_names(module: torch.nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _linear_geometry(module: Any, param: str, layer_class: str) -> rs.TensorGeometry | None:
    bias = param == "bias"
    if layer_class == "QKVParallelLinear":
        rows = (module.total_num_heads + module.total_num_kv_heads) * module.head_size
        rows += module.total_num_kv_heads * module.v_head_size
        shape = [rows] if bias else [rows, module.input_size]
        return rs.qkv_parallel(
            shape, module.total_num_heads, module.total_num_kv_heads, module.head_size, module.v_head_size
        )
    if layer_class == "MergedColumnParallelLinear":
        rows = sum(module.output_sizes)
        return rs.merged_column_parallel([rows] if bias else [rows, module.input_size], module.output_sizes)
    if layer_class == "ColumnParallelLinear":
        return rs.column_parallel([module.output_size] if bias else [module.output_size, module.input_size])
    if layer_class == "RowParallelLinear":
        if bias:
            return rs.replicated([module.output_size], layer_class)
        return rs.row_parallel([module.output_size, module.input_size])
    return None


def _experts_geometry(module: Any, param: str, layer_class: str) -> rs.TensorGeometry | None:
    """Stacked experts, as vLLM's ``_load_w13`` / ``_load_w2`` cut them.

    ``w13`` ``[experts, gate + up, hidden]`` is merged column parallel along dimension 1, ``w2``
    ``[experts, hidden, intermediate]`` split along its last. The geometry covers all the experts;
    which a rank holds under expert parallelism is the manifest's ``expert_placement``. Redundant
    (EPLB) experts and padded sizes are opaque (None).
    """
    config = getattr(module, "moe_config", None)
    parallel = getattr(config, "moe_parallel_config", None)
    if config is None or parallel is None or getattr(parallel, "enable_eplb", False):
        return None
    use_ep = bool(getattr(parallel, "use_ep", False))
    if getattr(parallel, "pcp_size", 1) != 1:
        # Prefill context parallelism cuts the experts across its ranks too: not described.
        return None
    experts = module.global_num_experts
    per_rank = config.intermediate_size_per_partition
    hidden = module.hidden_size
    if (
        (module.local_num_experts != experts and not use_ep)
        or per_rank != config.intermediate_size_per_partition_unpadded
        or hidden != config.hidden_dim_unpadded
    ):
        return None
    intermediate = per_rank * parallel.tp_size
    halves = [intermediate, intermediate] if config.is_act_and_mul else [intermediate]
    names = ["w1", "w3"] if config.is_act_and_mul else ["w1"]
    if param == "w13_weight":
        return rs.merged_column_parallel([experts, sum(halves), hidden], halves, names, layer_class, stacked=1)
    if param == "w13_bias":
        return rs.merged_column_parallel([experts, sum(halves)], halves, names, layer_class, stacked=1)
    if param == "w2_weight":
        return rs.row_parallel([experts, hidden, intermediate], layer_class, stacked=1)
    if param == "w2_bias":
        return rs.TensorGeometry(rs.REPLICATED, layer_class, (experts, hidden), stacked=1)
    return None


def _experts_load_their_own_way(module: Any) -> bool:
    """Whether a model's experts subclass brings its own ``weight_loader`` (GPT-OSS's interleaved
    gate/up): its cut is then the model's, not the layer's, and the experts are opaque."""
    for cls in type(module).__mro__:
        if cls.__name__ in ("RoutedExperts", "FusedMoE"):
            return False
        if "weight_loader" in vars(cls):
            return True
    return False


def _quantized_experts_geometry(module: Any, param: str, layer_class: str) -> rs.TensorGeometry | None:
    """Quantized stacked experts (int8, FP8), as vLLM's FusedMoE loader cuts them.

    Weights are cut as unquantized experts are. Scales follow the parameter's ``quant_method``:
    ``tensor`` scales and static input scales are whole on every rank holding the expert;
    ``channel`` scales follow the weight's output rows; ``block`` scales hold one entry per block, the
    geometry's ``unit``. Anything else (padding, transposed, global input scales, a block grid that
    does not divide the rank's rows) is opaque (None).
    """
    tensor = getattr(module, param, None)
    config = getattr(module, "moe_config", None)
    if tensor is None or getattr(tensor, "is_transposed", False) or getattr(config, "tp_shard_with_padding", True):
        return None
    stem, _, kind = param.partition("_")
    scheme = getattr(tensor, "quant_method", None)
    if kind in ("weight", "bias"):
        return _experts_geometry(module, param, layer_class) if scheme is None else None
    weight = _experts_geometry(module, f"{stem}_weight", layer_class) if stem in ("w13", "w2") else None
    if weight is None:
        return None
    experts, shape = weight.shape[0], tuple(tensor.shape)
    whole = rs.TensorGeometry(rs.REPLICATED, layer_class, (experts, *shape[1:]), stacked=1)
    if kind == "input_scale":
        # Global input scales are indexed by global expert id on every rank.
        return None if getattr(module.quant_method, "use_global_sf", False) else whole
    if kind not in ("weight_scale", "weight_scale_inv"):
        return None
    if scheme == "tensor" or (scheme == "channel" and stem == "w2"):
        return whole
    if scheme not in ("channel", "block") or len(shape) != len(weight.shape):
        return None
    dim = weight.split_dim
    assert dim is not None
    rows = sum(s.padded for s in weight.segments) // _experts_tp(module)
    if not shape[dim] or rows % shape[dim]:
        return None
    unit = rows // shape[dim]
    if scheme == "channel" and unit != 1:
        return None
    if scheme == "block" and unit not in _block_sizes(module.quant_method, 0 if stem == "w13" else 1):
        # A block grid rounded up at this TP size shares a block between ranks.
        return None
    global_shape = list(shape)
    global_shape[0], global_shape[dim] = experts, weight.shape[dim] // unit
    return replace(weight, shape=tuple(global_shape), unit=unit)


def _experts_tp(module: Any) -> int:
    """The TP size vLLM cuts the experts at (1 under expert parallelism)."""
    return module.moe_config.moe_parallel_config.tp_size


def _block_sizes(method: Any, dim: int) -> set[int]:
    """The FP8 block sizes along ``dim`` (0: rows, 1: columns): the checkpoint's, or the refined grid."""
    shapes = (getattr(method, "weight_block_size", None), getattr(method, "moe_block_shape", None))
    return {int(s[dim]) for s in shapes if s is not None and len(s) == 2}


def _quantized_linear_geometry(module: Any, param: str, layer_class: str) -> rs.TensorGeometry | None:
    """A quantized linear layer's parameter, split as vLLM's parameter classes say.

    The layer's rule applies along ``output_dim`` (column parallel) or ``input_dim`` (row parallel),
    whichever index that is (AWQ and GPTQ lay weights out ``[in, out]``). One index may stand for
    several rows, the ``unit``: the ``packed_factor`` along ``packed_dim``, the group size of group-wise
    scales, or the block size of FP8 block scales; the planner refuses a TP size that cuts a unit.
    A parameter with neither dimension is replicated. Anything else is opaque (None).
    """
    tensor = getattr(module, param, None)
    weight = _linear_geometry(module, "weight", layer_class)
    if tensor is None or weight is None:
        return None
    output_dim, input_dim = getattr(tensor, "output_dim", None), getattr(tensor, "input_dim", None)
    packed_dim = getattr(tensor, "packed_dim", None)
    shape = list(tensor.shape)
    if output_dim is None and input_dim is None:
        whole = type(tensor).__name__ == "PerTensorScaleParameter" or tensor.numel() == 1
        return rs.replicated(shape, layer_class) if whole and packed_dim is None else None
    row = layer_class == "RowParallelLinear"
    dim = input_dim if row else output_dim
    if dim is None:
        # GPTQ's ungrouped scales of a row-parallel layer: split along the dimension the layer does not split.
        return rs.replicated(shape, layer_class)
    if dim >= len(shape) or not shape[dim] or (dim != weight.split_dim and len(shape) != 2):
        # Only a 2-D tensor may be laid out the other way round ([in, out]).
        return None
    rows = module.input_size_per_partition if row else module.output_size_per_partition
    if rows % shape[dim]:
        return None
    unit = rows // shape[dim]
    block = getattr(module, "weight_block_size", None)
    if packed_dim == dim:
        if unit != getattr(tensor, "packed_factor", None):
            return None
    elif type(tensor).__name__ == "BlockQuantScaleParameter":
        # vLLM rounds a rank's blocks up, so a rank ending inside a block shares its scale: no unit then.
        if not block or len(block) != 2 or unit != block[1 if row else 0]:
            return None
    elif unit != 1 and not (dim == input_dim and type(tensor).__name__ in GROUPED_PARAMETERS):
        return None
    assert weight.split_dim is not None
    total = weight.shape[weight.split_dim]
    if any(s.padded % unit for s in weight.segments):
        return None
    global_shape = [*shape[:dim], total // unit, *shape[dim + 1 :]]
    return rs.TensorGeometry(weight.kind, layer_class, tuple(global_shape), dim, weight.segments, unit=unit)


def _vocab_geometry(module: Any, param: str, layer_class: str) -> rs.TensorGeometry | None:
    if param == "weight":
        return rs.vocab_parallel(
            module.num_embeddings, module.embedding_dim, module.org_vocab_size, module.padding_size, layer_class
        )
    if param == "bias":
        return rs.vocab_parallel_bias(module.num_embeddings, module.org_vocab_size, module.padding_size, layer_class)
    return None


def _loader_of(tensor: Any) -> Any:
    """A parameter's ``weight_loader`` (None without one), unwrapped: vLLM's layerwise reload wraps
    every loader of a layer while it runs, and the geometry is read again then."""
    loader = getattr(tensor, "weight_loader", None)
    return None if loader is None else inspect.unwrap(loader)


def _loads_its_own(module: Any, param: str) -> bool:
    """Whether ``param`` is filled by the layer's own weight loader, so that its class says the cut.
    A model may put in another (Mamba-2's ``mamba_v2_sharded_weight_loader``)."""
    tensor = getattr(module, param, None)
    loader = _loader_of(tensor)
    if loader is None:
        return True
    owner = getattr(getattr(loader, "func", loader), "__self__", None)  # also a functools.partial of it
    # A tied parameter (an LM head sharing the embedding's) keeps the loader of the layer it was made in.
    return owner is module or (isinstance(owner, torch.nn.Module) and getattr(owner, param, None) is tensor)


def _whole_layer_geometry(module: Any, param: str, shape: tuple[int, ...], tp_size: int | None) -> rs.TensorGeometry:
    """A parameter of a layer that is not tensor-parallel, as its ``weight_loader`` cuts it.

    ``default_weight_loader`` (or none) loads it whole; ``row_parallel_weight_loader`` cuts a tensor of
    two or more dimensions along dimension 0 (Command R+'s per-head q/k norms). Any other: opaque."""
    layer_class = type(module).__name__
    loader = _loader_of(getattr(module, param, None))
    name = getattr(loader, "__qualname__", None)
    from_vllm = getattr(loader, "__module__", "").startswith("vllm.")
    if loader is None or (from_vllm and name == "default_weight_loader"):
        return rs.replicated(shape, layer_class)
    if from_vllm and name == "row_parallel_weight_loader":
        if len(shape) == 1:
            return rs.replicated(shape, layer_class)
        if tp_size:
            return rs.column_parallel([shape[0] * tp_size, *shape[1:]], layer_class)
    return rs.TensorGeometry(rs.OPAQUE, layer_class, shape)


# Mamba-2's mixer (``MambaMixer2``: Nemotron-H, Granite 4.0-H, Falcon-H1, Bamba, Zamba2) cuts its own
# layers, which no layer class says, so the mixer is read here.


def _mamba2_geometry(mixer: Any, child: str, param: str) -> rs.TensorGeometry | None:
    """A parameter of vLLM's Mamba-2 mixer or of its ``in_proj``, ``conv1d`` and ``norm`` (None: opaque).

    The heads are split across the ranks (``A``, ``D``, ``dt_bias``, the norm, the gate and x rows).
    The B and C rows hold ``n_groups`` groups of states, split by whole groups, or with one group
    copied to every rank. Quantized projections are opaque.
    """
    norm = getattr(mixer, "norm", None)
    groups, heads = getattr(norm, "n_groups", None), getattr(mixer, "num_heads", None)
    inner, state = getattr(mixer, "intermediate_size", None), getattr(mixer, "ssm_state_size", None)
    if not all(isinstance(v, int) and v > 0 for v in (groups, heads, inner, state)):
        return None
    if child == "" and param in ("A", "D", "dt_bias"):
        return rs.column_parallel([heads], type(mixer).__name__)
    if child == "norm" and param == "weight":
        return rs.column_parallel([inner], type(norm).__name__)
    layer = getattr(mixer, child, None) if child in ("in_proj", "conv1d") else None
    if layer is None or type(getattr(layer, "quant_method", None)).__name__ != "UnquantizedLinearMethod":
        return None
    group = {"heads": groups, "head_size": state, "replicate_heads": True}
    b, c = (rs.Segment(name, groups * state, **group) for name in "BC")
    segments = [rs.Segment("x", inner), b, c]
    if child == "in_proj":
        segments = [rs.Segment("gate", inner), *segments, rs.Segment("dt", heads)]
    rows = sum(s.size for s in segments)
    # Named for the mixer: vLLM makes these layers of another class at TP=1 (merged) than above it.
    tensor = getattr(layer, param, None)
    if param == "bias" and tensor is not None:
        return rs.grouped_column_parallel([rows], segments, type(mixer).__name__)
    if param == "weight" and tensor is not None:
        # conv1d's weight is [channels, 1, kernel], in_proj's [rows, hidden].
        return rs.grouped_column_parallel([rows, *tensor.shape[1:]], segments, type(mixer).__name__)
    return None


def mamba2_mixers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's Mamba-2 mixers, by module name (none in most models)."""
    return {name: m for name, m in model.named_modules() if type(m).__name__ == "MambaMixer2"}


def mixer_geometry(
    mixers: dict[str, torch.nn.Module], module_name: str, param: str, shape: tuple[int, ...]
) -> rs.TensorGeometry | None:
    """The geometry of a parameter of one of ``mixers`` or its children; None for any other parameter."""
    parent, _, child = module_name.rpartition(".")
    if module_name in mixers:
        mixer, child = mixers[module_name], ""
    elif parent in mixers and child in ("in_proj", "conv1d", "norm"):
        mixer = mixers[parent]
    else:
        return None
    return _mamba2_geometry(mixer, child, param) or rs.TensorGeometry(rs.OPAQUE, type(mixer).__name__, shape)


def module_geometry(
    module: torch.nn.Module, param: str, shape: tuple[int, ...], tp_size: int | None = None
) -> rs.TensorGeometry:
    """The geometry of ``param`` of ``module``, before it is checked against a rank (``shape`` is one rank's)."""
    layer_class = type(module).__name__
    names = _class_names(module)
    quant_method = type(getattr(module, "quant_method", None)).__name__
    if names & PARALLEL_BASES:
        geometry = None
        if not _loads_its_own(module, param):
            pass  # a loader put in by the model cuts it its own way: opaque (Mamba-2's: :func:`mixer_geometry`)
        elif getattr(module, "disable_tp", False) or "ReplicatedLinear" in names:
            # Every rank holds the whole layer.
            geometry = rs.replicated(shape, layer_class)
        elif "RoutedExperts" in names and param == "e_score_correction_bias":
            # The router's bias over all experts (DeepSeek-V3): whole on every rank.
            geometry = _whole_layer_geometry(module, param, shape, tp_size)
        elif "RoutedExperts" in names and _experts_load_their_own_way(module):
            pass  # a model's experts with a loader of their own (GPT-OSS's interleaved gate/up): opaque
        elif "RoutedExperts" in names and quant_method in UNQUANTIZED_EXPERT_METHODS:
            geometry = _experts_geometry(module, param, layer_class)
        elif "RoutedExperts" in names and quant_method in QUANTIZED_EXPERT_METHODS:
            geometry = _quantized_experts_geometry(module, param, layer_class)
        elif layer_class in LINEAR_LAYERS:
            if quant_method in UNQUANTIZED_METHODS or param == "bias":
                geometry = _linear_geometry(module, param, layer_class)
            else:
                geometry = _quantized_linear_geometry(module, param, layer_class)
        elif layer_class in {"VocabParallelEmbedding", "ParallelLMHead"} and quant_method in UNQUANTIZED_METHODS:
            geometry = _vocab_geometry(module, param, layer_class)
        return geometry or rs.TensorGeometry(rs.OPAQUE, layer_class, shape)
    if param in getattr(module, "_buffers", {}):
        # vLLM's loaders never shard a buffer of a non-parallel layer (BERT's position_ids).
        return rs.replicated(shape, layer_class)
    if names & REPLICATED_LAYERS:
        return _whole_layer_geometry(module, param, shape, tp_size)
    return rs.TensorGeometry(rs.OPAQUE, layer_class, shape)


def tensor_geometry(
    model: torch.nn.Module,
    tensors: Mapping[str, torch.Tensor],
    tp_size: int,
    tp_rank: int,
    experts: ExpertPlacement | None = None,
    ep_rank: int = 0,
    expert_tp: tuple[int, int] | None = None,
) -> dict[str, rs.TensorGeometry]:
    """The geometry of each of this rank's tensors, checked against its local shape.

    A load compares it with the manifest's, so a checkpoint whose geometry is not the served
    model's is refused. ``experts``, ``ep_rank``: the expert placement; ``expert_tp``: (size, rank)
    of the experts' TP cut without it (default: the TP split).
    """
    result: dict[str, rs.TensorGeometry] = {}
    mixers = mamba2_mixers(model)
    for name, tensor in tensors.items():
        module_name, _, param = name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            module = None
        shape = tuple(tensor.shape)
        if module is None:
            geometry = rs.TensorGeometry(rs.OPAQUE, "?", shape)
        else:
            geometry = mixer_geometry(mixers, module_name, param, shape) or module_geometry(
                module, param, shape, tp_size
            )
        if geometry.kind != rs.OPAQUE:
            size, index = expert_tp if geometry.stacked and expert_tp else (tp_size, tp_rank)
            try:
                local = rank_shape(geometry, size, index, experts, ep_rank, name)
            except ShardedStateError:
                local = None
            if tuple(local or ()) != shape:
                # The layer is not split the way its class says: never reshard it.
                geometry = rs.TensorGeometry(rs.OPAQUE, geometry.layer_class, shape)
        result[name] = geometry
    return result
