"""``vllm-sharded convert`` against ``vllm-sharded save`` and a plain copy of the same bytes.

One run builds the Llama-style bf16 model of ``load_bench.py`` (hidden 2048, intermediate 5632,
32 heads, 8 KV heads; 1.3 GB by default), then times, each in a fresh process:

- ``cp``: ``cp`` of the model's safetensors files into a new folder, then ``sync`` of the copies
  (a convert's parts are fsynced before its manifest is published), warm and cold;
- ``convert``: ``vllm-sharded convert HF -tp N -o OUT`` (no engine), warm and cold: the whole
  command (vLLM's import and configuration included), and the part of it after vLLM's model
  is built (reading, cutting and writing), as the command reports it;
- ``save``: ``vllm-sharded save --model HF -tp N -o OUT``: an engine started at TP=N, the model
  loaded by vLLM's default loader, saved; the whole command, engine start included (warm);
- both again on a fresh node: an empty ``VLLM_CACHE_ROOT``, so vLLM has to inspect the model class
  first (a node that never ran vLLM, or a container started from an image).

Every case runs in rounds (``--runs``, default 3: each round runs every case once, so that a slow
spell of the machine falls on all of them), and the table gives medians. Warm: the source files
read once before; cold: evicted with ``posix_fadvise(DONTNEED)`` first.
Peak resident memory is the largest of the command and the processes it waited for (``wait4``). The
converted and saved checkpoints are checked to hold the same files (sizes and checksums).

    flock /tmp/vsl-engine.lock python -m benchmarks.convert_bench --tp 2 --out benchmarks/results

Writes ``convert_bench.json`` and ``convert_bench.md`` into ``--out``.
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
import time
from collections.abc import Callable

from benchmarks.harness import (
    MOE_LAYER_BYTES,
    ROOT,
    command,
    engine_env,
    evict,
    files_of,
    layers_for,
    machine,
    machine_line,
    report_or_measure,
    warm,
)

GB = 1e9


def run(args: list[str], env: dict[str, str], cwd: str = ROOT) -> dict:
    """Run a command in a fresh process in ``cwd``: wall seconds, its own peak RSS (``wait4``: the
    command and the children it waited for), its output."""
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    if proc.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{output[-6000:]}")
    return {"seconds": seconds, "peak_rss_kb": usage.ru_maxrss, "output": output}


def copy(hf: str, work: str, cold: bool) -> dict:
    dest = os.path.join(work, "copy")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    paths = files_of(hf)
    evict(paths) if cold else warm(paths)
    result = run(["bash", "-c", f"cp {' '.join(paths)} {dest}/ && sync {dest}/*"], dict(os.environ))
    result.pop("output")
    result["bytes"] = sum(os.path.getsize(p) for p in paths)
    return result


def fresh_node(env: dict[str, str], work: str) -> dict[str, str]:
    """``env`` with an empty vLLM cache folder, as on a node that never ran vLLM: vLLM then inspects
    the model class (in a new interpreter, where it does) before it can build anything."""
    env["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="fresh-vllm-cache-", dir=work)
    return env


def convert(
    hf: str, work: str, tp: int, cold: bool, tree: str | None = None, fresh: bool = False, name: str | None = None
) -> dict:
    """One ``convert`` of ``hf`` in a fresh process (of the package in ``tree``, default this checkout)
    into ``work/NAME`` (default ``converted-tpN``); ``fresh``: on a fresh node (:func:`fresh_node`)."""
    out = os.path.join(work, name or f"converted-tp{tp}")
    shutil.rmtree(out, ignore_errors=True)
    paths = files_of(hf)
    evict(paths) if cold else warm(paths)
    args = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "convert", hf, "-tp", str(tp), "-o", out]
    env = engine_env(1, plugins=True)
    if fresh:
        fresh_node(env, work)
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree)
    # ``python -m`` puts its working folder first on the path: run in the tree, or this checkout's
    # package is the one imported, whatever PYTHONPATH says.
    result = run(args, env, cwd=os.path.abspath(tree) if tree else ROOT)
    reported = re.search(r"written in ([\d.]+) s after ([\d.]+) s building vLLM's model", result.pop("output"))
    if reported:
        result["write_seconds"], result["build_seconds"] = float(reported.group(1)), float(reported.group(2))
    return result


def save(hf: str, work: str, tp: int, fresh: bool = False) -> dict:
    out = os.path.join(work, f"saved-tp{tp}")
    shutil.rmtree(out, ignore_errors=True)
    warm(files_of(hf))
    args = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "save", "--model", hf, "-o", out]
    args += ["--tensor-parallel-size", str(tp), "--enforce-eager", "--max-model-len", "256"]
    args += [] if tp == 1 else ["--distributed-executor-backend", "mp"]
    env = engine_env(tp, plugins=True)
    result = run(args, fresh_node(env, work) if fresh else env)
    result.pop("output")
    return result


def same_files(a: str, b: str) -> bool:
    def files(d: str) -> list:
        with open(os.path.join(d, "sharded_state.json")) as f:
            manifest = json.load(f)
        return [[(f["size"], f["checksum"]) for f in r["files"]] for r in manifest["ranks"]]

    return files(a) == files(b)


def measure(args: argparse.Namespace) -> dict:
    work = args.work or tempfile.mkdtemp(prefix="convert-bench-")
    hf = built(work, "build", layers_for(args.gigabytes))
    nbytes = sum(os.path.getsize(p) for p in files_of(hf))
    result: dict = {
        "machine": machine(),
        "command": command(),
        "model_bytes": nbytes,
        "tp": args.tp,
    }
    cases: dict[str, Callable[[], dict]] = {
        "cp_warm": lambda: copy(hf, work, False),
        "cp_cold": lambda: copy(hf, work, True),
        "convert_warm": lambda: convert(hf, work, args.tp, False),
        "convert_cold": lambda: convert(hf, work, args.tp, True),
        "save_warm": lambda: save(hf, work, args.tp),
        "convert_fresh_node": lambda: convert(hf, work, args.tp, False, fresh=True),
        "save_fresh_node": lambda: save(hf, work, args.tp, fresh=True),
    }
    # Rounds of every case, so that a slow spell of the machine hits every case alike; medians.
    for _ in range(args.runs):
        for key, case in cases.items():
            result.setdefault(f"{key}_runs", []).append(case())
    result["runs"] = args.runs
    for key in cases:
        result[key] = medians(result[f"{key}_runs"])
    result["same_files_as_save"] = same_files(
        os.path.join(work, f"converted-tp{args.tp}"), os.path.join(work, f"saved-tp{args.tp}")
    )
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def medians(runs: list[dict]) -> dict:
    """Each timing's median over ``runs``, and the highest peak RSS.

    >>> medians([{"seconds": 3.0, "peak_rss_kb": 5}, {"seconds": 1.0, "peak_rss_kb": 7}, {"seconds": 2.0}])
    {'seconds': 2.0, 'peak_rss_kb': 7}
    """
    out: dict = {}
    for key in dict.fromkeys(k for r in runs for k in r):
        values = [r[key] for r in runs if key in r]
        out[key] = max(values) if key == "peak_rss_kb" else statistics.median(values)
    return out


def built(work: str, how: str, layers: int) -> str:
    """The model of ``harness.build`` or ``build_on_disk`` (``how``), built in a child process. Built
    here, its memory would count in every command's peak RSS: a child that Python starts with
    ``vfork`` takes the high-water mark of this process's memory as its own ``ru_maxrss`` at its
    ``exec`` (every cp and convert read 2.77 GiB, the model built here)."""
    code = f"from benchmarks.harness import {how}; print({how}({work!r}, {layers}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


def largest_tensor_bytes(hf: str) -> int:
    """The largest tensor of the model's safetensors files, from their headers."""
    from vllm_sharded_loader.storage.local import read_header

    return max(t.end - t.begin for path in files_of(hf) for t in read_header(path).tensors.values())


