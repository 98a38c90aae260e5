"""One command for a lent GPU: our reader against the loaders users would pick, cold and warm.

Runs with what the lent machines have (one GPU, torch, safetensors, numpy; no vLLM, no
blake3), from the repository root:

    python -m benchmarks.gpu_bench --gb 8 --runs 2 --json $OUT/gpu_bench.json

Builds an ``--gb`` GB rank of a realistic shape in ``--work``: several safetensors files,
bfloat16 embeddings and small norms, FP8 (``float8_e4m3fn``) linear weights each with its
float32 scales. Then, each ``cold`` (files evicted with ``posix_fadvise(DONTNEED)`` after an
``fsync``) and ``warm`` (read once before), ``--runs`` times, round-robin:

- ``h2d_pinned``: one pinned host buffer of the rank's size copied to the GPU (the bound of
  any loader that goes through host memory);
- ``safetensors_to``: ``safe_open(device="cpu")`` (a mapping) and ``get_tensor(...).to("cuda")``
  per tensor: vLLM's default loader's pattern;
- ``fastsafetensors``: ``SafeTensorsFileLoader(..., nogds=True)`` (vLLM turns GDS off at TP>1),
  if it imports (carry its wheel, see docs/performance.md);
- ``instanttensor``: ``instanttensor.safe_open`` per file, each tensor cloned out of its
  buffer, if it imports;
- ``ours_t{threads}_s{span MiB}_{direct}``: :func:`vllm_sharded_loader.storage.tensor_files.read_files`
  into preallocated CUDA tensors, across ``--threads``, ``--spans`` and the page cache
  (``pc``) against ``O_DIRECT`` (``direct``; cold only).

Reported per method and mode: GB/s (median), seconds, CPU seconds of the process (every
thread) and whether every tensor equals the file's bytes (compared on the GPU with the
``safetensors_to`` result, byte for byte). Results as JSON (``--json``) and on stdout.

``--dry-run`` runs the same on the CPU (targets in host memory, no CUDA, ``h2d_pinned``
skipped), on a small rank: it checks the command's file building, eviction, peers and our
reader where no GPU is lent (CI runs it: ``tests/test_gpu_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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


def build(work: str, gb: float, files: int) -> list[str]:
    """A rank of about ``gb`` GB in ``files`` safetensors files: FP8 linears with scales, bf16 embeddings, norms."""
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
            return json.load(f)
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
        json.dump(paths, f)
    return paths


def _save(work: str, index: int, part: dict[str, torch.Tensor]) -> str:
    path = os.path.join(work, f"model-{index:05d}.safetensors")
    save_file(part, path)
    return path


evict, warm = harness.evict, harness.warm


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Byte-for-byte equality of every tensor (FP8 compared as bytes)."""
    if set(a) != set(b):
        return False
    return all(
        a[k].shape == b[k].shape
        and a[k].dtype == b[k].dtype
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in a
    )


