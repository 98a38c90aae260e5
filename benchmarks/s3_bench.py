"""Loading from object storage inside real vLLM: our ``s3://`` load against the Run:ai streamer and raw GETs.

One run, on one S3 server (SeaweedFS on loopback, ``examples/s3_server.py``) and the same
objects: it builds a bfloat16 Llama-style model in process (``load_bench.build``), saves
it sharded at TP=1 and TP=2 (``examples/save_sharded_state.py``), uploads both checkpoints
to the bucket, then, round-robin so that the machine's drift hits every row alike:

- ``raw_get``: the server's bandwidth for the same bytes, measured here: every part of the
  checkpoint fetched by parallel ranged GETs (16 MiB ranges, 16 threads per rank, through
  the same client as our loader) into one preallocated buffer per rank;
- ``ours``: ``LLM(model="s3://...", load_format="sharded_state")`` with this plugin (each rank
  reads its own parts by ranged GETs straight into its parameters);
- ``runai``: vLLM's ``runai_streamer_sharded`` on the same objects (``runai-model-streamer``).

``load_weights`` is timed the same way for both loaders by ``timing/sitecustomize.py``
(a TP=2 run counts its slowest rank); engine start is the time until ``LLM(...)`` returns.
Every engine must give the same greedy token ids. Peak extra memory of our reader is
measured engine-free: peak RSS of a process that loads one rank from the bucket into
freshly allocated tensors, minus the tensors' bytes.

    python benchmarks/s3_bench.py --out benchmarks/results          # ~15 minutes here
    python benchmarks/s3_bench.py --report benchmarks/results/s3_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import load_bench  # noqa: E402  (build, save, engine_env: the same model and engines as load_bench)

GB = 1e9
BUCKET = "models"
LOADERS = ("ours", "runai")
RANGE = 16 << 20
THREADS = 16


def upload(directory: str, url: str) -> None:
    from vllm_sharded_loader.storage import objects
    from vllm_sharded_loader.storage.location import copy_non_weight_files

    where = objects.ObjectPrefix.parse(url)
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors") or name == "sharded_state.json":
            objects.put(where, name, Path(os.path.join(directory, name)))
    copy_non_weight_files(directory, url)


def rank_parts(url: str, tp: int) -> list[list[tuple[str, int]]]:
    """(object name, size) of each rank's parts, from the manifest."""
    from vllm_sharded_loader.storage.location import read_manifest

    manifest = read_manifest(url)
    assert manifest is not None
    return [[(f.name, f.size) for f in manifest.rank(r, 0).files] for r in range(tp)]


def raw_get(url: str, tp: int) -> float:
    """GB/s of fetching every rank's parts by parallel ranged GETs into preallocated memory."""
    from vllm_sharded_loader.storage import objects

    where = objects.ObjectPrefix.parse(url)
    ranks = rank_parts(url, tp)
    buffers = [bytearray(sum(size for _, size in parts)) for parts in ranks]
    for b in buffers:  # touched: measure the network, not first-touch faults
        b[::4096] = b"\1" * len(b[::4096])
    jobs = []
    for r, parts in enumerate(ranks):
        base = 0
        for name, size in parts:
            opened = objects.ObjectFile.open(where, name)
            for start in range(0, size, RANGE):
                jobs.append((opened, start, min(RANGE, size - start), r, base + start))
            base += size

    def fetch(job) -> int:
        opened, start, length, r, at = job
        memoryview(buffers[r])[at : at + length] = opened._get(start, length)
        return length

    started = time.perf_counter()
    with ThreadPoolExecutor(THREADS * tp) as pool:
        total = sum(pool.map(fetch, jobs))
    return total / (time.perf_counter() - started) / GB


READER_MEMORY = """
import json, sys, threading, time, torch
from vllm_sharded_loader.checkpoint import RankInfo, load_rank, read_manifest


def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


url, tp = sys.argv[1], int(sys.argv[2])
manifest = read_manifest(url)
entry = manifest.rank(0, 0)
targets = {n: torch.empty(t.shape, dtype=getattr(torch, manifest.dtype)) for n, t in entry.tensors.items()}
for t in targets.values():
    t.view(-1)[::1024] = 0  # every page touched, as the parameters are before a load
before, peak, done = rss(), [0], threading.Event()


def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)


sampler = threading.Thread(target=sample)
sampler.start()
started = time.perf_counter()
stats = load_rank(url, targets, RankInfo(0, tp), manifest=manifest, verify="size")
seconds = time.perf_counter() - started
done.set()
sampler.join()
extra = max(peak[0], rss()) - before
print("RESULT " + json.dumps({"seconds": seconds, "bytes": stats.bytes_read, "extra_peak": extra}))
"""


