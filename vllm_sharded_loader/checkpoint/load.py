"""Loading one rank of a sharded checkpoint, without any engine: the checks, the plan, the read.

The vLLM layer (:mod:`..engine.loader`) finds out which rank it is and which tensors the
model has, then calls :func:`load_rank`. Tests call it directly on real files and real
tensors. Each step is a named piece beside this module:

- checks: the store's lock (no save running), :mod:`..planning.topology` (topology and
  source model), :mod:`..planning.tensors` (exactly the model's tensors), :mod:`.rank_files`
  (every file of the rank against the manifest);
- plan: :func:`..storage.tensor_files.file_plans` (each tensor's bytes, from its file's
  header), or :mod:`.reshard` at another topology;
- read: the one lowering of every route's plans, :func:`..storage.lowering.read_plans`,
  then :func:`..storage.reader.read_pieces`.
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

    ``request`` names the checkpoint and what to check it against (:class:`.request.LoadRequest`);
    ``targets`` maps each tensor name to the tensor it loads into (the model's
    :func:`.state.saveable_state`); ``rank`` is where this worker sits (topology, experts).
    Every check runs before the first byte is copied, so a refused checkpoint leaves the
    parameters untouched. With ``verify="checksum"`` every byte read is also hashed and
    compared with the manifest; a mismatch raises before the load returns (the engine
    then does not start).

    A checkpoint saved at another TP/PP size, or with its routed experts placed otherwise
    than ``rank.experts`` places them (another EP size or strategy, or expert parallelism
    on one side only), is resharded (:func:`.reshard.load_resharded`) if its manifest
    records the geometry. ``options`` run the reader (:class:`..storage.reader.ReadOptions`).
    ``adopt`` maps tensor names to callbacks that take a tensor over private mappings of
    the files in place of the target: every route maps the CPU tensors of the saved dtype
    whose saved pieces are whole runs of their files (see :func:`..storage.lowering.read_plans`),
    each called only once every check passed, the last one after the reads included.
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
        # Raise: nothing to reshard with.
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
        # The plan and the read: each tensor's bytes where its file's header places them.
        checksums = {c.file.path: c.entry.checksum for c in files.files} if verify == "checksum" else {}
        handles = [c.file for c in files.files]
        held = HeldAdoption(adopt)
        read = read_files(files.headers, targets, checksums, held.callbacks(), handles, options)
        check_not_replaced(store, manifest, files.check_unchanged)
        held.hand_over()
    return whole_file_stats([h.path for h in files.headers], len(targets), read, started, cast, with_manifest=True)
