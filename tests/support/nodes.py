"""Several "nodes" on one machine, for the multi-node tests: each node its own process tree,
host name, file system view and, where the machine allows, network.

- **Network.** Each node runs in a network namespace of its own, joined to the host by a
  veth pair on a bridge: node ``i`` is ``10.S.0.(i+1)``, the host ``10.S.0.254``. Servers of
  the tests (object storage) listen on the host's loopback, reached through a proxy per
  node on the host's bridge address, which also counts each node's bytes. Without
  ``CAP_NET_ADMIN`` (or ``ip``), every node shares the host's loopback.
- **Disk.** Each node runs in a mount namespace of its own in which its folder
  ``ROOT/node-i`` is mounted over ``ROOT/local``: every node sees the same path with its
  own contents, as separate machines do. ``ROOT/shared`` is the same for all (a shared
  file system). Without mount namespaces, ``isolated_disks`` is False and the tests that
  need them skip.
- **Host name.** Each node has its own UTS namespace, named ``node-i``, so that errors
  naming nodes can be told apart.

Everything made here (namespaces, links, processes) is removed by :meth:`Nodes.close`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from examples import tiny_models
from tests.support import ROOT

if TYPE_CHECKING:
    from tests.support.engines import ForkedProcess

ENGINE_TIMEOUT = 900
# A follower that has lost its leader stops within the watch's 3 checks 2 s apart, then
# vLLM's own shutdown of its workers (up to about 10 s).
FOLLOWER_EXIT_SECONDS = 60
LEADER_INTERVAL = 0.5  # seconds between a follower's checks of its leader (SHARDED_STATE_LEADER_INTERVAL)
LEADER_CHECKS = 3  # refused checks in a row that end a follower (engine/follower.py's default)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*argv: str) -> bool:
    return subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def _can_unshare(*flags: str) -> bool:
    return shutil.which("unshare") is not None and _run("unshare", *flags, "true")


class Nodes:
    """``count`` nodes under ``root``; use as a context manager."""

    def __init__(self, root: Path, count: int = 2) -> None:
        self.root, self.count = root, count
        self.local = root / "local"  # the per-node path
        self.shared = root / "shared"
        for path in [self.local, self.shared, *(self.node_dir(i) for i in range(count))]:
            path.mkdir(parents=True, exist_ok=True)
        self.isolated_disks = os.geteuid() == 0 and _can_unshare("--mount", "--uts")
        tag = os.getpid() % 10000
        self._names = [f"vsl{tag}n{i}" for i in range(count)]
        self._bridge = f"vsl{tag}br"
        self._subnet = _free_subnet(tag) if shutil.which("ip") else ""
        self.isolated_network = self.isolated_disks and shutil.which("ip") is not None and self._make_network()
        self.processes: list[subprocess.Popen | ForkedProcess] = []

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- addresses ---------------------------------------------------------------------------

    def ip(self, node: int) -> str:
        """The address other nodes reach ``node`` at."""
        return f"{self._subnet}.{node + 1}" if self.isolated_network else "127.0.0.1"

    @property
    def host_ip(self) -> str:
        """The address nodes reach the host's servers (through proxies) at."""
        return f"{self._subnet}.254" if self.isolated_network else "127.0.0.1"

    def interface(self, node: int) -> str:
        return self._names[node] if self.isolated_network else "lo"

    def node_dir(self, node: int) -> Path:
        """What ``node`` sees at :attr:`local`, as seen from the host."""
        return self.root / f"node-{node}"

    def engine_environment(self, node: int) -> dict[str, str]:
        """What a vLLM engine on ``node`` needs on this machine: one worker, on its own core."""
        return {
            **tiny_models.engine_environment(1),
            "VLLM_CPU_OMP_THREADS_BIND": str(node % (os.cpu_count() or 1)),
            # A follower finds its leader gone after 3 refused checks (engine/follower.py): 1.5 s, not 6.
            "SHARDED_STATE_LEADER_INTERVAL": str(LEADER_INTERVAL),
        }

    def environment(self, node: int) -> dict[str, str]:
        """The variables a vLLM process on ``node`` needs: its address for vLLM, gloo and ZeroMQ."""
        return {
            "VLLM_HOST_IP": self.ip(node),
            "GLOO_SOCKET_IFNAME": self.interface(node),
            "HOSTNAME": f"node-{node}",
        }

    # -- processes ---------------------------------------------------------------------------

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run on ``node``."""
        if not self.isolated_disks:
            return argv
        inner = (
            f"mount --bind {shlex.quote(str(self.node_dir(node)))} {shlex.quote(str(self.local))}"
            f" && hostname node-{node} && exec {shlex.join(argv)}"
        )
        wrapped = ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", inner]
        if self.isolated_network:
            wrapped = ["nsenter", f"--net=/run/netns/{self._names[node]}", *wrapped]
        return wrapped

    def start(self, node: int, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen | ForkedProcess:
        """Start ``argv`` on ``node`` in a process group of its own, output to ``log``. A Python
        module or script is a child of the engine tests' fork server where it can be one
        (``tests/support/forkserver.py``: it enters the node's namespaces as :meth:`command` does)."""
        from tests.support.engines import FAST, fork_python

        full_env = {**os.environ, **env, **self.environment(node)}
        proc: subprocess.Popen | ForkedProcess | None = None
        if self.isolated_disks and argv[0] == sys.executable:
            # The checkout first on the path, as for every engine script: the fork server's path.
            forked_env = {**full_env, "PYTHONPATH": FAST["PYTHONPATH"]}
            proc = fork_python(argv[1:], forked_env, str(log), self.namespaces(node))
        if proc is None:
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    self.command(node, argv),
                    cwd=ROOT,
                    env=full_env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        self.processes.append(proc)
        return proc

    def namespaces(self, node: int) -> dict:
        """What :meth:`command` enters, for a child of the fork server: the node's network
        namespace (if any), its folder over :attr:`local`, its host name."""
        netns = f"/run/netns/{self._names[node]}" if self.isolated_network else None
        return {"hostname": f"node-{node}", "bind": [str(self.node_dir(node)), str(self.local)], "netns": netns}

    def run(self, node: int, argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> str:
        """Run a short command on ``node`` and return its output; raise if it fails."""
        done = subprocess.run(
            self.command(node, argv),
            cwd=ROOT,
            env={**os.environ, **(env or {}), **self.environment(node)},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode:
            raise RuntimeError(f"{argv} on node {node} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def python(self, node: int, code: str, env: dict[str, str] | None = None) -> str:
        return self.run(node, [sys.executable, "-c", code], env)

    def close(self) -> None:
        for proc in self.processes:
            stop_group(proc)
        if self.isolated_network:
            for name in self._names:
                _run("ip", "netns", "del", name)
                _run("ip", "link", "del", f"{name}h")
            _run("ip", "link", "del", self._bridge)

    # -- network -----------------------------------------------------------------------------

    def _make_network(self) -> bool:
        steps = [
            ["ip", "link", "add", self._bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{self._subnet}.254/24", "dev", self._bridge],
            ["ip", "link", "set", self._bridge, "up"],
        ]
        for i, name in enumerate(self._names):
            steps += [
                ["ip", "netns", "add", name],
                ["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}h"],
                ["ip", "link", "set", name, "netns", name],
                ["ip", "-n", name, "addr", "add", f"{self._subnet}.{i + 1}/24", "dev", name],
                ["ip", "-n", name, "link", "set", name, "up"],
                ["ip", "-n", name, "link", "set", "lo", "up"],
                ["ip", "link", "set", f"{name}h", "master", self._bridge],
                ["ip", "link", "set", f"{name}h", "up"],
            ]
        for step in steps:
            if not _run(*step):
                self.isolated_network = True  # so that close() removes what was made
                self.close()
                return False
        return True


def _free_subnet(tag: int) -> str:
    """A ``10.A.B`` /24 (A 200-249) that no address of this host is in, the first from ``tag``'s on.

    A bridge that another run holds, or left when it was killed before its clean-up, must not
    share it: the host would send the nodes' replies out of the other bridge, and every request
    from a node to the host's servers (the bucket's proxies) would time out.
    """
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    taken = set(re.findall(r"inet (10\.\d+\.\d+)\.\d+/", shown))
    subnets = [f"10.{a}.{b}" for a in range(200, 250) for b in range(250)]
    start = tag % len(subnets)
    return next((n for n in subnets[start:] + subnets[:start] if n not in taken), subnets[start])


class ClusterFailed(Exception):
    """A multi-node engine that did not start, run or end as it should."""


@dataclass
class Served:
    """One run of a two-node engine."""

    result: dict | None  # the leader's RESULT line (tests/support/engine_runner.py)
    leader_exit: int | None
    follower_ended: bool  # by itself, after the leader ended
    leftovers: list[str]  # processes still running on either node afterwards
    logs: list[Path]


def session_processes(session: int) -> list[str]:
    """Live (not zombie) processes of a session, as ``pid command``."""
    listing = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat=,args="], capture_output=True, text=True).stdout
    found = []
    for line in listing.splitlines():
        pid, sid, stat, *args = line.split(None, 3)
        if int(sid) == session and not stat.startswith("Z"):
            found.append(f"{pid} {' '.join(args)}")
    return found


def serve_tp2(
    cluster: Nodes,
    model: str,
    load_format: str,
    name: str,
    envs: list[dict[str, str]],
    kill_leader: bool = False,
    leader_argv: list[str] | None = None,
    timeout: float = ENGINE_TIMEOUT,
    pipeline: bool = False,
    failing: bool = False,
    **spec: object,
) -> Served:
    """TP=2 across nodes 0 and 1, one worker each, each node's processes with its ``envs``: start
    the follower (``vllm-sharded-serve --headless``), then the leader (``tests/support/engine_runner.py``
    with ``spec``: ``saves``, ...), wait for the leader, then for the follower to end by itself;
    stop whatever is left and report it. Raises :class:`ClusterFailed` with both logs' tails.

    With ``kill_leader``, the leader serves on after its result until its whole process tree
    is killed (``SIGKILL``), as when its machine fails; the follower must outlive those 15 s of
    serving. ``leader_argv`` runs another leader (with
    the leader's options of the follower's command line added) instead of the engine runner.
    ``timeout`` bounds the leader's run (and its serving with ``kill_leader``). With ``pipeline``,
    PP=2 spans the nodes instead, one stage each. With ``failing``, a leader that fails is the
    outcome to report (``leader_exit``), not a failure of the cluster."""
    port = free_port()
    sizes = {"tp": 1, "pp": 2} if pipeline else {"tp": 2, "pp": 1}
    spans = ["--tensor-parallel-size", str(sizes["tp"]), "--pipeline-parallel-size", str(sizes["pp"])]
    spans += ["--nnodes", "2", "--master-addr", cluster.ip(0), "--master-port", str(port)]
    # The leader's settings, which every node must share: eager, but under pipeline parallelism
    # (vllm-cpu 0.32's eager PP workers fail) compiled as vLLM compiles by default, so that each
    # stage saves and restores its start-up artifacts (not as the other engine tests run PP:
    # tests/support/engine_runner.py, execution_mode).
    same = ["--max-model-len", "512", "--seed", "0", *([] if pipeline else ["--enforce-eager"])]
    follower_args = ["--load-format", load_format, *spans, "--node-rank", "1", "--headless", *same]
    logs = [cluster.root / f"{name}-node-{i}.log" for i in range(2)]
    follower = cluster.start(
        1,
        [sys.executable, "-m", "vllm_sharded_loader.engine.serve_cli", model, *follower_args],
        envs[1],
        logs[1],
    )
    leader_spec = {
        "model": model,
        **sizes,
        "load_format": load_format,
        "engine": {
            "nnodes": 2,
            "node_rank": 0,
            "master_addr": cluster.ip(0),
            "master_port": port,
            "enforce_eager": not pipeline,
        },
        **spec,
        **({"hold": timeout} if kill_leader else {}),
    }
    if leader_argv is not None:
        leader_argv = [*leader_argv, *spans, "--node-rank", "0", *same]
    leader = cluster.start(
        0,
        leader_argv or [sys.executable, "-m", "tests.support.engine_runner", json.dumps(leader_spec)],
        {**envs[0], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        logs[0],
    )
    try:

        def result() -> dict | None:
            lines = logs[0].read_text(errors="replace").splitlines()
            return next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)

        if kill_leader:
            wait_until(lambda: result() is not None or leader.poll() is not None, timeout)
            # While the leader serves, its follower stays: longer than the watch needs to act.
            time.sleep(LEADER_INTERVAL * LEADER_CHECKS * 4)
            if follower.poll() is not None:
                raise ClusterFailed(f"the follower ended while its leader still served:\n{tails(logs)}")
            os.killpg(leader.pid, signal.SIGKILL)
        try:
            leader.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterFailed(f"the leader did not end within {timeout} s:\n{tails(logs)}") from None
        if leader_argv is None and not failing and ((leader.returncode and not kill_leader) or result() is None):
            raise ClusterFailed(f"the two-node engine failed (leader exit {leader.returncode}):\n{tails(logs)}")
        ended = wait_until(lambda: follower.poll() is not None, FOLLOWER_EXIT_SECONDS)
        wait_until(lambda: not session_processes(follower.pid) and not session_processes(leader.pid), 20)
        leftovers = session_processes(follower.pid) + session_processes(leader.pid)
    finally:
        stop_group(follower)
        stop_group(leader)
    return Served(result(), leader.returncode, ended, leftovers, logs)


def tails(logs: list[Path], lines: int = 40) -> str:
    return "\n".join(
        f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) for log in logs
    )


def stop_group(proc: subprocess.Popen | ForkedProcess, grace: float = 10) -> None:
    """Stop a process and everything it started (its session), politely first."""
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of an ended leader
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def wait_until(predicate: Callable[[], object], timeout: float, every: float = 0.5) -> bool:
    """Whether ``predicate()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())


def kill_worker_when(log: Path, reading: Callable[[], bool], killed: dict) -> None:
    """``SIGKILL`` the first engine worker that ``log`` (a node's) names, once ``reading()`` holds (polled every
    50 ms, for at most 300 s), as when that node fails; ``killed`` gets its ``pid`` and the monotonic time ``at``."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = re.search(r"\(Worker_TP\d+ pid=(\d+)\)", log.read_text(errors="replace")) if log.exists() else None
        if found and reading():
            os.kill(int(found[1]), signal.SIGKILL)
            killed.update(pid=int(found[1]), at=time.monotonic())
            return
        time.sleep(0.05)
