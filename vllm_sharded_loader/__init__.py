"""vllm-sharded-loader: per-rank sharded checkpoints for vLLM that always reload right.

Importing this package is cheap: it imports neither torch nor vLLM. vLLM calls
:func:`register` in every process (front end, engine core, each worker) through the
``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "prepare_node", "register"]


def register() -> None:
    """Make ``sharded_state`` mean our loader, and route vLLM's save hook to our writer.

    Safe to call any number of times.
    """
    from .engine.plugin import install

    install()


def prepare_node(model: str, revision: str | None = None, download_dir: str | None = None) -> int:
    """Prepare this node for ``LLM(model, load_format="sharded_state")``: restore what the checkpoint
    carries that vLLM reads before any loader runs (its model-class inspection cache), from a
    manifest signed by a trusted key; on CPU, set ``VLLM_USE_AOT_COMPILE=0`` unless it is set, so
    that the engine finds the compile cache the checkpoint carries. The plugin does this itself as
    vLLM builds the model's configuration; call it to have it done earlier. Never fails a start;
    returns how many entries were restored. See :func:`.engine.node_setup.prepare_node`."""
    from .engine.node_setup import prepare_node as prepare

    return prepare(model, revision, download_dir)
