"""The ``sharded_state`` model loader: the thin vLLM layer over :mod:`..checkpoint`."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping
from copy import copy
from dataclasses import replace
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader import sharded_state_loader as builtin_sharded_state
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..checkpoint import LoadRequest, load_rank, read_manifest, saveable_state
from ..checkpoint.legacy import holds_sharded_checkpoint
from ..checkpoint.state import tied_groups
from ..checkpoint.stats import LoadStats, check_verify_mode
from ..format.errors import CheckpointNotFound, ShardedStateError
from ..format.experts import ExpertPlacement
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..planning.topology import check_dtype
from ..storage import hub
from ..storage.location import open_store
from ..storage.reader import DEFAULT_THREADS, ReadOptions
from .compile_cache import restore_startup_artifacts
from .identity import dtype_label, is_drafter, ranks_on_host, source_identity
from .layer_geometry import model_rank, tensor_geometry
from .progress import ByteProgress

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


def _register_saved_biases(model: torch.nn.Module, manifest: Manifest | None) -> None:
    """Register the biases a model makes only when its own ``load_weights`` meets them, if the
    checkpoint (``manifest``) holds them: vLLM's Transformers backend gives ``lm_head`` a bias
    (``ParallelLMHead._register_bias``) only for a checkpoint that has one (Phi), and this loader
    fills parameters without the model's ``load_weights``. Without it, such a model's saved
    state would not load back ("holds tensors the served model does not have")."""
    if manifest is None:
        return
    saved = {name for entry in manifest.ranks for name in entry.tensors}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if f"{name}.bias" in saved and hasattr(module, "_register_bias") and getattr(module, "bias", 0) is None:
            with torch.device(weight.device if isinstance(weight, torch.Tensor) else "cpu"):  # beside its weight
                module._register_bias()


class ShardedStateLoader(BaseModelLoader):
    """Loads each worker's own files of a sharded checkpoint straight into its parameters.

    Registered as the ``sharded_state`` load format, in place of vLLM's loader of the
    same name. Reads checkpoints saved by this package (with ``sharded_state.json``)
    and by vLLM's own save (no manifest), and refuses, with an error saying what to
    do, anything that would load wrong weights: another topology, another model,
    missing, unexpected or reshaped tensors, missing or resized files.

    ``model_loader_extra_config`` accepts ``verify``: ``"size"`` (the default: manifest
    complete, every file present with its recorded size, headers consistent with the
    manifest) or ``"checksum"`` (also the checksum of every byte read), and
    ``pattern`` (the file name pattern of a checkpoint saved with a custom one), as
    vLLM's loader does, and ``threads`` (reader threads per worker, default one per core, 4 to 8) and
    ``huge_pages`` (ask for transparent huge pages on the parameters, default off) and
    ``mmap`` (default on, on vLLM's CPU platform only: CPU parameters stored in their own dtype are served from a
    private, copy-on-write mapping of the checkpoint file, as ``safetensors`` maps files
    on CPU, instead of being copied into new memory; ``false`` copies every byte;
    ``"auto"`` copies the weights vLLM's CPU post-processing repacks, see
    :func:`repacked_parameters`, and maps the rest).
    Rank 0 shows a progress bar unless ``use_tqdm_on_load`` is off.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = copy(load_config.model_loader_extra_config or {})
        if not isinstance(extra, dict):
            raise ShardedStateError(
                f"model_loader_extra_config for sharded_state must be a dict, got {type(extra).__name__}."
            )
        unknown = set(extra) - EXTRA_CONFIG_KEYS
        if unknown:
            raise ShardedStateError(
                f"Unexpected model_loader_extra_config keys {sorted(unknown)} for load format "
                f"sharded_state; supported keys: {sorted(EXTRA_CONFIG_KEYS)}."
            )
        self.pattern: str | None = extra.get("pattern")
        self.verify: str = check_verify_mode(extra.get("verify", "size"))
        threads = extra.get("threads", DEFAULT_THREADS)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ShardedStateError(
                f"model_loader_extra_config threads={threads!r} for sharded_state must be a positive integer."
            )
        self.threads: int = threads
        huge_pages = extra.get("huge_pages", False)
        if not isinstance(huge_pages, bool):
            raise ShardedStateError(
                f"model_loader_extra_config huge_pages={huge_pages!r} for sharded_state must be true or false."
            )
        self.huge_pages: bool = huge_pages
        mmap = extra.get("mmap", True)
        if not isinstance(mmap, bool) and mmap != "auto":
            raise ShardedStateError(
                f'model_loader_extra_config mmap={mmap!r} for sharded_state must be true, false or "auto".'
            )
        self.mmap: bool | str = mmap

    # Save side: vLLM's worker hook calls `ShardedStateLoader.save_model`; the plugin
    # points that name at this class, so the hook writes our format.
    @staticmethod
    def save_model(model: torch.nn.Module, path: str, pattern: str | None = None, max_size: int | None = None) -> None:
        """Write this worker's loaded state to ``path`` (see :mod:`.capture`)."""
        from .save_hook import save_rank_from_hook

        save_rank_from_hook(model, path, pattern, max_size)

    def _locate(self, model_config: ModelConfig) -> tuple[str, str | None]:
        """The checkpoint's local folder, and its Hub repository id if it comes from the Hub.

        For a Hub repository only the small files are fetched here (manifest, config,
        tokenizer); :meth:`load_weights` then fetches the parts this rank reads.
        """
        # For s3://, gs://, az://..., vLLM pulls config and tokenizer into a local folder (model) and
        # keeps the URL (model_weights): the parts are read from the store, never copied.
        return self.locate(model_config.model_weights or model_config.model, model_config.revision)

    def locate(self, directory: str, revision: str | None = None) -> tuple[str, str | None]:
        """:meth:`_locate` for a checkpoint named by a folder, an ``s3://`` URL or a Hub id."""
        if open_store(directory).exists():
            return directory, None
        snapshot = hub.fetch(
            directory,
            hub.METADATA_PATTERNS,
            revision=revision,
            cache_dir=self.load_config.download_dir,
        )
        return snapshot, directory

    def load_model(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """vLLM's ``load_model``, with the objects that exist before it kept out of its ``gc.collect`` calls.

        vLLM collects garbage twice inside ``load_model`` (after the weights, after
        post-processing), to free transient tensors of the load. Each full collection
        walks every object of the process (about 600,000 once vLLM is imported: 0.5-0.8 s
        of one core here), although only objects made during the load can be such
        garbage. Frozen (``gc.freeze``), the older objects are skipped; they are unfrozen
        right after, so that any garbage among them is collected later as usual. vLLM
        freezes its whole heap once the engine is up (``freeze_gc_heap``); where something
        has frozen objects already, nothing is changed.
        """
        if gc.get_freeze_count():
            return super().load_model(*args, **kwargs)
        gc.freeze()
        try:
            return super().load_model(*args, **kwargs)
        finally:
            gc.unfreeze()

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

    def download_model(self, model_config: ModelConfig) -> None:
        # Which parts a rank needs is known only in the worker (load_weights).
        self._locate(model_config)

    def _load_drafter(self, model: torch.nn.Module, model_config: ModelConfig, directory: str) -> None:
        """Load a speculative drafter's weights from its Hugging Face folder, with vLLM's default loader.

        vLLM loads the drafter (EAGLE, MTP, a draft model) with the target's load format
        unless ``speculative_config`` names a ``draft_load_config``; a drafter's own folder
        holds its original weights, not a sharded checkpoint.
        """
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        logger.info(
            "sharded_state: the speculative drafter %s holds no sharded checkpoint; loading its weights with "
            "vLLM's default loader",
            directory,
        )
        config = replace(self.load_config, load_format="auto", model_loader_extra_config={})
        try:
            DefaultModelLoader(config).load_weights(model, model_config)
        except Exception as e:
            raise CheckpointNotFound(
                f"The speculative drafter {directory} holds no sharded checkpoint ({MANIFEST_NAME} or part "
                f"files), and vLLM's default loader could not load its weights either ({type(e).__name__}: {e}). "
                "Point speculative_config['model'] at the drafter's Hugging Face folder (its *.safetensors), "
                "or at a sharded checkpoint of the drafter saved with examples/save_sharded_state.py."
            ) from e

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        directory, repo_id = self._locate(model_config)
        if is_drafter(model_config) and not holds_sharded_checkpoint(directory, self.pattern):
            # The target is the sharded checkpoint; its drafter comes from its own folder.
            self._load_drafter(model, model_config, directory)
            return
        from .reload import remember_served_from

        manifest = read_manifest(directory)
        _register_saved_biases(model, manifest)
        state_dict = model.state_dict()
        targets = saveable_state(state_dict)
        remember_served_from(model, model_config)
        self.read_checkpoint(
            model,
            model_config,
            (directory, repo_id),
            manifest,
            targets,
            tied_groups(state_dict, targets),
            self.adoptable(model, state_dict),
        )
        # Before vLLM compiles (its profiling run comes after the load): a fresh node starts warm.
        hub_fetch = None if repo_id is None else (repo_id, model_config.revision, self.load_config.download_dir)
        restore_startup_artifacts(model, directory, manifest, model_rank(model), hub_fetch)

    def get_all_weights(self, model_config: ModelConfig, model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
        """vLLM's in-place ``reload_weights`` entry point (``collective_rpc("reload_weights")``).

        vLLM asks a loader for the checkpoint's weights in Hugging Face form and feeds them
        to the model's ``load_weights``, which shards them. A sharded checkpoint is already
        each rank's slice in the loaded layout, so the returned iterable yields nothing:
        iterated (inside the model's ``load_weights``, once vLLM has put the layers back in
        their loaded layout), it reads this rank's files straight into them and
        post-processes each layer (see :class:`.reload.InPlaceUpdate`). With
        ``weights_path``, vLLM has pointed ``model_config`` at the new checkpoint.
        """
        from .reload import InPlaceUpdate

        return InPlaceUpdate(self, model, model_config).for_reload_weights()

    def read_checkpoint(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        located: tuple[str, str | None],
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
        directory, repo_id = located
        verify = self.verify if verify is None else check_verify_mode(verify)
        rank = model_rank(model)
        if update and manifest is not None:
            check_dtype(manifest, dtype_label(model_config.dtype), directory)
        if repo_id is not None:
            # Online, vLLM leaves a Hub id as it is (offline it substitutes the cached
            # snapshot, and the files are only opened, never fetched): fetch this rank's parts.
            patterns = hub.rank_fetch_patterns(manifest, rank, list(targets), tied, self.pattern)
            hub.fetch(repo_id, patterns, revision=model_config.revision, cache_dir=self.load_config.download_dir)
            logger.info("sharded_state: %s fetched %d part files of %s", rank, len(patterns), repo_id)
        from vllm.model_executor.model_loader.weight_utils import enable_tqdm

        action = "Updating from" if update else "Loading"
        progress = ByteProgress(f"{action} sharded_state ({rank})", enable_tqdm(self.load_config.use_tqdm_on_load))
        with progress:
            request = LoadRequest(
                directory,
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
        # What was read, for a save that reads it again (issue 34: proven by content, see capture.manifest_proof).
        from .capture import READ_PROOF_ATTRIBUTE, manifest_proof

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


# The rest of the public surface of vLLM's class that ours replaces (its patterns and helpers,
# used by code written for it, vLLM's own tests among it), taken from vLLM's class itself so
# that it behaves the same in every version that has it. The raw class attributes keep
# their static-method wrappers.
for _name, _value in vars(builtin_sharded_state.ShardedStateLoader).items():
    if not _name.startswith("__") and _name not in vars(ShardedStateLoader):
        setattr(ShardedStateLoader, _name, _value)
