"""Reading this rank's files of a sharded checkpoint into a vLLM model: the step a start-up load and
a weight update share, with the loader's read options as one value."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from ..checkpoint import LoadRequest, load_rank
from ..checkpoint.save_proof import manifest_proof
from ..checkpoint.state import adoptable_parameters
from ..checkpoint.stats import LoaderOptions, LoadStats, check_verify_mode
from ..format.errors import CheckpointNotFound
from ..format.experts import ExpertPlacement
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..planning.topology import check_dtype
from ..storage import hub
from ..storage.location import Store, open_store
from ..storage.progress import ByteProgress
from ..storage.reader import ReadOptions
from .capture import READ_PROOF_ATTRIBUTE
from .identity import dtype_label, model_rank, ranks_on_host, source_identity
from .layer_geometry import tensor_geometry

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.config.load import LoadConfig

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")


def serves_on_cpu() -> bool:
    """Whether vLLM runs this engine on its CPU platform (the only one whose parameters are mapped)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


@cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU backend builds a oneDNN matmul (a packed copy) for weights of ``dtype``,
    asked as vLLM asks: oneDNN refuses dtypes the CPU has no kernel for (bfloat16 without AVX-512)."""
    try:
        from vllm import _cpu_ops as ops  # vLLM 0.34 and later
    except ImportError:
        from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        return False
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=dtype).t(), 1)
    except (RuntimeError, AttributeError):
        return False
    return True


def repacked_parameters(model: torch.nn.Module) -> set[str]:
    """Names of the CPU weights that vLLM's post-processing will repack into new memory and drop.

    Mapping such a weight saves no bytes: the repack writes every byte into freshly faulted memory
    where a copied weight's freed memory would have been reused. Mirrors vLLM's decision; a layer it
    cannot judge is left out (mapped).
    """
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return set()
    names = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, LinearBase) or not isinstance(
            getattr(module, "quant_method", None), UnquantizedLinearMethod
        ):
            continue
        weight = getattr(module, "weight", None)
        if getattr(module, "_cpu_skip_gemm_dispatch", False) or not isinstance(weight, torch.Tensor):
            continue
        if weight.ndim == 2 and weight.device.type == "cpu" and _onednn_packs(weight.dtype):
            names.add(f"{prefix}.weight" if prefix else "weight")
    return names


def _experts_change(manifest: Manifest | None, experts: ExpertPlacement | None) -> str:
    """`` (experts: saved ..., served ...)`` when the expert placement changed, else ``""``."""
    saved = None if manifest is None else manifest.experts
    if saved == experts:
        return ""
    have = "without expert parallelism" if saved is None else saved.describe()
    want = "without expert parallelism" if experts is None else experts.describe()
    return f" (experts: saved {have}, served {want})"


@dataclass(frozen=True)
class ReadInto:
    """Where a read goes: the tensors it fills, the names tied to one tensor, and the setters that
    serve a tensor from its file's mapping instead."""

    targets: Mapping[str, torch.Tensor]
    tied: list[list[str]]
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None


