"""Checkpoint tools that need no engine: inspect, and reshard to another TP/PP size on disk, one
tensor at a time through the load's plans and the save protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..checkpoint.carry import carried_problems, stale_problems
from ..checkpoint.rank_files import check_not_replaced
from ..checkpoint.reshard import ReshardSource
from ..checkpoint.save import DEFAULT_MAX_SIZE, SaveOptions, save_checkpoint
from ..checkpoint.trust import check_trust
from ..format.errors import CheckpointCorrupt, CheckpointNotFound, InvalidOption
from ..format.geometry import OPAQUE
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..planning.manifest_plans import files_to_check
from ..planning.pipeline import stage_names
from ..planning.reads import TensorPlan
from ..planning.topology import RankInfo
from ..storage.location import Store, no_manifest_here, open_store, require_store
from ..storage.progress import ByteProgress
from ..storage.writer import LazyTensor


def require_manifest(store: Store) -> Manifest:
    """``store``'s manifest; without one, the error says whether a save holds it."""
    manifest = store.read_manifest()
    if manifest is None:
        # A first save still writing (or killed) is named as such, not as "not a checkpoint".
        store.check_not_locked()
        raise CheckpointNotFound(no_manifest_here(store))
    return manifest


def inspect_checkpoint(store: Store) -> dict[str, Any]:
    """What the checkpoint in ``store`` holds, as JSON data.

    Returns:
        A dict of its topology, files, dtype, tensors, source model, resharding geometry, lock,
        and signature with whether it is trusted here.
    """
    require_store(store, "inspect_checkpoint")
    manifest = require_manifest(store)
    kinds: dict[str, int] = {}
    for g in manifest.geometry.values():
        kind = g.get("kind", "?") if isinstance(g, dict) else "?"
        kinds[kind] = kinds.get(kind, 0) + 1
    names = {n for r in manifest.ranks for n in r.tensors}
    return {
        "directory": store.canonical(),
        "format_version": manifest.format_version,
        "tp_size": manifest.tp_size,
        "pp_size": manifest.pp_size,
        "dp_size": manifest.dp_size,
        "replicas": manifest.replicas,
        "experts": (
            manifest.experts.describe()
            if manifest.experts is not None
            else f"cut across TP x DP ({manifest.expert_tp_size} ranks)"
            if manifest.experts_over_dp
            else None
        ),
        "dtype": manifest.dtype,
        "pattern": manifest.pattern,
        "source": {"architecture": manifest.source.architecture, "config_sha256": manifest.source.config_sha256},
        "bytes": manifest.nbytes,
        "tensors": len(names),
        "tensor_entries": sum(len(r.tensors) for r in manifest.ranks),
        "ranks": [
            {
                "pp_rank": r.pp_rank,
                "tp_rank": r.tp_rank,
                "dp_rank": r.dp_rank,
                "tensors": len(r.tensors),
                "files": [{"name": f.name, "size": f.size, "checksum": f.checksum is not None} for f in r.files],
                "startup_artifacts": None if r.startup is None else r.startup.to_dict(),
            }
            for r in manifest.ranks
        ],
        "checksums": all(f.checksum is not None for r in manifest.ranks for f in r.files),
        "geometry": {
            "tensors": len(manifest.geometry),
            "kinds": dict(sorted(kinds.items())),
            "reshardable": bool(manifest.geometry) and kinds.get(OPAQUE, 0) == 0 and names <= set(manifest.geometry),
        },
        "tied": [list(g) for g in manifest.tied],
        "locked": store.is_locked(),
        "signature": None if manifest.signature is None else manifest.signature.to_dict(),
        "trust": dataclasses.asdict(check_trust(manifest)),
    }


def open_output(where: str | Store, source: Store, what: str, folder: str = "folder") -> Store:
    """The output's store, resolved once; refused, before anything is written, where it is the source
    (under any name) or lies inside it."""
    output = open_store(where)
    if output.same_as(source):
        raise InvalidOption(f"--output must be another {folder} than the source {what}.")
    if output.inside(source):
        raise InvalidOption(
            f"--output {output.where} lies inside the source {what} {source.where}; nothing was written. Choose a "
            "folder outside the source."
        )
    return output


