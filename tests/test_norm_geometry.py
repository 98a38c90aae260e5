"""Norms that vLLM cuts across TP ranks reshard as its own loader cuts them.

Command R+ (``CohereForCausalLM`` with ``use_qk_norm``) normalises q and k per head with a
``LayerNorm`` of shape ``[heads on this rank, head_dim]``, which vLLM's
``row_parallel_weight_loader`` fills with the rank's own heads' rows. Its class name is a
norm's, but every rank holds other rows under the same shape: recorded ``replicated``, a TP=2
checkpoint was refused at TP=1 as not the served model's. Without an engine: vLLM's own layer
is filled by its own loader at TP=1 and 2 (a fake TP rank), the TP=2 geometry our save records
must plan reads giving every serving rank exactly vLLM's tensor; a norm loader this version
does not know is recorded opaque.

The same holds for vLLM's tensor-parallel layers: Mamba-2 with one group of B/C states builds
its ``in_proj`` as a ``ColumnParallelLinear`` but fills it with ``mamba_v2_sharded_weight_loader``,
which gives every rank a copy of the group: its rows are not the class's contiguous cut. Recorded
``column_parallel``, a TP=2 checkpoint was refused at TP=1 as "saved from another model"; such a
parameter is now opaque (served at its saved size, another size refused naming it).
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from tests.support.quantized import as_array, save_rank
from tests.support.reference import execute
from vllm_sharded_loader.format.geometry import COLUMN_PARALLEL, OPAQUE, REPLICATED
from vllm_sharded_loader.planning.layout import same_split
from vllm_sharded_loader.planning.reads import SavedCheckpoint, plan_reads
from vllm_sharded_loader.planning.topology import RankInfo

HEADS, HEAD_DIM, HIDDEN = 4, 64, 128


@pytest.fixture(scope="module")
def cohere():
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    from vllm.model_executor.model_loader import weight_utils
    from vllm.model_executor.models.commandr import LayerNorm

    from vllm_sharded_loader.engine.layer_geometry import tensor_geometry

    generator = torch.Generator().manual_seed(3)
    full = {
        "q_norm.weight": torch.randn(HEADS, HEAD_DIM, generator=generator),
        "norm.weight": torch.randn(HIDDEN, generator=generator),
    }

    def load(tp_size: int, tp_rank: int) -> torch.nn.Module:
        """The layers at ``tp_size``, filled from the full tensors by vLLM's own weight loaders."""
        model = torch.nn.ModuleDict(
            {"q_norm": LayerNorm(param_shape=(HEADS // tp_size, HEAD_DIM)), "norm": LayerNorm(param_shape=HIDDEN)}
        )
        with mock.patch.object(weight_utils, "get_tensor_model_parallel_rank", return_value=tp_rank):
            for name, param in model.named_parameters():
                param.weight_loader(param, full[name])
        return model

    return torch, load, tensor_geometry


def test_per_head_norms_reshard_like_vllms_row_parallel_weight_loader(cohere):
    _, load, tensor_geometry = cohere
    files: dict[str, bytearray] = {}
    ranks, recorded = [], None
    for rank in range(2):
        model = load(2, rank)
        tensors = dict(model.named_parameters())
        geometry, saved = save_rank(tensor_geometry(model, tensors, 2, rank), tensors, rank, files, "cohere")
        assert recorded is None or geometry == recorded
        recorded = geometry
        ranks.append(saved)
    assert recorded is not None
    assert recorded["q_norm.weight"].kind == COLUMN_PARALLEL and recorded["q_norm.weight"].shape == (HEADS, HEAD_DIM)
    assert recorded["norm.weight"].kind == REPLICATED  # 1-D: the same loader loads it whole
    for tp in (1, 2, 4):
        for rank in range(tp):
            model = load(tp, rank)
            tensors = dict(model.named_parameters())
            for name, g in tensor_geometry(model, tensors, tp, rank).items():
                assert same_split(g, recorded[name]), (name, g, recorded[name])
            plan = plan_reads(SavedCheckpoint(ranks, 2), list(tensors), RankInfo(rank, tp))
            for name, tensor in tensors.items():
                got = execute(plan.tensors[name], files, {})
                np.testing.assert_array_equal(got, as_array(tensor), err_msg=f"{name} TP={tp} rank {rank}")


def test_a_norm_filled_by_a_loader_this_version_does_not_know_is_opaque(cohere):
    _, load, tensor_geometry = cohere
    model = load(2, 1)

    def own_loader(param, loaded):  # a model's own cut, unknown here
        param.data.copy_(loaded[1:])

    model["q_norm"].weight.weight_loader = own_loader
    geometry = tensor_geometry(model, dict(model.named_parameters()), 2, 1)
    assert geometry["q_norm.weight"].kind == OPAQUE
    assert geometry["norm.weight"].kind == REPLICATED


def test_a_parallel_layer_filled_by_a_loader_the_model_put_in_is_opaque():
    """vLLM's ColumnParallelLinear at TP=2, its weight given Mamba-2's group-copying loader as
    ``MambaMixer2`` gives it (n_groups=1: x, then B and C of the one group on every rank, then dt):
    the layer's class no longer says which rows a rank holds, so its geometry is opaque; the same
    layer with its own loader is still column-parallel."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    import types

    import vllm.distributed.parallel_state as parallel_state
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader

    from vllm_sharded_loader.engine.layer_geometry import tensor_geometry

    intermediate, state, heads, hidden = 256, 16, 4, 128
    # At TP=2 vLLM pads the one group to two (one per rank), as MambaMixer2 does.
    rows = intermediate * 2 + 2 * 2 * state + heads
    group = (2 * state, state, True)
    spec = [(intermediate, 0, False), (intermediate, 0, False), group, group, (heads, 0, False)]
    for rank in range(2):
        with mock.patch.object(
            parallel_state, "get_tp_group", return_value=types.SimpleNamespace(world_size=2, rank_in_group=rank)
        ):
            layers = torch.nn.ModuleDict(
                {
                    "in_proj": ColumnParallelLinear(hidden, rows, bias=False, prefix="in_proj"),
                    "plain": ColumnParallelLinear(hidden, rows, bias=False, prefix="plain"),
                }
            )
        weight = layers["in_proj"].weight
        delattr(weight, "weight_loader")
        weight.weight_loader = mamba_v2_sharded_weight_loader(spec, 2, rank)
        geometry = tensor_geometry(layers, dict(layers.named_parameters()), 2, rank)
        assert geometry["in_proj.weight"].kind == OPAQUE
        assert geometry["plain.weight"].kind == COLUMN_PARALLEL


def test_the_geometry_is_the_same_under_the_layerwise_reloads_wrapped_loaders():
    """A weight update in place runs under vLLM's layerwise reload, which wraps every parameter's
    weight loader in its ``online_process_loader`` (keeping the original as ``__wrapped__``), and
    the served model's geometry is read again then: judged by the wrapper, a column-parallel layer
    and a norm both read as opaque, and every update of a resharded server was refused as "saved
    from another model"."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    import types

    import vllm.distributed.parallel_state as parallel_state
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.models.commandr import LayerNorm

    from vllm_sharded_loader.engine.layer_geometry import tensor_geometry

    with mock.patch.object(
        parallel_state, "get_tp_group", return_value=types.SimpleNamespace(world_size=2, rank_in_group=0)
    ):
        layers = torch.nn.ModuleDict(
            {
                "proj": ColumnParallelLinear(HIDDEN, 2 * HIDDEN, bias=False, prefix="proj"),
                "q_norm": LayerNorm(param_shape=(HEADS // 2, HEAD_DIM)),
                "norm": LayerNorm(param_shape=HIDDEN),
            }
        )

    def kinds() -> dict[str, str]:
        return {name: g.kind for name, g in tensor_geometry(layers, dict(layers.named_parameters()), 2, 0).items()}

    served = kinds()
    assert served == {"proj.weight": COLUMN_PARALLEL, "q_norm.weight": COLUMN_PARALLEL, "norm.weight": REPLICATED}
    for layer in layers.values():
        layerwise._wrap_parameters_weight_loader(layer)  # as initialize_layerwise_reload does
    assert {p.weight_loader.__name__ for p in layers.parameters()} == {"online_process_loader"}
    assert kinds() == served
