"""Who this worker is and what it serves, read off vLLM: its rank, the model's identity."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..format.errors import Unsupported
from ..format.experts import ExpertPlacement
from ..format.source import SourceModel, config_sha256, normalize_config
from ..planning.experts import expert_placement
from ..planning.topology import RankInfo

if TYPE_CHECKING:
    from vllm.config import ModelConfig


def current_rank() -> RankInfo:
    """This worker's place in the tensor- and pipeline-parallel grid, and its data-parallel replica."""
    from vllm.distributed import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    dp_rank, dp_size = data_parallel_replica()
    return RankInfo(tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size, dp_rank=dp_rank, dp_size=dp_size)


def data_parallel_replica() -> tuple[int, int]:
    """(this replica's data-parallel rank, the data-parallel size)."""
    from vllm.distributed.parallel_state import get_dp_group

    try:
        group = get_dp_group()
    except AssertionError:  # no data-parallel group: a single replica
        return 0, 1
    return group.rank_in_group, group.world_size


def is_drafter(model_config: Any) -> bool:
    """Whether the model being loaded is a speculative drafter: vLLM loads it with its own
    ``ModelConfig`` while the target's config is current."""
    from vllm.config import get_current_vllm_config

    try:
        served = get_current_vllm_config().model_config
    except Exception:  # outside an engine's config context: nothing to tell it from
        return False
    return served is not None and model_config is not served


def source_identity(model: torch.nn.Module, model_config: ModelConfig) -> SourceModel:
    """Architecture (the vLLM class that was built) and config hash of a model."""
    config = model_config.hf_config.to_dict()
    return SourceModel(
        architecture=type(model).__name__,
        config_sha256=config_sha256(config),
        config=normalize_config(config),
    )


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def current_vllm_config() -> Any:
    """vLLM's config of the engine being built or run here, or None outside one."""
    from vllm.config import get_current_vllm_config

    try:
        return get_current_vllm_config()
    except Exception:  # outside an engine's config context
        return None


def ranks_on_host() -> int:
    """How many workers of this engine run on this host; 1 outside an engine. They load at once,
    so they split the host's budget of requests to object storage."""
    config = current_vllm_config()
    size = getattr(getattr(config, "parallel_config", None), "local_world_size", None)
    return size if isinstance(size, int) and size >= 1 else 1


def model_rank(model: torch.nn.Module) -> RankInfo:
    """This worker's :class:`RankInfo` for ``model``: TP, PP and DP place, and its expert placement."""
    experts, ep_rank = model_expert_placement(model)
    over_dp = any(
        is_experts(m) and not m.moe_config.moe_parallel_config.use_ep and m.moe_config.moe_parallel_config.dp_size > 1
        for m in model.modules()
    )
    return replace(current_rank(), experts=experts, ep_rank=ep_rank, experts_over_dp=over_dp)


def model_expert_placement(model: torch.nn.Module) -> tuple[ExpertPlacement | None, int]:
    """Where this model's routed experts live under expert parallelism, and this rank's EP rank
    (``(None, 0)`` without). Every MoE layer's expert map must agree with vLLM's rule: a placement
    not known here (EPLB, a per-layer map) is refused rather than recorded wrong.
    """
    found: tuple[ExpertPlacement, int] | None = None
    for name, module in model.named_modules():
        if not is_experts(module):
            continue
        parallel = module.moe_config.moe_parallel_config
        if not parallel.use_ep:
            if found is not None:
                raise Unsupported(f"{name}: some MoE layers use expert parallelism and others do not.")
            continue
        if getattr(parallel, "enable_eplb", False):
            raise Unsupported(
                f"{name}: expert-parallel load balancing (EPLB) moves experts at run time; this version does not "
                "record such placements. Save and serve without enable_eplb."
            )
        strategy = str(getattr(module, "expert_placement_strategy", "linear"))
        placement = expert_placement(module.global_num_experts, parallel.ep_size, strategy)
        expert_map = getattr(module, "_expert_map", None)
        if expert_map is None:
            raise Unsupported(f"{name}: expert parallelism is on, but the layer has no expert map.")
        local = sorted((int(v), e) for e, v in enumerate(expert_map.tolist()) if v >= 0)
        mine = tuple(e for _, e in local)
        if [v for v, _ in local] != list(range(len(local))) or mine != placement.experts[parallel.ep_rank]:
            raise Unsupported(
                f"{name}: vLLM placed experts {list(mine)} on EP rank {parallel.ep_rank}, but its {strategy!r} rule "
                f"gives {list(placement.experts[parallel.ep_rank])}; this version does not know this placement. "
                "Save and serve without expert parallelism."
            )
        if found is not None and found != (placement, parallel.ep_rank):
            raise Unsupported(f"{name}: MoE layers place their experts differently ({found[0].describe()}).")
        found = (placement, parallel.ep_rank)
    return found if found is not None else (None, 0)


def is_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of vLLM's routed-experts layers."""
    return any(c.__name__ == "RoutedExperts" for c in type(module).__mro__)
