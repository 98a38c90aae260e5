"""The one command for a lent GPU (``benchmarks/gpu_bench.py``) runs here in its CPU dry run.

It checks what can be checked without a GPU, for real: the eviction and its check (``mincore``),
each method's first pass in a fresh process with its repeat passes apart, every tensor equal to
the files' bytes, and the results' record. The GPU figures themselves come only from a lent GPU.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_bench, harness
from tests.support import ROOT


@pytest.fixture
def disk_file(tmp_path: Path) -> Path:
    """A 4 MiB file on a disk (the test's folder, or the checkout's where that is in memory)."""
    folder = tmp_path
    if (
        subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
        == "tmpfs"
    ):
        folder = ROOT / ".gpu-bench-test"
        folder.mkdir(exist_ok=True)
    path = folder / f"rank-{os.getpid()}.bin"
    path.write_bytes(os.urandom(4 << 20))
    yield path
    path.unlink(missing_ok=True)


def test_an_eviction_is_checked_with_mincore(disk_file):
    gpu_bench.make_warm([str(disk_file)])
    assert gpu_bench.resident_share([str(disk_file)]) == 1.0
    cold = gpu_bench.make_cold([str(disk_file)])
    assert cold["resident_before"] == 1.0 and cold["resident_after"] <= gpu_bench.EVICTED and cold["verified"]
    assert gpu_bench.make_warm([str(disk_file)])["verified"]


def test_an_eviction_that_leaves_the_pages_is_not_verified():
    """A file in memory (tmpfs) stays resident whatever ``posix_fadvise`` says: the check says so."""
    path = Path("/dev/shm") / f"gpu-bench-test-{os.getpid()}.bin"
    if not path.parent.is_dir():
        pytest.skip("no /dev/shm here")
    path.write_bytes(os.urandom(1 << 20))
    try:
        cold = gpu_bench.make_cold([str(path)])
    finally:
        path.unlink()
    assert cold["resident_after"] == 1.0 and not cold["verified"]


def test_a_fingerprint_sees_a_moved_or_changed_byte():
    import torch

    t = torch.arange(1001, dtype=torch.uint8)
    moved, changed = t.roll(1), t.clone()
    changed[500] += 1
    assert gpu_bench.fingerprint(t) == gpu_bench.fingerprint(t.clone())
    assert len({gpu_bench.fingerprint(x) for x in (t, moved, changed)}) == 3


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    """The command's CPU dry run: two methods, cold and warm, one fresh process each and one repeat
    pass, in processes that cannot import blake3 or vLLM, as on the lent machines."""
    tmp = tmp_path_factory.mktemp("gpu-bench")
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(
        "import sys\nsys.modules['blake3'] = None\nsys.modules['vllm'] = None\n"
    )
    out = tmp / "gpu_bench.json"
    command = [sys.executable, "-m", "benchmarks.gpu_bench", "--dry-run", "--runs", "1", "--repeats", "1"]
    command += ["--threads", "2", "--spans", "4", "--methods", "safetensors_to,ours,instanttensor"]
    command += ["--work", str(tmp / "work"), "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp / "site"), str(ROOT)]))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def test_each_methods_first_pass_is_a_fresh_processs_and_its_repeats_are_apart(dry_run):
    result, _ = dry_run
    first, again = result["raw"], result["repeat_passes"]
    assert set(first) == {"safetensors_to", "ours_t2_s4_pc", "ours_t2_s4_direct"}
    assert set(first["ours_t2_s4_pc"]) == {"cold", "warm"} and set(first["ours_t2_s4_direct"]) == {"cold"}
    heads = [row for by_mode in first.values() for rows in by_mode.values() for row in rows]
    assert all(row["pass"] == 0 for row in heads)
    pids = [row["pid"] for row in heads]
    assert len(set(pids)) == len(pids) == 5  # one process per method and mode
    repeats = [row for by_mode in again.values() for rows in by_mode.values() for row in rows]
    assert sorted(row["pid"] for row in repeats) == sorted(pids) and all(row["pass"] == 1 for row in repeats)
    for name, by_mode in result["summary"].items():
        for mode, s in by_mode.items():
            assert s["gb_per_s_median"] == round(first[name][mode][0]["gb_per_s"], 3)
            assert s["repeat_gb_per_s_median"] == round(again[name][mode][0]["gb_per_s"], 3)
            assert s["every_tensor_equal"] and s["cache_verified"]
    assert result["not_run"] == {"instanttensor": "not run: LookupError: needs CUDA"}


def test_a_cold_pass_records_its_checked_eviction(dry_run):
    result, _ = dry_run
    colds = [row["cache"] for by_mode in result["raw"].values() for row in by_mode.get("cold", [])]
    assert colds and all(c["resident_before"] > c["resident_after"] and c["verified"] for c in colds)
    assert result["cold"]["verified"] and "posix_fadvise" in result["cold"]["how"]
    assert "mincore" in result["cold"]["checked"]
    assert result["cold"]["in_vm"] == gpu_bench.in_vm()
    assert ("upper bounds" in result["cold"]["host_cache"]) == gpu_bench.in_vm()


def test_the_result_records_command_commit_date_and_machine(dry_run):
    result, stdout = dry_run
    assert result["command"].startswith("python -m benchmarks.gpu_bench --dry-run")
    assert result["commit"] == harness.commit()
    recorded = datetime.datetime.fromisoformat(result["date"])
    assert abs(datetime.datetime.now(datetime.timezone.utc) - recorded) < datetime.timedelta(hours=1)
    assert result["machine"]["cpu_model"] and isinstance(result["machine"]["cpu_flags"], list)
    assert "gpu" not in result["machine"] and result["device"] == "cpu (dry run)"
    assert result["vllm"] == harness.vllm_version()
    assert "fresh processes per method and mode" in stdout and "every eviction verified" in stdout
