"""Times the phases of every vLLM model loader's ``load_model``, in every process of a benchmark engine.

``benchmarks/load_bench.py`` puts this folder first on ``PYTHONPATH`` of the engines it
starts, so that the front end, the engine core and each tensor-parallel worker (spawned
processes) all import it. When vLLM's ``base_loader`` module is imported, its
``BaseModelLoader.load_model`` is wrapped, the same way for every loader (ours, vLLM's
sharded_state, the default safetensors loader, the Run:ai streamer), to time:

- ``load_model``: the whole call (model init, weights, post-processing, vLLM's ``gc.collect``);
- ``create_model``: the model's construction (parameters allocated, not filled);
- ``load_weights``: the loader's ``self.load_weights`` call;
- ``post``: ``process_weights_after_loading`` (vLLM's repacking of the weights for its kernels);

with, per phase, the process's CPU seconds (user, system) and page faults (minor, major),
and over the whole call the memory of the process (peak ``VmRSS``, ``RssAnon``,
``RssFile`` from ``/proc/self/status``, sampled every 10 ms by a thread, and ``VmHWM``
at the end) and of the machine (``/proc/meminfo``: ``Cached`` and ``MemAvailable``
before and after, lowest ``MemAvailable`` during). One JSON line per load is appended
to ``$SHARDED_BENCH_TIMING``. Nothing happens when that variable is unset. With
``$SHARDED_BENCH_PROFILE`` set, post-processing also runs under ``cProfile``, its stats
written to ``$SHARDED_BENCH_PROFILE.<loader>.<pid>``.

With ``$SHARDED_BENCH_ISA=avx2`` (``load_bench.py --isa avx2``), the engine takes the code paths
of an AVX2-only machine on an AVX-512 one: PyTorch's ``torch.cpu._is_avx512*`` and
``_is_amx*`` checks answer ``False`` (vLLM loads its ``_C_AVX2`` kernels and skips its AVX-512
repacking), and the plugin's CPU flags lose ``avx512*`` and ``amx*`` (its page-touch rule
decides as on AVX2). ``load_bench.py`` also caps oneDNN and ATen at AVX2 through their own
variables. The hardware, its memory and the VM stay this machine's.
"""

import importlib.abc
import importlib.util
import json
import os
import resource
import sys
import threading
import time

TARGET = "vllm.model_executor.model_loader.base_loader"
PLUGIN_MEMORY = "vllm_sharded_loader.storage.memory"
KB = 1024


def _proc_fields(path: str, keys: tuple[str, ...]) -> dict:
    """Fields of a /proc file of "Key:  value kB" lines, in bytes."""
    out = {}
    with open(path) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) * KB
    return out


