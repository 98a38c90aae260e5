"""The package's vLLM uses (:mod:`.vllm_uses`) checked against one version's source (:mod:`.vllm_source`):
what ``tests/test_vllm_versions.py`` runs for each supported version, and ``scripts/vllm_surface.py``
records a surface file from.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tests.support.vllm_resolve import Broken, Resolver, check_override, shown
from tests.support.vllm_source import Source
from tests.support.vllm_uses import Chain, Use, uses

SURFACES = Path(__file__).resolve().parents[1] / "vllm_surfaces"

# Methods of ours that vLLM calls by name on a loader, though no base class of ours declares them:
# each is checked against the method of vLLM's that it stands for.
LOADERS = "vllm.model_executor.model_loader"
CALLED_BY_NAME = {
    # vLLM's worker save hook calls ShardedStateLoader.save_model, the class the plugin replaces.
    "ShardedStateLoader.save_model": f"{LOADERS}.sharded_state_loader.ShardedStateLoader.save_model",
    # reload_weights asks the loader for get_all_weights (hasattr), as the default loader has it.
    "ShardedStateLoader.get_all_weights": f"{LOADERS}.default_loader.DefaultModelLoader.get_all_weights",
}


def _counterpart(use: Use) -> Chain | None:
    """The vLLM method an override of ours that no base class declares stands for (:data:`CALLED_BY_NAME`)."""
    if use.override is None or use.owner is None:
        return None
    target = CALLED_BY_NAME.get(use.owner)
    return tuple(target.split(".")) if target else None


def check_use(resolver: Resolver, use: Use) -> None:
    """Raise :class:`Broken` if ``use`` does not hold in the resolver's version."""
    for guard, chain in use.alternatives:
        if guard is not None:
            try:
                resolver.chain(guard)
            except Broken:
                continue  # Python takes the next alternative here
        if use.override is None:
            resolver.chain(chain)
            return
        try:
            base = resolver.chain(chain)
        except Broken:
            counterpart = _counterpart(use)
            if counterpart is None:
                raise
            base = resolver.chain(counterpart)
        check_override(base, use.override, f"{use.owner} ({use.where})")
        return
    raise Broken(f"none of {use.shown()} imports")


def problems(source: Source, found: list[Use] | None = None) -> list[str]:
    """Every use of the package that does not hold in ``source``'s version, with where and why."""
    resolver = Resolver(source)
    broken = []
    for use in sorted(found if found is not None else uses(), key=lambda u: (u.where, u.shown())):
        try:
            check_use(resolver, use)
        except Broken as e:
            broken.append(f"{use.where}: {use.shown()}: {e}")
    return broken


def record(source: Source) -> None:
    """Resolve every chain of every use, each alternative and counterpart too, so that a recording
    source holds the answers a surface file needs whichever way a check goes."""
    resolver = Resolver(source)
    for use in uses():
        chains = [c for g, c in use.alternatives] + [g for g, _ in use.alternatives if g is not None]
        counterpart = _counterpart(use)
        for chain in [*chains, *([counterpart] if counterpart else [])]:
            with contextlib.suppress(Broken):
                resolver.chain(chain)
        with contextlib.suppress(Broken):
            check_use(resolver, use)


def surface_path(distribution: str, version: str) -> Path:
    """Where the surface file of one distribution and version lives."""
    return SURFACES / f"{distribution}-{version}.json"


__all__ = ["CALLED_BY_NAME", "check_use", "problems", "record", "shown", "surface_path"]