def reader_memory(url: str, tp: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", READER_MEMORY, url, str(tp)], capture_output=True, text=True, timeout=900
    )
    found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if proc.returncode or not found:
        raise RuntimeError(f"engine-free load failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(found.group(1))


def run_engine(loader: str, tp: int, url: str, hf: str, work: str) -> dict:
    timing = os.path.join(work, "timing.jsonl")
    load_format = "sharded_state" if loader == "ours" else "runai_streamer_sharded"
    spec = {"model": url, "tokenizer": hf, "tp": tp, "load_format": load_format, "extra_config": {}}
    env = load_bench.engine_env(tp, plugins=loader == "ours", timing=timing)
    env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"  # path-style requests to the loopback endpoint
    result, loads, log = load_bench.start_engine(spec, env, timing, f"{loader} TP={tp}")
    if (loader == "ours") != ("vllm_sharded_loader.ShardedStateLoader" in log):
        raise RuntimeError(f"{loader}: our loader ran when it should not, or did not when it should:\n{log[-3000:]}")
    result["load_seconds"] = max(entry["seconds"] for entry in loads)
    result["rank_seconds"] = sorted(entry["seconds"] for entry in loads)
    result["loader_class"] = sorted({entry["loader"] for entry in loads})
    return result


def measure(args: argparse.Namespace) -> dict:
    from s3_server import SeaweedS3

    work = args.work or tempfile.mkdtemp(prefix="s3-bench-")
    hf = load_bench.build(work, args.layers)
    dirs = {tp: os.path.join(work, f"sharded-tp{tp}") for tp in (1, 2)}
    for tp, out in dirs.items():
        load_bench.save(hf, out, tp)
    result: dict = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join(sys.argv),
        "layers": args.layers,
        "rows": [],
    }
    with SeaweedS3(os.path.join(work, "seaweed")) as server:
        os.environ.update(server.aws_environment())
        server.create_bucket(BUCKET)
        urls = {tp: f"s3://{BUCKET}/tp{tp}" for tp in (1, 2)}
        for tp in (1, 2):
            upload(dirs[tp], urls[tp])
        result["bytes"] = {tp: sum(size for parts in rank_parts(urls[tp], tp) for _, size in parts) for tp in (1, 2)}
        reference: dict[int, list] = {}
        for run in range(args.runs):
            for tp in (1, 2):
                row = {"run": run, "tp": tp, "loader": "raw_get", "gbps": raw_get(urls[tp], tp)}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                for loader in LOADERS if run % 2 == 0 else reversed(LOADERS):
                    engine = run_engine(loader, tp, urls[tp], hf, work)
                    ids = engine["ids"]
                    if reference.setdefault(tp, ids) != ids:
                        raise RuntimeError(f"{loader} TP={tp} generated other tokens than the first engine")
                    row = {
                        "run": run,
                        "tp": tp,
                        "loader": loader,
                        "load_seconds": engine["load_seconds"],
                        "rank_seconds": engine["rank_seconds"],
                        "engine_start_seconds": engine["engine_start"],
                        "gbps": result["bytes"][tp] / tp / engine["load_seconds"] / GB,
                    }
                    result["rows"].append(row)
                    print(json.dumps(row), flush=True)
            row = {"run": run, "tp": 1, "loader": "ours_engine_free", **reader_memory(urls[1], 1)}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    return result


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "| TP | loader | `load_weights` (s), median | GB/s per rank | runs (s) | engine start (s) "
        "| vs Run:ai | vs raw GET |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for tp in (1, 2):
        raw = [r for r in rows if r["tp"] == tp and r["loader"] == "raw_get"]
        raw_gbps = median(raw, "gbps")
        runai = median([r for r in rows if r["tp"] == tp and r["loader"] == "runai"], "load_seconds")
        for loader in LOADERS:
            mine = [r for r in rows if r["tp"] == tp and r["loader"] == loader]
            seconds = median(mine, "load_seconds")
            per_rank = result["bytes"][str(tp)] / tp / seconds / GB
            runs = ", ".join(f"{r['load_seconds']:.2f}" for r in mine)
            lines.append(
                f"| {tp} | {loader} | {seconds:.3f} | {per_rank:.2f} | {runs} | "
                f"{median(mine, 'engine_start_seconds'):.1f} | {runai / seconds:.2f}x | "
                f"{100 * per_rank * tp / raw_gbps:.0f}% |"
            )
        runs = ", ".join(f"{r['gbps']:.2f}" for r in raw)
        lines.append(f"| {tp} | raw parallel GET | | {raw_gbps / tp:.2f} | {runs} GB/s | | | 100% |")
    free = [r for r in rows if r["loader"] == "ours_engine_free"]
    if free:
        extra = max(r["extra_peak"] for r in free)
        lines.append("")
        lines.append(
            f"Engine-free load of the TP=1 rank from the bucket: {median(free, 'seconds'):.2f} s "
            f"({statistics.median(r['bytes'] / r['seconds'] for r in free) / GB:.2f} GB/s); peak memory beyond the "
            f"parameters {extra / 2**20:.0f} MiB (largest of {len(free)} runs)."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for s3_bench.json and s3_bench.md")
    parser.add_argument("--work", default=None, help="work folder (model, checkpoints, server data)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the model (8: 0.8 GB)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--report", default=None, help="print the table of a saved s3_bench.json")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            print(markdown(json.load(f)))
        return
    result = json.loads(json.dumps(measure(args)))  # int keys as the saved file has them
    table = markdown(result)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "s3_bench.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "s3_bench.md"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
