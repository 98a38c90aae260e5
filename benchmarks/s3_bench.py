"""Loading from object storage inside real vLLM: our ``s3://`` load against the Run:ai streamer and raw GETs.

One run, on one S3 server (SeaweedFS on loopback, ``examples/s3_server.py``) and the same
objects: it builds a bfloat16 Llama-style model in process (``harness.build``), saves
it sharded at TP=1 and TP=2 (``examples/save_sharded_state.py``), uploads both checkpoints
to the bucket, then, round-robin so that the machine's drift hits every row alike:

- ``raw_get``: the server's bandwidth for the same bytes, in the shape of the load: one
  process per rank, all ranks at once (as vLLM's workers), each fetching its own rank's
  parts by parallel ranged GETs through the same client as our loader, with as many
  requests in flight as our loader uses at that TP (16 MiB ranges, ``remote_threads``),
  into one buffer touched beforehand (the network and the server, not first-touch
  faults); the rate is all ranks' bytes over the slowest rank's time;
- ``ours``: ``LLM(model="s3://...", load_format="sharded_state")`` with this plugin (each rank
  reads its own parts by ranged GETs straight into its parameters);
- ``runai``: vLLM's ``runai_streamer_sharded`` on the same objects (``runai-model-streamer``).

``load_weights`` is timed the same way for both loaders by ``timing/sitecustomize.py``
(a TP=2 run counts its slowest rank), with the CPU seconds its processes spent in it;
engine start is the time until ``LLM(...)`` returns, what a user waits for. Every engine
must give the same greedy token ids. Peak extra memory of our reader is measured
engine-free: peak RSS of a process that loads one rank from the bucket into freshly
allocated tensors, minus the tensors' bytes.

    python -m benchmarks.s3_bench --out benchmarks/results          # ~15 minutes here
    python -m benchmarks.s3_bench --report benchmarks/results/s3_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks import harness
from benchmarks.harness import machine_line, rank_parts, raw_get, upload

GB = 1e9
BUCKET = "models"
LOADERS = ("ours", "runai")


READER_MEMORY = """
import json, sys, threading, time, torch
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
from vllm_sharded_loader.storage.location import open_store


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
stats = load_rank(LoadRequest(open_store(url), manifest, verify="size"), targets, RankInfo(0, tp))
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
    env = harness.engine_env(tp, plugins=loader == "ours", timing=timing)
    env["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"  # path-style requests to the loopback endpoint
    result, loads, log = harness.start_engine(spec, env, timing, f"{loader} TP={tp}")
    if (loader == "ours") != ("vllm_sharded_loader.ShardedStateLoader" in log):
        raise RuntimeError(f"{loader}: our loader ran when it should not, or did not when it should:\n{log[-3000:]}")
    result["load_seconds"] = max(entry["seconds"] for entry in loads)
    result["rank_seconds"] = sorted(entry["seconds"] for entry in loads)
    # CPU seconds of every rank's process inside load_weights (all its threads).
    result["cpu_seconds"] = sum(e["load_weights_cpu"]["user"] + e["load_weights_cpu"]["sys"] for e in loads)
    result["loader_class"] = sorted({entry["loader"] for entry in loads})
    return result


def measure(args: argparse.Namespace) -> dict:
    from examples.s3_server import SeaweedS3

    work = args.work or tempfile.mkdtemp(prefix="s3-bench-")
    hf = harness.build(work, args.layers)
    dirs = {tp: os.path.join(work, f"sharded-tp{tp}") for tp in (1, 2)}
    for tp, out in dirs.items():
        harness.save(hf, out, tp)
    result: dict = {
        "machine": harness.machine(),
        "command": harness.command(),
        "layers": args.layers,
        "rows": [],
    }
    # A fresh server each run (the checkpoints are uploaded again): SeaweedFS restarted on an
    # earlier run's data refuses its readiness probe (the probe bucket exists already).
    shutil.rmtree(os.path.join(work, "seaweed"), ignore_errors=True)
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
                row = {"run": run, "tp": tp, "loader": "raw_get", **raw_get(urls[tp], tp, server.process.pid)}
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
                        "cpu_seconds": engine["cpu_seconds"],
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
    m = result["machine"]
    runs = len({r["run"] for r in rows})
    command = result.get("command", "python -m benchmarks.s3_bench --out benchmarks/results")
    if not command.startswith("python"):  # recorded as the script's path, before benchmarks/ was a package
        command = f"PYTHONPATH=. python {command}"
    lines = [
        "# Object storage (S3) load inside vLLM: ours, Run:ai, raw parallel GET",
        "",
        f"Re-run: `{command}` (under `flock /tmp/vsl-engine.lock` on a shared machine).",
        "",
        f"Machine: {machine_line(m)}; "
        f"{m['platform']}, Python {m['python']}. SeaweedFS runs on the same 2 cores as the engines. "
        f"Model: {result['layers']} layers, bfloat16, {result['bytes']['1'] / 1e6:.0f} MB. Medians of {runs} runs, "
        "engines round-robin with the raw GETs. GB/s are all ranks together (a TP=2 load: both ranks' bytes over "
        "the slowest rank's `load_weights`).",
        "",
        "| TP | loader | `load_weights` (s), median | GB/s | runs (s) | engine start (s) | CPU s per GB "
        "| vs Run:ai | vs raw GET |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tp in (1, 2):
        total = result["bytes"][str(tp)]
        raw = [r for r in rows if r["tp"] == tp and r["loader"] == "raw_get"]
        raw_gbps = median(raw, "gbps")
        runai = median([r for r in rows if r["tp"] == tp and r["loader"] == "runai"], "load_seconds")
        for loader in LOADERS:
            mine = [r for r in rows if r["tp"] == tp and r["loader"] == loader]
            seconds = median(mine, "load_seconds")
            gbps = total / seconds / GB
            times = ", ".join(f"{r['load_seconds']:.2f}" for r in mine)
            cpu = statistics.median(r["cpu_seconds"] / (total / GB) for r in mine) if "cpu_seconds" in mine[0] else None
            lines.append(
                f"| {tp} | {loader} | {seconds:.3f} | {gbps:.2f} | {times} | "
                f"{median(mine, 'engine_start_seconds'):.1f} | {'' if cpu is None else f'{cpu:.2f}'} | "
                f"{runai / seconds:.2f}x | {100 * gbps / raw_gbps:.0f}% |"
            )
        times = ", ".join(f"{r['gbps']:.2f}" for r in raw)
        cpu = (
            statistics.median(r["client_cpu_seconds"] / (total / GB) for r in raw)
            if "client_cpu_seconds" in raw[0]
            else None
        )
        threads = raw[0].get("threads_per_rank", "?")
        lines.append(
            f"| {tp} | raw parallel GET ({tp} process{'es' if tp > 1 else ''} x {threads} requests) | "
            f"{total / raw_gbps / GB:.3f} | {raw_gbps:.2f} | {times} GB/s | | {'' if cpu is None else f'{cpu:.2f}'} "
            "| | 100% |"
        )
    server = [r for r in rows if "server_cpu_seconds" in r]
    if server:
        per_gb = statistics.median(r["server_cpu_seconds"] / (result["bytes"][str(r["tp"])] / GB) for r in server)
        lines += [
            "",
            f"CPU s per GB: the loading processes' CPU time (user + system, all threads) per GB loaded; the server "
            f"(SeaweedFS) spent another {per_gb:.2f} CPU s per GB serving the raw GETs (median over TP=1 and TP=2).",
        ]
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
    harness.report_or_measure(parser.parse_args(), "s3_bench", measure, markdown)


if __name__ == "__main__":
    main()