def methods(paths: list[str], device: str, threads: list[int], spans: list[int]) -> dict[str, Callable]:
    """Each method: (mode) -> its tensors on ``device``, or None where it does not apply to ``mode``."""
    headers = [local.read_header(p) for p in paths]
    nbytes = sum(os.path.getsize(p) for p in paths)
    out: dict[str, Callable] = {}

    if device.startswith("cuda"):
        # Allocated once, outside the timing: the bound is the copy, not cudaHostAlloc.
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)

        def h2d(mode: str) -> dict[str, torch.Tensor]:
            dev.copy_(host, non_blocking=True)
            return {}

        out["h2d_pinned"] = h2d

    def safetensors_to(mode: str) -> dict[str, torch.Tensor]:
        tensors = {}
        for p in paths:
            with safe_open(p, framework="pt", device="cpu") as f:
                for k in f.keys():  # noqa: SIM118
                    tensors[k] = f.get_tensor(k).to(device)
        return tensors

    out["safetensors_to"] = safetensors_to
    try:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        def fastsafetensors(mode: str) -> dict[str, torch.Tensor]:
            loader = SafeTensorsFileLoader(SingleGroup(), device, nogds=True)
            try:
                loader.add_filenames({0: paths})
                buffers = loader.copy_files_to_device()
                tensors = {k: buffers.get_tensor(k).clone() for h in headers for k in h.tensors}
                buffers.close()
            finally:
                loader.close()
            return tensors

        out["fastsafetensors"] = fastsafetensors
    except Exception as e:
        out["fastsafetensors"] = _unavailable(f"{type(e).__name__}: {e}")
    try:
        import instanttensor

        def instant(mode: str) -> dict[str, torch.Tensor]:
            tensors = {}
            with instanttensor.safe_open(list(paths), framework="pt", device=device) as f:  # all files, as it is meant
                for name, t in f.tensors():
                    tensors[name] = t.clone()
            return tensors

        out["instanttensor"] = instant if device.startswith("cuda") else _unavailable("needs CUDA")
    except Exception as e:
        out["instanttensor"] = _unavailable(f"{type(e).__name__}: {e}")

    for t in threads:
        for s in spans:
            for way in ("pc", "direct"):

                def ours(mode: str, t: int = t, s: int = s, way: str = way) -> dict[str, torch.Tensor] | None:
                    if way == "direct" and mode == "warm":
                        return None  # warm files are read from the page cache (auto keeps it)
                    targets = {
                        n: torch.empty(e.shape, dtype=DTYPES[e.dtype], device=device)
                        for h in headers
                        for n, e in h.tensors.items()
                    }
                    os.environ[direct.ENV] = "on" if way == "direct" else "off"
                    try:
                        tensor_files.read_files(headers, targets, options=ReadOptions(threads=t), span_bytes=s * MiB)
                    finally:
                        os.environ.pop(direct.ENV, None)
                    return targets

                out[f"ours_t{t}_s{s}_{way}"] = ours
    return out


def _unavailable(why: str) -> Callable:
    def skip(mode: str) -> None:
        raise LookupError(why)

    return skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=8.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", default="4,8,16")
    parser.add_argument("--spans", default="4,16,64", help="span sizes in MiB")
    parser.add_argument("--modes", default="cold,warm")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "sharded-gpu-bench"))
    parser.add_argument("--json")
    parser.add_argument(
        "--budget-s", type=float, default=0, help="start no new pass after this many seconds (a lent GPU's time limit)"
    )
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, a small rank: checks the command here")
    parser.add_argument("--report", help="print the table of a saved --json result and stop")
    args = parser.parse_args()
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
    paths = build(args.work, args.gb, args.files)
    nbytes = sum(os.path.getsize(p) for p in paths)
    table = methods(paths, device, [int(x) for x in args.threads.split(",")], [int(x) for x in args.spans.split(",")])
    rows: dict[str, dict[str, list[dict]]] = {}
    notes: dict[str, str] = {}
    failed: list[str] = []
    reference: dict[str, torch.Tensor] | None = None
    began, result = time.monotonic(), report(args, device, paths, nbytes, rows, notes)
    for run in range(args.runs):
        for mode in args.modes.split(","):
            if args.budget_s and time.monotonic() - began > args.budget_s:
                notes.setdefault("budget", f"stopped before run {run + 1} {mode}: --budget-s {args.budget_s} spent")
                break
            for name, method in table.items():
                if name in notes:
                    continue
                (evict if mode == "cold" else warm)(paths)
                sync(device)
                cpu, start = cpu_seconds(), time.perf_counter()
                try:
                    tensors = method(mode)
                    sync(device)
                except LookupError as e:
                    notes[name] = f"not run: {e}"
                    continue
                except Exception as e:  # one broken method must not cost the others' figures on a lent GPU
                    notes[name] = f"failed: {type(e).__name__}: {e}"
                    failed.append(name)
                    print(f"{name:28s} {mode:5s} {notes[name]}", flush=True)
                    continue
                if tensors is None:
                    continue
                seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
                if name == "safetensors_to" and reference is None:
                    reference = tensors
                equal = None if name == "h2d_pinned" or reference is None else same(reference, tensors)
                row = {"seconds": seconds, "cpu_s": cpu, "gb_per_s": nbytes / seconds / GB, "equal": equal}
                rows.setdefault(name, {}).setdefault(mode, []).append(row)
                print(
                    f"run {run + 1} {name:28s} {mode:5s} {row['gb_per_s']:8.3f} GB/s {seconds:8.3f} s "
                    f"{cpu:7.2f} CPU s  equal={equal}",
                    flush=True,
                )
                del tensors
                # Written after every measurement: a run cut off at the lent machine's limit keeps its figures.
                result = report(args, device, paths, nbytes, rows, notes)
    for name, by_mode in result["summary"].items():
        for mode, s in by_mode.items():
            print(
                f"{name:28s} {mode:5s} {s['gb_per_s_median']:8.3f} GB/s {s['seconds_median']:8.3f} s "
                f"{s['cpu_s_median']:7.2f} CPU s  equal={s['every_tensor_equal']}"
            )
    for name, why in notes.items():
        print(f"{name:28s} {why}")
    if failed:
        raise SystemExit(f"methods that failed: {', '.join(failed)} (see not_run)")
    if not all(s["every_tensor_equal"] for by_mode in result["summary"].values() for s in by_mode.values()):
        raise SystemExit("some method loaded tensors that differ from the files: see every_tensor_equal")


