"""``benchmarks/load_bench.py --isa avx2`` runs engines on an AVX2-only machine's code paths; here a
fresh interpreter with that environment (``timing/sitecustomize.py`` first on its path) shows
what vLLM's checks, ATen and the plugin's touch rule then see, and that the timing hook still
wraps vLLM's loader."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from benchmarks import load_bench
from tests.support import ROOT

# With an argument, vLLM's loader is imported too (10 s), to see the timing hook wrap it.
PROBE = """
import json, sys, torch
from vllm_sharded_loader.storage import memory
seen = {
    "avx512": torch.cpu._is_avx512_supported(),
    "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
    "amx": torch.cpu._is_amx_tile_supported(),
    "aten": torch.backends.cpu.get_cpu_capability(),
    "plugin_flags": sorted(f for f in memory.CPU_FLAGS if f.startswith(("avx512", "amx"))),
    "touch_bf16": memory.touched_by_the_load(torch.bfloat16),
    "touch_f32": memory.touched_by_the_load(torch.float32),
}
if sys.argv[1:]:
    from vllm.model_executor.model_loader import base_loader
    seen["timed"] = base_loader.BaseModelLoader.load_model.__qualname__
print(json.dumps(seen))
"""


def probe(tmp_path, isa: dict[str, str], *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDED_STATE_TOUCH_PAGES", *load_bench.ISA_ENV["avx2"])}
    env.update(isa, SHARDED_BENCH_TIMING=str(tmp_path / "timing.jsonl"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "timing"), str(ROOT)])
    done = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_avx2_paths_hide_avx512_from_vllm_aten_and_the_touch_rule(tmp_path):
    seen = probe(tmp_path, load_bench.ISA_ENV["avx2"], "vllm")
    assert seen == {
        "avx512": False,
        "avx512_bf16": False,
        "amx": False,
        "aten": "AVX2",
        "plugin_flags": [],
        "touch_bf16": False,  # nothing repacks bfloat16 on AVX2
        "touch_f32": True,  # oneDNN repacks float32 there too
        "timed": "_patch.<locals>.load_model",
    }


def test_without_it_an_engine_sees_this_machines_cpu(tmp_path):
    seen = probe(tmp_path, {})
    assert seen["avx512_bf16"] == torch.cpu._is_avx512_bf16_supported()
    assert seen["aten"] == torch.backends.cpu.get_cpu_capability()
    assert seen["touch_bf16"] == (seen["avx512_bf16"] or "amx_bf16" in seen["plugin_flags"])
