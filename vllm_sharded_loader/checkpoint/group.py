"""The members holding one model (an engine's workers) agreeing on each step over an :class:`Exchange`
(:class:`ProcessGroups`, or threads in the tests): every member reaches every exchange, and a failure
anywhere is raised everywhere."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch

from ..format.errors import CheckpointMismatch, ShardedStateError, WorkerLost, agreed_error
from ..format.manifest import Manifest
from ..planning.topology import RankInfo

# How long a save or an update under data + expert parallelism waits for every replica to call it.
REPLICA_TIMEOUT_ENV = "SHARDED_STATE_REPLICA_TIMEOUT"
DEFAULT_REPLICA_TIMEOUT = 600.0

# How long a load's workers wait for each other at the check that they hold one checkpoint.
LOAD_TIMEOUT_ENV = "SHARDED_STATE_LOAD_TIMEOUT"
DEFAULT_LOAD_TIMEOUT = 600.0

T = TypeVar("T")

# The other members of this process's model, member -> node, as the load's first exchange
# (check_same_checkpoint) told them: gloo's error names only an address and port, and on several
# nodes the user must know which worker on which machine to look at.
_PEERS: dict[str, str] = {}


class Exchange(Protocol):
    """How the members of one model reach each other: ``alone`` (no other member); ``gather``, every
    member's ``outcome`` in member order (:class:`WorkerLost`, naming ``what``, if one stopped
    answering); ``barrier``, a ``RuntimeError`` unless every member arrives within ``seconds``."""

    @property
    def alone(self) -> bool: ...

    def gather(self, outcome: Any, what: str) -> list[Any]: ...

    def barrier(self, seconds: float, wait_all: bool = False) -> None: ...


class ProcessGroups:
    """The exchange over torch.distributed's (gloo) groups of more than one process, in turn."""

    def __init__(self, groups: Sequence[Any]) -> None:
        self.groups = list(groups)

    @property
    def alone(self) -> bool:
        return not self.groups

    def gather(self, outcome: Any, what: str) -> list[Any]:
        # A worker that died resets its connections: the exchange fails at once (gloo), raised
        # here as our error naming what stopped, so that the caller's cleanup runs.
        outcomes = [outcome]
        for group in self.groups:
            gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
            try:
                torch.distributed.all_gather_object(gathered, outcomes, group=group)
            except RuntimeError as e:
                peers = "; ".join(f"{member} on {host}" for member, host in _PEERS.items()) or "its node"
                raise WorkerLost(
                    f"another worker of {what} stopped answering (did it die? see the log of {peers}): {e}"
                ) from e
            outcomes = [o for part in gathered for o in part]
        return outcomes

    def barrier(self, seconds: float, wait_all: bool = False) -> None:
        # Gloo's monitored barrier: every rank that arrived raises once the timeout passes.
        for group in self.groups:
            torch.distributed.monitored_barrier(
                group=group, timeout=timedelta(seconds=seconds), wait_all_ranks=wait_all
            )


class Members:
    """The save protocol's group (:class:`.protocol.SaveGroup`) over ``exchange``: steps that every
    member of one save runs together, failing together; the first member is rank 0."""

    def __init__(self, exchange: Exchange, rank: RankInfo) -> None:
        self.exchange = exchange
        self.first = rank.tp_rank == 0 and rank.pp_rank == 0 and rank.dp_rank == 0
        self.member = str(rank)

    def run(self, step: Callable[[], T], only_first: bool = False) -> list[T]:
        """Run ``step`` here (or only on the first member), exchange results, raise if any failed.

        Every member reaches the exchange even when its step fails, or the others would hang.
        A failure anywhere is raised on every member, ``agreed``, with every failing member's
        message; a member that stops answering is :class:`WorkerLost`.
        """
        own: Exception | None = None
        try:
            outcome: tuple[bool, Any] = (True, step() if self.first or not only_first else None)
        except Exception as e:
            # The node too: on several nodes a path names another folder on each.
            own, outcome = e, (False, f"{self.member} on {socket.gethostname()}: {e}")
        try:
            outcomes = self.exchange.gather(outcome, "this save")
        except WorkerLost as e:
            # This member's own cleanup (the lock, what it staged) runs on this error.
            raise WorkerLost(f"{e}" + ("" if outcome[0] else f" | {outcome[1]}")) from e
        errors = [value for ok, value in outcomes if not ok]
        if errors:
            raise agreed_error(ShardedStateError, " | ".join(errors), own)
        return [value for _, value in outcomes]


