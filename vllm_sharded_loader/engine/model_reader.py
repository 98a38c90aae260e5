"""Reading this rank's files of a sharded checkpoint into a vLLM model: the step a start-up load
(:class:`.loader.ShardedStateLoader`) and a weight update (:class:`.reload.InPlaceUpdate`) share,
with the loader's read options (``model_loader_extra_config``) as one value."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from ..checkpoint import LoadRequest, load_rank
from ..checkpoint.save_proof import manifest_proof
from ..checkpoint.stats import LoadStats, check_verify_mode
from ..format.errors import InvalidOption
from ..format.experts import ExpertPlacement
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..planning.topology import check_dtype
from ..storage import hub
from ..storage.location import Store, open_store
from ..storage.progress import ByteProgress
from ..storage.reader import DEFAULT_THREADS, ReadOptions
from .capture import READ_PROOF_ATTRIBUTE
from .identity import dtype_label, ranks_on_host, source_identity
from .layer_geometry import model_rank, tensor_geometry

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.config.load import LoadConfig

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")

EXTRA_CONFIG_KEYS = frozenset({"pattern", "verify", "threads", "huge_pages", "mmap"})


def _storage_uses(tensor: torch.Tensor) -> int | None:
    """How many tensors share ``tensor``'s memory (torch's count), or None where torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(tensor.untyped_storage()._cdata))