@dataclass(frozen=True)
class ModelReader(LoaderOptions):
    """The loader's read options, and the read of one rank's files into a model. ``load_config``
    gives the Hub's download folder and vLLM's progress-bar setting."""

    load_config: LoadConfig | None = None

    @classmethod
    def from_load_config(cls, load_config: LoadConfig) -> ModelReader:
        """The options ``load_config.model_loader_extra_config`` asks for, each checked."""
        options = LoaderOptions.parse(load_config.model_loader_extra_config or {})
        return cls(**asdict(options), load_config=load_config)

    def locate(self, directory: str, revision: str | None = None, update: bool = False) -> tuple[Store, str | None]:
        """The checkpoint's store (resolved once per load), and its Hub repository id if it comes from
        the Hub, where only the small files are fetched here; :meth:`read` fetches this rank's parts.
        ``update``: a weight update's path, where a local path that does not exist is refused at once."""
        store = open_store(directory)
        if store.exists():
            return store, None
        if update and (os.path.isabs(directory) or directory.startswith((".", "~")) or os.path.exists(directory)):
            raise CheckpointNotFound(
                f"{directory}: no such checkpoint directory for the weight update. Save the update first "
                "(examples/save_sharded_state.py, or vLLM's save_sharded_state hook) and pass its folder."
            )
        snapshot = hub.fetch(
            directory,
            hub.METADATA_PATTERNS,
            revision=revision,
            cache_dir=getattr(self.load_config, "download_dir", None),
        )
        return snapshot, directory

    def locate_update(self, path: Any, revision: str | None) -> tuple[Store, str | None]:
        """:meth:`locate` for a weight update's ``path``, refusing at once a local path that does not exist."""
        if not isinstance(path, str) or not path:  # reload_weights(weights_path=...) is passed on unchecked
            raise CheckpointNotFound(
                f"weights_path={path!r}: expected the folder, s3://, gs:// or az:// URL, or Hub id of a sharded "
                "checkpoint for the weight update, as a string."
            )
        return self.locate(path, revision, update=True)

    def adoptable(
        self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
    ) -> dict[str, Callable[[torch.Tensor], None]] | None:
        """The parameters to serve from file mappings (``mmap``), by state-dict name; on vLLM's CPU
        platform only, since elsewhere CPU parameters are pinned offloads a mapping would unpin."""
        if not self.mmap or not serves_on_cpu():
            return None
        setters = adoptable_parameters(model, state_dict)
        if self.mmap == "auto":
            repacked = repacked_parameters(model)
            setters = {name: setter for name, setter in setters.items() if name not in repacked}
        return setters

    def read(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        located: tuple[Store, str | None],
        manifest: Manifest | None,
        into: ReadInto,
        *,
        verify: str | None = None,
        update: bool = False,
    ) -> LoadStats:
        """Check this rank's files of the checkpoint at ``located`` and read them ``into`` tensors.

        ``manifest``: read once by the caller (None for vLLM's own save). ``update`` also refuses a
        checkpoint stored in another dtype than the served one (a start-up load casts it). ``verify``
        overrides the loader's setting.
        """
        store, repo_id = located
        directory = store.where
        verify = self.verify if verify is None else check_verify_mode(verify)
        rank = model_rank(model)
        if update and manifest is not None:
            check_dtype(manifest, dtype_label(model_config.dtype), directory)
        if repo_id is not None:
            # Online, vLLM leaves a Hub id as it is: fetch this rank's parts.
            patterns = hub.rank_fetch_patterns(manifest, rank, list(into.targets), into.tied, self.pattern)
            hub.fetch_more(repo_id, store, patterns, getattr(self.load_config, "download_dir", None))
            logger.info("sharded_state: %s fetched %d part files of %s", rank, len(patterns), repo_id)
        from vllm.model_executor.model_loader.weight_utils import enable_tqdm

        action = "Updating from" if update else "Loading"
        progress = ByteProgress(
            f"{action} sharded_state ({rank})", enable_tqdm(getattr(self.load_config, "use_tqdm_on_load", True))
        )
        with progress:
            request = LoadRequest(
                store,
                manifest,
                verify,
                serving=source_identity(model, model_config),
                geometry=tensor_geometry(
                    model, into.targets, rank.tp_size, rank.tp_rank, rank.experts, rank.ep_rank, rank.expert_tp
                ),
                tied=into.tied,
                pattern=self.pattern if manifest is None else None,
            )
            options = ReadOptions(self.threads, progress, self.huge_pages, ranks_on_host())
            stats = load_rank(request, into.targets, rank, options, into.adopt)
        # What was read, for a save that reads it again (checkpoint/save_proof.py).
        model.__dict__[READ_PROOF_ATTRIBUTE] = (located, manifest_proof(manifest), manifest)
        if stats.resharded_from is not None:
            logger.info(
                "sharded_state: %s resharded from TP=%d PP=%d to TP=%d PP=%d%s: read %.1f MB of the %.1f MB "
                "checkpoint (%.0f%%)",
                rank,
                *stats.resharded_from,
                rank.tp_size,
                rank.pp_size,
                _experts_change(manifest, rank.experts),
                stats.bytes_read / 1e6,
                stats.checkpoint_bytes / 1e6,
                100 * stats.bytes_read / max(stats.checkpoint_bytes, 1),
            )
        if stats.cast:
            logger.info(
                "sharded_state: %d tensors are stored in another dtype than %s and were cast "
                "while loading (for example %s).",
                len(stats.cast),
                dtype_label(model_config.dtype),
                stats.cast[0],
            )
        if manifest is None:
            logger.warning(
                "%s has no %s (a checkpoint written by vLLM's own save): file sizes and the "
                "source model could not be checked.",
                directory,
                MANIFEST_NAME,
            )
        logger.info(
            "vllm_sharded_loader.ShardedStateLoader: %s %s %d tensors, %.1f MB (%.1f MB mapped) from %d "
            "files in %.3f s (%.2f GB/s, verify=%s, %d threads)",
            rank,
            f"read an update of {directory}:" if update else "loaded",
            stats.tensors,
            stats.bytes_read / 1e6,
            stats.bytes_mapped / 1e6,
            len(stats.files),
            stats.seconds,
            stats.bytes_read / max(stats.seconds, 1e-9) / 1e9,
            verify,
            stats.threads,
        )
        return stats
