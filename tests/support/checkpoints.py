"""Checkpoints of the reference model (:mod:`tests.support.reference`) and of Mixture-of-Experts
weights, saved with ``save_checkpoint`` the way vLLM's workers at a topology hold them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.reference import llama_like, reference_shard
from tests.support.states import SOURCE
from vllm_sharded_loader.checkpoint import (
    RankInfo,
)
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import (
    Manifest,
    SourceModel,
    config_sha256,
    normalize_config,
)


def stage_state(model, tp_size, pp_size, tp_rank, pp_rank):
    """A rank's local tensors, as a vLLM worker at (tp_size, pp_size) holds them."""
    return {
        name: torch.from_numpy(reference_shard(model.tensors[name].spec, model.tensors[name].data, tp_size, tp_rank))
        for name in model.stage_names(pp_size, pp_rank)
    }


def save_model(directory, model, tp_size, pp_size):
    ranks = {
        RankInfo(t, tp_size, p, pp_size): stage_state(model, tp_size, pp_size, t, p)
        for p in range(pp_size)
        for t in range(tp_size)
    }
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    tied = tuple(tuple(g) for g in model.tied_groups)
    return save_checkpoint(
        str(directory),
        ranks,
        dtype="int32",
        source=source_of(model),
        options=SaveOptions(max_size=4096, geometry=geometry, tied=tied),
    )


def source_of(model) -> SourceModel:
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": model.num_layers}
    return SourceModel("LlamaForCausalLM", config_sha256(config), normalize_config(config))


def experts_rank(w1, w3, w2, tp_size, tp_rank):
    """A rank's stacked experts as vLLM's _load_w13 / _load_w2 cut them: gate then up slice, down's columns."""
    per = w1.shape[1] // tp_size
    rows = slice(tp_rank * per, (tp_rank + 1) * per)
    return {
        "model.layers.0.mlp.experts.w13_weight": torch.cat([w1[:, rows], w3[:, rows]], dim=1).contiguous(),
        "model.layers.0.mlp.experts.w2_weight": w2[:, :, rows].contiguous(),
    }


EXPERTS, INTERMEDIATE, HIDDEN = 6, 16, 8


def moe_weights(experts=EXPERTS, intermediate=INTERMEDIATE, hidden=HIDDEN):
    """Full w1, w3 ``[experts, intermediate, hidden]``, w2 ``[experts, hidden, intermediate]`` and w2's bias."""
    g = torch.Generator().manual_seed(3)
    w1, w3 = (torch.randn(experts, intermediate, hidden, generator=g) for _ in range(2))
    return w1, w3, torch.randn(experts, hidden, intermediate, generator=g), torch.randn(experts, hidden, generator=g)


def moe_rank(weights, tp_size, strategy, tp_rank):
    """RankInfo and local tensors of one rank, as vLLM's fused-MoE layer holds them.

    Under expert parallelism each rank's experts whole, in vLLM's placement order; without,
    every expert cut by ``experts_rank`` (gate then up slice, down's columns).
    """
    from vllm_sharded_loader.planning.experts import expert_placement

    w1, w3, w2, bias = weights
    prefix = "model.layers.0.mlp.experts."
    if strategy is None:
        state = experts_rank(w1, w3, w2, tp_size, tp_rank)
        state[prefix + "w2_bias"] = bias.clone()
        return RankInfo(tp_rank, tp_size), state
    placement = expert_placement(w1.shape[0], tp_size, strategy)
    ids = list(placement.experts[tp_rank])
    state = {
        prefix + "w13_weight": torch.cat([w1[ids], w3[ids]], dim=1).contiguous(),
        prefix + "w2_weight": w2[ids].contiguous(),
        prefix + "w2_bias": bias[ids].contiguous(),
    }
    return RankInfo(tp_rank, tp_size, experts=placement, ep_rank=tp_rank), state


def moe_geometry(experts, intermediate, hidden, opaque_w2=False):
    from vllm_sharded_loader.format.geometry import REPLICATED, TensorGeometry, merged_column_parallel, row_parallel

    prefix = "model.layers.0.mlp.experts."
    w2 = row_parallel([experts, hidden, intermediate], "FusedMoE", stacked=1)
    if opaque_w2:
        # A layout this version does not describe (a quantized MoE's packed weights).
        w2 = TensorGeometry("opaque", "FusedMoE", (experts, hidden, intermediate))
    return {
        prefix + "w13_weight": merged_column_parallel(
            [experts, 2 * intermediate, hidden], [intermediate] * 2, ["w1", "w3"], "FusedMoE", stacked=1
        ).to_dict(),
        prefix + "w2_weight": w2.to_dict(),
        prefix + "w2_bias": TensorGeometry(REPLICATED, "FusedMoE", (experts, hidden), stacked=1).to_dict(),
    }


NORM = "model.norm.weight"


