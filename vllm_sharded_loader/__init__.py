"""vllm-sharded-loader: per-rank sharded checkpoints for vLLM that always reload right.

Importing this package is cheap: it imports neither torch nor vLLM. vLLM calls
:func:`register` in every process (front end, engine core, each worker) through the
``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "register"]


def register() -> None:
    """Make ``sharded_state`` mean our loader, and route vLLM's save hook to our writer.

    Safe to call any number of times.
    """
    from .engine.plugin import install

    install()
