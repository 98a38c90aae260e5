"""Who this worker is and what it serves, read off vLLM: its rank, the model's identity."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..format.source import SourceModel, config_sha256, normalize_config
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
    """Whether the model being loaded is not the engine's own (a speculative drafter).

    vLLM loads a drafter with its own ``ModelConfig`` while the engine's config (the
    target's) is current.
    """
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
    """How many workers of this engine run on this host (vLLM's local world size); 1 outside an engine.

    They load at the same time, so they split the host's budget of requests to object
    storage (:func:`..storage.reader.remote_threads`) instead of each taking all of it.
    """
    config = current_vllm_config()
    size = getattr(getattr(config, "parallel_config", None), "local_world_size", None)
    return size if isinstance(size, int) and size >= 1 else 1
