"""The object-storage read benchmark on every store: S3 (SeaweedFS), Azure (Azurite), GCS (fake-gcs-server).

One run, the same checkpoint on each store's emulator on loopback (``examples/s3_server.py``,
``examples/cloud_servers.py``): a bfloat16 checkpoint of random tensors (``--mib`` in all), saved
at TP=1 and TP=2, uploaded to each store (through obstore; to fake-gcs-server, which refuses
obstore's uploads, through its JSON API). Then, round-robin over the stores so that the
machine's drift hits every row alike, ``--runs`` times:

- ``raw_get``: the store's bandwidth for the same bytes, measured here, as in ``s3_bench.py``:
  one process per rank, all at once, each fetching its rank's parts by parallel ranged GETs
  (16 MiB ranges, as many in flight as our loader at that TP) through the same client as our
  loader, into one preallocated buffer;
- ``ours``: our loader, engine-free (``load_rank`` in a fresh process per rank, all ranks of the
  TP size at once, as vLLM's workers run; the slowest rank counts), with size checks.

Engine-level rows (``LLM(model=URL)``, Run:ai's loader) are ``s3_bench.py``'s on S3. These are
emulators on one shared machine: the figures compare the stores' code paths here, not the clouds.

    python -m benchmarks.stores_bench --out benchmarks/results        # ~5 minutes here
    python -m benchmarks.stores_bench --report benchmarks/results/stores_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from benchmarks import harness
from benchmarks.harness import GB, rank_parts, raw_get

BUCKET = "models"
STORES = ("s3", "az", "gs")
NAMES = {"s3": "S3 (SeaweedFS)", "az": "Azure (Azurite)", "gs": "GCS (fake-gcs-server)"}

# One rank's engine-free load, timed inside its process (imports and manifest excluded).
RANK_LOAD = """
import json, sys, time, torch
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
from vllm_sharded_loader.storage.location import open_store

url, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
manifest = read_manifest(url)
entry = manifest.rank(rank, 0)
targets = {n: torch.empty(t.shape, dtype=getattr(torch, manifest.dtype)) for n, t in entry.tensors.items()}
for t in targets.values():
    t.view(-1)[::1024] = 0  # every page touched, as the parameters are before a load
started = time.perf_counter()
stats = load_rank(LoadRequest(open_store(url), manifest, verify="size"), targets, RankInfo(rank, tp))
print("RESULT " + json.dumps({"seconds": time.perf_counter() - started, "bytes": stats.bytes_read}))
"""


def build(work: str, mib: int) -> dict[int, str]:
    """The checkpoint at TP=1 and TP=2 in local folders (row-split tensors of 32 MiB)."""
    import torch

    from vllm_sharded_loader.checkpoint import RankInfo
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    from vllm_sharded_loader.format import SourceModel

    generator = torch.Generator().manual_seed(0)
    count = max(mib // 32, 2)
    tensors = {
        f"layers.{i}.weight": torch.randn(4096, 4096, generator=generator).to(torch.bfloat16) for i in range(count)
    }
    dirs = {}
    for tp in (1, 2):
        ranks = {RankInfo(r, tp): {n: t.chunk(tp)[r].contiguous() for n, t in tensors.items()} for r in range(tp)}
        dirs[tp] = os.path.join(work, f"tp{tp}")
        save_checkpoint(
            dirs[tp],
            ranks,
            dtype="bfloat16",
            source=SourceModel("Bench", "0" * 64, {}),
            options=SaveOptions(max_size=256 << 20),
        )
    return dirs


def start(scheme: str, work: str):
    from examples.cloud_servers import Azurite, FakeGCS
    from examples.s3_server import SeaweedS3

    server = {"s3": SeaweedS3, "az": Azurite, "gs": FakeGCS}[scheme](os.path.join(work, f"server-{scheme}"))
    os.makedirs(server.workdir, exist_ok=True)
    server.start()
    server.create_bucket(BUCKET)
    return server


def use(scheme: str, server) -> None:
    """Point this process (and the loads it starts) at the store's server."""
    from vllm_sharded_loader.storage import objects

    os.environ.update(server.aws_environment() if scheme == "s3" else server.environment())
    objects._store.cache_clear()


