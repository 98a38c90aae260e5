"""The four places where the plugin hooks into vLLM; nothing else is patched."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..storage.objects import is_object_url


def install() -> None:
    """Register the loader, route the save hook, and record loaded states (idempotent).

    1. ``sharded_state`` -> our :class:`~.loader.ShardedStateLoader` (vLLM's own
       registry; it warns once that the built-in class is replaced).
    2. ``vllm.model_executor.model_loader.ShardedStateLoader`` -> our class: vLLM's
       worker ``save_sharded_state`` hook looks the class up by that name at call
       time, so the hook writes our format.
    3. ``base_loader.process_weights_after_loading`` -> a wrapper that records the
       loaded state first (see :mod:`.capture`); it applies to every load format,
       so a model loaded from a HF checkpoint can be saved.
    4. ``VllmConfig.try_verify_and_update_config`` -> a wrapper that lets ``sharded_state``
       serve ``s3://`` models (see :func:`allow_object_storage`).
    """
    from vllm.model_executor import model_loader
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
    from vllm.config import VllmConfig

    if not getattr(VllmConfig.try_verify_and_update_config, "_sharded_state", False):
        VllmConfig.try_verify_and_update_config = allow_object_storage(VllmConfig.try_verify_and_update_config)


def allow_object_storage(verify: Callable[[Any], None]) -> Callable[[Any], None]:
    """Let ``load_format="sharded_state"`` pass vLLM's check on object-storage models.

    For ``model="s3://..."`` vLLM pulls config and tokenizer into a local folder, keeps
    the URL as ``model_weights``, and then refuses every load format but the Run:ai ones
    (a fixed list in ``VllmConfig.try_verify_and_update_config``). Our loader reads the
    URL itself (:mod:`..storage.objects`), so during that one check the load format is
    shown as ``runai_streamer_sharded``, vLLM's name for the same kind of checkpoint, and
    restored right after; nothing else of the config changes.
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
