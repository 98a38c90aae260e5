"""Kill points: named steps of the save protocol where a test kills the saving process.

``SHARDED_STATE_KILL_AT=<step>[:<n>][@<rank>]`` makes the process send itself ``SIGKILL`` the n-th
time it reaches the step (in that ``torch.distributed`` rank), so none of our clean-up runs.
Every step is declared in :data:`KILL_POINTS`: tests cover them all, and a misspelt one fails.
"""

from __future__ import annotations

import os
import signal

from ..format.errors import InvalidOption

KILL_ENV = "SHARDED_STATE_KILL_AT"
# The signal sent there: KILL by default; INT is a Ctrl-C, so the save's ``finally`` blocks run.
KILL_SIGNAL_ENV = "SHARDED_STATE_KILL_SIGNAL"

KILL_POINTS: dict[str, str] = {}  # step -> where it is, for the tests' ids and messages

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