def wait_for_replicas(replicas: Exchange | None, rank: RankInfo, call: str, doing: str, changed: str) -> None:
    """Where each data-parallel replica holds its own experts (``replicas``: their exchange; None
    otherwise): wait, at most ``SHARDED_STATE_REPLICA_TIMEOUT`` seconds, until every replica has called
    ``call``, and raise naming that wait if one did not (``doing``: what is refused; ``changed``: what
    was not).

    Each replica's engine is called on its own (an offline replica's process, or vLLM's server
    for each engine core): the replicas' exchanges would wait for a replica that was never called
    until gloo's timeout (30 minutes).
    """
    if replicas is None:
        return
    seconds = float(os.environ.get(REPLICA_TIMEOUT_ENV) or DEFAULT_REPLICA_TIMEOUT)
    try:
        replicas.barrier(seconds, wait_all=True)
    except RuntimeError as e:
        raise WorkerLost(
            f"Refusing to {doing}: each of the {rank.dp_size} data-parallel replicas holds its own experts "
            f"(placed on it, or cut across TP x DP), and not all of them called {call} within {seconds:g} s "
            f"({REPLICA_TIMEOUT_ENV}; {e}). Call it on every replica: in each data-parallel process of an "
            f"offline engine (vLLM's serve reaches them all through collective_rpc). {changed}"
        ) from e


def checkpoint_digest(manifest: Manifest | None) -> str:
    """What tells two members' checkpoints apart: the digest of the manifest each read."""
    return "no manifest" if manifest is None else hashlib.sha256(manifest.to_json().encode()).hexdigest()[:16]


def different_checkpoints(
    where: str, held: list[tuple[str, str, str, str]], then: str = "start again. Nothing was loaded"
) -> str | None:
    """The error for members that read different checkpoints at ``where`` (``held``: each member's
    rank, node, path and :func:`checkpoint_digest`), or None where they read one; ``then``: what to do."""
    if len({digest for *_, digest in held}) < 2:
        return None
    said = "; ".join(f"{member} on {host} read {path} (manifest {digest})" for member, host, path, digest in held)
    return (
        f"The workers of this engine hold different checkpoints at {where}: {said}. Each node reads its "
        "own copy, and a mix of two saves would be served as one model. Give every node the same save "
        f"(its manifest and config files, and the parts its ranks read), or serve from object storage, then {then}."
    )


def check_same_checkpoint(
    exchange: Exchange, rank: RankInfo, where: str, manifest: Manifest | None, failed: Exception | None
) -> None:
    """Before a load reads a byte: check that the members holding this model read one checkpoint,
    by the digest of the manifest each read (``failed``: why this one read none).

    On several nodes each member reads its node's copy of ``where``. Each rank's files agree with
    the manifest beside them, so a node holding another save of the same model (or another model of
    the same shapes) passes every check of its own rank, and the engine would serve a mix of the
    two. Every member reaches the exchange, even one whose manifest could not be read, so that
    none waits for it; a member that never reaches it (a node started with another load format)
    ends the wait after ``SHARDED_STATE_LOAD_TIMEOUT`` seconds.
    """
    if exchange.alone:
        return
    seconds = float(os.environ.get(LOAD_TIMEOUT_ENV) or DEFAULT_LOAD_TIMEOUT)
    try:
        exchange.barrier(seconds)
    except RuntimeError as e:
        raise WorkerLost(
            f"{rank} on {socket.gethostname()}: another worker of this engine did not reach the sharded_state "
            f"load of {where} (waited at most {seconds:g} s, {LOAD_TIMEOUT_ENV}), or stopped answering: {e}. "
            "See the other nodes' logs; every node must run the same model with --load-format sharded_state. "
            "Nothing was loaded."
        ) from e
    own = (str(rank), socket.gethostname(), where, None if failed else checkpoint_digest(manifest), str(failed))
    members = exchange.gather(own, "this load")
    _PEERS.clear()
    _PEERS.update({member: host for member, host, *_ in members if member != str(rank)})
    if failed is not None:
        return  # the caller raises its own error
    _raise_others_failures([(member, host, error) for member, host, _, digest, error in members if digest is None])
    if (mismatch := different_checkpoints(where, [m[:4] for m in members])) is not None:
        raise CheckpointMismatch(mismatch)


def share_load_outcome(exchange: Exchange, rank: RankInfo, failed: Exception | None) -> None:
    """After this member's reads: tell the others whether they failed, and hear theirs.

    A worker whose load fails ends its process; without this, the others learn of it only from
    vLLM's next collective, as gloo's "Connection closed by peer", and the leader, whose log the
    user reads, never says which file on which node failed. Here every member raises the failing
    members' own messages (the failing one its own error, from the caller).
    """
    if exchange.alone:
        return
    own = (str(rank), socket.gethostname(), None if failed is None else str(failed))
    members = exchange.gather(own, "this load")
    if failed is None:
        _raise_others_failures([(member, host, error) for member, host, error in members if error is not None])


def _raise_others_failures(failures: list[tuple[str, str, str]]) -> None:
    if failures:
        said = " | ".join(f"{member} on {host}: {error}" for member, host, error in failures)
        raise agreed_error(ShardedStateError, f"Another worker's load failed, so this engine cannot start: {said}")