def _status() -> dict:
    return _proc_fields("/proc/self/status", ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"))


def _meminfo() -> dict:
    return _proc_fields("/proc/meminfo", ("MemTotal", "MemAvailable", "Cached", "AnonPages", "Mapped"))


class _Sampler(threading.Thread):
    """Peak RSS (anonymous, file-backed) of this process and lowest MemAvailable, every 10 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="bench-memory-sampler")
        self.stop = threading.Event()
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.min_available = None

    def sample(self) -> None:
        s = _status()
        for key in self.peak:
            self.peak[key] = max(self.peak[key], s.get(key, 0))
        available = _meminfo().get("MemAvailable")
        if available is not None:
            self.min_available = available if self.min_available is None else min(self.min_available, available)

    def run(self) -> None:
        while not self.stop.wait(0.01):
            self.sample()


class _Phase:
    """Wall seconds, CPU seconds and page faults of this process over a ``with`` block."""

    def __init__(self, record: dict, name: str) -> None:
        self.record, self.name = record, name

    def __enter__(self):
        self.started, self.usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        return self

    def __exit__(self, *exc) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.record[self.name] = time.perf_counter() - self.started
        self.record[self.name + "_cpu"] = {
            "user": usage.ru_utime - self.usage.ru_utime,
            "sys": usage.ru_stime - self.usage.ru_stime,
            "minflt": usage.ru_minflt - self.usage.ru_minflt,
            "majflt": usage.ru_majflt - self.usage.ru_majflt,
        }


def _isa() -> dict:
    """The code paths this process took: vLLM's kernel library and ATen's CPU capability."""
    import torch

    with open("/proc/self/maps") as f:
        libraries = {os.path.basename(line.split()[-1]) for line in f if "/vllm/_C" in line}
    return {"vllm_kernels": sorted(libraries), "aten": torch.backends.cpu.get_cpu_capability()}


def _patch(module):
    cls = module.BaseModelLoader
    original = cls.load_model
    original_post = module.process_weights_after_loading
    current: list[dict] = []  # the record of the load_model call under way

    def post(*args, **kwargs):
        if not current:
            return original_post(*args, **kwargs)
        with _Phase(current[-1], "post"):
            profile = os.environ.get("SHARDED_BENCH_PROFILE")
            if not profile:
                return original_post(*args, **kwargs)
            import cProfile

            profiler = cProfile.Profile()
            try:
                return profiler.runcall(original_post, *args, **kwargs)
            finally:
                profiler.dump_stats(f"{profile}.{current[-1]['loader']}.{os.getpid()}")

    module.process_weights_after_loading = post

    def load_model(self, *args, **kwargs):
        inner = self.load_weights
        record: dict = {"loader": type(self).__name__, "pid": os.getpid()}
        record["affinity"] = sorted(os.sched_getaffinity(0))
        record["wall_start"] = time.time()

        def timed(model, model_config):
            with _Phase(record, "load_weights"):
                return inner(model, model_config)

        inner_create = self.create_model

        def create(*a, **k):
            with _Phase(record, "create_model"):
                return inner_create(*a, **k)

        self.load_weights = timed
        self.create_model = create
        sampler = _Sampler()
        sampler.sample()
        record["meminfo_before"] = _meminfo()
        record["status_before"] = _status()
        sampler.start()
        current.append(record)
        try:
            with _Phase(record, "load_model"):
                return original(self, *args, **kwargs)
        finally:
            current.pop()
            record["wall_end"] = time.time()
            sampler.stop.set()
            sampler.join()
            sampler.sample()
            self.__dict__.pop("load_weights", None)
            self.__dict__.pop("create_model", None)
            record["meminfo_after"] = _meminfo()
            record["status_after"] = _status()
            record["peak"] = dict(sampler.peak, VmHWM=record["status_after"].get("VmHWM", 0))
            record["min_available"] = sampler.min_available
            record["isa"] = _isa()
            # The older name, kept for earlier JSON readers.
            record["seconds"] = record.get("load_weights")
            try:
                from vllm.distributed import get_tp_group

                record["rank"] = get_tp_group().rank_in_group
            except Exception:
                record["rank"] = 0
            with open(os.environ["SHARDED_BENCH_TIMING"], "a") as f:
                f.write(json.dumps(record) + "\n")

    cls.load_model = load_model


def _pin_plugin_flags(module) -> None:
    module.CPU_FLAGS = frozenset(f for f in module.CPU_FLAGS if not f.startswith(("avx512", "amx")))


def _pin_torch_avx2() -> None:
    import torch

    for name in dir(torch.cpu):
        if name.startswith(("_is_avx512", "_is_amx")):
            setattr(torch.cpu, name, lambda: False)


class _Finder(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` after the module ``name`` is first executed."""

    def __init__(self, patches: dict) -> None:
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        if not self.patches:
            sys.meta_path.remove(self)
        # find_spec again skips this finder for ``name``: its patch is gone.
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_patches = {}
if os.environ.get("SHARDED_BENCH_TIMING"):
    _patches[TARGET] = _patch
if os.environ.get("SHARDED_BENCH_ISA") == "avx2":
    _pin_torch_avx2()
    _patches[PLUGIN_MEMORY] = _pin_plugin_flags
if _patches:
    sys.meta_path.insert(0, _Finder(_patches))
