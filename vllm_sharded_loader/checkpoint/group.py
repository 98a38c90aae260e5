"""An engine's workers agreeing on each step over an :class:`Exchange`: every member reaches every
exchange, and a failure anywhere is raised everywhere."""

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

# The other members, member -> node, from the load's first exchange: gloo's errors name only an address.
_PEERS: dict[str, str] = {}


class Exchange(Protocol):
    """How the members of one model reach each other: ``gather`` every member's ``outcome`` in member
    order (:class:`WorkerLost` if one stopped answering); ``barrier`` within ``seconds`` or ``RuntimeError``."""

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
        # A dead worker's reset connections fail the exchange at once; the caller's cleanup then runs.
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
    """The save protocol's group over ``exchange``; the first member is rank 0."""

    def __init__(self, exchange: Exchange, rank: RankInfo) -> None:
        self.exchange = exchange
        self.first = rank.tp_rank == 0 and rank.pp_rank == 0 and rank.dp_rank == 0
        self.member = str(rank)

    def run(self, step: Callable[[], T], only_first: bool = False) -> list[T]:
        """Run ``step`` here (or only on the first member), exchange results, raise if any failed.

        Every member reaches the exchange even when its step fails, or the others would hang.
        """
        own: Exception | None = None
        try:
            outcome: tuple[bool, Any] = (True, step() if self.first or not only_first else None)
        except Exception as e:
            own, outcome = e, (False, f"{self.member} on {socket.gethostname()}: {e}")
        try:
            outcomes = self.exchange.gather(outcome, "this save")
        except WorkerLost as e:
            raise WorkerLost(f"{e}" + ("" if outcome[0] else f" | {outcome[1]}")) from e
        errors = [value for ok, value in outcomes if not ok]
        if errors:
            raise agreed_error(ShardedStateError, " | ".join(errors), own)
        return [value for _, value in outcomes]


def wait_for_replicas(replicas: Exchange | None, rank: RankInfo, call: str, doing: str, changed: str) -> None:
    """Wait, at most ``SHARDED_STATE_REPLICA_TIMEOUT`` seconds, until every data-parallel replica that
    holds its own experts has called ``call``; raise if one did not (``doing``: what is refused).

    Each replica is called on its own: without this, a replica never called would be waited for
    until gloo's 30-minute timeout.
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
    """The error for members that read different checkpoints (``held``: rank, node, path, digest), or None."""
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
    """Before a load reads a byte, check by manifest digest that every member reads one checkpoint
    (``failed``: why this one read none).

    Each node reads its own copy of ``where``, and a node holding another save passes every check
    of its own rank: the engine would serve a mix. A member that never arrives ends the wait after
    ``SHARDED_STATE_LOAD_TIMEOUT`` seconds.
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
    """After this member's reads, share whether they failed, so that every member raises the failing
    ones' messages (else the leader's log would say only gloo's "Connection closed by peer").
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
