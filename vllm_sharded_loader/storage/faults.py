"""Kill points: named steps of the save protocol where a test kills the saving process.

A save must be survivable wherever it dies: the previous checkpoint still loads, or the
new one is complete, and nothing else changed. The fault tests prove that for every step
by running a real save with ``SHARDED_STATE_KILL_AT=<step>`` (or ``<step>:<n>`` for the
n-th time the step is reached, counting from 1; ``<step>[:<n>]@<rank>`` only in the worker of
that ``torch.distributed`` rank): the process sends itself ``SIGKILL`` there,
so no ``finally`` block, ``atexit`` handler or lock release of ours runs, as when the
machine loses power or the OOM killer strikes. Without the variable a kill point costs one
dictionary look-up.

Every step is declared in :data:`KILL_POINTS`, so that a test can parametrize over all of
them and a misspelt step fails loudly instead of never firing.
"""

from __future__ import annotations

import os
import signal

from ..format.errors import InvalidOption

KILL_ENV = "SHARDED_STATE_KILL_AT"
# The signal sent there: KILL by default; INT is an operator's Ctrl-C, which Python raises as
# KeyboardInterrupt at that point, so every ``except``/``finally`` of the save runs.
KILL_SIGNAL_ENV = "SHARDED_STATE_KILL_SIGNAL"

# step -> where it is, for the tests' ids and failure messages. Each save protocol adds its own.
KILL_POINTS: dict[str, str] = {}

_reached: dict[str, int] = {}


def declare(step: str, where: str) -> str:
    """Declare a kill point (at import of the module that reaches it); returns ``step``."""
    KILL_POINTS[step] = where
    return step


def _distributed_rank() -> int | None:
    import torch.distributed

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else None


def kill_point(step: str) -> None:
    """Die by ``SIGKILL`` (or ``$SHARDED_STATE_KILL_SIGNAL``) here when ``$SHARDED_STATE_KILL_AT``
    names this step (and count)."""
    if step not in KILL_POINTS:
        raise InvalidOption(f"kill point {step!r} is not declared in vllm_sharded_loader.storage.faults.")
    wanted = os.environ.get(KILL_ENV)
    if not wanted:
        return
    wanted, _, rank = wanted.partition("@")
    name, _, nth = wanted.partition(":")
    if name != step or (rank and str(_distributed_rank()) != rank):
        return
    _reached[step] = _reached.get(step, 0) + 1
    if _reached[step] == (int(nth) if nth else 1):
        os.kill(os.getpid(), signal.Signals[f"SIG{os.environ.get(KILL_SIGNAL_ENV) or 'KILL'}"])


# Where a test kills a save of either store once it placed one carried file, before the manifest.
KILL_CARRIED = declare("local.carried", "storage: one non-weight file placed, the manifest not yet")
