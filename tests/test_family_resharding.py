"""A family's whole model resharded as vLLM's own ``load_weights`` cuts it, without an engine.

For each family: its tiny random model (``examples/tiny_models.py``) is built by vLLM on the CPU
at TP=1 and at TP=2 (each rank, on a fake TP group) and filled by the model's own
``load_weights`` from the Hugging Face files (random values, biases too). Each TP=2 rank is saved
with the geometry our save records, and the TP=1 model's tensors are planned from those files (and
the other way, TP=1 files to each TP=2 rank). Every tensor must come out exactly as vLLM's own
load gave it, or be refused (recorded ``opaque``, or a geometry the served model does not share):
never other values under the right shape.

GPT-OSS's experts hold gate and up interleaved row by row and their ``w2_bias`` on TP rank 0 only;
they were recorded as ordinary experts (gate rows, then up rows; a bias on every rank), so a
resharded load gave other rows silently.
"""

from __future__ import annotations

import os
import types
from unittest import mock

import numpy as np
import pytest

from tests.support.quantized import as_array
from tests.support.reference import execute
from vllm_sharded_loader.format import ShardedStateError
from vllm_sharded_loader.format.geometry import OPAQUE
from vllm_sharded_loader.planning.layout import same_split
from vllm_sharded_loader.planning.reads import SavedCheckpoint, SavedRank, SavedTensor, plan_reads
from vllm_sharded_loader.planning.topology import RankInfo

# Families whose layers or loaders were wrong once (GPT-OSS's experts, Command R+'s per-head
# norms), and a plain one; GLM-4.5's MoE (a router bias over all experts, handed to the experts
# layer: recorded opaque, it kept DeepSeek-V3-style models at their saved size), not in the matrix.
# Nemotron: its LayerNorm1P was not a norm class this version listed (opaque: served only at the saved size).
FAMILIES = ["gpt_oss", "cohere", "qwen2", "glm4_moe", "nemotron"]
GLM4_MOE = dict(
    architecture="Glm4MoeForCausalLM",
    config="Glm4MoeConfig",
    fields=dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
)


@pytest.fixture(scope="module")
def vllm_build():
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    import vllm.distributed.parallel_state as parallel_state
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_sharded_loader.checkpoint.meta_model import DEFAULT_OPTIONS
    from vllm_sharded_loader.engine.convert import build_meta_model, engine_config
    from vllm_sharded_loader.engine.layer_geometry import tensor_geometry

    def load(directory: str, tp_size: int, tp_rank: int):
        """The model vLLM builds at ``tp_size`` for rank ``tp_rank``, filled by its ``load_weights``
        from the folder's files with random values in their place."""
        config = engine_config(directory, DEFAULT_OPTIONS)
        build_meta_model(config)  # this process's world of one, which the layers ask for their group
        config.compilation_config.static_forward_context.clear()
        config.parallel_config.tensor_parallel_size = tp_size
        group = types.SimpleNamespace(world_size=tp_size, rank_in_group=tp_rank)
        weights = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(directory, name)))
        generator = torch.Generator().manual_seed(7)
        weights = {
            n: (torch.randn(t.shape, generator=generator) * 0.1).to(t.dtype) if t.is_floating_point() else t
            for n, t in sorted(weights.items())
        }
        with (
            set_current_vllm_config(config),
            mock.patch.object(parallel_state, "get_tp_group", return_value=group),
            set_default_torch_dtype(torch.float32),
            torch.device("cpu"),
        ):
            model = initialize_model(vllm_config=config, model_config=config.model_config)
            model.load_weights(iter(weights.items()))
        return model

    return load, tensor_geometry


def save(model, geometry, tp_size: int, rank: int, files: dict[str, bytearray]) -> SavedRank:
    """One saved rank as our save writes it: every tensor with the geometry recorded for it, opaque
    ones too, between filler bytes a wrong offset would read."""
    buf = bytearray(b"\x11" * (rank + 3))
    saved = {}
    for name, tensor in model.state_dict().items():
        data = as_array(tensor)
        saved[name] = SavedTensor(f"f{tp_size}.{rank}", len(buf), data.itemsize, data.shape, geometry[name])
        buf += data.tobytes() + b"\x22" * 5
    files[f"f{tp_size}.{rank}"] = bytes(buf)
    return SavedRank(rank, 0, saved)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_reshards_as_vllms_own_load_or_is_refused(family, vllm_build, tmp_path, monkeypatch):
    from examples import tiny_models
    from examples.tiny_models import build_family

    monkeypatch.setitem(tiny_models.FAMILIES, "glm4_moe", GLM4_MOE)
    load, tensor_geometry = vllm_build
    directory = build_family(str(tmp_path / "model"), family)
    models = {(1, 0): load(directory, 1, 0), (2, 0): load(directory, 2, 0), (2, 1): load(directory, 2, 1)}
    files: dict[str, bytearray] = {}
    geometry = {key: tensor_geometry(m, m.state_dict(), key[0], key[1]) for key, m in models.items()}
    saved = {tp: [save(models[tp, r], geometry[tp, r], tp, r, files) for r in range(tp)] for tp in (1, 2)}
    checked, refused, wrong = 0, [], []
    for (tp, rank), model in models.items():
        source = 3 - tp  # the other size: TP=2 files to TP=1, TP=1 files to each TP=2 rank
        for name, tensor in model.state_dict().items():
            recorded, served = saved[source][0].tensors[name].geometry, geometry[tp, rank][name]
            if OPAQUE in (recorded.kind, served.kind) or not same_split(served, recorded):
                refused.append(name)  # the load refuses it (check_served_geometry, the planner)
                continue
            try:
                plan = plan_reads(SavedCheckpoint(saved[source], source), [name], RankInfo(rank, tp))
            except ShardedStateError:
                refused.append(name)
                continue
            got = execute(plan.tensors[name], files, {})
            checked += 1
            if got.shape != tuple(tensor.shape) or not np.array_equal(got, as_array(tensor)):
                wrong.append(f"{name} at TP={tp} rank {rank}")
    assert not wrong, f"{family}: resharded tensors differ from vLLM's own load: {wrong}"
    assert checked > 0
    if family == "gpt_oss":
        assert any("routed_experts.w13_weight" in n for n in refused)
    else:
        assert not refused, refused
