"""Weight loading inside real vLLM: our loader against vLLM's loaders and the hardware.

One run builds a 1-2 GB bfloat16 Llama-style model (random weights, in process),
saves it sharded at TP=1 and TP=2 with our save script, measures the machine's raw
limits, then starts real engines, round-robin so that drifts of the machine hit every
loader alike:

- ``ours``: ``--load-format sharded_state`` with this plugin, as configured by default
  (CPU parameters served from private mappings of the files);
- ``ours_copy``: the same with ``{"mmap": false}``: every byte copied into the parameters;
- ``builtin``: vLLM's own ``sharded_state`` on the same files (plugins off: ``VLLM_PLUGINS=""``);
- ``default``: vLLM's default safetensors loader on the HF checkpoint;
- ``runai``: ``runai_streamer_sharded`` on the same files (``runai-model-streamer``);
- ``ours_resharded``: our loader on the checkpoint saved at the other TP size.

each ``warm`` (files read once before) and ``cold`` (files evicted with
``posix_fadvise(DONTNEED)``). Weight-loading time is the time of the loader's
``load_weights`` call, taken the same way for every loader by ``timing/sitecustomize.py``
(per rank; a TP=2 run reports its slowest rank). Engine start is the time until
``LLM(...)`` returns. Every engine generates the same greedy tokens, checked here.

    python benchmarks/load_bench.py --out benchmarks/results          # about 45 minutes here
    python benchmarks/load_bench.py --runs 3 --layers 17 --out DIR    # the defaults

Writes ``load_bench.json`` (every raw number), ``load_bench.png`` and ``load_bench.md``
(the tables of ``benchmarks/README.md``) into ``--out``.
"""

from __future__ import annotations

import argparse
import glob
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))  # tiny_models.py, the demo's model builder
GB = 1e9
LOADERS = ("ours", "ours_copy", "builtin", "default", "runai", "ours_resharded")
EXTRA_CONFIG = {"ours_copy": {"mmap": False}}
PROMPT = "the model loads every shard"

# --------------------------------------------------------------------- model and save


def build(work: str, layers: int) -> str:
    from tiny_models import build_model

    hf = os.path.join(work, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        build_model(
            hf,
            "llama",
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
        )
    return hf


def engine_env(tp: int, plugins: bool, timing: str | None = None) -> dict[str, str]:
    from tiny_models import engine_environment

    env = dict(os.environ, **engine_environment(tp))
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if plugins:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = ""  # parses to [""]: an allowlist that matches no plugin
    if timing:
        env["SHARDED_BENCH_TIMING"] = timing
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "timing"), ROOT, env.get("PYTHONPATH", "")])
    return env


