"""The one error type of the package, and how its messages list things."""

from __future__ import annotations

from collections.abc import Sequence


class ShardedStateError(ValueError):
    """A sharded checkpoint cannot be saved or loaded as asked.

    The message names the file or tensor, what was expected, what was found, and
    what to do. A ``ValueError`` so that vLLM reports it like its own loader errors.
    """


def listing(items: Sequence[str], limit: int = 10, sep: str = ", ") -> str:
    """The first ``limit`` of ``items`` for a message, and how many there are in all.

    >>> listing(["a", "b", "c"], limit=2)
    'a, b, ... (3 in all)'
    """
    shown = sep.join(items[:limit])
    return shown + (f"{sep}... ({len(items)} in all)" if len(items) > limit else "")
