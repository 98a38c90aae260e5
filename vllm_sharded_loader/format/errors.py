"""The one error type of the package."""

from __future__ import annotations


class ShardedStateError(ValueError):
    """A sharded checkpoint cannot be saved or loaded as asked.

    The message names the file or tensor, what was expected, what was found, and
    what to do. A ``ValueError`` so that vLLM reports it like its own loader errors.
    """
