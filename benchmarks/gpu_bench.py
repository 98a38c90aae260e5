"""One command for a lent GPU: our reader against the loaders users would pick, cold and warm, each
load the first of a fresh process, as an engine's is.

Runs with what the lent machines have (one GPU, torch, safetensors, numpy; no vLLM, no
blake3), from the repository root:

    BENCH_COMMIT=abc1234 python -m benchmarks.gpu_bench --gb 8 --runs 2 --json $OUT/gpu_bench.json

Builds an ``--gb`` GB rank of a realistic shape in ``--work``: several safetensors files,
bfloat16 embeddings and small norms, FP8 (``float8_e4m3fn``) linear weights each with its
float32 scales. Then, ``--runs`` times, round-robin over the methods and the modes, one **fresh
process** per method and mode (one load per process, as an engine loads once): it starts, makes
its CUDA context and whatever the method keeps (a pinned buffer), then empties or fills the page
cache and checks that it did, times its **first pass** (the headline), and then ``--repeats``
passes more in the same process, reported apart (they reuse what the first pass made: pinned
blocks, PyTorch's cached device memory). Methods:

- ``h2d_pinned``: one pinned host buffer of the rank's size copied to the GPU (the bound of
  any loader that goes through host memory);
- ``safetensors_to``: ``safe_open(device="cpu")`` (a mapping) and ``get_tensor(...).to("cuda")``
  per tensor: vLLM's default loader's pattern;
- ``fastsafetensors``: ``SafeTensorsFileLoader(..., nogds=True)`` (vLLM turns GDS off at TP>1),
  if it imports (carry its wheel, see docs/performance.md);
- ``instanttensor``: ``instanttensor.safe_open`` over all files, each tensor cloned out of its
  buffer, if it imports;
- ``ours_t{threads}_s{span MiB}_{pc|direct}``: :func:`vllm_sharded_loader.storage.tensor_files.read_files`
  into CUDA tensors, across ``--threads``, ``--spans`` and the page cache (``pc``) against
  ``O_DIRECT`` (``direct``; cold only).

``cold``: each file ``fsync``-ed and dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)``, then
checked: ``mincore`` over a mapping of every file says how much of it is still in the page cache,
and ``/proc/meminfo``'s ``Cached`` is read around the eviction; a pass whose files were not
emptied is recorded as not verified. Inside a VM (the CPU's ``hypervisor`` flag) the host's own
cache of the virtual disk is beyond the guest's reach: cold figures there are upper bounds of a
cold disk's. ``warm``: every file read once before, and checked resident.

Reported per method and mode: GB/s (median of the first passes, and every process's), seconds,
CPU seconds of the process (every thread), whether every tensor equals the file's bytes (a
fingerprint of each tensor, taken on the device after the timing, against the one of the bytes
written), and the repeat passes apart. Results as JSON (``--json``, with the record of
``benchmarks/harness.py``: command, commit, date, machine and GPU) and on stdout.

``--dry-run`` runs the same on the CPU (targets in host memory, no CUDA, ``h2d_pinned`` skipped),
on a small rank: it checks the command's file building, eviction and its check, the fresh
processes, peers and our reader where no GPU is lent (CI runs it: ``tests/test_gpu_bench.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks import harness
from vllm_sharded_loader.storage import direct, local, tensor_files
from vllm_sharded_loader.storage.reader import ReadOptions
from vllm_sharded_loader.storage.tensors import DTYPES

GB = 1e9
MiB = 1024 * 1024
PAGE = mmap.PAGESIZE
FINGERPRINT_CHUNK = 1 << 22  # int64 words per step: 32 MiB of a tensor at a time
EVICTED = 0.01  # at most this share of the rank's pages still cached after an eviction
COLD_HOW = "each file fsync-ed, then posix_fadvise(POSIX_FADV_DONTNEED) over the whole file"


# ---------------------------------------------------------------------------- the rank


def fingerprint(t: torch.Tensor) -> int:
    """A fingerprint of a tensor's bytes, the same on the CPU and on a GPU: the sum of its bytes
    taken as int64 words, each times its position's weight, modulo 2**64 (integer sums wrap the
    same in any order). A byte moved or changed changes it.

    >>> a = torch.arange(12, dtype=torch.float32)
    >>> fingerprint(a) == fingerprint(a.clone()), fingerprint(a) == fingerprint(a.flip(0))
    (True, False)
    """
    data = t.detach().contiguous().view(-1).view(torch.uint8)
    if data.storage_offset() % 8:  # a tensor inside a larger buffer: words must start on 8 bytes
        data = data.clone()
    whole = data.numel() // 8 * 8
    words = data[:whole].view(torch.int64)
    total = 0
    for start in range(0, words.numel(), FINGERPRINT_CHUNK):
        chunk = words[start : start + FINGERPRINT_CHUNK]
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64) % 65521 + 1
        total += int((chunk * weights).sum().item())
    tail = data[whole:].to(torch.int64)
    total += int((tail * torch.arange(1, tail.numel() + 1, device=tail.device, dtype=torch.int64)).sum().item())
    return total % 2**64


def build(work: str, gb: float, files: int) -> tuple[list[str], dict[str, int]]:
    """A rank of about ``gb`` GB in ``files`` safetensors files (FP8 linears with scales, bf16
    embeddings, norms), and each tensor's fingerprint as written."""
    hidden, inter, vocab = 4096, 14336, 32000
    embed = vocab * hidden * 2
    per_layer = (3 * hidden * hidden + hidden * hidden + 3 * hidden * inter) + 8 * hidden  # fp8 bytes + norms
    layers = max(1, int((gb * GB - 2 * embed) // per_layer)) if gb * GB > 2 * embed + per_layer else 0
    if layers == 0:  # a small rank (dry runs): shrink the shapes instead
        scale = max(gb * GB / (2 * embed + per_layer), 1e-4) ** 0.5
        hidden, inter, vocab = max(64, int(hidden * scale) // 64 * 64), max(64, int(inter * scale) // 64 * 64), 4096
        layers = 2
    marker = os.path.join(work, f"rank-{gb}-{files}.json")
    if os.path.exists(marker):
        with open(marker) as f:
            built = json.load(f)
        return built["paths"], {k: int(v) for k, v in built["fingerprints"].items()}
    g = torch.Generator().manual_seed(0)
    # Random FP8 values from one pool, each tensor at its own offset: distinct tensors (a misplaced
    # byte range shows as inequality) without drawing billions of normals for an 8 GB rank.
    pool = (torch.randn(64 * 1024 * 1024 + 7919, generator=g) * 0.5).to(torch.float8_e4m3fn)
    cursor = [0]

    def fp8(rows: int, cols: int) -> torch.Tensor:
        n, out = rows * cols, torch.empty(rows * cols, dtype=torch.float8_e4m3fn)
        done = 0
        while done < n:
            start = cursor[0] % (pool.numel() - 1)
            take = min(n - done, pool.numel() - start)
            out[done : done + take] = pool[start : start + take]
            done += take
            cursor[0] += 7919 * (take // 7919 + 1)
        return out.view(rows, cols)

    tensors: list[tuple[str, torch.Tensor]] = [
        ("model.embed_tokens.weight", torch.randn(vocab, hidden, generator=g).to(torch.bfloat16))
    ]
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, (rows, cols) in {
            "self_attn.qkv_proj": (3 * hidden, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_up_proj": (2 * inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }.items():
            tensors.append((p + name + ".weight", fp8(rows, cols)))
            tensors.append((p + name + ".weight_scale", torch.rand(rows, 1, generator=g) + 0.5))  # per channel
            tensors.append((p + name + ".input_scale", torch.rand(1, generator=g)))  # per tensor
        tensors.append((p + "input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)))
        tensors.append((p + "post_attention_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)))
    tensors.append(("model.norm.weight", torch.ones(hidden, dtype=torch.bfloat16)))
    tensors.append(("lm_head.weight", torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)))
    prints = {name: fingerprint(t) for name, t in tensors}
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    paths, part, size = [], {}, 0
    for name, t in tensors:
        part[name] = t
        size += t.numel() * t.element_size()
        if size >= total / files and len(paths) < files - 1:
            paths.append(_save(work, len(paths), part))
            part, size = {}, 0
    if part:
        paths.append(_save(work, len(paths), part))
    with open(marker, "w") as f:
        json.dump({"paths": paths, "fingerprints": {k: str(v) for k, v in prints.items()}}, f)
    return paths, prints


def _save(work: str, index: int, part: dict[str, torch.Tensor]) -> str:
    path = os.path.join(work, f"model-{index:05d}.safetensors")
    save_file(part, path)
    return path


# ---------------------------------------------------------------------------- the page cache, checked

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_pages(path: str) -> tuple[int, int]:
    """How many of a file's pages are in the page cache, and how many it has: ``mincore`` over a
    shared mapping of the whole file (mapping reads nothing; the kernel answers from the cache)."""
    size = os.path.getsize(path)
    pages = (size + PAGE - 1) // PAGE
    if size == 0:
        return 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
            return sum(v & 1 for v in vector), pages
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def resident_share(paths: list[str]) -> float:
    """The share of the files' pages that are in the page cache (0 to 1)."""
    counts = [resident_pages(p) for p in paths]
    total = sum(n for _, n in counts)
    return sum(r for r, _ in counts) / total if total else 0.0


def meminfo_cached() -> int:
    """``Cached`` of ``/proc/meminfo``, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def in_vm() -> bool:
    """Whether this machine is a virtual machine (the CPU's ``hypervisor`` flag): its host may cache
    the virtual disk's blocks where the guest cannot drop them."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " hypervisor" in line for line in f)
    except OSError:
        return False


def make_cold(paths: list[str]) -> dict:
    """Drop the files from the page cache and check it: what was resident before and after
    (``mincore``), how far ``Cached`` fell, and whether the eviction is verified (at most 1% left)."""
    before, cached = resident_share(paths), meminfo_cached()
    harness.evict(paths)
    after = resident_share(paths)
    return {
        "how": COLD_HOW,
        "resident_before": round(before, 4),
        "resident_after": round(after, 4),
        "cached_drop_bytes": cached - meminfo_cached(),
        "verified": after <= EVICTED,
    }


def make_warm(paths: list[str]) -> dict:
    """Read the files once and check that every page stayed in the page cache."""
    harness.warm(paths)
    share = resident_share(paths)
    return {"how": "every file read once", "resident": round(share, 4), "verified": share >= 1 - EVICTED}


# ---------------------------------------------------------------------------- the methods


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def method_names(device: str, threads: list[int], spans: list[int]) -> list[str]:
    """Every method, in the order they run."""
    names = (["h2d_pinned"] if device.startswith("cuda") else []) + [
        "safetensors_to",
        "fastsafetensors",
        "instanttensor",
    ]
    return names + [f"ours_t{t}_s{s}_{way}" for t in threads for s in spans for way in ("pc", "direct")]


def method(name: str, paths: list[str], device: str) -> Callable[[], dict[str, torch.Tensor]]:
    """One method, set up (what it keeps between passes made here, outside any timing): a call
    loads the rank's tensors onto ``device``. Raises ``LookupError`` where it cannot run here."""
    headers = [local.read_header(p) for p in paths]
    if name == "h2d_pinned":
        if not device.startswith("cuda"):
            raise LookupError("needs CUDA")
        nbytes = sum(os.path.getsize(p) for p in paths)
        # Allocated once, outside the timing: the bound is the copy, not cudaHostAlloc.
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def h2d() -> dict[str, torch.Tensor]:
            dev.copy_(host, non_blocking=True)
            return {}

        return h2d
    if name == "safetensors_to":

        def safetensors_to() -> dict[str, torch.Tensor]:
            tensors = {}
            for p in paths:
                with safe_open(p, framework="pt", device="cpu") as f:
                    for k in f.keys():  # noqa: SIM118
                        tensors[k] = f.get_tensor(k).to(device)
            return tensors

        return safetensors_to
    if name == "fastsafetensors":
        try:
            from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        except Exception as e:
            raise LookupError(f"{type(e).__name__}: {e}") from None

        def fastsafetensors() -> dict[str, torch.Tensor]:
            loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
            try:
                loader.add_filenames({0: paths})
                buffers = loader.copy_files_to_device()
                tensors = {k: buffers.get_tensor(k).clone() for h in headers for k in h.tensors}
                buffers.close()
            finally:
                loader.close()
            return tensors

        return fastsafetensors
    if name == "instanttensor":
        if not device.startswith("cuda"):
            raise LookupError("needs CUDA")
        try:
            import instanttensor
        except Exception as e:
            raise LookupError(f"{type(e).__name__}: {e}") from None

        def instant() -> dict[str, torch.Tensor]:
            tensors = {}
            with instanttensor.safe_open(list(paths), framework="pt", device=device) as f:  # all files, as it is meant
                for tensor_name, t in f.tensors():
                    tensors[tensor_name] = t.clone()
            return tensors

        return instant
    threads, span, way = name.removeprefix("ours_").split("_")
    t, s = int(threads.removeprefix("t")), int(span.removeprefix("s"))

    def ours() -> dict[str, torch.Tensor]:
        targets = {
            n: torch.empty(e.shape, dtype=DTYPES[e.dtype], device=device) for h in headers for n, e in h.tensors.items()
        }
        os.environ[direct.ENV] = "on" if way == "direct" else "off"
        try:
            tensor_files.read_files(headers, targets, options=ReadOptions(threads=t, span_bytes=s * MiB))
        finally:
            os.environ.pop(direct.ENV, None)
        return targets

    return ours


def applies(name: str, mode: str) -> bool:
    """``O_DIRECT`` is measured cold only: warm files are read from the page cache (``auto`` keeps it)."""
    return not (name.endswith("_direct") and mode == "warm")


# ---------------------------------------------------------------------------- one process


def one_process(spec: dict) -> dict:
    """Runs in a fresh process: set the method up, make the cache cold or warm and check it, time
    the first pass, then ``repeats`` more, each after the cache is made so again."""
    device, paths, mode = spec["device"], spec["paths"], spec["mode"]
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context, outside the timing
    load = method(spec["method"], paths, device)
    nbytes = sum(os.path.getsize(p) for p in paths)
    passes = []
    for number in range(1 + spec["repeats"]):
        cache = make_cold(paths) if mode == "cold" else make_warm(paths)
        sync(device)
        cpu, start = cpu_seconds(), time.perf_counter()
        tensors = load()
        sync(device)
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
        prints = {k: str(fingerprint(t)) for k, t in tensors.items()}
        passes.append(
            {
                "pid": os.getpid(),
                "pass": number,
                "seconds": seconds,
                "cpu_s": cpu,
                "gb_per_s": nbytes / seconds / GB,
                "cache": cache,
                "fingerprints": prints,
            }
        )
        del tensors
    return {"passes": passes}


def run_process(spec: dict, timeout: float) -> dict:
    """One method and mode in a fresh interpreter; its passes, or why it did not run."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.gpu_bench", "--child", json.dumps(spec)],
            cwd=harness.ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return {"error": tail[0]}
    return json.loads(lines[-1].removeprefix("RESULT "))


# ---------------------------------------------------------------------------- the run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=8.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2, help="fresh processes per method and mode")
    parser.add_argument("--repeats", type=int, default=1, help="passes after the first in each process, reported apart")
    parser.add_argument("--threads", default="4,8,16")
    parser.add_argument("--spans", default="16,64", help="span sizes in MiB")
    parser.add_argument("--modes", default="cold,warm")
    parser.add_argument("--methods", default="", help="only the methods whose names start with one of these")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "sharded-gpu-bench"))
    parser.add_argument("--json")
    parser.add_argument(
        "--budget-s", type=float, default=0, help="start no new process after this many seconds (a lent GPU's limit)"
    )
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, a small rank: checks the command here")
    parser.add_argument("--report", help="print the table of a saved --json result and stop")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(one_process(json.loads(args.child))), flush=True)
        return
    if args.report:
        with open(args.report) as f:
            print(markdown(json.load(f)))
        return
    if args.dry_run:
        device = "cpu"
        args.gb = min(args.gb, 0.05)
    elif torch.cuda.is_available():
        device = "cuda:0"
    else:
        raise SystemExit("no CUDA device: run on a lent GPU, or with --dry-run to check the command on the CPU")
    os.makedirs(args.work, exist_ok=True)
    paths, reference = build(args.work, args.gb, args.files)
    names = method_names(device, [int(x) for x in args.threads.split(",")], [int(x) for x in args.spans.split(",")])
    if args.methods:
        names = [n for n in names if n.startswith(tuple(args.methods.split(",")))]
    run = Run(args, device, paths, reference)
    began = time.monotonic()
    for number in range(args.runs):
        for mode in args.modes.split(","):
            for name in names:
                if name in run.notes or not applies(name, mode):
                    continue
                if args.budget_s and time.monotonic() - began > args.budget_s:
                    run.notes.setdefault("budget", f"stopped before run {number + 1} {mode}: --budget-s spent")
                    break
                spec = {"device": device, "paths": paths, "mode": mode, "method": name, "repeats": args.repeats}
                run.add(name, mode, run_process(spec, timeout=max(60.0, args.budget_s or 600.0)))
                run.write()  # after every process: a run cut off at the lent machine's limit keeps its figures
    result = run.write()
    print(markdown(result))
    if run.failed:
        raise SystemExit(f"methods that failed: {', '.join(run.failed)} (see not_run)")
    if not all(s["every_tensor_equal"] for by_mode in result["summary"].values() for s in by_mode.values()):
        raise SystemExit("some method loaded tensors that differ from the files: see every_tensor_equal")


class Run:
    """What a run has measured so far, and its results file."""

    def __init__(self, args: argparse.Namespace, device: str, paths: list[str], reference: dict[str, int]):
        self.args, self.device, self.paths, self.reference = args, device, paths, reference
        self.first: dict[str, dict[str, list[dict]]] = {}
        self.repeats: dict[str, dict[str, list[dict]]] = {}
        self.notes: dict[str, str] = {}
        self.failed: list[str] = []

    def add(self, name: str, mode: str, outcome: dict) -> None:
        if "error" in outcome:
            why = outcome["error"]
            self.notes[name] = f"not run: {why}" if "LookupError" in why else f"failed: {why}"
            if "LookupError" not in why:
                self.failed.append(name)
            print(f"{name:28s} {mode:5s} {self.notes[name]}", flush=True)
            return
        for row in outcome["passes"]:
            prints = row.pop("fingerprints")
            row["equal"] = None if name == "h2d_pinned" else prints == {k: str(v) for k, v in self.reference.items()}
            kept = self.first if row["pass"] == 0 else self.repeats
            kept.setdefault(name, {}).setdefault(mode, []).append(row)
            print(
                f"{name:28s} {mode:5s} pass {row['pass']} (pid {row['pid']}) {row['gb_per_s']:8.3f} GB/s "
                f"{row['seconds']:8.3f} s {row['cpu_s']:7.2f} CPU s  equal={row['equal']} "
                f"cache verified={row['cache']['verified']}",
                flush=True,
            )

    def write(self) -> dict:
        result = report(self.args, self.device, self.paths, self.first, self.repeats, self.notes)
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(result, f, indent=1)
        return result


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def report(
    args: argparse.Namespace, device: str, paths: list[str], first: dict, repeats: dict, notes: dict[str, str]
) -> dict:
    """The results so far: per method and mode, the medians of the first passes (one per fresh
    process) and, apart, of the repeat passes; every pass; how the cache was made cold, and whether
    every eviction was verified."""
    summary: dict[str, dict[str, dict]] = {}
    for name, by_mode in first.items():
        for mode, rows in by_mode.items():
            again = repeats.get(name, {}).get(mode, [])
            summary.setdefault(name, {})[mode] = {
                "gb_per_s_median": _median(rows, "gb_per_s"),
                "seconds_median": _median(rows, "seconds"),
                "cpu_s_median": _median(rows, "cpu_s"),
                "every_tensor_equal": all(r["equal"] is not False for r in rows + again),
                "cache_verified": all(r["cache"]["verified"] for r in rows + again),
                **({"repeat_gb_per_s_median": _median(again, "gb_per_s")} if again else {}),
            }
    colds = [r["cache"] for by_mode in (*first.values(), *repeats.values()) for r in by_mode.get("cold", [])]
    vm = in_vm()
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    return {
        **harness.record(gpu=gpu),
        "device": gpu or "cpu (dry run)",
        "torch": torch.__version__,
        "bytes": sum(os.path.getsize(p) for p in paths),
        "files": len(paths),
        "runs": args.runs,
        "repeats": args.repeats,
        "passes": "the headline of each method and mode is its first pass in a fresh process (one load per "
        "process, as an engine loads), one process per run; the repeat passes ran in the same processes after it",
        "cold": {
            "how": COLD_HOW,
            "checked": "mincore over a mapping of every file, before and after; /proc/meminfo Cached around it",
            "verified": bool(colds) and all(c["verified"] for c in colds),
            "most_resident_after": max((c["resident_after"] for c in colds), default=None),
            "in_vm": vm,
            "host_cache": "not emptied: a guest cannot drop its host's cache of the virtual disk, so cold figures "
            "are upper bounds of a cold disk's"
            if vm
            else "no hypervisor flag: the disk is the machine's own",
        },
        "summary": summary,
        "not_run": notes,
        "raw": first,
        "repeat_passes": repeats,
    }


def markdown(result: dict) -> str:
    """A saved result as a table: per method, warm and cold GB/s of the first pass in a fresh process
    (median and every process), the repeat passes apart, and CPU seconds."""
    gb = result["bytes"] / GB
    fresh = "repeat_passes" in result  # results before the fresh processes ran every pass in one process
    lines = [
        f"Device: {result['device']}, torch {result['torch']}; commit {result.get('commit', '?')}, "
        f"{result.get('date', '?')}; rank: {gb:.2f} GB in {result['files']} files; {result['runs']} "
        + ("fresh processes per method and mode, each one first pass" if fresh else "passes per method in one process")
        + (f" and {result['repeats']} repeat passes." if fresh else "."),
        "",
        "| method | warm GB/s | warm repeats | warm CPU s | cold GB/s | cold repeats | cold CPU s "
        "| every tensor equal |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cells(name: str, mode: str) -> tuple[str, str, str]:
        s = result["summary"][name].get(mode)
        if s is None:
            return "", "", ""
        runs = ", ".join(f"{r['gb_per_s']:.2f}" for r in result["raw"][name][mode])
        again = f"{s['repeat_gb_per_s_median']:.2f}" if "repeat_gb_per_s_median" in s else ""
        return f"{s['gb_per_s_median']:.2f} ({runs})", again, f"{s['cpu_s_median']:.2f}"

    for name, by_mode in result["summary"].items():
        warm, cold = cells(name, "warm"), cells(name, "cold")
        equal = "n/a" if name == "h2d_pinned" else str(all(s["every_tensor_equal"] for s in by_mode.values()))
        lines.append(f"| `{name}` | {' | '.join(warm)} | {' | '.join(cold)} | {equal} |")
    lines += [f"| `{name}` | {why} | | | | | | |" for name, why in result["not_run"].items()]
    cold = result.get("cold")
    if cold:
        lines += [
            "",
            f"Cold: {cold['how']}; checked with {cold['checked']}: "
            + ("every eviction verified" if cold["verified"] else "**not every eviction verified**")
            + f" (at most {cold['most_resident_after']} of the pages left). Host cache: {cold['host_cache']}.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
