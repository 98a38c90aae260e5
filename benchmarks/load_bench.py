"""Weight loading inside real vLLM: our loader against vLLM's loaders and the hardware.

One run builds a 1-2 GB bfloat16 Llama-style model (random weights, in process),
saves it sharded at TP=1 and TP=2 with our save script, measures the machine's raw
limits, then starts real engines, round-robin so that drifts of the machine hit every
loader alike:

- ``ours``: ``--load-format sharded_state`` with this plugin, as configured by default
  (CPU parameters served from private mappings of the files);
- ``ours_copy``: the same with ``{"mmap": false}``: every byte copied into the parameters;
- ``ours_auto``: the same with ``{"mmap": "auto"}``: weights that vLLM's CPU post-processing
  repacks are copied, the rest mapped;
- ``ours_untouched``: ``ours`` with ``SHARDED_STATE_TOUCH_PAGES=0``: the mapped pages are paged in
  but never read by the load (as where vLLM's post-processing does not read them next);
- ``ours_touched``: ``ours`` with ``SHARDED_STATE_TOUCH_PAGES=1``: the load reads every page;
- ``ours_t1``, ``ours_t2``: ``ours`` with one or two reader threads (``{"threads": N}``);
- ``builtin``: vLLM's own ``sharded_state`` on the same files (plugins off: ``VLLM_PLUGINS=""``);
- ``default``: vLLM's default safetensors loader on the HF checkpoint;
- ``runai``: ``runai_streamer_sharded`` on the same files (``runai-model-streamer``);
- ``ours_resharded``: our loader on the checkpoint saved at the other TP size.

each ``warm`` (files read once before) and ``cold`` (files evicted with
``posix_fadvise(DONTNEED)``). ``--isa avx2`` runs the engines on an AVX2-only machine's code
paths (vLLM's kernels, PyTorch, oneDNN, the plugin's touch rule) on an AVX-512 machine.
Weight-loading time is the time of the loader's ``load_weights`` call, taken the same way for
every loader by ``timing/sitecustomize.py`` (per rank; a TP=2 run reports its slowest rank).
Engine start is the time until ``LLM(...)`` returns. Every engine generates the same greedy
tokens, checked here.

    python -m benchmarks.load_bench --out benchmarks/results          # about 45 minutes here
    python -m benchmarks.load_bench --runs 3 --layers 17 --out DIR    # the defaults

Writes ``load_bench.json`` (every raw number), ``load_bench.png`` and ``load_bench.md``
(the tables of ``benchmarks/README.md``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.harness import (
    GB,
    HERE,
    ROOT,
    build,
    command,
    commit,
    engine_env,
    evict,
    files_of,
    layers_for,
    record,
    save,
    start_engine,
    warm,
    write_probe,
)

LOADERS = (
    "ours",
    "ours_auto",
    "ours_copy",
    "ours_untouched",
    "ours_touched",
    "ours_t1",
    "ours_t2",
    "builtin",
    "default",
    "runai",
    "ours_resharded",
)
EXTRA_CONFIG = {
    "ours_copy": {"mmap": False},
    "ours_auto": {"mmap": "auto"},
    "ours_t1": {"threads": 1},
    "ours_t2": {"threads": 2},
}
# The page-touch rule forced either way (``ours`` decides per CPU and dtype).
TOUCH = {"ours_untouched": "0", "ours_touched": "1"}

# ------------------------------------------------------------------------ raw limits


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


# ``--isa avx2``: oneDNN and ATen capped at AVX2 by their own variables; vLLM's checks and the
# plugin's CPU flags pinned by timing/sitecustomize.py.
ISA_ENV = {"avx2": {"SHARDED_BENCH_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def run_engine(
    loader: str, tp: int, mode: str, dirs: dict, hf: str, work: str, dtype: str = "auto", isa: str = "native"
) -> dict:
    # Every loader reads the checkpoint saved at this TP size, but these two.
    model = {"default": hf, "ours_resharded": dirs[3 - tp]}.get(loader, dirs[tp])
    load_format = {"default": "safetensors", "runai": "runai_streamer_sharded"}.get(loader, "sharded_state")
    paths = files_of(model)
    probe = None
    if mode == "cold":
        probe = cold_probe(paths)
        evict(paths)
    else:
        warm(paths)
    timing = os.path.join(work, "timing.jsonl")
    spec = {"model": model, "tokenizer": hf, "tp": tp, "load_format": load_format, "dtype": dtype}
    spec["extra_config"] = EXTRA_CONFIG.get(loader, {})
    cached_before = meminfo()["Cached"]
    env = engine_env(tp, plugins=loader.startswith("ours"), timing=timing)
    if loader in TOUCH:
        env["SHARDED_STATE_TOUCH_PAGES"] = TOUCH[loader]
    env.update(ISA_ENV.get(isa, {}))
    result, loads, log = start_engine(spec, env, timing, f"{loader} TP={tp} {mode}")
    if loader.startswith("ours") and "vllm_sharded_loader.ShardedStateLoader" not in log:
        raise RuntimeError(f"{loader}: our loader did not run:\n{log[-3000:]}")
    if not loader.startswith("ours") and "vllm_sharded_loader" in log:
        raise RuntimeError(f"{loader}: our plugin was active although disabled")
    if isa == "avx2" and any(e["isa"] != {"vllm_kernels": ["_C_AVX2.abi3.so"], "aten": "AVX2"} for e in loads):
        raise RuntimeError(f"{loader}: a rank did not take the AVX2 code paths: {[e['isa'] for e in loads]}")
    result["load_seconds"] = max(entry["load_weights"] for entry in loads)
    result["rank_seconds"] = sorted(entry["load_weights"] for entry in loads)
    # The slowest rank's phases (the engine waits for it).
    for phase in ("load_model", "create_model", "load_weights", "post"):
        result[phase] = max(entry.get(phase, 0.0) for entry in loads)
    if "wall_before_llm" in result and all("wall_start" in entry for entry in loads):
        # Engine start around load_model: before it (processes, model config) and after it
        # until LLM(...) returns (KV cache, the profiling forward pass, warm-up).
        result["before_load_model"] = min(e["wall_start"] for e in loads) - result["wall_before_llm"]
        result["after_load_model"] = result["wall_after_llm"] - max(e["wall_end"] for e in loads)
        result["from_load_model"] = result["engine_start"] - result["before_load_model"]
    result["ranks"] = sorted(loads, key=lambda entry: entry.get("rank", 0))
    # Memory over all ranks: each worker's peak resident set, summed (an upper bound of the
    # ranks' peak together), split into anonymous memory and mapped file pages.
    for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
        result[f"peak_{key}"] = sum(entry["peak"][key] for entry in loads)
    # Anonymous memory the load added: parameters copied in, buffers, repacked weights.
    result["anon_growth"] = sum(e["peak"]["RssAnon"] - e["status_before"]["RssAnon"] for e in loads)
    # The machine: how far MemAvailable fell below its value when the first rank began to load.
    before = max(entry["meminfo_before"]["MemAvailable"] for entry in loads)
    result["available_drop"] = before - min(entry["min_available"] for entry in loads)
    result["cached_before_engine"] = cached_before
    result["cached_after_load"] = max(entry["meminfo_after"]["Cached"] for entry in loads)
    result["cached_growth"] = result["cached_after_load"] - cached_before
    result["loader_class"] = sorted({entry["loader"] for entry in loads})
    result["rank_bytes"] = sum(os.path.getsize(p) for p in files_of(dirs[tp])) / tp
    result["cold_sequential_before"] = probe
    return result


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    return out


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


PHASES = (
    "engine_start",
    "from_load_model",
    "before_load_model",
    "load_model",
    "after_load_model",
    "create_model",
    "load_weights",
    "post",
)
MEMORY = ("peak_RssAnon", "peak_RssFile", "peak_VmRSS", "available_drop", "anon_growth", "cached_growth")


def key_of(e: dict) -> str:
    return f"{e['loader']}|{e['tp']}|{e['mode']}|{e.get('layers', 17)}"


def summarize(engines: list[dict]) -> dict:
    table: dict = {}
    for e in engines:
        table.setdefault(key_of(e), []).append(e)
    summary = {}
    for key, rows in table.items():
        load = statistics.median(r["load_seconds"] for r in rows)
        summary[key] = {
            "load_seconds": load,
            "engine_start": statistics.median(r["engine_start"] for r in rows),
            "gbps": rows[0]["rank_bytes"] / load / GB,
            "rank_bytes": rows[0]["rank_bytes"],
            "runs": len(rows),
        }
        for name in PHASES + MEMORY:
            values = [r[name] for r in rows if r.get(name) is not None]
            if values:
                summary[key][name] = statistics.median(values)
                summary[key][name + "_range"] = [min(values), max(values)]
        probes = [r["cold_sequential_before"] for r in rows if r.get("cold_sequential_before")]
        if probes:
            # Each run's load GB/s over the cold read just before it, then the median.
            ratios = [r["rank_bytes"] / r["load_seconds"] / GB / r["cold_sequential_before"] for r in rows]
            summary[key]["cold_sequential_before"] = statistics.median(probes)
            summary[key]["of_cold_sequential_before"] = statistics.median(ratios)
    return summary


def paired(engines: list[dict], loader: str, against: str = "builtin") -> dict:
    """Per (TP, mode, size): the differences ``against - loader`` of each phase within the same round.

    Both engines of a pair ran back to back in the same round, so a drift of the shared
    machine hits both; the median of the per-round differences resolves less than the
    spread of either loader's own times.
    """
    rounds: dict = {}
    for e in engines:
        rounds.setdefault((e["tp"], e["mode"], e.get("layers", 17), e["run"], e.get("chunk", 0)), {})[e["loader"]] = e
    out: dict = {}
    for (tp, mode, layers, _, _), by_loader in rounds.items():
        if loader in by_loader and against in by_loader:
            a, b = by_loader[loader], by_loader[against]
            row = out.setdefault(f"{tp}|{mode}|{layers}", {name: [] for name in PHASES})
            for name in PHASES:
                if a.get(name) is not None and b.get(name) is not None:
                    row[name].append(b[name] - a[name])
    for row in out.values():
        row["pairs"] = len(row["load_weights"])
        for name in PHASES:
            row[name + "_median"] = statistics.median(row[name]) if row[name] else float("nan")
        won = row["load_weights_median"]
        # Of the seconds won in load_weights (median of the pairs), the share still won when
        # LLM(...) returns, and from the start of load_model on: without the process start-up
        # before it, which no loader touches and which drifts by seconds at TP=2 here.
        row["kept_share"] = row["engine_start_median"] / won if won > 0 else None
        row["kept_share_since_load"] = row["from_load_model_median"] / won if won > 0 else None
    return out


def _loaders(s: dict, tp: int, mode: str, layers: int) -> list[str]:
    return [n for n in LOADERS if f"{n}|{tp}|{mode}|{layers}" in s]


def _grid(s: dict) -> list[tuple[int, int, str]]:
    """(layers, tp, mode) present in a summary, in report order."""
    found = {(int(k.split("|")[3]), int(k.split("|")[1]), k.split("|")[2]) for k in s}
    return sorted(found, key=lambda g: (g[0], g[1], g[2] != "cold"))


def markdown(result: dict) -> str:
    s, engines = result["summary"], result["engines"]
    lines = [
        "Median seconds (fastest-slowest) per loader; a TP=2 phase is its slowest rank's. `load_model` is "
        "vLLM's whole call in the worker (model init, `load_weights`, post-processing, its `gc.collect`s); "
        "`post` is `process_weights_after_loading` (vLLM's repacking of the weights).",
        "",
        "| GB | TP | mode | loader | runs | engine start (s) | before load_model | load_model (s) | "
        "after load_model | create_model | load_weights (s) | post (s) | load_weights GB/s/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if any(e.get("isa", "native") != "native" for e in engines):
        lines[1:1] = [
            "",
            "Engines with `--isa avx2` took an AVX2-only machine's code paths on this machine: vLLM's "
            "`_C_AVX2` kernels and no AVX-512 repacking, PyTorch and oneDNN capped at AVX2, the plugin's "
            "page-touch rule deciding as on AVX2 (`benchmarks/timing/sitecustomize.py`). The CPU, its "
            "memory and the VM stayed this machine's.",
        ]

    def cell(row: dict, name: str, digits: int = 2) -> str:
        if name not in row:
            return "-"
        lo, hi = row[name + "_range"]
        return f"{row[name]:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"

    for layers, tp, mode in _grid(s):
        for loader in _loaders(s, tp, mode, layers):
            row = s[f"{loader}|{tp}|{mode}|{layers}"]
            size = row["rank_bytes"] * tp / GB
            lines.append(
                f"| {size:.2f} | {tp} | {mode} | {loader} | {row['runs']} | {cell(row, 'engine_start', 1)} | "
                f"{cell(row, 'before_load_model', 1)} | {cell(row, 'load_model')} | "
                f"{cell(row, 'after_load_model', 1)} | {cell(row, 'create_model')} | "
                f"{cell(row, 'load_weights')} | {cell(row, 'post')} | "
                f"{row['gbps']:.2f} |"
            )
    lines += [
        "",
        "Paired with the built-in loader (each pair ran back to back in one round): medians of the per-round "
        "differences built-in minus ours, in seconds, and the share of the `load_weights` seconds won that "
        "is still won when `LLM(...)` returns (target: at least 80%).",
        "",
        "| GB | TP | mode | pairs | load_weights won | post won | load_model won | after load_model won | "
        "engine start won | kept | load_model start to LLM return won | kept from load_model on |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    size_of = {int(k.split("|")[3]): v["rank_bytes"] * int(k.split("|")[1]) / GB for k, v in s.items()}
    for loader in ("ours",):
        for key, row in sorted(paired(engines, loader).items(), key=lambda kv: (int(kv[0].split("|")[2]), kv[0])):
            tp, mode, layers = key.split("|")
            kept = f"{row['kept_share']:.0%}" if row["kept_share"] is not None else "-"
            since = row["kept_share_since_load"]
            since_text = f"{row['from_load_model_median']:+.2f} | " + (f"{since:.0%}" if since is not None else "-")
            lines.append(
                f"| {size_of[int(layers)]:.2f} | {tp} | {mode} | {row['pairs']} | "
                + " | ".join(
                    f"{row[n + '_median']:+.2f}"
                    for n in ("load_weights", "post", "load_model", "after_load_model", "engine_start")
                )
                + f" | {kept} | {since_text} |"
            )
    lines += [
        "",
        "Memory during `load_model` (cold runs, medians; GB): each worker's peak resident set sampled every "
        "10 ms, summed over the ranks, split into anonymous memory (private: parameters copied in, "
        "copy-on-write copies, repacked weights) and mapped file pages (page cache shared with the file, "
        "not extra memory); and how far the machine's `MemAvailable` fell during the load (page cache "
        "filled by the reads counts as available, so this is the memory the load really takes).",
        "",
        "| GB | TP | loader | peak anon | anon added by the load | peak file-mapped | peak RSS | "
        "MemAvailable drop | page cache growth |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for layers, tp, mode in _grid(s):
        if mode != "cold":
            continue
        for loader in _loaders(s, tp, mode, layers):
            row = s[f"{loader}|{tp}|{mode}|{layers}"]
            if "peak_RssAnon" not in row:
                continue
            lines.append(
                f"| {row['rank_bytes'] * tp / GB:.2f} | {tp} | {loader} | {row['peak_RssAnon'] / GB:.2f} | "
                f"{row.get('anon_growth', float('nan')) / GB:.2f} | "
                f"{row['peak_RssFile'] / GB:.2f} | {row['peak_VmRSS'] / GB:.2f} | "
                f"{row['available_drop'] / GB:.2f} | {row.get('cached_growth', float('nan')) / GB:.2f} |"
            )
    lines += scaling_table(s)
    lines += commits_table(engines)
    limits = result.get("limits")
    if limits:
        lines += ["", "| raw limit (TP=1 files) | GB/s, median | runs |", "|---|---|---|"]
        for name, v in limits.items():
            lines.append(f"| {name} | {v['median']:.2f} | {', '.join(f'{x:.2f}' for x in v['gbps'])} |")
    return "\n".join(lines) + "\n"


def commits_table(engines: list[dict]) -> list[str]:
    """Where the engines ran more than one commit (``--append`` from each tree in turn): per TP size,
    mode and loader, each commit's ``load_weights`` and engine start, every run and the median."""
    commits = list(dict.fromkeys(e.get("commit", "?") for e in engines))
    if len(commits) < 2:
        return []
    lines = [
        "",
        f"By commit, in the order they first ran ({', '.join(commits)}): `load_weights` seconds (slowest rank), "
        "median and every run in run order, and the median engine start.",
        "",
        "| GB | TP | mode | loader | " + " | ".join(f"{c}: load_weights | {c}: start" for c in commits) + " |",
        "|---|---|---|---|" + "---|---|" * len(commits),
    ]
    groups: dict = {}
    for e in engines:
        groups.setdefault((e.get("layers", 17), e["tp"], e["mode"], e["loader"]), {}).setdefault(
            e.get("commit", "?"), []
        ).append(e)
    for (_, tp, mode, loader), by_commit in sorted(groups.items()):
        size = next(iter(by_commit.values()))[0]["rank_bytes"] * tp / GB
        cells = []
        for c in commits:
            rows = by_commit.get(c, [])
            if not rows:
                cells += ["-", "-"]
                continue
            loads = [r["load_seconds"] for r in rows]
            runs = ", ".join(f"{x:.2f}" for x in loads)
            cells += [
                f"{statistics.median(loads):.2f} ({runs})",
                f"{statistics.median(r['engine_start'] for r in rows):.1f}",
            ]
        lines.append(f"| {size:.2f} | {tp} | {mode} | {loader} | " + " | ".join(cells) + " |")
    return lines


