"""Where a test engine's time goes: ``LLM(...)``, one generation, the shutdown, and the whole
process, for engines started from the fork server as the engine tests start them.

Run it alone on the machine (an engine test beside it changes the figures), from the repository::

    python -m tests.support.engine_timing            # TP=1 and TP=2, three engines each
    python -m tests.support.engine_timing --tp 2 --runs 5

It builds a tiny Llama-style model in a temporary folder. The first engine of a session also
fills vLLM's model-class inspection cache (:func:`tests.support.engines.warm_model_inspection`),
timed on its own line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from examples.tiny_models import build_model
from tests.support import tiers
from tests.support.engines import fresh_processes, run_python, warm_model_inspection

# One engine, as tests/support/engine_runner.py starts it, each phase timed in the engine's process.
_ENGINE = """
import json, sys, time
started = time.perf_counter()
from vllm import LLM, SamplingParams
from examples.tiny_models import PROMPTS
from tests.support.engine_runner import execution_mode
model, tp = sys.argv[1], int(sys.argv[2])
backend = "mp" if tp > 1 else None
llm = LLM(model=model, tensor_parallel_size=tp, max_model_len=512, seed=0, distributed_executor_backend=backend,
          **execution_mode(1))
built = time.perf_counter()
llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
generated = time.perf_counter()
del llm
print("TIMES " + json.dumps({"LLM()": built - started, "generate": generated - built,
                             "shutdown": time.perf_counter() - generated}), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, action="append", help="tensor-parallel sizes (default: 1 and 2)")
    parser.add_argument("--runs", type=int, default=3, help="engines per size (default: 3)")
    args = parser.parse_args()
    tiers.enter(tiers.ENGINE)
    with tempfile.TemporaryDirectory(prefix="vsl-engine-timing-") as folder:
        # Built first: building sets TORCHINDUCTOR_CACHE_DIR in this process, and a fork server
        # started before it could then fork no engine (tests/support/forkserver.py: why_not_served).
        model = build_model(folder, "llama")
        started = time.perf_counter()
        warm_model_inspection()
        print(f"model-class inspection (once per session): {time.perf_counter() - started:.2f} s")
        for tp in args.tp or [1, 2]:
            rows: dict[str, list[float]] = {}
            for _ in range(args.runs):
                started = time.perf_counter()
                run = run_python(["-c", _ENGINE, model, str(tp)], tp=tp)
                wall = time.perf_counter() - started
                said = [line for line in run.output.splitlines() if line.startswith("TIMES ")]
                if run.returncode != 0 or not said:
                    raise SystemExit(f"the engine at TP={tp} failed (exit {run.returncode}):\n{run.tail()}")
                for phase, seconds in {**json.loads(said[-1][len("TIMES ") :]), "process": wall}.items():
                    rows.setdefault(phase, []).append(seconds)
            medians = ", ".join(f"{phase} {statistics.median(values):.2f}" for phase, values in rows.items())
            print(f"TP={tp}, median of {args.runs} engines, seconds: {medians}")
    for reason, count in fresh_processes().items():
        print(f"{count} engines ran in fresh processes, not forked: {reason}")


if __name__ == "__main__":
    main()
