"""Cold loads through the page cache against ``O_DIRECT`` reads, and the storage's own cold read limit.

One run, engine-free (the code a worker's ``load_weights`` runs: ``checkpoint.load_rank``,
here in the copying mode, no file mappings), on a 1.3 GB-class bfloat16 rank saved with
this package (several parts, small norms):

- ``limit_dd``: ``dd iflag=direct bs=16M`` over every part, one stream (the usual way to
  ask what a disk gives cold);
- ``limit_direct``: the same bytes read with ``O_DIRECT`` by ``--threads`` threads in
  16 MiB requests into one buffer each, nothing copied: the limit our direct path can reach;
- ``cold_pagecache``: ``load_rank`` with ``SHARDED_STATE_DIRECT_IO=off``, files evicted first;
- ``cold_direct``: the same with ``SHARDED_STATE_DIRECT_IO=on``;
- ``cold_auto``: the default (``auto``: the files are not resident, so direct);
- ``warm_auto``: the default on files in the page cache (``auto`` keeps the page cache).

Each load runs in a new process (fresh parameter memory, as at engine start), round-robin,
``--runs`` times; files are evicted with ``posix_fadvise(DONTNEED)`` after an ``fsync``.
Reported: seconds, GB/s and CPU seconds of the process during the load.

    python -m benchmarks.direct_bench --out benchmarks/results       # about 10 minutes here
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import harness
from vllm_sharded_loader.storage.location import open_store

HERE = harness.HERE
ROOT = harness.ROOT
GB = harness.GB
MODES = ("cold_pagecache", "cold_direct", "cold_auto", "warm_auto")


def rank_state(layers: int, hidden: int, inter: int, vocab: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state[p + "self_attn.qkv_proj.weight"] = w(3 * hidden, hidden)
        state[p + "self_attn.o_proj.weight"] = w(hidden, hidden)
        state[p + "mlp.gate_up_proj.weight"] = w(2 * inter, hidden)
        state[p + "mlp.down_proj.weight"] = w(hidden, inter)
        state[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        state[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    state["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return state


def build(work: str, layers: int) -> list[str]:
    from vllm_sharded_loader.checkpoint import RankInfo
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    from vllm_sharded_loader.format import SourceModel, config_sha256, normalize_config

    directory = os.path.join(work, f"rank-{layers}")
    if not os.path.exists(os.path.join(directory, "sharded_state.json")):
        config = {"layers": layers}
        source = SourceModel("BenchForCausalLM", config_sha256(config), normalize_config(config))
        state = rank_state(layers, 2048, 5632, 32000)
        save_checkpoint(
            directory,
            {RankInfo(0, 1): state},
            dtype="bfloat16",
            source=source,
            options=SaveOptions(max_size=512 * 1024**2),
        )
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


evict, warm = harness.evict, harness.warm


def limit_dd(paths: list[str]) -> dict:
    evict(paths)
    start = time.perf_counter()
    for path in paths:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes": sum(os.path.getsize(p) for p in paths)}


def limit_direct(paths: list[str], threads: int) -> dict:
    """Every byte read with O_DIRECT, 16 MiB per request, by ``threads`` threads; nothing copied."""
    from vllm_sharded_loader.storage.direct import WINDOW_BYTES, AlignedBuffer

    evict(paths)
    jobs = [(p, off) for p in paths for off in range(0, os.path.getsize(p), WINDOW_BYTES)]
    lock = threading.Lock()

    def reader() -> None:
        buffer = AlignedBuffer(WINDOW_BYTES)
        fds: dict[str, int] = {}
        try:
            while True:
                with lock:
                    if not jobs:
                        return
                    path, offset = jobs.pop(0)
                fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY | os.O_DIRECT))
                os.preadv(fd, [buffer.view], offset)
        finally:
            for fd in fds.values():
                os.close(fd)
            buffer.close()

    start = time.perf_counter()
    pool = [threading.Thread(target=reader) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"seconds": time.perf_counter() - start, "bytes": sum(os.path.getsize(p) for p in paths)}


def child(directory: str, mode: str, threads: int) -> dict:
    """One load in this (new) process: fresh targets, copying mode; prints its numbers as JSON."""
    import torch

    from vllm_sharded_loader.checkpoint import RankInfo, load_rank, read_manifest
    from vllm_sharded_loader.checkpoint.request import LoadRequest
    from vllm_sharded_loader.storage.reader import ReadOptions

    manifest = read_manifest(directory)
    entry = manifest.rank(0, 0)
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32}
    targets = {name: torch.empty(spec.shape, dtype=dtypes[spec.dtype]) for name, spec in entry.tensors.items()}
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    stats = load_rank(
        LoadRequest(open_store(directory), manifest), targets, RankInfo(0, 1), ReadOptions(threads=threads)
    )
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "mode": mode,
        "seconds": seconds,
        "bytes": stats.bytes_read,
        "cpu_s": (after.ru_utime - cpu.ru_utime) + (after.ru_stime - cpu.ru_stime),
        "threads": stats.threads,
    }


def run_child(directory: str, paths: list[str], mode: str, threads: int) -> dict:
    if mode.startswith("cold"):
        evict(paths)
    else:
        warm(paths)
    env = dict(os.environ, SHARDED_STATE_DIRECT_IO={"cold_pagecache": "off", "cold_direct": "on"}.get(mode, "auto"))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.direct_bench",
            "--child",
            directory,
            "--mode",
            mode,
            "--threads",
            str(threads),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(rows: list[dict]) -> dict:
    gbs = [r["bytes"] / r["seconds"] / GB for r in rows]
    return {
        "runs": len(rows),
        "gb_per_s_median": round(statistics.median(gbs), 3),
        "gb_per_s": [round(x, 3) for x in gbs],
        "seconds_median": round(statistics.median(r["seconds"] for r in rows), 3),
        "cpu_s_median": round(statistics.median(r.get("cpu_s", 0.0) for r in rows), 3),
    }


def markdown(result: dict) -> str:
    lines = [
        "# Cold loads: page cache against O_DIRECT (engine-free `load_rank`, copying mode)",
        "",
        f"Machine: {result['machine'].get('cpu_model', '?')}, {result['machine']['cpus']} CPUs. "
        f"Rank: {result['bytes'] / GB:.2f} GB in {result['files']} parts, "
        f"{result['threads']} reader threads, {result['runs']} runs each (new process per load).",
        "",
        "| what | GB/s (median) | seconds | CPU s | every run (GB/s) |",
        "|---|---|---|---|---|",
    ]
    for key, s in result["summary"].items():
        lines.append(
            f"| `{key}` | {s['gb_per_s_median']} | {s['seconds_median']} | {s['cpu_s_median']} | "
            f"{', '.join(map(str, s['gb_per_s']))} |"
        )
    lines += ["", f"Re-run: `{result['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "sharded-direct-bench"))
    parser.add_argument("--layers", type=int, default=11, help="11: 1.39 GB")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="reader threads (default: the loader's)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from vllm_sharded_loader.storage.reader import DEFAULT_THREADS

    threads = args.threads or DEFAULT_THREADS
    if args.child:
        print(json.dumps(child(args.child, args.mode, threads)))
        return
    os.makedirs(args.work, exist_ok=True)
    paths = build(args.work, args.layers)
    directory = os.path.dirname(paths[0])
    rows: dict[str, list[dict]] = {"limit_dd": [], "limit_direct": [], **{m: [] for m in MODES}}
    for run in range(args.runs):
        rows["limit_dd"].append(limit_dd(paths))
        rows["limit_direct"].append(limit_direct(paths, threads))
        for mode in MODES:
            rows[mode].append(run_child(directory, paths, mode, threads))
        medians = ", ".join(f"{k} {summary(v)['gb_per_s_median']}" for k, v in rows.items())
        print(f"run {run + 1}/{args.runs}: {medians}", flush=True)
    result = {
        "machine": harness.machine(),
        "command": harness.command(),
        "bytes": sum(os.path.getsize(p) for p in paths),
        "files": len(paths),
        "threads": threads,
        "runs": args.runs,
        "summary": {k: summary(v) for k, v in rows.items()},
        "raw": rows,
    }
    harness.write_results(args.out, "direct_bench", result, markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
