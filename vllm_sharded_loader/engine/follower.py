"""A follower node of a multi-node engine ends when its leader has ended.

A follower's workers wait for the leader's next call with no timeout, so nothing tells them the
leader is gone. Every follower worker therefore watches the world group's store (hosted by the
leader at ``--master-addr:--master-port``): once it has refused ``SHARDED_STATE_LEADER_CHECKS``
connections in a row, ``SHARDED_STATE_LEADER_INTERVAL`` seconds apart, the worker sends
``SIGTERM`` to the process that started it, as ``Ctrl-C`` would, and ends itself if that does not.
``SHARDED_STATE_FOLLOWER_EXIT=0`` turns the watch off.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import threading
import time
from typing import Any

from vllm.logger import init_logger

logger = init_logger(f"vllm.plugins.{__name__}")

EXIT_ENV = "SHARDED_STATE_FOLLOWER_EXIT"
INTERVAL_ENV = "SHARDED_STATE_LEADER_INTERVAL"
CHECKS_ENV = "SHARDED_STATE_LEADER_CHECKS"
DEFAULT_INTERVAL = 2.0
DEFAULT_CHECKS = 3
# After the SIGTERM, vLLM's own grace for a worker (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS' default)
# before this worker ends itself: its main thread, waiting on the gone leader's queue, may not end.
GRACE_SECONDS = 5.0

_watching = threading.Event()


def leader_listens(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to the leader's store opens (closed at once, with nothing sent)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def watch_leader(parallel_config: Any) -> bool:
    """Start the watch in this worker if it runs on a follower node; whether it did (once per process)."""
    nnodes = getattr(parallel_config, "nnodes", 1)
    node_rank = getattr(parallel_config, "node_rank", 0)
    if nnodes <= 1 or node_rank == 0 or os.environ.get(EXIT_ENV, "1").lower() in ("0", "false", "no"):
        return False
    if _watching.is_set():
        return True
    _watching.set()
    host, port = parallel_config.master_addr, int(parallel_config.master_port)
    interval = float(os.environ.get(INTERVAL_ENV) or DEFAULT_INTERVAL)
    checks = int(os.environ.get(CHECKS_ENV) or DEFAULT_CHECKS)
    threading.Thread(
        target=_watch, args=(host, port, interval, checks, node_rank), name="ShardedStateLeaderWatch", daemon=True
    ).start()
    logger.info("sharded_state: node %d stops when its leader at %s:%d is gone", node_rank, host, port)
    return True


def _watch(host: str, port: int, interval: float, checks: int, node_rank: int) -> None:
    refused = 0
    while refused < checks:
        time.sleep(interval)
        refused = 0 if leader_listens(host, port, timeout=interval) else refused + 1
    logger.warning(
        "sharded_state: the leader's store at %s:%d refused %d connections in a row: the leader has ended, "
        "so follower node %d stops (%s=0 keeps it running)",
        host,
        port,
        checks,
        node_rank,
        EXIT_ENV,
    )
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(parent.pid, signal.SIGTERM)
    time.sleep(GRACE_SECONDS)
    os._exit(0)