def scaling_table(s: dict) -> list[str]:
    """Per TP size, mode and loader measured at more than one model size: ``load_weights`` GB/s
    (all ranks together) and engine start at each size, and the slowest size's GB/s over the
    fastest's (the issue's target: within 20%, i.e. at least 80%)."""
    groups: dict = {}
    for key, row in s.items():
        loader, tp, mode, _ = key.split("|")
        groups.setdefault((int(tp), mode, loader), []).append(row)
    groups = {g: sorted(rows, key=lambda r: r["rank_bytes"]) for g, rows in groups.items() if len(rows) > 1}
    if not groups:
        return []
    lines = [
        "",
        "Scaling (medians): `load_weights` seconds and GB/s of all ranks together, and engine start, at each "
        "model size; the single-stream cold read of the same files just before each cold load (median, GB/s: the "
        "disk's speed that minute); the lowest GB/s over the highest (target: at least 80%).",
        "",
        "| TP | mode | loader | GB | load_weights (s) | load_weights GB/s | engine start (s) | cold read before "
        "(GB/s) | lowest / highest GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    order = {name: i for i, name in enumerate(LOADERS)}
    for (tp, mode, loader), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order[kv[0][2]])):
        rates = [r["rank_bytes"] * tp / r["load_seconds"] / GB for r in rows]
        lines.append(
            f"| {tp} | {mode} | {loader} | "
            + " | ".join(
                ", ".join(cells)
                for cells in (
                    [f"{r['rank_bytes'] * tp / GB:.2f}" for r in rows],
                    [f"{r['load_seconds']:.2f}" for r in rows],
                    [f"{g:.2f}" for g in rates],
                    [f"{r['engine_start']:.1f}" for r in rows],
                    [f"{r['cold_sequential_before']:.2f}" if "cold_sequential_before" in r else "-" for r in rows],
                )
            )
            + f" | {min(rates) / max(rates):.0%} |"
        )
    return lines


