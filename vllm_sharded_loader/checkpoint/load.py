"""Loading one rank of a sharded checkpoint, without any engine: the checks, the plan, the read.

The vLLM layer (:mod:`..engine.loader`) and the tests call :func:`load_rank`; the checks live in
:mod:`..planning.topology`, :mod:`..planning.tensors` and :mod:`.rank_files`, resharding in :mod:`.reshard`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from ..format.errors import CheckpointNotFound
from ..format.names import MANIFEST_NAME
from ..planning.experts import check_expert_placement, rank_experts_moved
from ..planning.layout import check_served_geometry
from ..planning.tensors import check_tensor_sets
from ..planning.topology import RankInfo, check_source, check_topology
from ..storage.memory import check_materialized
from ..storage.reader import DEFAULT_READ, ReadOptions
from ..storage.tensor_files import read_files
from .legacy import load_without_manifest
from .rank_files import HeldAdoption, RankFiles, check_not_replaced, saved_specs
from .request import LoadRequest
from .reshard import load_resharded
from .state import tensor_specs
from .stats import LoadStats, check_verify_mode, whole_file_stats


def load_rank(
    request: LoadRequest,
    targets: Mapping[str, torch.Tensor],
    rank: RankInfo,
    options: ReadOptions = DEFAULT_READ,
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> LoadStats:
    """Check a rank's saved files against the model, then read them into ``targets``.

    Every check runs before the first byte is copied, so a refused checkpoint leaves the
    parameters untouched. A checkpoint saved at another TP/PP size or expert placement is
    resharded if its manifest records the geometry.

    Args:
        request: the checkpoint and what to check it against (:class:`.request.LoadRequest`); with
            ``verify="checksum"`` every byte read is hashed and a mismatch raises before returning.
        targets: each tensor name to the tensor it loads into (the model's :func:`.state.saveable_state`).
        rank: where this worker sits (topology, experts).
        options: how the reader runs (:class:`..storage.reader.ReadOptions`).
        adopt: tensor names to callbacks that take a tensor mapped privately from the files in place
            of copying into the target (CPU tensors of the saved dtype stored whole), each called
            only once every check passed, the reads' final one included.

    Returns:
        The load's :class:`.stats.LoadStats`.
    """
    started = time.perf_counter()
    store, manifest, verify = request.store, request.manifest, request.verify
    directory = store.where
    check_verify_mode(verify)
    check_materialized(targets, f"{directory} ({rank})")
    store.check_not_locked()
    if manifest is None:
        if not store.vllm_saves_here:
            raise CheckpointNotFound(
                f"{directory}: no {MANIFEST_NAME}. A checkpoint in object storage is served only with the manifest "
                "this package writes (or the save into it is incomplete): save it with vllm_sharded_loader."
            )
        return load_without_manifest(request, targets, rank, options, adopt, started)
    moved = rank_experts_moved(manifest, rank)
    resharding = moved or (manifest.tp_size, manifest.pp_size) != (rank.tp_size, rank.pp_size)
    if resharding and not manifest.geometry:
        # These raise: nothing to reshard with.
        check_topology(manifest, rank, directory)
        check_expert_placement(
            manifest.experts,
            rank.experts,
            serving_ep_rank=rank.ep_rank,
            tp_rank=rank.tp_rank,
            saved_tp_size=manifest.tp_size,
            where=directory,
        )
    # The checks: the model served and how it splits its tensors, ...
    if request.serving is not None:
        check_source(manifest, request.serving, directory)
    if request.geometry is not None:
        check_served_geometry(
            manifest.geometries,
            request.geometry,
            {name for entry in manifest.ranks for name in entry.tensors},
            resharding=resharding,
            tied=[*manifest.tied, *request.tied],
            where=directory,
        )
    if resharding:
        return load_resharded(request, targets, rank, options, adopt, started)
    # ... its tensors, then every file of this rank, each opened once.
    entry = manifest.rank(rank.tp_rank, rank.pp_rank)
    cast = check_tensor_sets(
        tensor_specs(targets),
        saved_specs(entry),
        f"{directory} ({rank})",
        hint="The checkpoint was saved from a different model; save it again.",
    )
    with RankFiles(store, entry, verify) as files:
        checksums = {c.file.path: c.entry.checksum for c in files.files} if verify == "checksum" else {}
        handles = [c.file for c in files.files]
        held = HeldAdoption(adopt)
        read = read_files(files.headers, targets, checksums, held.callbacks(), handles, options)
        check_not_replaced(store, manifest, files.check_unchanged)
        held.hand_over()
    return whole_file_stats([h.path for h in files.headers], len(targets), read, started, cast, with_manifest=True)
