"""The three places where the plugin hooks into vLLM; nothing else is patched."""

from __future__ import annotations


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
