"""Issue 34, class 5: after the publish, the checkpoint is the checkpoint.

A real engine saves its start-up capture in place (``SHARDED_STATE_CAPTURE_DIR`` = the output,
vLLM's save hook) and is killed by ``SIGKILL`` right after the manifest's rename, or later in its
cleanup (the named kill points of ``storage/faults.py``): no ``finally``, no ``atexit`` handler
runs, so the capture's owner marker, the save lock and the replaced parts stay beside the
published manifest. ``vllm-sharded verify`` must call the checkpoint sound (exit 0, the leftovers
as notes), a ``sharded_state`` engine must load it and give vLLM's default loader's greedy tokens,
and the next save into the folder must remove the leftovers.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from examples.tiny_models import build_model
from tests.support.engines import run_engine
from tests.support.states import save
from vllm_sharded_loader.checkpoint.loaded_state import CAPTURE_DIR_ENV
from vllm_sharded_loader.checkpoint.verify import verify_checkpoint
from vllm_sharded_loader.format.names import LOCK_NAME, is_staged_name
from vllm_sharded_loader.storage import faults
from vllm_sharded_loader.storage.location import open_store

pytestmark = pytest.mark.engine

ENGINE = {"dtype": "float32"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, list]:
    """A tiny Qwen2 (biases, tied embeddings) and its greedy tokens under vLLM's default loader."""
    hf = build_model(str(tmp_path_factory.mktemp("leftovers") / "hf"), "tied", dtype="float32", seed=3)
    return hf, run_engine({"model": hf, "engine": ENGINE}).result["token_ids"]


def leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if is_staged_name(n) or n == LOCK_NAME)


@pytest.mark.parametrize("kill_at", ["local.published", "local.cleaned"])
def test_a_save_killed_after_its_publish_leaves_a_sound_checkpoint(model, tmp_path, kill_at):
    hf, reference = model
    out = tmp_path / "ckpt"
    env = {CAPTURE_DIR_ENV: str(out), faults.KILL_ENV: kill_at}
    killed = run_engine({"model": hf, "engine": ENGINE, "save_to": str(out), "env": env}, expect_ok=False)
    assert killed.returncode == -9 and killed.result is None, killed.tail()
    # The dead engine's own bookkeeping is still there: its capture's owner marker and its lock.
    left = leftovers(out)
    assert LOCK_NAME in left and any(n.startswith(".owner.") for n in left), left

    notes: list[str] = []
    assert verify_checkpoint(open_store(str(out)), notes=notes) == []
    assert any("owner marker" in n for n in notes) and any(LOCK_NAME in n for n in notes), notes
    cli = subprocess.run(
        [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "verify", str(out)], capture_output=True, text=True
    )
    assert cli.returncode == 0 and "OK:" in cli.stdout and "NOTE:" in cli.stdout, cli.stdout + cli.stderr

    loaded = run_engine({"model": str(out), "load_format": "sharded_state", "engine": ENGINE}).result
    assert loaded["token_ids"] == reference

    # The next save into the folder takes the dead save's lock over and removes what it left.
    save(out, overwrite=True)
    assert leftovers(out) == []
    assert verify_checkpoint(open_store(str(out))) == []