def reshard_checkpoint(
    source: Store,
    output: str | Store,
    tp_size: int,
    pp_size: int | None = None,
    *,
    max_size: int | None = DEFAULT_MAX_SIZE,
    overwrite: bool = False,
    progress: ByteProgress | None = None,
) -> Manifest:
    """Write ``source``'s checkpoint resharded to ``tp_size`` x ``pp_size`` into ``output``.

    The output loads at the new topology without resharding at load time. Every byte read is
    checked against the source's checksums; non-weight files (config, tokenizer) are copied under
    the save's lock, and the manifest is written last.

    Args:
        source: the source checkpoint's store.
        output: where to write (a folder, URL or store), not inside the source.
        tp_size: the new tensor-parallel size.
        pp_size: the new pipeline-parallel size (default: as saved).
        max_size: bytes per part file.
        overwrite: replace a checkpoint already in ``output``.
        progress: counts the bytes written.

    Returns:
        The published manifest.
    """
    require_store(source, "reshard_checkpoint")
    manifest = require_manifest(source)
    source.check_not_locked()
    pp_size = manifest.pp_size if pp_size is None else pp_size
    if tp_size < 1 or pp_size < 1:
        raise InvalidOption(f"Sizes must be >= 1, got TP={tp_size} PP={pp_size}.")
    out = open_output(output, source, "checkpoint", "directory")
    _refuse_damaged_carried_files(source, manifest)
    # The output's checksums must not certify a corrupt source: read every byte checked.
    verify = "checksum" if any(f.checksum is not None for r in manifest.ranks for f in r.files) else "size"
    with ReshardSource(source, manifest, verify) as reads:
        # Plan every rank before writing anything: a refused tensor leaves no output behind.
        plans = {}
        for pp_rank in range(pp_size):
            names = stage_names(manifest, pp_size, pp_rank, source.file_path(MANIFEST_NAME))
            for tp_rank in range(tp_size):
                rank = RankInfo(tp_rank, tp_size, pp_rank, pp_size)
                plans[rank] = reads.plan(names, rank)
        # Every file the plans touch, checked before a tensor is allocated or a byte is written.
        for name in sorted({f for plan in plans.values() for f in files_to_check(plan, manifest)}):
            reads.check_file(name)
        check_not_replaced(source, manifest, reads.check_unchanged)

        def lazy(tensor_plan: TensorPlan) -> LazyTensor:
            dtype = reads.stored_dtype(tensor_plan)

            def produce() -> torch.Tensor:
                tensor = torch.empty(tensor_plan.shape, dtype=dtype)
                reads.fill(tensor_plan, tensor)
                return tensor

            return LazyTensor(tuple(tensor_plan.shape), dtype, produce)

        ranks = {rank: {n: lazy(p) for n, p in plan.tensors.items()} for rank, plan in plans.items()}
        options = SaveOptions(
            max_size=max_size,
            overwrite=overwrite,
            geometry=manifest.geometry,
            tied=manifest.tied,
            carry=source,
            carried_record=manifest.carried_files,  # a save into the source since is refused
            progress=progress,
        )
        return save_checkpoint(out, ranks, dtype=manifest.dtype, source=manifest.source, options=options)


def _refuse_damaged_carried_files(store: Store, manifest: Manifest) -> None:
    """Refuse a source whose carried files are not as recorded: the output's record would certify the damage."""
    directory = store.where
    problems = carried_problems(store, manifest.carried_files or {}) + stale_problems(store, manifest)
    # Unrecorded files are copied too, but never through a link out of the checkpoint (a secret, say).
    outside = store.links_out(store.non_weight_files())
    if outside and not problems:
        raise CheckpointCorrupt(
            f"Not resharding {directory}: {len(outside)} of the files beside its parts link out of it (named below), "
            "and a reshard copies only the checkpoint's own files; nothing was written. Copy the real files into the "
            f"checkpoint, or remove the links, and reshard again. {' '.join(map(str, outside))}"
        )
    if problems:
        found = " ".join(problems)
        raise CheckpointCorrupt(
            f"Not resharding {directory}: files it carries are not what its save recorded ({len(problems)}: named "
            "below), and the output would carry them and record them as sound; nothing was written. Put them right "
            f"and reshard again. {found}"
        )
