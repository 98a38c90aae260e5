"""The test tiers, and the check that a test starts only what its tier allows.

``unit``: no engine, no server. ``servers``: starts S3/Azure/GCS emulators, no engine.
``engine``: starts vLLM (and may start servers). ``tests/conftest.py`` gives every test exactly
one of them and tells this module which one the running test has; the functions that start an
engine (:mod:`tests.support.engines`) and the emulators' ``start`` call :func:`require`, so a
test in the wrong tier fails at once instead of slowing down, or hanging, the fast tier.
"""

from __future__ import annotations

import pytest

UNIT, SERVERS, ENGINE = "unit", "servers", "engine"
TIERS = (UNIT, SERVERS, ENGINE)

_running: str | None = None  # the running test's tier; None outside pytest (a benchmark, a script)


def enter(tier: str | None) -> None:
    """The test about to run (its setup, call and teardown) is of ``tier``."""
    global _running
    _running = tier


def require(tier: str, what: str) -> None:
    """Fail the running test if its tier does not allow ``what`` (which needs ``tier``)."""
    allowed = {UNIT: (UNIT, SERVERS, ENGINE), SERVERS: (SERVERS, ENGINE), ENGINE: (ENGINE,)}[tier]
    if _running is not None and _running not in allowed:
        pytest.fail(
            f"this test starts {what} but is in the {_running!r} tier: mark it @pytest.mark.{tier}, or add its "
            f"module to ENGINE_MODULES / its fixture to SERVER_FIXTURES in tests/conftest.py",
            pytrace=False,
        )
