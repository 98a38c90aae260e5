"""Where vLLM keeps this worker's compile cache, and the key that says where it is valid.

vLLM compiles each ``@support_torch_compile`` module on its first forward into
``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/{hash}/``, ``{hash}`` being vLLM's own key
over its configuration. The checkpoint carries ``inductor_cache/`` (entries named by the hash of what
they compile, so valid under any ``{hash}``), unpacked into the folder vLLM is about to use, computed
as vLLM does just before it does (:func:`cache_dir_of`).

On CPU, vLLM cannot load the AOT-compiled function it wrote and every start compiles in full, while
Inductor's caches hit; so :func:`place_compile_cache` points Inductor's cache at the same
``{hash}/inductor_cache`` folder. See docs/startup-artifacts.md.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import replace
from typing import Any

import torch
from vllm.logger import init_logger

from ..checkpoint import startup_artifacts
from ..checkpoint.trust import check_trust
from ..format.errors import CheckpointCorrupt
from ..format.manifest import Manifest, RankEntry
from ..planning.topology import RankInfo
from ..storage import hub
from ..storage.location import Store
from .node_setup import served_key_python, stage_model_info

logger = init_logger(f"vllm.plugins.{__name__}")

# Where :func:`place_compile_cache` put a compiled module's cache folder, on the module.
PLACED_ATTRIBUTE = "_sharded_state_cache_dir"


def aot_cache_root() -> str:
    """``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile``, where vLLM looks."""
    import vllm.envs as envs

    return os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", "torch_aot_compile")


def compiled_modules(model: torch.nn.Module) -> list[Any]:
    """The model's modules that vLLM compiles, outermost first (none in eager mode or without a cache)."""
    import vllm.envs as envs
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    if envs.VLLM_DISABLE_COMPILE_CACHE:
        return []
    found = []
    for module in model.modules():
        if not isinstance(module, TorchCompileWithNoGuardsWrapper) or getattr(module, "do_not_compile", True):
            continue
        if module.vllm_config.compilation_config.backend == "eager":
            continue  # vLLM skips its AOT cache for the eager backend
        found.append(module)
    return found


def _vllm_cache_key(module: Any) -> str:
    """vLLM's ``{hash}`` folder name for one compiled module, computed as its decorator does."""
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.compilation.decorators import _model_hash_key

    factors: list[str] = aot_compile_hash_factors(module.vllm_config)
    factors.append(_model_hash_key(module.forward))
    return hashlib.sha256(str(factors).encode()).hexdigest()


def cache_dir_of(module: Any) -> str:
    """The ``{hash}`` folder vLLM compiles ``module`` into: the one recorded, or the one it will use."""
    placed = getattr(module, PLACED_ATTRIBUTE, None)
    if placed:
        return placed
    recorded = module.vllm_config.compilation_config.local_cache_dir
    if recorded and os.path.basename(os.path.dirname(recorded)) == "torch_aot_compile":
        return recorded
    return os.path.join(aot_cache_root(), _vllm_cache_key(module))