def adoptable_parameters(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> dict[str, Callable[[torch.Tensor], None]]:
    """Callbacks that make a CPU parameter use another tensor as its data, by state-dict name.

    A parameter is offered only if nothing but itself and the ``state_dict`` entries
    holds its memory: a layer that kept a view of a parameter's memory would otherwise go
    on reading the old, never-filled memory after the swap. Shared (tied) parameters are
    one object, so swapping it serves every name.
    """
    baseline = _storage_uses(torch.nn.Parameter(torch.empty(1), requires_grad=False))
    if baseline is None:
        return {}
    held: dict[int, int] = {}
    for t in {id(t): t for t in state_dict.values()}.values():
        key = t.untyped_storage().data_ptr()
        held[key] = held.get(key, 0) + 1
    setters: dict[str, Callable[[torch.Tensor], None]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name not in state_dict or param.device.type != "cpu" or not param.numel():
            continue
        if _storage_uses(param) == baseline + held.get(param.untyped_storage().data_ptr(), 0):
            setters[name] = partial(_swap_data, param)
    return setters


def serves_on_cpu() -> bool:
    """Whether vLLM runs this engine on its CPU platform (the only one whose parameters are mapped)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _swap_data(param: torch.nn.Parameter, data: torch.Tensor) -> None:
    param.data = data


@cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether vLLM's CPU backend builds a oneDNN matmul for weights of ``dtype`` (it then packs a copy).

    Asked the way vLLM asks, on a small weight: oneDNN refuses dtypes the CPU has no kernel
    for (bfloat16 without AVX-512), and vLLM then keeps the weight as it is.
    """
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
    """Names of the CPU weights that vLLM's post-processing will rewrite into new memory and drop.

    vLLM's CPU backend repacks the weight of every unquantized linear layer for its GEMM
    kernel (``dispatch_cpu_unquantized_gemm`` with ``remove_weight=True``) where its
    kernel takes the dtype, then replaces the weight with an empty one. Mapping such a
    weight saves the copy at load time but not the bytes: the repack reads it once and
    writes every byte into freshly faulted memory on the one core vLLM pins the worker to,
    where a copied weight's freed memory would have been reused. Mirrors vLLM 0.32's
    decision; a layer it cannot judge is left out (mapped, as before).
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
    """`` (experts: saved EP=2 linear, served without expert parallelism)`` when the placement changed."""
    saved = None if manifest is None else manifest.experts
    if saved == experts:
        return ""
    have = "without expert parallelism" if saved is None else saved.describe()
    want = "without expert parallelism" if experts is None else experts.describe()
    return f" (experts: saved {have}, served {want})"


@dataclass(frozen=True)
class ModelReader:
    """The ``sharded_state`` loader's read options, and the read of one rank's files into a model.

    ``pattern`` names the parts of a checkpoint saved with a custom file name pattern (one
    without a manifest); ``verify`` is ``"size"`` or ``"checksum"``; ``threads``, reader threads;
    ``huge_pages``, transparent huge pages on the parameters; ``mmap``, whether CPU parameters
    are served from the checkpoint's files (see :meth:`adoptable`). ``load_config`` gives the
    Hub's download folder and vLLM's progress-bar setting.
    """

    load_config: LoadConfig
    pattern: str | None = None
    verify: str = "size"
    threads: int = DEFAULT_THREADS
    huge_pages: bool = False
    mmap: bool | str = True

    @classmethod
    def from_load_config(cls, load_config: LoadConfig) -> ModelReader:
        """The options ``load_config.model_loader_extra_config`` asks for, each checked."""
        extra = load_config.model_loader_extra_config or {}
        if not isinstance(extra, dict):
            raise InvalidOption(
                f"model_loader_extra_config for sharded_state must be a dict, got {type(extra).__name__}."
            )
        unknown = set(extra) - EXTRA_CONFIG_KEYS
        if unknown:
            raise InvalidOption(
                f"Unexpected model_loader_extra_config keys {sorted(unknown)} for load format "
                f"sharded_state; supported keys: {sorted(EXTRA_CONFIG_KEYS)}."
            )
        threads = extra.get("threads", DEFAULT_THREADS)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise InvalidOption(
                f"model_loader_extra_config threads={threads!r} for sharded_state must be a positive integer."
            )
        huge_pages = extra.get("huge_pages", False)
        if not isinstance(huge_pages, bool):
            raise InvalidOption(
                f"model_loader_extra_config huge_pages={huge_pages!r} for sharded_state must be true or false."
            )
        mmap = extra.get("mmap", True)
        if not isinstance(mmap, bool) and mmap != "auto":
            raise InvalidOption(
                f'model_loader_extra_config mmap={mmap!r} for sharded_state must be true, false or "auto".'
            )
        verify = check_verify_mode(extra.get("verify", "size"))
        return cls(load_config, extra.get("pattern"), verify, threads, huge_pages, mmap)

    def locate(self, directory: str, revision: str | None = None) -> tuple[Store, str | None]:
        """The checkpoint's store (resolved here, once per load), and its Hub repository id if it comes from
        the Hub, for a checkpoint named by a folder, an ``s3://`` URL or a Hub id.

        For a Hub repository only the small files are fetched here (manifest, config,
        tokenizer); :meth:`read` then fetches the parts this rank reads.
        """
        store = open_store(directory)
        if store.exists():
            return store, None
        snapshot = hub.fetch(
            directory,
            hub.METADATA_PATTERNS,
            revision=revision,
            cache_dir=self.load_config.download_dir,
        )
        return snapshot, directory

    def adoptable(
        self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
    ) -> dict[str, Callable[[torch.Tensor], None]] | None:
        """The parameters to serve from file mappings (``mmap``), by state-dict name.

        Only on vLLM's CPU platform: on an accelerator, the CPU parameters are offloaded
        ones (``cpu_offload_gb``), which vLLM keeps in pinned memory for fast copies to the
        device; a mapping of the file would take that pinning away.
        """
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
        targets: Mapping[str, torch.Tensor],
        tied: list[list[str]],
        adopt: Mapping[str, Callable[[torch.Tensor], None]] | None,
        *,
        verify: str | None = None,
        update: bool = False,
    ) -> LoadStats:
        """Check this rank's files of the checkpoint at ``located`` (folder, Hub id) and read them into ``targets``.

        ``manifest`` is the checkpoint's, as the caller read it from the folder (None for vLLM's own
        save, which has none): read once per load, however many steps look at it. The start-up load
        and a weight update share this. ``update`` also refuses a checkpoint stored in another dtype
        than the served one (a start-up load casts it): an update must be the served model, as
        served. ``verify`` overrides the loader's setting.
        """
        store, repo_id = located
        directory = store.where
        verify = self.verify if verify is None else check_verify_mode(verify)
        rank = model_rank(model)
        if update and manifest is not None:
            check_dtype(manifest, dtype_label(model_config.dtype), directory)
        if repo_id is not None:
            # Online, vLLM leaves a Hub id as it is (offline it substitutes the cached
            # snapshot, and the files are only opened, never fetched): fetch this rank's parts.
            patterns = hub.rank_fetch_patterns(manifest, rank, list(targets), tied, self.pattern)
            hub.fetch_more(repo_id, store, patterns, self.load_config.download_dir)
            logger.info("sharded_state: %s fetched %d part files of %s", rank, len(patterns), repo_id)
        from vllm.model_executor.model_loader.weight_utils import enable_tqdm

        action = "Updating from" if update else "Loading"
        progress = ByteProgress(f"{action} sharded_state ({rank})", enable_tqdm(self.load_config.use_tqdm_on_load))
        with progress:
            request = LoadRequest(
                store,
                manifest,
                verify,
                serving=source_identity(model, model_config),
                geometry=tensor_geometry(
                    model, targets, rank.tp_size, rank.tp_rank, rank.experts, rank.ep_rank, rank.expert_tp
                ),
                tied=tied,
                pattern=self.pattern if manifest is None else None,
            )
            options = ReadOptions(self.threads, progress, self.huge_pages, ranks_on_host())
            stats = load_rank(request, targets, rank, options, adopt)
        # What was read, for a save that reads it again (issue 34: proven by content, see checkpoint/save_proof.py).
        model.__dict__[READ_PROOF_ATTRIBUTE] = (directory, manifest_proof(manifest), manifest)
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
