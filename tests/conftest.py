"""Shared fixtures: small models built in process, and a runner for real engines."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The demo's tiny models (examples/tiny_models.py) serve the tests too.
sys.path.insert(0, str(ROOT / "examples"))
ENGINE_TIMEOUT = 900


@dataclass
class EngineRun:
    """One engine process: its exit code, its whole output, and its RESULT line."""

    returncode: int
    output: str
    result: dict | None

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def run_python(args: list[str], tp: int = 1, pp: int = 1, env: dict | None = None) -> EngineRun:
    """Run a Python script that starts an engine, with the environment engines need here."""
    from tiny_models import engine_environment

    # The engine core in-process: an engine starts in seconds instead of ~25 s.
    fast = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    full_env = {**os.environ, **engine_environment(tp, pp), **fast, **(env or {})}
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=ENGINE_TIMEOUT,
    )
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return EngineRun(proc.returncode, proc.stdout, result)


def run_engine(spec: dict, expect_ok: bool = True, env: dict | None = None) -> EngineRun:
    """Start one engine through tests/engine_runner.py; fail the test if it should work and did not."""
    run = run_python(["tests/engine_runner.py", json.dumps(spec)], spec.get("tp", 1), spec.get("pp", 1), env)
    if expect_ok and (run.returncode != 0 or run.result is None):
        pytest.fail(f"engine run {spec} failed with exit code {run.returncode}:\n{run.tail()}")
    return run


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    """The small HF models of every kind in examples/tiny_models.py, built once."""
    from tiny_models import MODEL_KINDS, build_model

    root = tmp_path_factory.mktemp("models")
    return {kind: build_model(str(root / kind), kind) for kind in MODEL_KINDS}