def _place(modules: list[Any]) -> None:
    """Point Inductor's cache at ``{hash}/inductor_cache`` (as vLLM does in AOT mode), a folder of this
    engine's own that a save can carry; Inductor's default is shared by every model on the node.
    Runs as the first forward begins, when vLLM names that folder; idempotent."""
    import vllm.envs as envs
    from vllm.config import CompilationMode

    if envs.VLLM_USE_AOT_COMPILE or not modules or getattr(modules[0], PLACED_ATTRIBUTE, None):
        return
    if modules[0].vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE:
        return  # vLLM's own backend (GPUs) places Inductor's cache itself
    folder = cache_dir_of(modules[0])
    for module in modules:  # one process-wide Inductor folder, so one folder for all of them
        setattr(module, PLACED_ATTRIBUTE, folder)
    inductor = os.path.join(folder, "inductor_cache")
    os.makedirs(inductor, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor


def place_compile_cache(model: torch.nn.Module) -> None:
    """Have Inductor's cache placed per configuration at the first forward (:func:`_place`), unless
    start-up artifacts are off or vLLM places it itself."""
    import vllm.envs as envs

    if not startup_artifacts.enabled() or envs.VLLM_USE_AOT_COMPILE:
        return
    modules = compiled_modules(model)
    if not modules or any(m is model for m in modules):
        return

    def place(*_: Any) -> None:
        handle.remove()
        try:
            _place(modules)
        except Exception as e:  # optional: Inductor keeps its default folder
            logger.warning("sharded_state: Inductor's cache left in its default folder (%s)", e)

    handle = model.register_forward_pre_hook(place)


def served_key(model: torch.nn.Module, rank: RankInfo) -> dict[str, str] | None:
    """Everything that decides whether compile artifacts are valid for this worker, or None when vLLM
    keeps no compile cache for this model.

    vLLM's ``{hash}`` is not part of it (it covers the model's path and load format, which differ
    between saving and serving engines): Inductor's entries are named by the hash of what they
    compile, so an entry for another graph or setting is simply not found."""
    return _served_key(compiled_modules(model), rank)


def _served_key(modules: list[Any], rank: RankInfo) -> dict[str, str] | None:
    if not modules:
        return None
    compilation = modules[0].vllm_config.compilation_config
    return {
        **uncompiled_key(rank),
        "compiled": ",".join(type(m).__name__ for m in modules),
        "compilation": f"mode={compilation.mode.name} backend={compilation.backend}",
    }


def uncompiled_key(rank: RankInfo) -> dict[str, str]:
    """The key of an archive that carries only vLLM's model-class inspection cache (``compiled`` empty)."""
    import vllm

    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": served_key_python(),
        "compiled": "",
        "topology": f"tp={rank.tp_size} pp={rank.pp_size} dp={rank.dp_size}",
        "rank": f"tp_rank={rank.tp_rank} pp_rank={rank.pp_rank} dp_rank={rank.dp_rank}",
        "device": startup_artifacts.device_label(),
    }


def save_startup_artifacts(
    model: torch.nn.Module, target: Store, entry: RankEntry, rank: RankInfo, model_config: Any = None
) -> RankEntry:
    """At a save, on every worker: pack this rank's compile cache and vLLM's model-class inspection
    cache entries, write them into ``target`` and return ``entry`` with the record (``model_config``:
    the served one, when nothing was compiled). Optional: a failure is one log line."""
    if not startup_artifacts.enabled():
        return entry
    try:
        modules = compiled_modules(model)
        key = _served_key(modules, rank)
        if modules:
            model_config = modules[0].vllm_config.model_config
        staging = tempfile.mkdtemp(prefix="startup-artifacts-")
        try:
            for index, module in enumerate(modules):
                inductor = os.path.join(cache_dir_of(module), "inductor_cache")
                if not os.path.isdir(inductor):
                    logger.info("sharded_state: %s carries no start-up artifacts: %s is absent", rank, inductor)
                    return entry
                os.symlink(inductor, os.path.join(staging, str(index)))
            folders = [str(i) for i in range(len(modules))]
            info = model_config is not None and stage_model_info(
                model_config, os.path.join(staging, startup_artifacts.MODEL_INFO_FOLDER)
            )
            if info:
                folders.append(startup_artifacts.MODEL_INFO_FOLDER)
            if key is None:
                if not info:
                    logger.info("sharded_state: %s carries no start-up artifacts: vLLM compiled nothing", rank)
                    return entry
                key = uncompiled_key(rank)
            data = startup_artifacts.pack(staging, folders)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        record = startup_artifacts.write_rank_artifacts(target, data, key, entry.tp_rank, entry.pp_rank, entry.dp_rank)
    except Exception as e:  # optional: vLLM internals that moved, a full disk; never a reason to fail the save
        logger.warning("sharded_state: %s start-up artifacts not saved (%s); the weights are saved as usual", rank, e)
        return entry
    logger.info("sharded_state: %s start-up artifacts: %s, %.1f MB", rank, record.file, record.size / 1e6)
    return replace(entry, startup=record)