def replica_rank(weights, tp_size, dp_size, strategy, dp_rank, tp_rank):
    """RankInfo and local tensors of one worker of an engine at TP x DP under expert parallelism
    (EP size = TP x DP, EP rank = dp_rank * tp_size + tp_rank), with a replicated norm beside
    its experts: every replica holds the same norm."""
    from vllm_sharded_loader.planning.experts import expert_placement

    w1, w3, w2, bias = weights
    placement = expert_placement(w1.shape[0], tp_size * dp_size, strategy)
    ep_rank = dp_rank * tp_size + tp_rank
    ids = list(placement.experts[ep_rank])
    prefix = "model.layers.0.mlp.experts."
    state = {
        prefix + "w13_weight": torch.cat([w1[ids], w3[ids]], dim=1).contiguous(),
        prefix + "w2_weight": w2[ids].contiguous(),
        prefix + "w2_bias": bias[ids].contiguous(),
        NORM: torch.arange(w1.shape[2], dtype=torch.float32),
    }
    return RankInfo(tp_rank, tp_size, experts=placement, ep_rank=ep_rank, dp_rank=dp_rank, dp_size=dp_size), state


def save_replicas(directory, weights, tp_size, dp_size, strategy, opaque_w2=False, opaque_norm=False):
    """Save as the hook does under TP x DP with expert parallelism: replica 0 writes all it
    holds, each later replica only its experts."""
    from vllm_sharded_loader.format.geometry import replicated

    ranks = {}
    for d in range(dp_size):
        for t in range(tp_size):
            rank, state = replica_rank(weights, tp_size, dp_size, strategy, d, t)
            ranks[rank] = state if d == 0 else {n: x for n, x in state.items() if n != NORM}
    geometry = moe_geometry(*weights[0].shape, opaque_w2=opaque_w2)
    geometry[NORM] = replicated([weights[0].shape[2]], "RMSNorm").to_dict()
    if opaque_norm:
        # A tensor outside the experts that this version cannot split (FP8 block scales).
        geometry[NORM] = {**geometry[NORM], "kind": "opaque"}
    return save_checkpoint(
        str(directory),
        ranks,
        dtype="float32",
        source=SOURCE,
        options=SaveOptions(max_size=4096, geometry=geometry, experts=next(iter(ranks)).experts),
    )


def serving_ranks(weights, serving):
    """Every worker of a serving topology: (TP, DP, strategy), ("flat", TP, DP) without expert
    parallelism (experts cut across TP x DP), or (TP, strategy) from PLACEMENTS."""
    if serving[0] == "flat":
        _, tp, dp = serving
        return [flat_rank(weights, tp, dp, d, t) for d in range(dp) for t in range(tp)]
    if len(serving) == 3:
        tp, dp, strategy = serving
        return [replica_rank(weights, tp, dp, strategy, d, t) for d in range(dp) for t in range(tp)]
    ranks = []
    for t in range(serving[0]):
        rank, state = moe_rank(weights, serving[0], serving[1], t)
        state[NORM] = torch.arange(weights[0].shape[2], dtype=torch.float32)
        ranks.append((rank, state))
    return ranks


def flat_rank(weights, tp_size, dp_size, dp_rank, tp_rank):
    """A worker of an engine at TP x DP without expert parallelism: vLLM cuts every expert at
    TP size ``tp_size * dp_size``, this worker holding index ``dp_rank * tp_size + tp_rank``."""
    w1, w3, w2, bias = weights
    state = experts_rank(w1, w3, w2, tp_size * dp_size, dp_rank * tp_size + tp_rank)
    state["model.layers.0.mlp.experts.w2_bias"] = bias.clone()
    state[NORM] = torch.arange(w1.shape[2], dtype=torch.float32)
    return RankInfo(tp_rank, tp_size, dp_rank=dp_rank, dp_size=dp_size, experts_over_dp=dp_size > 1), state


def save_flat(directory, weights, tp_size, dp_size, opaque_w2=False):
    from vllm_sharded_loader.format.geometry import replicated

    ranks = {}
    for d in range(dp_size):
        for t in range(tp_size):
            rank, state = flat_rank(weights, tp_size, dp_size, d, t)
            ranks[rank] = state if d == 0 else {n: x for n, x in state.items() if n != NORM}
    geometry = moe_geometry(*weights[0].shape, opaque_w2=opaque_w2)
    geometry[NORM] = replicated([weights[0].shape[2]], "RMSNorm").to_dict()
    return save_checkpoint(
        str(directory), ranks, dtype="float32", source=SOURCE, options=SaveOptions(max_size=4096, geometry=geometry)
    )


RESHARD_MODEL = llama_like(num_layers=2, vocab=128, kv_heads=2)


def save_reshardable(directory: Path, max_size: int | None = None) -> Manifest:
    model = RESHARD_MODEL
    ranks = {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)}
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    return save_checkpoint(
        str(directory),
        ranks,
        dtype="int32",
        source=source_of(model),
        options=SaveOptions(geometry=geometry, max_size=max_size),
    )
