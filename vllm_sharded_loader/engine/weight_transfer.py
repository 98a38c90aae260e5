"""The ``sharded_state`` weight-transfer engine: vLLM's RL weight-update API, fed from a sharded checkpoint.

vLLM's own engines receive the trainer's tensors over a wire (NCCL, CUDA IPC); this one receives the
path of a sharded checkpoint the trainer saved, and every worker reads its own slice of it in place
(:class:`.reload.InPlaceUpdate`), with every check of a start-up load::

    llm = LLM(model=CKPT, load_format="sharded_state", weight_transfer_config={"backend": "sharded_state"})
    llm.init_weight_transfer_engine({"init_info": {}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"path": NEW_CKPT}})
    llm.finish_weight_update()

``update_info`` takes ``path`` (a folder, ``s3://`` URL or Hub id) and optionally ``verify``
(``"size"`` or ``"checksum"``; default: the one given at init, else the loader's). The served model
may have been loaded by any load format.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from ..checkpoint.stats import check_verify_mode
from ..format.errors import InvalidOption, WorkerLost

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.plugins.{__name__}")

BACKEND = "sharded_state"

# What a worker that vLLM failed before this engine ran says (a list of update_info too short).
NO_UPDATE_INFO = "was given no update_info by vLLM"


@dataclass
class ShardedStateInitInfo(WeightTransferInitInfo):
    """``init_info`` of the ``sharded_state`` backend: nothing to connect to; the default ``verify``."""

    verify: str | None = None

    def __post_init__(self) -> None:
        if self.verify is not None:
            check_verify_mode(self.verify)


@dataclass
class ShardedStateUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of the ``sharded_state`` backend: the checkpoint to serve from now on."""

    path: str
    verify: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"update_info path={self.path!r}: expected the folder or URL of a sharded checkpoint.")
        if self.verify is not None:
            check_verify_mode(self.verify)


class ShardedStateWeightTransferEngine(WeightTransferEngine[ShardedStateInitInfo, ShardedStateUpdateInfo]):
    """Each worker reads its own slice of a sharded checkpoint into the served model, in place.

    One ``update_weights`` carries a whole checkpoint, so it runs the whole layerwise reload itself:
    between the calls the model stays as served, and a refused update leaves it so.
    """

    init_info_cls = ShardedStateInitInfo
    update_info_cls = ShardedStateUpdateInfo
    # A drafter's weights are not in the target's checkpoint.
    supports_draft_weight_update = False

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.verify: str | None = None

    def init_transfer_engine(self, init_info: ShardedStateInitInfo) -> None:
        self.verify = init_info.verify

    def start_weight_update(self) -> None:
        """Nothing to prepare: the update happens whole in :meth:`update_weights`."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: :meth:`update_weights` returns once the weights are served."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Read the checkpoint ``update_info["path"]`` into the model, once every worker agrees on the request."""
        info = self._agreed(update_info)
        if info is None:
            return
        self.receive_weights(info)
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def reset_weight_update_target(self) -> None:
        """vLLM's reset after a failed call; a worker vLLM failed before :meth:`update_weights` (a list
        of ``update_info`` shorter than the workers) joins the others' exchange as refused, so that
        they do not wait for it until gloo's timeout (30 minutes).
        """
        failed = sys.exc_info()[1]
        try:
            if failed is not None and _failed_before_update(failed.__traceback__):
                self._agreed(None, failed=failed)
        finally:
            super().reset_weight_update_target()

    def _agreed(self, update_info: Any, failed: BaseException | None = None) -> ShardedStateUpdateInfo | None:
        """``update_info`` parsed, if every worker of the model parsed the same request; else refused.

        vLLM's executor stops reading answers at the first failing worker, so the others' would be
        taken for the next calls' answers; and workers given different checkpoints (a list) would serve
        a mix of models. So the workers exchange what they parsed, and only the last one raises a
        refusal (:func:`.workers.raises_for_all`).
        """
        from ..checkpoint.group import wait_for_replicas
        from .identity import model_rank
        from .workers import model_groups, raises_for_all, replica_group

        rank = model_rank(self.model)
        info, own = None, (False, f"{rank} {NO_UPDATE_INFO} ({type(failed).__name__}: {failed})")
        try:
            if failed is None:
                info = self.parse_update_info(update_info)
                own = (True, (info.path, info.verify))
        except Exception as e:  # a bad argument: refused below, on one worker only
            own = (False, f"{rank}: {e}")
        try:
            wait_for_replicas(replica_group(rank), rank, "update_weights", "update", "No weights were changed.")
        except WorkerLost:
            if raises_for_all():
                raise
            return None
        outcomes = model_groups(rank).gather(own, "this update")
        errors = [value for ok, value in outcomes if not ok]
        if not errors and len({value for _, value in outcomes}) > 1:
            asked = ", ".join(f"path={path!r} verify={verify!r}" for _, (path, verify) in outcomes)
            errors = [
                f"the workers were given different update_info ({asked}, by worker): one update reads one "
                'checkpoint on every worker. Pass one dict, {"path": ..., "verify": ...}, not a list per worker'
            ]
        if any(NO_UPDATE_INFO in error for error in errors):
            errors.append(
                "a list of update_info needs an entry for every worker (vLLM hands each its own, by rank): "
                'pass one dict, {"path": ..., "verify": ...}, for all'
            )
        if not errors:
            return info
        if raises_for_all():
            raise InvalidOption(" | ".join(errors) + " (no rank's weights were changed)")
        logger.warning("sharded_state: %s did not update: the update's arguments were refused", rank)
        return None

    def receive_weights(self, update_info: ShardedStateUpdateInfo) -> None:
        from .model_reader import ModelReader
        from .reload import InPlaceUpdate

        load_config = self.vllm_config.load_config
        if load_config.load_format != BACKEND:
            # Served from another format: the sharded loader's defaults, not that format's options.
            load_config = replace(load_config, load_format=BACKEND, model_loader_extra_config={})
        update = InPlaceUpdate(
            ModelReader.from_load_config(load_config),
            self.model,
            self.model_config,
            path=update_info.path,
            verify=update_info.verify or self.verify,
        )
        update.run_layerwise()

    def shutdown(self) -> None:
        """Nothing held between updates."""


def _failed_before_update(traceback: TracebackType | None) -> bool:
    """Whether vLLM's worker raised the exception in its ``update_weights`` before calling this engine's."""
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame.f_code)
        traceback = traceback.tb_next
    return (
        bool(frames)
        and frames[0].co_name == "update_weights"
        and ShardedStateWeightTransferEngine.update_weights.__code__ not in frames
    )