def restore_startup_artifacts(
    model: torch.nn.Module,
    where: Store,
    manifest: Manifest | None,
    rank: RankInfo,
    hub_fetch: tuple[str, str | None] | None = None,
) -> bool:
    """At start-up, before vLLM compiles: check this rank's artifacts (signed by a trusted key, same
    key as the served one, checksums) and have them unpacked just before the first forward. Anything
    else is one log line and vLLM compiles as usual. ``hub_fetch``: (repo id, cache dir) of a Hub
    checkpoint. True if the artifacts will be used."""
    if not startup_artifacts.enabled() or manifest is None:
        return False
    try:
        return _restore(model, where, manifest, rank, hub_fetch)
    except Exception as e:  # optional: vLLM compiles as it would without them; never a failed start
        logger.warning("sharded_state: %s start-up artifacts not used (%s); vLLM compiles as usual", rank, e)
        return False


def _restore(
    model: torch.nn.Module,
    where: Store,
    manifest: Manifest,
    rank: RankInfo,
    hub_fetch: tuple[str, str | None] | None,
) -> bool:
    try:
        entry = manifest.rank(rank.tp_rank, rank.pp_rank, rank.saved_dp_rank)
    except CheckpointCorrupt:
        entry = None
    record = entry.startup if entry is not None else None
    if record is None or record.key.get("compiled") == "":
        return False  # none, or only what prepare_node restores before the engine
    # Code that torch runs in this process: only from a manifest a trusted key signed.
    verdict = check_trust(manifest)
    if not verdict.trusted:
        logger.info("sharded_state: %s start-up artifacts not used: %s; vLLM compiles as usual", rank, verdict.reason)
        return False
    served = served_key(model, rank)
    if served is None:
        logger.info("sharded_state: %s start-up artifacts not used: vLLM keeps no compile cache here", rank)
        return False
    differs = startup_artifacts.key_mismatch(record.key, served)
    if differs is not None:
        logger.info("sharded_state: %s start-up artifacts not used, saved for another setup (%s)", rank, differs)
        return False
    if hub_fetch is not None:
        repo_id, cache_dir = hub_fetch
        where = hub.fetch_more(repo_id, where, [record.file], cache_dir)
    if any(m is model for m in compiled_modules(model)):
        # vLLM's compiled __call__ replaces the module's own, which runs the forward hooks.
        logger.info("sharded_state: %s start-up artifacts not used: the model class itself is compiled", rank)
        return False
    data = startup_artifacts.read_rank_artifacts(where, record)
    _unpack_before_first_forward(model, data, rank, record.file)
    return True


def _unpack_before_first_forward(model: torch.nn.Module, data: bytes, rank: RankInfo, name: str) -> None:
    """Unpack the checked archive into each compiled module's cache folder at the first forward: vLLM
    names that folder by a hash of the configuration as it then stands. ``model`` is not the compiled
    module itself, so its hooks run before vLLM's compiled ``__call__``."""

    def unpack(*_: Any) -> None:
        handle.remove()
        try:
            staging = tempfile.mkdtemp(prefix="startup-artifacts-")
            try:
                modules = compiled_modules(model)
                _place(modules)
                for index, module in enumerate(modules):
                    inductor = os.path.join(cache_dir_of(module), "inductor_cache")
                    os.makedirs(inductor, exist_ok=True)
                    os.symlink(inductor, os.path.join(staging, str(index)))
                written, kept = startup_artifacts.restore(data, staging, [str(i) for i in range(len(modules))])
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        except Exception as e:  # optional: vLLM compiles as usual
            logger.warning("sharded_state: %s start-up artifacts not used (%s); vLLM compiles as usual", rank, e)
            return
        logger.info(
            "sharded_state: %s restored start-up artifacts %s (%.1f MB, %d files, %d already there) into %s",
            rank,
            name,
            len(data) / 1e6,
            written,
            kept,
            ", ".join(cache_dir_of(m) for m in modules),
        )

    handle = model.register_forward_pre_hook(unpack)
