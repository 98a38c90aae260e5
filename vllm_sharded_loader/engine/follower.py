"""A follower node of a multi-node engine ends when its leader has ended.

vLLM's multiprocessing executor spans nodes: the leader (``--node-rank 0``) runs the
engine, and each follower (``vllm serve ... --node-rank N --headless``) runs only its
workers, which wait for the leader's next call on a ZeroMQ socket with no timeout. When
the leader's process ends, nothing tells them: the follower runs on, holding its memory
and its accelerators, until someone stops it.

Once the plugin is installed, every follower worker, whatever its load format, starts a
daemon thread when its weights are loaded, which watches the leader: the world group's
store, hosted by global rank 0 at ``--master-addr:--master-port``, listens for as long as
the leader's engine lives. Once it has refused
``SHARDED_STATE_LEADER_CHECKS`` connections in a row, ``SHARDED_STATE_LEADER_INTERVAL``
seconds apart, the thread stops the follower as ``Ctrl-C`` would: ``SIGTERM`` to the
process that started the workers (vLLM's headless command, which then shuts its
executor down), and, should that not end this worker within 5 s (it did not, in the tests, while
the worker waited for the leader's next call), the worker itself. ``SHARDED_STATE_FOLLOWER_EXIT=0`` turns the watch off.
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
# After the SIGTERM: time for vLLM's own shutdown before this worker ends itself; the grace that
# shutdown gives a worker before its own SIGTERM (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS' default),
# so that a worker that can end cleanly does. In the tests' two-node runs it never ended the worker,
# whose main thread waits on the gone leader's queue: SIGTERM came after 5 s, SIGKILL 4 s later.
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
