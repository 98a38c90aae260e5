"""Planning from a manifest: its ranks as the planner sees them, a serving rank's reads over
them, and the checks around those reads (recorded geometry, headers to check, tensors the
serving model has no place for). Pure: no torch, no vLLM, no I/O.
"""

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
    """Raise unless every recorded geometry gives each saved rank's shape of its tensor.

    A resharding load checks this for the tensors it plans; ``verify`` for all of them.
    """
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
    """The manifest's ranks as the planner sees them: each tensor's file, offset, size and geometry.

    A manifest without byte offsets cannot be planned from (vLLM's own save records none).
    """
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
    """:func:`plan_reads` over a manifest's ranks for serving ``rank`` (its topology and expert placement).

    The manifest's tied names are added to ``tied``; the saved expert placement is the manifest's.
    A tie only the manifest records never fills a tensor from another that ``rank`` also needs
    (:func:`check_manifest_ties`).
    """
    saved = SavedCheckpoint(
        saved_ranks(manifest, directory), manifest.tp_size, manifest.experts, manifest.replicas, manifest.expert_tp_size
    )
    plan = plan_reads(saved, list(needed), rank, [*manifest.tied, *tied])
    check_manifest_ties(plan, tied)
    return plan


def check_manifest_ties(plan: ReadPlan, served_tied: Iterable[Iterable[str]]) -> None:
    """Raise if a tensor is planned from another tensor the serving rank also holds, through a tie
    the served model does not make (``served_tied``).

    The manifest's ties are needed where the served model cannot see its own (a pipeline stage
    holding the embedding but not the LM head saved for it). But one saved tensor read into two
    tensors the served model holds apart gives one of them the other's weights: a manifest tie
    the model does not make, from a model that tied them or a damaged manifest. At the saved
    topology that load is refused as a missing tensor; resharded, it must be too.
    """
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
    """The saved files whose headers a resharding load checks before reading: sorted names.

    The files its reads touch; and every file of the checkpoint when a tensor is read
    under a tied name. A header lists exactly its file's tensors, so checking all of
    them proves no saved tensor of the served name was left out of the manifest, where
    the tie would stand in for it with another tensor's bytes.
    """
    if all(t.source_name == t.name for t in plan.tensors.values()):
        return plan.files
    return sorted(f.name for entry in manifest.ranks for f in entry.files)


def unexpected_tensors(
    manifest: Manifest, needed: Iterable[str], tied: Iterable[Iterable[str]] = (), pp_size: int = 1
) -> list[str]:
    """Saved tensors the serving model has no place for: a sign it is another model. Sorted.

    A serving rank knows only its own tensors (``needed``) and the groups it ties. With
    one pipeline stage it holds the whole model, so every saved name must be needed or
    tied to a needed one. With several, only the decoder layers within the stage's range
    are its to judge.
    """
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
