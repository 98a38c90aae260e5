"""The one command for a lent GPU (``benchmarks/gpu_bench.py``) runs here in its CPU dry run.

It checks what can be checked without a GPU: the rank's files are built, evicted and read
by the peers and by our reader (page cache and O_DIRECT), every tensor equal, results as
JSON. The GPU figures themselves come only from a lent GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_command_runs_its_cpu_dry_run(tmp_path):
    out = tmp_path / "gpu_bench.json"
    command = ["benchmarks.gpu_bench", "--dry-run", "--runs", "1", "--threads", "2"]
    command += ["--spans", "4", "--work", str(tmp_path / "work"), "--json", str(out)]
    # Without blake3 and vLLM, as on the lent machines: the command must not need them.
    code = (
        "import runpy, sys; sys.modules['blake3'] = None; sys.modules['vllm'] = None; "
        f"sys.argv = {command!r}; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert {"safetensors_to", "ours_t2_s4_pc", "ours_t2_s4_direct"} <= set(summary)
    assert set(summary["ours_t2_s4_pc"]) == {"cold", "warm"} and set(summary["ours_t2_s4_direct"]) == {"cold"}
    assert all(s["every_tensor_equal"] for by_mode in summary.values() for s in by_mode.values())
    assert result["files"] > 1 and result["device"] == "cpu (dry run)"
