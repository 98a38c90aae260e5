"""The exchange between an engine's workers: steps they run together and fail together."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from ..format.errors import CheckpointMismatch, ShardedStateError, WorkerLost, agreed_error
from ..format.manifest import Manifest
from ..planning.topology import RankInfo

# How long a save under data + expert parallelism waits for every replica to call it.
REPLICA_TIMEOUT_ENV = "SHARDED_STATE_REPLICA_TIMEOUT"
DEFAULT_REPLICA_TIMEOUT = 600.0

# How long a load's workers wait for each other at the check that they hold one checkpoint.
LOAD_TIMEOUT_ENV = "SHARDED_STATE_LOAD_TIMEOUT"
DEFAULT_LOAD_TIMEOUT = 600.0

T = TypeVar("T")

# The other workers of this engine's model groups, member -> node, as the load's first exchange
# (check_same_checkpoint) told them: gloo's error names only an address and port, and on several
# nodes the user must know which worker on which machine to look at.
_PEERS: dict[str, str] = {}


def gather_over(groups: list[Any], outcomes: list[Any], what: str) -> list[Any]:
    """Every worker's ``outcomes`` (picklable), gathered over vLLM's ``groups`` (their CPU groups) in turn.

    A worker that died resets its connections: the exchange fails at once (gloo), raised
    here as our error naming ``what`` stopped, so that the caller's cleanup runs.
    """
    for group in groups:
        gathered: list[Any] = [None] * group.world_size
        try:
            torch.distributed.all_gather_object(gathered, outcomes, group=group.cpu_group)
        except RuntimeError as e:
            peers = "; ".join(f"{member} on {host}" for member, host in _PEERS.items()) or "its node"
            raise WorkerLost(
                f"another worker of {what} stopped answering (did it die? see the log of {peers}): {e}"
            ) from e
        outcomes = [o for part in gathered for o in part]
    return outcomes


def model_groups(rank: RankInfo) -> list[Any]:
    """The groups of workers that hold one model between them, those of more than one worker:
    this replica's TP group, then its PP group, then the data-parallel group where each replica
    holds its own experts (:attr:`RankInfo.replicas`).

    Replicas that hold their own experts serve one model between them (a token's experts may
    be on another replica): a load or an update must be the same on all of them, or the
    experts of one checkpoint would serve beside the rest of another. Never the data-parallel
    group otherwise: replicas of the whole model are independent, and need not even be started
    with this load format.
    """
    from vllm.distributed import get_pp_group, get_tp_group
    from vllm.distributed.parallel_state import get_dp_group

    groups = [get_tp_group(), get_pp_group()] + ([get_dp_group()] if rank.replicas > 1 else [])
    return [g for g in groups if g.world_size > 1]


def wait_for_replicas(rank: RankInfo, call: str, doing: str, changed: str) -> None:
    """Where each data-parallel replica holds its own experts: wait, at most
    ``SHARDED_STATE_REPLICA_TIMEOUT`` seconds, until every replica has called ``call``, and
    raise naming that wait if one did not (``doing``: what is refused; ``changed``: what was not).

    Each replica's engine is called on its own (an offline replica's process, or vLLM's
    server for each engine core): the replicas' exchanges over the data-parallel group
    would wait for a replica that was never called until gloo's timeout (30 minutes).
    """
    if rank.replicas == 1:
        return
    from vllm.distributed.parallel_state import get_dp_group

    seconds = float(os.environ.get(REPLICA_TIMEOUT_ENV) or DEFAULT_REPLICA_TIMEOUT)
    try:
        # Gloo's monitored barrier: every rank that arrived raises once the timeout passes.
        torch.distributed.monitored_barrier(
            group=get_dp_group().cpu_group, timeout=timedelta(seconds=seconds), wait_all_ranks=True
        )
    except RuntimeError as e:
        raise WorkerLost(
            f"Refusing to {doing}: each of the {rank.dp_size} data-parallel replicas holds its own experts "
            f"(placed on it, or cut across TP x DP), and not all of them called {call} within {seconds:g} s "
            f"({REPLICA_TIMEOUT_ENV}; {e}). Call it on every replica: in each data-parallel process of an "
            f"offline engine (vLLM's serve reaches them all through collective_rpc). {changed}"
        ) from e


def raises_for_all() -> bool:
    """Whether this worker is the one that raises an agreed failure for all: the last of the engine's workers.

    vLLM 0.32's multiprocessing executor reads the workers' answers in rank order and stops
    at the first failure: the answers of the workers after it stay queued and are taken
    for the answers to the next call (a second save, or ``/pause``, then fails with this
    call's error). Failing on the last worker alone keeps every answer read.
    """
    from vllm.distributed import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return tp.rank_in_group == tp.world_size - 1 and pp.rank_in_group == pp.world_size - 1


class Workers:
    """Steps that every worker of one save runs together, failing together.

    The exchange spans this replica's tensor- and pipeline-parallel workers (its TP group,
    then its PP group), and the data-parallel replicas only when each writes its own
    experts. Never vLLM's world group otherwise: with data parallelism it also spans
    replicas that may never reach the save, and they would hang it. When the replicas
    take part, :meth:`wait_for_replicas` bounds the wait for them.
    """

    def __init__(self, rank: RankInfo) -> None:
        self.rank = rank
        self.groups = model_groups(rank)
        self.first = rank.tp_rank == 0 and rank.pp_rank == 0 and rank.dp_rank == 0
        self.member = str(rank)

    def wait_for_replicas(self) -> None:
        """Wait until every data-parallel replica has called the save, where each writes its own
        experts (:func:`wait_for_replicas`)."""
        wait_for_replicas(self.rank, "save_sharded_state", "save", "Nothing was written.")

    def run(self, step: Callable[[], T], only_first: bool = False) -> list[T]:
        """Run ``step`` here (or only on the first worker), exchange results, raise if any failed: the
        save protocol's group (:class:`..checkpoint.protocol.SaveGroup`).

        Every worker reaches the exchange even when its step fails, or the others would hang.
        A failure anywhere is raised on every worker, ``agreed``, with every failing worker's
        message; a worker that stops answering is :class:`WorkerLost`.
        """
        own: Exception | None = None
        try:
            outcome: tuple[bool, Any] = (True, step() if self.first or not only_first else None)
        except Exception as e:
            # The node too: on several nodes a path names another folder on each.
            own, outcome = e, (False, f"{self.rank} on {socket.gethostname()}: {e}")
        try:
            outcomes = gather_over(self.groups, [outcome], "this save")
        except WorkerLost as e:
            # This worker's own cleanup (the lock, what it staged) runs on this error.
            raise WorkerLost(f"{e}" + ("" if outcome[0] else f" | {outcome[1]}")) from e
        errors = [value for ok, value in outcomes if not ok]
        if errors:
            raise agreed_error(ShardedStateError, " | ".join(errors), own)
        return [value for _, value in outcomes]


def checkpoint_digest(manifest: Manifest | None) -> str:
    """What tells two workers' checkpoints apart: the digest of the manifest each read."""
    return "no manifest" if manifest is None else hashlib.sha256(manifest.to_json().encode()).hexdigest()[:16]


