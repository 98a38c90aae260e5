"""The demo: a small model built in process, saved sharded at TP=2, served back.

    python examples/demo.py [--workdir DIR] [--tp 2] [--kind llama|tied] [--hidden-size N]

1. builds a random-weight Llama-style model and tokenizer (no download needed);
2. runs vLLM's default loader on it at TP=2 and keeps its greedy outputs;
3. saves it with examples/save_sharded_state.py at TP=2;
4. loads it back with ``load_format="sharded_state"`` and compares the outputs.

Every engine runs in its own process, one after the other, as a user would run them.
Prints the outputs, the save time, the engine start time and each rank's load line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tiny_models import PROMPTS, build_model, engine_environment  # noqa: E402

LOAD_LINE = re.compile(r"vllm_sharded_loader\.ShardedStateLoader: (.*)")


def run(args: list[str], tp: int, log: Path) -> tuple[str, float]:
    """Run a script with the engine environment; returns its output and wall time."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=dict(os.environ, **engine_environment(tp)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seconds = time.perf_counter() - started
    log.write_text(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise SystemExit(f"{' '.join(args[:1])} failed (exit {proc.returncode}); full log in {log}:\n{tail}")
    return proc.stdout, seconds


def generate(model: str, tp: int, load_format: str, log: Path) -> tuple[dict, str]:
    engine = ["--tensor-parallel-size", str(tp), "--max-model-len", "512", "--enforce-eager"]
    if tp > 1:
        engine += ["--distributed-executor-backend", "mp"]
    output, _ = run(
        ["examples/load_sharded_state.py", "--model", model, "--load-format", load_format, "--json", *engine], tp, log
    )
    line = next(x for x in output.splitlines() if x.startswith("{"))
    return json.loads(line), output


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=str(ROOT / "out" / "demo"))
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--kind", default="llama", choices=["llama", "tied"])
    parser.add_argument("--hidden-size", type=int, default=None, help="make the model bigger")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    source, sharded = work / "hf-model", work / f"sharded-tp{args.tp}"
    engine = ["--tensor-parallel-size", str(args.tp), "--max-model-len", "512", "--enforce-eager"]
    if args.tp > 1:
        engine += ["--distributed-executor-backend", "mp"]

    overrides = {"hidden_size": args.hidden_size} if args.hidden_size else {}
    build_model(str(source), args.kind, **overrides)
    size = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    print(f"[1/4] built a random {args.kind} model in {source} ({size / 1e6:.1f} MB of weights)")

    reference, _ = generate(str(source), args.tp, "auto", work / "default-loader.log")
    print(f"[2/4] vLLM's default loader, TP={args.tp}: engine started in {reference['engine_start_seconds']:.1f} s")

    # --overwrite: the demo's own output from an earlier run is replaced, not an error.
    save = ["examples/save_sharded_state.py", "--model", str(source), "-o", str(sharded), "--overwrite", *engine]
    output, _ = run(save, args.tp, work / "save.log")
    print(f"[3/4] {next(x for x in output.splitlines() if x.startswith('Saved '))}")
    for name in sorted(os.listdir(sharded)):
        print(f"        {name:45s} {os.path.getsize(sharded / name):>10,d} bytes")

    loaded, output = generate(str(sharded), args.tp, "sharded_state", work / "sharded-loader.log")
    print(f"[4/4] sharded_state, TP={args.tp}: engine started in {loaded['engine_start_seconds']:.1f} s")
    for match in LOAD_LINE.finditer(output):
        print(f"        {match.group(1)}")

    same = loaded["token_ids"] == reference["token_ids"]
    print("\nGreedy token ids, default loader vs sharded_state:")
    for prompt, ours, theirs in zip(PROMPTS, loaded["token_ids"], reference["token_ids"], strict=True):
        print(f"  {prompt!r}\n    sharded_state: {ours}\n    default:       {theirs}")
    print(f"\n{'SAME' if same else 'DIFFERENT'} outputs. Logs are in {work}.")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