def upload(scheme: str, server, directory: str, url: str) -> None:
    from pathlib import Path

    from vllm_sharded_loader.storage import objects

    where = objects.ObjectPrefix.parse(url)
    for name in sorted(os.listdir(directory)):
        if scheme == "gs":
            server.upload(BUCKET, where.key(name), Path(directory, name).read_bytes())
        else:
            objects.put(where, name, Path(directory, name))


def ours(url: str, tp: int) -> dict:
    """Every rank's engine-free load at once, each in its own process; the slowest counts."""

    def one(rank: int) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", RANK_LOAD, url, str(tp), str(rank)], capture_output=True, text=True, timeout=900
        )
        found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
        if proc.returncode or not found:
            raise RuntimeError(f"load of rank {rank} from {url} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return json.loads(found.group(1))

    with ThreadPoolExecutor(tp) as pool:
        ranks = list(pool.map(one, range(tp)))
    return {"load_seconds": max(r["seconds"] for r in ranks), "rank_seconds": sorted(r["seconds"] for r in ranks)}


def measure(args: argparse.Namespace) -> dict:
    work = args.work or tempfile.mkdtemp(prefix="stores-bench-")
    dirs = build(work, args.mib)
    result: dict = {
        "machine": harness.machine(),
        "command": harness.command(),
        "mib": args.mib,
        "rows": [],
    }
    servers = {scheme: start(scheme, work) for scheme in args.stores}
    try:
        for scheme, server in servers.items():
            use(scheme, server)
            for tp in (1, 2):
                upload(scheme, server, dirs[tp], f"{scheme}://{BUCKET}/tp{tp}")
        use(args.stores[0], servers[args.stores[0]])
        result["bytes"] = {
            tp: sum(s for parts in rank_parts(f"{args.stores[0]}://{BUCKET}/tp{tp}", tp) for _, s in parts)
            for tp in (1, 2)
        }
        for run in range(args.runs):
            for scheme in args.stores if run % 2 == 0 else reversed(args.stores):
                use(scheme, servers[scheme])
                for tp in (1, 2):
                    url = f"{scheme}://{BUCKET}/tp{tp}"
                    rows = [{"loader": "raw_get", **raw_get(url, tp)}]
                    loaded = ours(url, tp)
                    rows.append({"loader": "ours", **loaded, "gbps": result["bytes"][tp] / loaded["load_seconds"] / GB})
                    for row in rows:
                        row.update(run=run, store=scheme, tp=tp)
                        result["rows"].append(row)
                        print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return result


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        f"Checkpoint: {result['bytes']['1'] / 1e6:.0f} MB bfloat16, at TP=1 and TP=2; medians of "
        f"{len({r['run'] for r in rows})} runs; GB/s are all ranks together.",
        "",
        "| store | TP | raw parallel GET (GB/s) | ours: load (s) | ours (GB/s) | ours vs raw GET | runs (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for scheme in STORES:
        for tp in (1, 2):
            mine = [r for r in rows if r["store"] == scheme and r["tp"] == tp]
            if not mine:
                continue
            raw = statistics.median(r["gbps"] for r in mine if r["loader"] == "raw_get")
            loads = [r for r in mine if r["loader"] == "ours"]
            seconds = statistics.median(r["load_seconds"] for r in loads)
            gbps = result["bytes"][str(tp)] / seconds / GB
            runs = ", ".join(f"{r['load_seconds']:.2f}" for r in loads)
            lines.append(
                f"| {NAMES[scheme]} | {tp} | {raw:.2f} | {seconds:.2f} | {gbps:.2f} | {100 * gbps / raw:.0f}% "
                f"| {runs} |"
            )
    lines += [
        "",
        "`raw parallel GET` runs one process per rank, all at once, with as many requests in flight as our "
        "loader; its buffers are touched beforehand, our targets too.",
        "",
        "Re-run: `python -m benchmarks.stores_bench --out benchmarks/results` (about 3 minutes here).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="folder for stores_bench.json and stores_bench.md")
    parser.add_argument("--work", default=None, help="work folder (checkpoints, server data)")
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    parser.add_argument("--report", default=None, help="print the table of a saved stores_bench.json")
    harness.report_or_measure(parser.parse_args(), "stores_bench", measure, markdown)


if __name__ == "__main__":
    main()