def save(hf: str, out: str, tp: int) -> dict:
    """Save with examples/save_sharded_state.py; returns each rank's logged write rate."""
    if os.path.exists(os.path.join(out, "sharded_state.json")):
        return {}
    # Flush other files' dirty pages first (the model just built): an fsync of ours
    # would otherwise wait for them too.
    os.sync()
    # The disk's write speed right now, both ways, to compare this save with.
    probes = {"write_fsync": write_probe(os.path.dirname(out), 1 << 30, direct=False)}
    probes["write_direct"] = write_probe(os.path.dirname(out), 1 << 30, direct=True)
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "save_sharded_state.py"),
            "--model",
            hf,
            "--output",
            out,
            "--tensor-parallel-size",
            str(tp),
            "--enforce-eager",
            "--max-model-len",
            "256",
            *([] if tp == 1 else ["--distributed-executor-backend", "mp"]),
        ],
        env=engine_env(tp, plugins=True),
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        sys.exit(f"save at TP={tp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    log = proc.stdout + proc.stderr
    ranks = re.findall(r"tp_rank=(\d+) .*?saved ([\d.]+) MB in \d+ files to .* in ([\d.]+) s \(([\d.]+) GB/s", log)
    return {
        "total_seconds": time.perf_counter() - started,
        "ranks": [{"rank": int(r), "mb": float(mb), "seconds": float(s), "gbps": float(g)} for r, mb, s, g in ranks],
        "write_before": probes,
    }


def write_probe(directory: str, nbytes: int, direct: bool, streams: int = 1) -> float:
    """GB/s of writing ``nbytes`` of new files in ``streams`` threads from touched memory, fsynced.

    ``direct``: ``O_DIRECT`` from page-aligned buffers, like ``dd oflag=direct bs=64M``;
    otherwise through the page cache then ``fsync``, like ``dd conv=fsync``.
    """
    import mmap

    chunk = 64 << 20
    os.sync()

    def one(i: int) -> None:
        buffer = mmap.mmap(-1, chunk)
        buffer.write(b"\1" * chunk)  # touched
        path = os.path.join(directory, f"write-probe-{i}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o644)
        try:
            for _ in range(nbytes // streams // chunk):
                os.write(fd, buffer)
            os.fsync(fd)
        finally:
            os.close(fd)
            buffer.close()

    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(one, range(streams)))
    seconds = time.perf_counter() - started
    for i in range(streams):
        os.remove(os.path.join(directory, f"write-probe-{i}"))
    return nbytes // streams // chunk * chunk * streams / seconds / GB


# ------------------------------------------------------------------------ raw limits


def files_of(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def evict(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[str]) -> None:
    buffer = bytearray(64 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def sequential_read(paths: list[str], buffer) -> int:
    """One thread, 64 MiB reads, file after file: what `dd` would do."""
    import torch  # noqa: F401  (buffer is a tensor's memory)

    view = memoryview(buffer).cast("B")
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        offset, size = 0, os.fstat(fd).st_size
        while offset < size:
            n = os.preadv(fd, [view[total + offset : total + min(size, offset + (64 << 20))]], offset)
            offset += n
        os.close(fd)
        total += size
    return total


def parallel_read(paths: list[str], buffer, threads: int, chunk: int = 16 << 20) -> int:
    view = memoryview(buffer).cast("B")
    jobs, base = [], 0
    fds = []
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        fds.append(fd)
        size = os.fstat(fd).st_size
        jobs += [(fd, o, base + o, min(chunk, size - o)) for o in range(0, size, chunk)]
        base += size

    def job(j):
        fd, offset, at, n = j
        os.preadv(fd, [view[at : at + n]], offset)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(job, jobs))
    for fd in fds:
        os.close(fd)
    return base


def timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def raw_limits(paths: list[str], runs: int) -> dict:
    """The hardware's numbers on the TP=1 checkpoint's bytes, measured like the loads."""
    import torch

    os.sync()
    from vllm_sharded_loader.storage import local, memory, tensor_files, tensors, writer

    size = sum(os.path.getsize(p) for p in paths)
    touched = torch.ones(size, dtype=torch.uint8).numpy()
    out: dict[str, list[float]] = {k: [] for k in ("cold_sequential", "warm_touched_1", "warm_touched_4")}
    out.update({k: [] for k in ("warm_fresh_1", "warm_fresh_4", "warm_fresh_huge_4", "reader_warm", "reader_cold")})
    out.update({"reader_mapped_warm": [], "reader_mapped_cold": []})
    out.update({"write_fsync_1": [], "write_fsync_2": [], "save_1": [], "save_2": []})
    out.update({"write_direct_1": [], "write_direct_2": []})
    headers = [local.read_header(p) for p in paths]
    # The rank's tensors in memory, as a worker holds them when it saves.
    weights = [
        (n, torch.empty(e.shape, dtype=tensors.torch_dtype(e.dtype, n))) for h in headers for n, e in h.tensors.items()
    ]
    tensor_files.read_files(headers, dict(weights))

    def reader_into_fresh(mapped: bool = False):
        targets = {
            n: torch.empty(e.shape, dtype=tensors.torch_dtype(e.dtype, n))
            for h in headers
            for n, e in h.tensors.items()
        }
        adopted: list[torch.Tensor] = []  # what the loader's parameter swap would keep
        tensor_files.read_files(headers, targets, adopt={n: adopted.append for n in targets} if mapped else None)

    def fresh(threads: int, huge: bool):
        t = torch.empty(size, dtype=torch.uint8)
        if huge:
            memory.advise_huge_pages(t)
        parallel_read(paths, t.numpy(), threads) if threads > 1 else sequential_read(paths, t.numpy())

    with tempfile.TemporaryDirectory(dir=os.path.dirname(paths[0])) as scratch:

        def save(ranks: int):
            # What each worker's save does (writer.write_file: header, data
            # streamed from the tensors, BLAKE3 on a second thread, fsync), ranks at once.
            def one(i):
                path = os.path.join(scratch, f"s{i}")
                writer.write_file(path, weights[i::ranks], {"format": "pt"})
                return path

            with ThreadPoolExecutor(ranks) as pool:
                for path in list(pool.map(one, range(ranks))):
                    os.remove(path)

        for _ in range(runs):
            evict(paths)
            out["cold_sequential"].append(size / timed(sequential_read, paths, touched) / GB)
            out["warm_touched_1"].append(size / timed(sequential_read, paths, touched) / GB)
            out["warm_touched_4"].append(size / timed(parallel_read, paths, touched, 4) / GB)
            out["warm_fresh_1"].append(size / timed(fresh, 1, False) / GB)
            out["warm_fresh_4"].append(size / timed(fresh, 4, False) / GB)
            out["warm_fresh_huge_4"].append(size / timed(fresh, 4, True) / GB)
            out["reader_warm"].append(size / timed(reader_into_fresh) / GB)
            evict(paths)
            out["reader_cold"].append(size / timed(reader_into_fresh) / GB)
            warm(paths)
            out["reader_mapped_warm"].append(size / timed(reader_into_fresh, True) / GB)
            evict(paths)
            out["reader_mapped_cold"].append(size / timed(reader_into_fresh, True) / GB)
            for streams in (1, 2):
                os.sync()
                out[f"write_fsync_{streams}"].append(write_probe(scratch, size, False, streams))
                out[f"write_direct_{streams}"].append(write_probe(scratch, size, True, streams))
                os.sync()
                out[f"save_{streams}"].append(size / timed(save, streams) / GB)
    return {k: {"gbps": v, "median": statistics.median(v)} for k, v in out.items()}


# --------------------------------------------------------------------------- engines


def engine_child(spec: dict) -> None:
    """Runs in a subprocess: start one engine, generate, report."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["tokenizer"],
        tensor_parallel_size=spec["tp"],
        distributed_executor_backend="mp" if spec["tp"] > 1 else None,
        load_format=spec["load_format"],
        model_loader_extra_config=spec.get("extra_config") or {},
        max_model_len=256,
        enforce_eager=True,
        seed=0,
    )
    start = time.perf_counter() - started
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    print("RESULT " + json.dumps({"engine_start": start, "ids": list(out[0].outputs[0].token_ids)}), flush=True)


def run_engine(loader: str, tp: int, mode: str, dirs: dict, hf: str, work: str) -> dict:
    model = {
        "ours": dirs[tp],
        "ours_copy": dirs[tp],
        "builtin": dirs[tp],
        "runai": dirs[tp],
        "default": hf,
        "ours_resharded": dirs[3 - tp],
    }[loader]
    load_format = {"default": "safetensors", "runai": "runai_streamer_sharded"}.get(loader, "sharded_state")
    paths = files_of(model)
    probe = None
    if mode == "cold":
        probe = cold_probe(paths)
        evict(paths)
    else:
        warm(paths)
    timing = os.path.join(work, "timing.jsonl")
    if os.path.exists(timing):
        os.remove(timing)
    spec = {"model": model, "tokenizer": hf, "tp": tp, "load_format": load_format}
    spec["extra_config"] = EXTRA_CONFIG.get(loader, {})
    proc = subprocess.run(
        [sys.executable, __file__, "--engine", json.dumps(spec)],
        env=engine_env(tp, plugins=loader.startswith("ours"), timing=timing),
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if proc.returncode or not found:
        raise RuntimeError(f"{loader} TP={tp} {mode} failed:\n{log[-4000:]}")
    result = json.loads(found.group(1))
    with open(timing) as f:
        loads = [json.loads(line) for line in f]
    if loader.startswith("ours") and "vllm_sharded_loader.ShardedStateLoader" not in log:
        raise RuntimeError(f"{loader}: our loader did not run:\n{log[-3000:]}")
    if not loader.startswith("ours") and "vllm_sharded_loader" in log:
        raise RuntimeError(f"{loader}: our plugin was active although disabled")
    result["load_seconds"] = max(entry["seconds"] for entry in loads)
    result["rank_seconds"] = sorted(entry["seconds"] for entry in loads)
    result["loader_class"] = sorted({entry["loader"] for entry in loads})
    result["rank_bytes"] = sum(os.path.getsize(p) for p in files_of(dirs[tp])) / tp
    result["cold_sequential_before"] = probe
    return result


def cold_probe(paths: list[str]) -> float:
    """GB/s of a cold sequential read of ``paths`` just now, like ``dd bs=64M of=/dev/null``.

    The machine's cold read speed drifts minute to minute with the host's state (the page
    cache's new pages are memory the host may have taken back), so each cold engine run
    is compared with a read taken right before it, in the same conditions, as well as
    with the limits measured at the start.
    """
    evict(paths)
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    started, total = time.perf_counter(), 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - started) / GB


# --------------------------------------------------------------------------- report


def summarize(engines: list[dict]) -> dict:
    table: dict = {}
    for e in engines:
        key = f"{e['loader']}|{e['tp']}|{e['mode']}"
        table.setdefault(key, []).append(e)
    summary = {}
    for key, rows in table.items():
        load = statistics.median(r["load_seconds"] for r in rows)
        summary[key] = {
            "load_seconds": load,
            "engine_start": statistics.median(r["engine_start"] for r in rows),
            "gbps": rows[0]["rank_bytes"] / load / GB,
            "runs": len(rows),
        }
        probes = [r["cold_sequential_before"] for r in rows if r.get("cold_sequential_before")]
        if probes:
            # Each run's load GB/s over the cold read just before it, then the median.
            ratios = [r["rank_bytes"] / r["load_seconds"] / GB / r["cold_sequential_before"] for r in rows]
            summary[key]["cold_sequential_before"] = statistics.median(probes)
            summary[key]["of_cold_sequential_before"] = statistics.median(ratios)
    return summary


def markdown(result: dict) -> str:
    s, limits = result["summary"], result["limits"]
    lines = [
        "| loader | TP | warm load (s) | warm GB/s/rank | cold load (s) | cold GB/s/rank | "
        "built-in / this, warm | built-in / this, cold | engine start warm (s) | engine start cold (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tp in (1, 2):
        for loader in LOADERS:
            w, c = s.get(f"{loader}|{tp}|warm"), s.get(f"{loader}|{tp}|cold")
            bw, bc = s.get(f"builtin|{tp}|warm"), s.get(f"builtin|{tp}|cold")
            if not (w and c and bw and bc):
                continue
            lines.append(
                f"| {loader} | {tp} | {w['load_seconds']:.3f} | {w['gbps']:.2f} | {c['load_seconds']:.3f} | "
                f"{c['gbps']:.2f} | {bw['load_seconds'] / w['load_seconds']:.2f}x | "
                f"{bc['load_seconds'] / c['load_seconds']:.2f}x | {w['engine_start']:.1f} | {c['engine_start']:.1f} |"
            )
    lines += ["", "| raw limit (TP=1 files) | GB/s, median | runs |", "|---|---|---|"]
    for name, v in limits.items():
        lines.append(f"| {name} | {v['median']:.2f} | {', '.join(f'{x:.2f}' for x in v['gbps'])} |")
    lines.append("")
    for n in (1, 2):
        save, raw = limits[f"save_{n}"]["median"], limits[f"write_fsync_{n}"]["median"]
        direct = limits.get(f"write_direct_{n}", {}).get("median")
        line = f"Save with {n} rank(s) at once, engine-free: {save:.2f} GB/s = {save / raw:.0%} of write+fsync"
        lines.append(line + (f", {save / direct:.0%} of O_DIRECT writes." if direct else "."))
    for loader in LOADERS:
        if f"{loader}|1|cold" not in s:
            continue
        row = s[f"{loader}|1|cold"]
        start = row["gbps"] / limits["cold_sequential"]["median"]
        line = f"Cold TP=1, {loader}: {start:.0%} of the cold sequential read"
        if "of_cold_sequential_before" in row:
            line += (
                f" measured at the start; {row['of_cold_sequential_before']:.0%} of the one taken right before each "
                f"load (median {row['cold_sequential_before']:.2f} GB/s)"
            )
        lines.append(line + ".")
    for tp, saved in result["saves"].items():
        before = saved.get("write_before")
        if before:
            # The disk's speed just before this save; ranks share it, so compare their sum.
            best = max(before.values())
            total = sum(r["mb"] for r in saved["ranks"]) / 1e3 / max(r["seconds"] for r in saved["ranks"])
            lines.append(
                f"Save TP={tp} inside the engine: {total:.2f} GB/s for all ranks together = {total / best:.0%} of "
                f"the best raw write just before it (write+fsync {before['write_fsync']:.2f} GB/s, O_DIRECT "
                f"{before['write_direct']:.2f} GB/s)."
            )
        for r in saved.get("ranks", []):
            rate = f"{r['gbps']:.2f} GB/s"
            lines.append(f"Save TP={tp} rank {r['rank']}: {r['mb']:.0f} MB in {r['seconds']:.2f} s, {rate}.")
    return "\n".join(lines) + "\n"


def chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, tp in zip(axes, (1, 2), strict=True):
        names = [n for n in LOADERS if f"{n}|{tp}|warm" in s]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [s[f"{n}|{tp}|warm"]["gbps"] for n in names], 0.4, label="warm")
        ax.bar([i + 0.2 for i in x], [s[f"{n}|{tp}|cold"]["gbps"] for n in names], 0.4, label="cold")
        limit = result["limits"]["cold_sequential"]["median"]
        ax.axhline(limit, color="k", ls="--", lw=1, label="cold sequential read")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_title(f"TP={tp}: weight loading, GB/s per rank (median)")
        ax.legend()
    axes[0].set_ylabel("GB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_report(result: dict, out: str) -> None:
    with open(os.path.join(out, "load_bench.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    chart(result, os.path.join(out, "load_bench.png"))


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "sharded-load-bench"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=17, help="17 layers of hidden 2048: a 1.5 GB bf16 model")
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--report", metavar="JSON", help="only write the table and chart of an earlier run's JSON")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_child(json.loads(args.engine))
        return
    if args.report:
        with open(args.report) as f:
            result = json.load(f)
        write_report(result, os.path.dirname(os.path.abspath(args.report)))
        return
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    hf = build(args.work, args.layers)
    dirs = {tp: os.path.join(args.work, f"tp{tp}") for tp in (1, 2)}
    saves = {str(tp): save(hf, dirs[tp], tp) for tp in (1, 2)}
    print(f"saved: {json.dumps(saves)}", flush=True)
    limits = raw_limits(files_of(dirs[1]), args.runs)
    print(f"limits: {json.dumps({k: v['median'] for k, v in limits.items()})}", flush=True)
    engines = []
    loaders, tps = args.loaders.split(","), [int(t) for t in args.tp.split(",")]
    for run in range(args.runs):
        for tp in tps:
            for mode in ("warm", "cold"):
                for loader in loaders:
                    r = run_engine(loader, tp, mode, dirs, hf, args.work)
                    r.update(loader=loader, tp=tp, mode=mode, run=run)
                    engines.append(r)
                    print(
                        f"run {run} TP={tp} {mode:4s} {loader:15s} load {r['load_seconds']:.3f} s "
                        f"start {r['engine_start']:.1f} s ids {r['ids']}",
                        flush=True,
                    )
    reference = engines[0]["ids"]
    mismatched = [f"{e['loader']} TP={e['tp']}" for e in engines if e["ids"] != reference]
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
        },
        "model": {"hf": hf, "bytes_tp1": sum(os.path.getsize(p) for p in files_of(dirs[1])), "layers": args.layers},
        "runs": args.runs,
        "saves": saves,
        "limits": limits,
        "engines": engines,
        "summary": summarize(engines),
        "same_greedy_ids": not mismatched,
        "mismatched": mismatched,
    }
    with open(os.path.join(args.out, "load_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_report(result, args.out)
    if mismatched:
        sys.exit(f"greedy ids differ from the first engine's: {mismatched}")


if __name__ == "__main__":
    main()