def different_checkpoints(
    where: str, held: list[tuple[str, str, str, str]], then: str = "start again. Nothing was loaded"
) -> str | None:
    """The error for workers that read different checkpoints at ``where`` (``held``: each worker's
    rank, node, path and :func:`checkpoint_digest`), or None where they read one; ``then``: what to do."""
    if len({digest for *_, digest in held}) < 2:
        return None
    said = "; ".join(f"{member} on {host} read {path} (manifest {digest})" for member, host, path, digest in held)
    return (
        f"The workers of this engine hold different checkpoints at {where}: {said}. Each node reads its "
        "own copy, and a mix of two saves would be served as one model. Give every node the same save "
        f"(its manifest and config files, and the parts its ranks read), or serve from object storage, then {then}."
    )


def check_same_checkpoint(rank: RankInfo, where: str, manifest: Manifest | None, failed: Exception | None) -> None:
    """Before a load reads a byte: check that the workers holding this model (:func:`model_groups`:
    this replica's TP and PP workers, and the replicas where each holds its own experts) read one
    checkpoint, by the digest of the manifest each read (``failed``: why it read none).

    On several nodes each worker reads its node's copy of ``where``. Each rank's files agree with
    the manifest beside them, so a node holding another save of the same model (or another model of
    the same shapes) passes every check of its own rank, and the engine would serve a mix of the
    two. Every worker reaches the exchange, even one whose manifest could not be read, so that
    none waits for it; a worker that never reaches it (a node started with another load format)
    ends the wait after ``SHARDED_STATE_LOAD_TIMEOUT`` seconds.
    """
    groups = model_groups(rank)
    if not groups:
        return
    seconds = float(os.environ.get(LOAD_TIMEOUT_ENV) or DEFAULT_LOAD_TIMEOUT)
    try:
        for group in groups:
            torch.distributed.monitored_barrier(group=group.cpu_group, timeout=timedelta(seconds=seconds))
    except RuntimeError as e:
        raise WorkerLost(
            f"{rank} on {socket.gethostname()}: another worker of this engine did not reach the sharded_state "
            f"load of {where} (waited at most {seconds:g} s, {LOAD_TIMEOUT_ENV}), or stopped answering: {e}. "
            "See the other nodes' logs; every node must run the same model with --load-format sharded_state. "
            "Nothing was loaded."
        ) from e
    own = (str(rank), socket.gethostname(), where, None if failed else checkpoint_digest(manifest), str(failed))
    workers = gather_over(groups, [own], "this load")
    _PEERS.clear()
    _PEERS.update({member: host for member, host, *_ in workers if member != str(rank)})
    if failed is not None:
        return  # the caller raises its own error
    _raise_others_failures([(member, host, error) for member, host, _, digest, error in workers if digest is None])
    if (mismatch := different_checkpoints(where, [w[:4] for w in workers])) is not None:
        raise CheckpointMismatch(mismatch)


def share_load_outcome(rank: RankInfo, failed: Exception | None) -> None:
    """After this worker's reads: tell the others whether they failed, and hear theirs.

    A worker whose load fails ends its process; without this, the others learn of it only from
    vLLM's next collective, as gloo's "Connection closed by peer", and the leader, whose log the
    user reads, never says which file on which node failed. Here every worker raises the failing
    workers' own messages (the failing one its own error, from the caller).
    """
    groups = model_groups(rank)
    if not groups:
        return
    own = (str(rank), socket.gethostname(), None if failed is None else str(failed))
    workers = gather_over(groups, [own], "this load")
    if failed is None:
        _raise_others_failures([(member, host, error) for member, host, error in workers if error is not None])


def _raise_others_failures(failures: list[tuple[str, str, str]]) -> None:
    if failures:
        said = " | ".join(f"{member} on {host}: {error}" for member, host, error in failures)
        raise agreed_error(ShardedStateError, f"Another worker's load failed, so this engine cannot start: {said}")