def chart(result: dict, path: str) -> None:
    """Seconds and GB/s of ``load_weights`` (cold), and engine start, against model size, per TP, for ours,
    built-in and default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    tps = sorted({int(k.split("|")[1]) for k in s})
    fig, axes = plt.subplots(len(tps), 3, figsize=(16, 4 * len(tps)), squeeze=False)
    for row, tp in zip(axes, tps, strict=True):
        for loader, color in (("ours", "C0"), ("builtin", "C1"), ("default", "C2")):
            keys = sorted((k for k in s if k.startswith(f"{loader}|{tp}|cold|")), key=lambda k: s[k]["rank_bytes"])
            if not keys:
                continue
            sizes = [s[k]["rank_bytes"] * tp / GB for k in keys]
            row[0].plot(sizes, [s[k]["load_weights"] for k in keys], "o-", color=color, label=f"{loader} load_weights")
            row[0].plot(sizes, [s[k]["load_model"] for k in keys], "s--", color=color, label=f"{loader} load_model")
            row[1].plot(
                sizes,
                [s[k]["rank_bytes"] * tp / s[k]["load_weights"] / GB for k in keys],
                "o-",
                color=color,
                label=loader,
            )
            row[2].plot(sizes, [s[k]["engine_start"] for k in keys], "o-", color=color, label=loader)
        row[0].set_title(f"TP={tp}, cold: seconds (median)")
        row[1].set_title(f"TP={tp}, cold: load_weights GB/s, all ranks")
        row[2].set_title(f"TP={tp}, cold: engine start, until LLM(...) returns (s)")
        for ax in row:
            ax.set_xlabel("model size (GB, bf16)")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        row[0].set_ylabel("s")
        row[1].set_ylabel("GB/s")
        row[2].set_ylabel("s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_report(result: dict, out: str, name: str) -> None:
    for e in result["engines"]:
        e.setdefault("load_weights", e["load_seconds"])
        if "cached_growth" not in e and "cached_after_load" in e:
            e["cached_growth"] = e["cached_after_load"] - e["cached_before_engine"]
        ranks = e.get("ranks", [])
        if "after_load_model" not in e and "wall_before_llm" in e and ranks and all("wall_end" in r for r in ranks):
            e["before_load_model"] = min(r["wall_start"] for r in ranks) - e["wall_before_llm"]
            e["after_load_model"] = e["wall_after_llm"] - max(r["wall_end"] for r in ranks)
            e["from_load_model"] = e["engine_start"] - e["before_load_model"]
    result["summary"] = summarize(result["engines"])
    text = markdown(result)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
    chart(result, os.path.join(out, f"{name}.png"))


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--name", default="load_bench", help="results are NAME.json, NAME.md, NAME.png in --out")
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "sharded-load-bench"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default="1.5", help="model sizes in GB (bf16), e.g. 0.5,1.5,5")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="float32: vLLM's CPU backend repacks the linear weights after loading on AVX2 machines too",
    )
    parser.add_argument("--loaders", default=",".join(n for n in LOADERS if n not in TOUCH))
    parser.add_argument(
        "--isa",
        default="native",
        choices=("native", "avx2"),
        help="avx2: engines take an AVX2-only machine's code paths (vLLM, PyTorch, oneDNN, the plugin) on this one",
    )
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--modes", default="warm,cold")
    parser.add_argument("--limits", action="store_true", help="also measure the raw read/write limits")
    parser.add_argument("--append", action="store_true", help="add this chunk's engines to NAME.json in --out")
    parser.add_argument("--report", metavar="JSON", help="only write the tables and chart of an earlier run's JSON")
    parser.add_argument("--chunks", help="with --report: only the engines of these chunks (e.g. 2,3)")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            result = json.load(f)
        if args.chunks:
            keep = {int(c) for c in args.chunks.split(",")}
            result["engines"] = [e for e in result["engines"] if e.get("chunk", 0) in keep]
        name = os.path.splitext(os.path.basename(args.report))[0]
        write_report(result, os.path.dirname(os.path.abspath(args.report)), name)
        return
    os.makedirs(args.out, exist_ok=True)
    # Byte-compile the plugin, as pip does when it installs it: engines run with
    # PYTHONDONTWRITEBYTECODE here, and a source checkout on PYTHONPATH would otherwise be
    # compiled again in every engine process (0.1-0.3 s each, before any loading).
    import compileall

    compileall.compile_dir(os.path.join(ROOT, "vllm_sharded_loader"), quiet=1)
    target = os.path.join(args.out, f"{args.name}.json")
    result = {"engines": [], "saves": {}, "models": {}}
    if args.append and os.path.exists(target):
        with open(target) as f:
            result = json.load(f)
    chunk = 1 + max((e.get("chunk", 0) for e in result["engines"]), default=0)
    tree = commit()
    result["commands"] = [*result.get("commands", []), command()]
    loaders, tps = args.loaders.split(","), [int(t) for t in args.tp.split(",")]
    if unknown := sorted(set(loaders) - set(LOADERS)):
        parser.error(f"unknown loaders {unknown}: choose from {', '.join(LOADERS)}")
    modes = args.modes.split(",")
    models = {}
    for size in (float(x) for x in args.sizes.split(",")):
        layers = layers_for(size, args.dtype)
        work = os.path.join(args.work, f"L{layers}" + ("" if args.dtype == "bfloat16" else f"-{args.dtype}"))
        os.makedirs(work, exist_ok=True)
        hf = build(work, layers)
        dirs = {tp: os.path.join(work, f"tp{tp}") for tp in (1, 2)}
        # Only the checkpoints this chunk loads (ours_resharded loads the other TP size's).
        for tp in sorted(set(tps) | ({3 - t for t in tps} if "ours_resharded" in loaders else set())):
            saved = save(hf, dirs[tp], tp, args.dtype)
            if saved:
                result["saves"][f"{layers}|{tp}"] = saved
        models[layers] = (hf, dirs, work)
        result["models"][str(layers)] = {"bytes": sum(os.path.getsize(p) for p in files_of(dirs[min(tps)]))}
    if args.limits:
        layers = min(models)
        result["limits"] = raw_limits(files_of(models[layers][1][1]), args.runs)
        print(f"limits: {json.dumps({k: v['median'] for k, v in result['limits'].items()})}", flush=True)
    for run in range(args.runs):
        for layers, (hf, dirs, work) in models.items():
            for tp in tps:
                for mode in modes:
                    # Alternate the order from round to round: no loader always runs first after an eviction.
                    for loader in loaders if run % 2 == 0 else loaders[::-1]:
                        r = run_engine(loader, tp, mode, dirs, hf, work, args.dtype, args.isa)
                        r.update(loader=loader, tp=tp, mode=mode, run=run, layers=layers, chunk=chunk, commit=tree)
                        r["isa"] = args.isa
                        r["time"] = time.time()
                        result["engines"].append(r)
                        print(
                            f"run {run} L{layers} TP={tp} {mode:4s} {loader:15s} start {r['engine_start']:.1f} s "
                            f"load_model {r['load_model']:.2f} load_weights {r['load_weights']:.2f} "
                            f"post {r['post']:.2f} anon {r['peak_RssAnon'] / GB:.2f} GB ids {r['ids']}",
                            flush=True,
                        )
                        # Saved after every engine: a chunk cut short keeps what it measured.
                        with open(target, "w") as f:
                            json.dump(result, f, indent=1)
    reference: dict = {}
    mismatched = []
    for e in result["engines"]:
        # Per model and TP size: a TP=2 engine sums in another order, and a random model's
        # greedy tokens may part from TP=1's after a few steps.
        first = reference.setdefault((e.get("layers", 17), e["tp"]), e["ids"])
        if e["ids"] != first:
            mismatched.append(f"{e['loader']} TP={e['tp']} L{e.get('layers')}")
    # The record: the engines' commits (several when --append ran each tree in turn), every command.
    result.update(record())
    commits = list(dict.fromkeys(e.get("commit", "?") for e in result["engines"]))
    result["commit"] = commits[0] if len(commits) == 1 else commits
    result["command"] = " && ".join(result["commands"])
    result["same_greedy_ids"] = not mismatched
    result["mismatched"] = mismatched
    with open(target, "w") as f:
        json.dump(result, f, indent=1)
    write_report(result, args.out, args.name)
    if mismatched:
        sys.exit(f"greedy ids differ from the first engine's of the same model and TP size: {mismatched}")


if __name__ == "__main__":
    main()
