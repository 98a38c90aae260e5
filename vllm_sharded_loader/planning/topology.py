"""Which worker this is, and whether a checkpoint was saved for the topology and model served. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from ..format.errors import CheckpointMismatch
from ..format.experts import ExpertPlacement, writing_replicas
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..format.source import SourceModel, config_differences


@dataclass(frozen=True)
class RankInfo:
    """Which worker this is in the TP/PP grid and DP replica, and its expert placement and EP rank."""

    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    experts: ExpertPlacement | None = None
    ep_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    experts_over_dp: bool = False  # no EP under DP: vLLM cuts each expert across TP x DP (expert_tp)

    @property
    def expert_tp(self) -> tuple[int, int]:
        """(size, rank) of the experts' TP split without expert parallelism.

        >>> RankInfo(1, 2, dp_rank=1, dp_size=2, experts_over_dp=True).expert_tp
        (4, 3)
        """
        if self.experts_over_dp:
            return self.tp_size * self.dp_size, self.dp_rank * self.tp_size + self.tp_rank
        return self.tp_size, self.tp_rank

    @property
    def replicas(self) -> int:
        """How many data-parallel replicas write files when this engine saves.

        >>> from ..planning.experts import expert_placement
        >>> RankInfo(0, 1, experts=expert_placement(4, 2), ep_rank=1, dp_rank=1, dp_size=2).replicas
        2
        """
        return writing_replicas(self.experts, self.tp_size, self.dp_size, self.experts_over_dp)

    @property
    def saved_dp_rank(self) -> int:
        """The ``dp_rank`` this worker's saved files carry (0 unless :attr:`replicas` > 1)."""
        return self.dp_rank if self.replicas > 1 else 0

    def __str__(self) -> str:
        dp = f", dp_rank={self.dp_rank} of DP={self.dp_size}" if self.dp_size > 1 else ""
        return f"pp_rank={self.pp_rank} tp_rank={self.tp_rank} (TP={self.tp_size}, PP={self.pp_size}{dp})"


def check_topology(manifest: Manifest, rank: RankInfo, directory: str) -> None:
    """Refuse to serve a checkpoint at another TP/PP size than it was saved at."""
    if (manifest.tp_size, manifest.pp_size) != (rank.tp_size, rank.pp_size):
        raise CheckpointMismatch(
            f"{directory} was saved with tensor_parallel_size={manifest.tp_size} and "
            f"pipeline_parallel_size={manifest.pp_size}, but the engine runs "
            f"tensor_parallel_size={rank.tp_size} and pipeline_parallel_size={rank.pp_size}. "
            f"Serve it with --tensor-parallel-size {manifest.tp_size} --pipeline-parallel-size "
            f"{manifest.pp_size}, or save it again at the new sizes."
        )


def check_dtype(manifest: Manifest, serving: str, directory: str) -> None:
    """Refuse a weight update stored in another dtype than the served weights (only a start-up load casts)."""
    if manifest.dtype != serving:
        raise CheckpointMismatch(
            f"{directory}/{MANIFEST_NAME}: the checkpoint holds {manifest.dtype} weights, but the engine serves "
            f"{serving}. Save the update in {serving} (the dtype the server was started with), or restart the "
            f"server with --dtype {manifest.dtype}."
        )


def check_source(manifest: Manifest, serving: SourceModel, directory: str) -> None:
    """Refuse to load weights saved from another model than the one being served."""
    if manifest.source.architecture != serving.architecture or (manifest.source.config_sha256 != serving.config_sha256):
        diff = config_differences(manifest.source.config, serving.config)
        raise CheckpointMismatch(
            f"{directory}: the checkpoint was saved from a {manifest.source.architecture} with config "
            f"sha256 {manifest.source.config_sha256[:12]}, but the engine serves a "
            f"{serving.architecture} with config sha256 {serving.config_sha256[:12]}"
            + (f" (differences: {'; '.join(diff)})" if diff else "")
            + ". Serve it with the config.json saved beside it, or save the checkpoint again from this model."
        )
