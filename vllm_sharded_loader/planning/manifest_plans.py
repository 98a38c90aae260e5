"""Planning from a manifest: a serving rank's reads over its ranks, and the checks around them. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from ..format.errors import CheckpointMismatch
from ..format.geometry import OPAQUE
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..format.safetensors import dtype_size
from .pipeline import layer_index
from .reads import ReadPlan, SavedCheckpoint, SavedRank, SavedTensor, check_saved_shape, plan_reads
from .tensors import tied_source
from .topology import RankInfo


def check_saved_geometry(manifest: Manifest) -> None:
    """Raise unless every recorded geometry gives each saved rank's shape of its tensor."""
    for entry in manifest.ranks:
        for name, t in entry.tensors.items():
            g = manifest.geometries.get(name)
            if g is not None and g.kind != OPAQUE:
                saved_rank = entry.dp_rank * manifest.tp_size + entry.tp_rank
                check_saved_shape(
                    name,
                    g,
                    t.shape,
                    manifest.tp_size,
                    saved_rank,
                    entry.pp_rank,
                    manifest.experts,
                    manifest.expert_tp_size,
                )


def saved_ranks(manifest: Manifest, directory: str = "") -> list[SavedRank]:
    """The manifest's ranks as the planner sees them (a manifest without byte offsets is refused)."""
    ranks = []
    for entry in manifest.ranks:
        tensors = {}
        for name, t in entry.tensors.items():
            if t.offset is None:
                raise CheckpointMismatch(
                    f"{directory}: {MANIFEST_NAME} records no byte offset for {name!r}, so the checkpoint cannot "
                    f"be resharded; serve it at TP={manifest.tp_size} PP={manifest.pp_size} or save it again."
                )
            geometry = manifest.geometries.get(name)
            tensors[name] = SavedTensor(t.file, t.offset, dtype_size(t.dtype, name), tuple(t.shape), geometry, t.dtype)
        ranks.append(SavedRank(entry.tp_rank, entry.pp_rank, tensors, entry.dp_rank))
    return ranks


def plan_manifest_reads(
    manifest: Manifest,
    needed: Iterable[str],
    rank: RankInfo,
    *,
    tied: Iterable[Iterable[str]] = (),
    directory: str = "",
) -> ReadPlan:
    """:func:`plan_reads` over a manifest's ranks for serving ``rank``, the manifest's ties added to ``tied``."""
    saved = SavedCheckpoint(
        saved_ranks(manifest, directory), manifest.tp_size, manifest.experts, manifest.replicas, manifest.expert_tp_size
    )
    plan = plan_reads(saved, list(needed), rank, [*manifest.tied, *tied])
    check_manifest_ties(plan, tied)
    return plan


def check_manifest_ties(plan: ReadPlan, served_tied: Iterable[Iterable[str]]) -> None:
    """Raise if a tensor is planned from another tensor the serving rank also holds, through a tie
    the served model does not make (``served_tied``): one would get the other's weights."""
    served_as = tied_source(served_tied)
    for t in plan.tensors.values():
        if t.source_name != t.name and t.source_name in plan.tensors and served_as(t.name, {t.source_name}) is None:
            raise CheckpointMismatch(
                f"{t.name} is saved only as {t.source_name}, which {MANIFEST_NAME} ties to it, but the served "
                "model holds them as separate tensors: one would be loaded with the other's weights. The "
                "checkpoint was saved from a model that ties them (another config), or its manifest is damaged: "
                "save it again from the model being served."
            )


def files_to_check(plan: ReadPlan, manifest: Manifest) -> list[str]:
    """The saved files whose headers a resharding load checks, sorted: those its reads touch, or every
    file where a tensor is read under a tied name (proving the manifest left none of it out)."""
    if all(t.source_name == t.name for t in plan.tensors.values()):
        return plan.files
    return sorted(f.name for entry in manifest.ranks for f in entry.files)


def unexpected_tensors(
    manifest: Manifest, needed: Iterable[str], tied: Iterable[Iterable[str]] = (), pp_size: int = 1
) -> list[str]:
    """Saved tensors the serving model has no place for, sorted (with PP, only this stage's layers)."""
    wanted = set(needed)
    for group in [*manifest.tied, *tied]:
        if wanted.intersection(group):
            wanted.update(group)
    saved = {name for entry in manifest.ranks for name in entry.tensors}
    if pp_size == 1:
        return sorted(saved - wanted)
    layers = [i for i in map(layer_index, wanted) if i is not None]
    if not layers:
        return []
    lo, hi = min(layers), max(layers)
    return sorted(n for n in saved - wanted if (i := layer_index(n)) is not None and lo <= i <= hi)