def model_record(hf: str, tp: int, kind: str) -> dict:
    """The start of a ``kind`` run's result: the machine, the command, the model's size and its largest tensor."""
    return {
        "machine": machine(),
        "command": command(),
        kind: True,
        "model_bytes": sum(os.path.getsize(p) for p in files_of(hf)),
        "largest_tensor_bytes": largest_tensor_bytes(hf),
        "tp": tp,
    }


def measure_large(args: argparse.Namespace) -> dict:
    """A model larger than half the machine's memory, built on disk: cp and convert, cold (its
    pages do not all fit the page cache beside the output's), then ``verify`` of the output. No
    save: an engine would have to hold the whole model."""
    work = args.work or tempfile.mkdtemp(prefix="convert-bench-")
    hf = built(work, "build_on_disk", layers_for(args.large))
    result = model_record(hf, args.tp, "large")
    result["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.compare:
        result["compare_tree"] = args.compare
    # Rounds, as in :func:`measure`; with ``--compare`` each round also converts with the other tree
    # (the one before a change), alternating with this one: the same disk's moods for both.
    for _ in range(args.runs):
        result.setdefault("cp_cold_runs", []).append(copy(hf, work, True))
        shutil.rmtree(os.path.join(work, "copy"))
        if args.compare:
            result.setdefault("convert_cold_compare", []).append(convert(hf, work, args.tp, True, args.compare))
        result.setdefault("convert_cold_runs", []).append(convert(hf, work, args.tp, True))
    result["runs"] = args.runs
    result["cp_cold"], result["convert_cold"] = medians(result["cp_cold_runs"]), medians(result["convert_cold_runs"])
    out = os.path.join(work, f"converted-tp{args.tp}")
    verify = subprocess.run(
        [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "verify", out], capture_output=True, text=True
    )
    result["verified"] = verify.returncode == 0
    shutil.rmtree(out)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def markdown_large(r: dict) -> str:
    nbytes, gib = r["model_bytes"], 1024**3
    convert = r["convert_cold"]
    peak = convert["peak_rss_kb"] * 1024
    lines = [
        f"Model: {nbytes / GB:.2f} GB bf16 Llama-style, built on disk in shards, on a machine of "
        f"{r['memory_bytes'] / gib:.1f} GiB; largest tensor {r['largest_tensor_bytes'] / 1e6:.0f} MB; to TP={r['tp']}; "
        f"{machine_line(r['machine'])}."
        + (f" Medians of {r['runs']} rounds (peak RSS: the highest)." if r.get("runs", 1) > 1 else ""),
        "",
        "| what | whole command | of the model's bytes | after vLLM's model is built | peak RSS |",
        "|---|---|---|---|---|",
        f"| cp + sync, cold | {r['cp_cold']['seconds']:.1f} s | {nbytes / GB / r['cp_cold']['seconds']:.2f} GB/s "
        "| - | - |",
        f"| convert TP={r['tp']}, cold | {convert['seconds']:.1f} s | {nbytes / GB / convert['seconds']:.2f} GB/s | "
        f"{convert['write_seconds']:.1f} s ({nbytes / GB / convert['write_seconds']:.2f} GB/s) "
        f"| {peak / gib:.2f} GiB |",
        "",
        f"convert vs cp (cold): {100 * r['cp_cold']['seconds'] / convert['seconds']:.0f}% of cp's throughput, whole "
        f"command; {100 * r['cp_cold']['seconds'] / convert['write_seconds']:.0f}% after vLLM's model is built. "
        f"Peak RSS {peak / gib:.2f} GiB: {peak / nbytes:.2f} of the model's size, "
        f"{(peak - r['largest_tensor_bytes']) / gib:.2f} GiB above its largest tensor. "
        f"`vllm-sharded verify` of the output: {'passed' if r['verified'] else 'FAILED'}. "
        "No save: an engine would hold the whole model.",
        "",
    ]
    if r.get("convert_cold_compare"):
        runs = zip(r["convert_cold_compare"], r["convert_cold_runs"], strict=True)
        lines += [
            f"Alternating with `{r['compare_tree']}` (cold, whole command / after the model is built, seconds): "
            + "; ".join(
                f"{a['seconds']:.1f} / {a['write_seconds']:.1f} there, "
                f"{b['seconds']:.1f} / {b['write_seconds']:.1f} here"
                for a, b in runs
            )
            + ".",
            "",
        ]
    lines += [
        f"Re-run: `{r['command']}`",
        "",
    ]
    return "\n".join(lines)


def measure_moe(args: argparse.Namespace) -> dict:
    """A MoE model (:func:`harness.build_moe`), warm: cp and convert in rounds (with ``--compare``,
    each round converts with the other tree too, and the outputs are compared file by file), and
    one convert at TP=1, whose largest tensor is the largest that vLLM's model holds: a layer's
    experts fused, what one component is."""
    work = args.work or tempfile.mkdtemp(prefix="convert-bench-")
    hf = built(work, "build_moe", max(1, round(args.moe * GB / MOE_LAYER_BYTES)))
    result = model_record(hf, args.tp, "moe")
    convert(hf, work, 1, False)
    result["vllm_largest_tensor_bytes"] = largest_tensor_bytes(os.path.join(work, "converted-tp1"))
    shutil.rmtree(os.path.join(work, "converted-tp1"))
    if args.compare:
        result["compare_tree"] = args.compare
    for _ in range(args.runs):
        result.setdefault("cp_warm_runs", []).append(copy(hf, work, False))
        if args.compare:
            there = convert(hf, work, args.tp, False, args.compare, name="compared")
            result.setdefault("convert_warm_compare", []).append(there)
        result.setdefault("convert_warm_runs", []).append(convert(hf, work, args.tp, False))
    result["runs"] = args.runs
    for key in ("cp_warm", "convert_warm"):
        result[key] = medians(result[f"{key}_runs"])
    if args.compare:
        result["convert_warm_compared"] = medians(result["convert_warm_compare"])
        result["same_files_as_compared"] = same_files(
            os.path.join(work, f"converted-tp{args.tp}"), os.path.join(work, "compared")
        )
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def markdown_moe(r: dict) -> str:
    nbytes, gib = r["model_bytes"], 1024**3
    largest, fused = r["largest_tensor_bytes"], r["vllm_largest_tensor_bytes"]

    def row(label: str, m: dict) -> str:
        rss = f"{m['peak_rss_kb'] / 1024**2:.2f} GiB" if m.get("peak_rss_kb") else "-"
        write = f"{m['write_seconds']:.1f} s" if "write_seconds" in m else "-"
        return f"| {label} | {m['seconds']:.1f} s | {write} | {rss} |"

    peak = r["convert_warm"]["peak_rss_kb"] * 1024
    lines = [
        f"Model: {nbytes / GB:.2f} GB bf16 Mixtral-style (16 experts per layer), to TP={r['tp']}, warm; "
        f"{machine_line(r['machine'])}. Medians of {r['runs']} rounds (peak RSS: the highest).",
        "",
        "| what | whole command | after vLLM's model is built | peak RSS |",
        "|---|---|---|---|",
        row("cp + sync", r["cp_warm"]),
        row(f"convert TP={r['tp']}", r["convert_warm"]),
    ]
    if "convert_warm_compared" in r:
        lines.append(row(f"convert TP={r['tp']}, `{r['compare_tree']}`", r["convert_warm_compared"]))
    lines += [
        "",
        f"Largest tensor: {largest / 1e6:.0f} MB in the source (one expert's), {fused / 1e6:.0f} MB in vLLM's "
        f"model (a layer's experts fused, at TP=1: what convert makes at once). Peak RSS {peak / gib:.2f} GiB: "
        f"{(peak - fused) / gib:.2f} GiB above vLLM's largest tensor, {(peak - largest) / gib:.2f} GiB above the "
        "source's.",
    ]
    if "same_files_as_compared" in r:
        lines.append(f"Same files and checksums as `{r['compare_tree']}`'s: {r['same_files_as_compared']}.")
    lines += ["", f"Re-run: `flock /tmp/vsl-engine.lock {r['command']}`", ""]
    return "\n".join(lines)


def markdown(r: dict) -> str:
    if r.get("large"):
        return markdown_large(r)
    if r.get("moe"):
        return markdown_moe(r)
    nbytes = r["model_bytes"]

    def row(label: str, m: dict) -> str:
        rss = f"{m['peak_rss_kb'] / 1024**2:.2f} GiB" if m.get("peak_rss_kb") else "-"
        write = (
            f"{m['write_seconds']:.1f} s ({nbytes / GB / m['write_seconds']:.2f} GB/s)" if "write_seconds" in m else "-"
        )
        return f"| {label} | {m['seconds']:.1f} s | {nbytes / GB / m['seconds']:.2f} GB/s | {write} | {rss} |"

    tp = r["tp"]
    fresh_rows, fresh_ratio = [], ""
    if "convert_fresh_node" in r:
        fresh_rows = [
            row(f"convert TP={tp}, fresh node", r["convert_fresh_node"]),
            row(f"save TP={tp} (engine start included), fresh node", r["save_fresh_node"]),
        ]
        ratio = r["save_fresh_node"]["seconds"] / r["convert_fresh_node"]["seconds"]
        fresh_ratio = f", {ratio:.2f}x on a fresh node"
    runs = r.get("runs", 1)
    lines = [
        f"Model: {nbytes / GB:.2f} GB bf16 Llama-style, to TP={tp}; {machine_line(r['machine'])}."
        + (f" Medians of {runs} rounds of every case (peak RSS: the highest)." if runs > 1 else ""),
        "",
        "| what | whole command | of the model's bytes | after vLLM's model is built | peak RSS |",
        "|---|---|---|---|---|",
        row("cp + sync, warm", r["cp_warm"]),
        row("cp + sync, cold", r["cp_cold"]),
        row(f"convert TP={tp}, warm", r["convert_warm"]),
        row(f"convert TP={tp}, cold", r["convert_cold"]),
        row(f"save TP={tp} (engine start included), warm", r["save_warm"]),
        *fresh_rows,
        "",
        f"convert vs save: {r['save_warm']['seconds'] / r['convert_warm']['seconds']:.2f}x faster "
        f"(warm, whole commands){fresh_ratio}; "
        f"same files and checksums as the save: {r['same_files_as_save']}.",
        "",
        "Warm and cold: the source files in the page cache or not, on a node whose vLLM cache already "
        "holds vLLM's inspection of the model class. Fresh node: an empty vLLM cache (files warm).",
        "",
        f"Re-run: `flock /tmp/vsl-engine.lock {r['command']}`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--work", default=None, help="folder for the model and outputs (default: a temporary one)")
    parser.add_argument("--out", default=None, help="folder for convert_bench.json and .md")
    parser.add_argument("--report", default=None, help="print the table of a saved convert_bench.json")
    parser.add_argument(
        "--large", type=float, default=None, help="GB: instead, a model of this size built on disk (no save)"
    )
    parser.add_argument(
        "--moe", type=float, default=None, help="GB: instead, a MoE model of this size, warm (peak memory; no save)"
    )
    parser.add_argument(
        "--compare", default=None, help="with --large or --moe: also convert with the package in this tree"
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="rounds of every case (medians); with --compare, each round runs both trees"
    )
    args = parser.parse_args()
    if args.large:
        report_or_measure(args, "convert_bench_large", measure_large, markdown)
    elif args.moe:
        report_or_measure(args, "convert_bench_moe", measure_moe, markdown)
    else:
        report_or_measure(args, "convert_bench", measure, markdown)


if __name__ == "__main__":
    main()