def markdown(result: dict) -> str:
    """A saved result as a table: per method, warm and cold GB/s (median and every run) and CPU seconds."""
    gb = result["bytes"] / GB
    lines = [
        f"Device: {result['device']}, torch {result['torch']}; rank: {gb:.2f} GB in {result['files']} files; "
        f"{result['runs']} runs.",
        "",
        "| method | warm GB/s | warm CPU s | cold GB/s | cold CPU s | every tensor equal |",
        "|---|---|---|---|---|---|",
    ]

    def cell(name: str, mode: str) -> tuple[str, str]:
        s = result["summary"][name].get(mode)
        if s is None:
            return "", ""
        runs = ", ".join(f"{r['gb_per_s']:.2f}" for r in result["raw"][name][mode])
        return f"{s['gb_per_s_median']:.2f} ({runs})", f"{s['cpu_s_median']:.2f}"

    for name, by_mode in result["summary"].items():
        (warm_gb, warm_cpu), (cold_gb, cold_cpu) = cell(name, "warm"), cell(name, "cold")
        equal = "n/a" if name == "h2d_pinned" else str(all(s["every_tensor_equal"] for s in by_mode.values()))
        lines.append(f"| `{name}` | {warm_gb} | {warm_cpu} | {cold_gb} | {cold_cpu} | {equal} |")
    lines += [f"| `{name}` | {why} | | | | |" for name, why in result["not_run"].items()]
    return "\n".join(lines) + "\n"


def report(args: argparse.Namespace, device: str, paths: list[str], nbytes: int, rows: dict, notes: dict) -> dict:
    """The results so far (medians per method and mode, and every run), written to ``--json`` if given."""
    summary = {
        name: {
            mode: {
                "gb_per_s_median": round(statistics.median(r["gb_per_s"] for r in runs), 3),
                "seconds_median": round(statistics.median(r["seconds"] for r in runs), 3),
                "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 3),
                "every_tensor_equal": all(r["equal"] is not False for r in runs),
            }
            for mode, runs in by_mode.items()
        }
        for name, by_mode in rows.items()
    }
    result = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu (dry run)",
        "machine": harness.machine(),
        "torch": torch.__version__,
        "command": harness.command(),
        "bytes": nbytes,
        "files": len(paths),
        "runs": args.runs,
        "summary": summary,
        "not_run": notes,
        "raw": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
