"""Two nodes on one machine, through vLLM's own multiprocessing executor: TP=2 across them, one
worker each, the leader an offline ``LLM`` (``tests/support/engine_runner.py``) and the follower
``vllm-sharded-serve ... --headless`` (vLLM's ``vllm serve``).

Each node is its own process tree with its own host name, disk view and network
(``tests/support/nodes.py``: mount, UTS and network namespaces, a veth pair each on a bridge), so that
a path means different folders on each node, as on separate machines. The object-storage
server (SeaweedFS) runs on the host; each node reaches it through its own counting proxy,
which tells how many bytes that node read.

One engine runs at a time: the default loader first (the reference token ids, and saves
from two nodes), then ``sharded_state`` loads from per-node disks, from the bucket and,
resharded, from per-node Hub caches; a save whose follower dies; PP=2 across the nodes. Every
run ends with no process left on either node.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

from examples.s3_server import SeaweedS3
from examples.tiny_models import build_model
from tests.support.faultkit import tree_digest
from tests.support.faultproxy import FaultProxy
from tests.support.hub import lay_out_cache, repo_folder, session_cache
from tests.support.nodes import ClusterFailed, Nodes, Served, kill_worker_when, serve_tp2, tails
from tests.support.signing import signed_and_trusted
from tests.support.stores import stores_pointed_at
from vllm_sharded_loader.checkpoint import read_manifest, verify_checkpoint
from vllm_sharded_loader.checkpoint.loaded_state import OVERWRITE_ENV
from vllm_sharded_loader.format import MANIFEST_NAME
from vllm_sharded_loader.storage import faults
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.tools.convert import convert_checkpoint
from vllm_sharded_loader.tools.offline import reshard_checkpoint

pytestmark = pytest.mark.engine
BUCKET = "nodes"


@dataclass
class Bucket:
    server: SeaweedS3
    proxies: list[FaultProxy]  # one per node


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = Nodes(tmp_path_factory.mktemp("nodes"))
    if not nodes.isolated_disks:
        nodes.close()
        pytest.skip("two nodes on one machine need mount and UTS namespaces (unshare, as root)")
    with nodes:
        yield nodes


@pytest.fixture(scope="module")
def bucket(cluster, seaweed):
    server = seaweed  # the session's SeaweedFS, with this module's bucket
    with (
        stores_pointed_at(server.aws_environment()),
        contextlib.ExitStack() as stack,
    ):
        server.create_bucket(BUCKET)
        port = int(server.endpoint.rsplit(":", 1)[1])
        proxies = [stack.enter_context(FaultProxy(port, host=cluster.host_ip)) for _ in range(cluster.count)]
        yield Bucket(server, proxies)


def node_environment(cluster: Nodes, bucket: Bucket, node: int) -> dict[str, str]:
    """What every process on ``node`` gets: the engine settings, the bucket through its proxy, and the
    operator's key (saves sign with it, loads trust it)."""
    bucket_settings = {**bucket.server.aws_environment(), "AWS_ENDPOINT_URL": bucket.proxies[node].url}
    return {**cluster.engine_environment(node), **bucket_settings, **signed_and_trusted()}


def serve(cluster: Nodes, bucket: Bucket, model: str, load_format: str, name: str, env=None, **options) -> Served:
    """:func:`nodes.serve_tp2` with each node's environment (engine settings, the bucket through its
    proxy, ``env``); a failure of the cluster fails the test with both nodes' logs."""
    envs = [{**node_environment(cluster, bucket, i), **(env or {})} for i in range(cluster.count)]
    try:
        return serve_tp2(cluster, model, load_format, name, envs, **options)
    except ClusterFailed as e:
        pytest.fail(str(e))


def assert_all_ended(served: Served) -> None:
    assert served.follower_ended, f"the follower did not end after the leader:\n{tails(served.logs)}"
    assert not served.leftovers, served.leftovers


@pytest.fixture(scope="module")
def reference(cluster, bucket, tmp_path_factory) -> Served:
    """vLLM's default loader on the two nodes, each with its own copy of the HF model: the token ids
    every sharded load must give. The same engine then saves three times: to a path that is
    each node's own disk, to the shared folder, and to the bucket.

    The model is the tests' Llama with two layers instead of four, one per pipeline stage: the
    PP=2 engines compile, and each layer adds seconds to every compiled start."""
    hf = build_model(str(tmp_path_factory.mktemp("two-layers")), "llama", num_hidden_layers=2)
    for i in range(cluster.count):
        shutil.copytree(hf, cluster.node_dir(i) / "hf")
    served = serve(
        cluster,
        bucket,
        str(cluster.local / "hf"),
        "auto",
        "default",
        saves=[str(cluster.local / "out"), str(cluster.shared / "tp2"), f"s3://{BUCKET}/tp2"],
    )
    assert len(served.result["token_ids"]) == 4 and all(len(ids) == 16 for ids in served.result["token_ids"])
    assert_all_ended(served)  # the plugin stops a follower whatever it loaded
    return served


def test_a_save_to_a_folder_the_nodes_do_not_share_is_refused_and_leaves_nothing(cluster, reference):
    refusal = reference.result["saves"][0]
    assert "do not share" in refusal and "node-0" in refusal and "node-1" in refusal, refusal
    assert "s3://" in refusal and "Nothing was written" in refusal
    # No lock, staging file or manifest on either node; the folder the save made is gone too.
    for i in range(cluster.count):
        assert not (cluster.node_dir(i) / "out").exists(), list((cluster.node_dir(i) / "out").iterdir())


def test_a_save_to_a_shared_folder_from_two_nodes_needs_no_setting(cluster, reference):
    assert reference.result["saves"][1] == "ok", reference.result["saves"][1]
    checkpoint = cluster.shared / "tp2"
    assert verify_checkpoint(open_store(str(checkpoint))) == []
    manifest = read_manifest(str(checkpoint))
    assert (manifest.tp_size, len(manifest.ranks)) == (2, 2)
    # Parts, manifest and the served model's non-weight files: no lock or staging file left.
    parts = manifest.listed_files()  # each rank's parts and start-up archive
    carried = {p.name for p in (cluster.node_dir(0) / "hf").iterdir() if not p.name.endswith(".safetensors")}
    assert {p.name for p in checkpoint.iterdir()} == parts | carried | {MANIFEST_NAME}


def test_a_save_to_a_bucket_from_two_nodes(bucket, reference):
    assert reference.result["saves"][2] == "ok", reference.result["saves"][2]
    assert verify_checkpoint(open_store(f"s3://{BUCKET}/tp2")) == []


def test_each_node_serves_from_its_own_disk_and_the_follower_ends_when_the_leader_is_killed(cluster, bucket, reference):
    saved = cluster.shared / "tp2"
    manifest = read_manifest(str(saved))
    for i in range(cluster.count):
        own = cluster.node_dir(i) / "ckpt"
        own.mkdir()
        keep = {f.name for f in manifest.rank(i, 0).files}
        for f in saved.iterdir():
            if f.name in keep or not f.name.endswith(".safetensors"):
                shutil.copy(f, own / f.name)
    served = serve(cluster, bucket, str(cluster.local / "ckpt"), "sharded_state", "own-disks", kill_leader=True)
    assert served.result["token_ids"] == reference.result["token_ids"]
    assert_all_ended(served)


def place_two_checkpoints(cluster, name: str) -> None:
    """At ``cluster.local / name``: on node 0 its rank of the saved checkpoint, on node 1 its rank of
    another model's (same architecture and sizes, other weights), each with its own manifest."""
    other = build_model(str(cluster.root / f"{name}-other-hf"), "llama", num_hidden_layers=2, seed=7)
    convert_checkpoint(other, str(cluster.root / f"{name}-other-tp2"), 2)
    for i, saved in enumerate([cluster.shared / "tp2", cluster.root / f"{name}-other-tp2"]):
        own = cluster.node_dir(i) / name
        own.mkdir()
        keep = {f.name for f in read_manifest(str(saved)).rank(i, 0).files}
        for f in saved.iterdir():
            if f.name in keep or not f.name.endswith(".safetensors"):
                shutil.copy(f, own / f.name)


def test_nodes_holding_different_checkpoints_at_one_path_are_refused_naming_both(cluster, bucket, reference):
    """Node 0 holds its rank of the saved checkpoint, node 1 its rank of another model's (same
    architecture and sizes, other weights) at the same path: each rank's files agree with its own
    node's manifest, so every per-rank check passes, and the engine served a mix of two models.
    The workers compare their manifests before reading: refused on both nodes, naming each
    node's folder, and every process ends."""
    place_two_checkpoints(cluster, "mixed")
    envs = [node_environment(cluster, bucket, i) for i in range(cluster.count)]
    served = serve_tp2(cluster, str(cluster.local / "mixed"), "sharded_state", "mixed", envs, failing=True)
    assert served.result is None, f"served a mix of two checkpoints: {served.result}, the saved one: {reference.result}"
    for log in served.logs:
        text = log.read_text(errors="replace")
        print(next((line for line in text.splitlines() if "hold different checkpoints" in line), ""))
        assert "hold different checkpoints" in text and "node-0" in text and "node-1" in text, tails(served.logs)
    assert served.leader_exit != 0
    assert_all_ended(served)


def test_an_update_from_nodes_holding_different_checkpoints_at_one_path_is_refused_and_changes_nothing(
    cluster, bucket, reference
):
    """The same for a weight update (``reload_weights``) of an engine serving one checkpoint: each
    node's copy of the new one agrees with itself, and the update served a mix of two models. The
    workers compare what they read before any served weight changes: refused, naming both nodes,
    and the engine serves on as before."""
    place_two_checkpoints(cluster, "update-mixed")
    envs = [node_environment(cluster, bucket, i) for i in range(cluster.count)]
    mixed = str(cluster.local / "update-mixed")
    served = serve_tp2(cluster, str(cluster.shared / "tp2"), "sharded_state", "update-mixed", envs, reload_from=mixed)
    assert served.result is not None, tails(served.logs)
    error = served.result.get("reload_error") or ""
    assert "hold different checkpoints" in error, f"updated from a mix of two checkpoints: {served.result}"
    assert "node-0" in error and "node-1" in error, error
    assert "no rank's weights were changed" in error, error
    assert served.result["token_ids"] == reference.result["token_ids"]
    assert_all_ended(served)


def test_a_follower_missing_its_part_fails_the_load_on_the_leader_naming_the_file_and_node(cluster, bucket, reference):
    """Node 1's disk lacks its rank's part: its worker refuses, and the leader, where the user
    looks, says which worker on which node failed and why (not only gloo's "Connection closed
    by peer"); every process ends."""
    saved = cluster.shared / "tp2"
    manifest = read_manifest(str(saved))
    lost = manifest.rank(1, 0).files[0].name
    for i in range(cluster.count):
        own = cluster.node_dir(i) / "part-lost"
        own.mkdir()
        keep = {f.name for f in manifest.rank(i, 0).files} - {lost}
        for f in saved.iterdir():
            if f.name in keep or not f.name.endswith(".safetensors"):
                shutil.copy(f, own / f.name)
    envs = [node_environment(cluster, bucket, i) for i in range(cluster.count)]
    served = serve_tp2(cluster, str(cluster.local / "part-lost"), "sharded_state", "part-lost", envs, failing=True)
    assert served.result is None and served.leader_exit != 0, tails(served.logs)
    leader = served.logs[0].read_text(errors="replace")
    said = next((line for line in leader.splitlines() if f"{lost}: listed in" in line), "")
    print(said)
    assert "tp_rank=1" in said and "on node-1" in said and "missing" in said, tails(served.logs)
    assert_all_ended(served)


def test_each_node_reads_only_its_share_from_the_bucket(bucket, cluster, reference):
    manifest = read_manifest(f"s3://{BUCKET}/tp2")
    shares = [sum(f.size for f in manifest.rank(i, 0).files) for i in range(2)]
    for proxy in bucket.proxies:
        proxy.sent = proxy.received = 0
    served = serve(cluster, bucket, f"s3://{BUCKET}/tp2", "sharded_state", "bucket")
    assert served.result["token_ids"] == reference.result["token_ids"]
    assert_all_ended(served)
    received = [proxy.received for proxy in bucket.proxies]
    print(f"bytes read per node: {received}; each rank's parts: {shares}")
    for i in range(2):
        # Its own parts (plus manifest, config and tokenizer, and HTTP headers), never the other's.
        assert shares[i] <= received[i] < shares[i] + shares[1 - i] / 2, (i, received, shares)


def test_a_resharded_load_from_each_nodes_hub_cache(cluster, bucket, reference):
    """Each node has the repository in its own Hub cache: the session's cache (the engines' setting,
    tests/support/hub.py) holds it as a link into the per-node path, which is each node's own folder."""
    tp1 = cluster.shared / "tp1"
    reshard_checkpoint(open_store(str(cluster.shared / "tp2")), str(tp1), 1)
    repo = "acme/tiny-sharded-nodes"
    for i in range(cluster.count):
        lay_out_cache(tp1, cluster.node_dir(i) / "hub", repo_id=repo)
    (session_cache() / repo_folder(repo)).symlink_to(cluster.local / "hub" / repo_folder(repo))
    served = serve(cluster, bucket, repo, "sharded_state", "hub")
    assert served.result["token_ids"] == reference.result["token_ids"]
    assert_all_ended(served)


def test_the_save_script_across_nodes_refuses_a_folder_they_do_not_share_and_leaves_nothing(cluster, bucket, reference):
    """The save script as the leader (it captures the loaded state into the output folder at
    start-up, on its own node only): refused before the manifest, with no capture, lock or
    folder left on either node."""
    script = [sys.executable, "examples/save_sharded_state.py", "--model", str(cluster.local / "hf")]
    script += ["--output", str(cluster.local / "by-script")]
    served = serve(cluster, bucket, str(cluster.local / "hf"), "auto", "script", leader_argv=script)
    output = served.logs[0].read_text(errors="replace")
    assert served.leader_exit == 2, tails(served.logs)
    assert "error: " in output and "do not share" in output and "node-1" in output, tails(served.logs)
    for i in range(cluster.count):
        assert not (cluster.node_dir(i) / "by-script").exists(), list((cluster.node_dir(i) / "by-script").iterdir())
    assert not served.leftovers, served.leftovers


def test_a_follower_killed_mid_save_ends_the_save_promptly_and_loses_nothing(cluster, bucket, reference):
    """Node 1's worker dies (``SIGKILL``) after placing one part of a save over the checkpoint
    in the shared folder, as when that machine fails: the leader's save ends in bounded time,
    not at the collective timeout, with an error that says so; the checkpoint there is
    byte-identical and verifies; every process on both nodes ends. The next save publishes,
    and leaves in the folder only what its manifest lists (the dead save's part is gone)."""
    target = cluster.shared / "tp2"
    before = tree_digest(str(target))
    kill = {faults.KILL_ENV: "local.placed@1", OVERWRITE_ENV: "1"}
    started = time.monotonic()
    model = str(cluster.local / "hf")
    once = {"saves": [str(target)], "generate": False}
    served = serve(cluster, bucket, model, "auto", "killed-save", env=kill, timeout=240, **once)
    elapsed = time.monotonic() - started
    error = served.result["saves"][0]
    print(f"the two-node save ended {elapsed:.0f} s after the engines started: {error}")
    assert "another worker of this save stopped answering" in error and "intact" in error, error
    after = tree_digest(str(target))
    assert {n: after.get(n) for n in before} == before  # every file of the checkpoint as it was
    assert not [p for p in verify_checkpoint(open_store(str(target))) if any(f"/{n}:" in p for n in before)]
    assert not served.leftovers, served.leftovers

    served = serve(cluster, bucket, model, "auto", "save-after-kill", env={OVERWRITE_ENV: "1"}, **once)
    assert served.result["saves"] == ["ok"], served.result["saves"]
    assert verify_checkpoint(open_store(str(target))) == []
    manifest = read_manifest(str(target))
    parts = manifest.listed_files()  # each rank's parts and start-up archive
    carried = {p.name for p in (cluster.node_dir(0) / "hf").iterdir() if not p.name.endswith(".safetensors")}
    assert {p.name for p in target.iterdir()} == parts | carried | {MANIFEST_NAME}
    assert_all_ended(served)


def test_a_save_to_a_folder_read_only_on_the_follower_fails_naming_its_node_and_keeps_the_checkpoint(
    cluster, bucket, reference
):
    """One shared folder, holding a checkpoint, that node 1 sees read-only (a read-only bind
    mount of it): node 1 sees the save's lock, so the save starts, and its worker's first write
    fails. The error names that worker's node (the path alone is ambiguous: every node has one),
    the file and the cause; the checkpoint is byte-identical, nothing of the save is left, every
    process ends."""
    target = cluster.root / "ro-target"
    shutil.copytree(cluster.shared / "tp2", target)
    view = cluster.root / "ro-view"
    view.mkdir()
    subprocess.run(["mount", "--bind", str(target), str(view)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], check=True)
        (cluster.node_dir(0) / "ro").symlink_to(target)
        (cluster.node_dir(1) / "ro").symlink_to(view)
        before = tree_digest(str(target))
        envs = [{**node_environment(cluster, bucket, i), OVERWRITE_ENV: "1"} for i in range(cluster.count)]
        once = {"saves": [str(cluster.local / "ro")], "generate": False}
        served = serve_tp2(cluster, str(cluster.local / "hf"), "auto", "read-only", envs, **once)
    finally:
        subprocess.run(["umount", str(view)], check=True)
    error = served.result["saves"][0]
    print(error)
    assert "tp_rank=1 (TP=2, PP=1) on node-1: [Errno 30] Read-only file system" in error, error
    assert "intact" in error, error
    assert tree_digest(str(target)) == before  # nothing changed, nothing left (lock, staging, archive)
    assert verify_checkpoint(open_store(str(target))) == []
    assert_all_ended(served)


def test_pipeline_stages_on_two_nodes_each_read_their_own_layers_resharded_from_the_bucket(bucket, cluster, reference):
    """PP=2 across the nodes, one stage each: vLLM's default loader gives the reference ids and
    saves at PP=2 to the bucket; then the TP=2 checkpoint, resharded to PP=2 at load, and the PP=2
    save load from the bucket with the same ids, each node reading its own stage's bytes. The
    PP=2 engines are compiled: each node also restores its own stage's start-up artifacts."""
    pp = serve(
        cluster, bucket, str(cluster.local / "hf"), "auto", "pp-default", pipeline=True, saves=[f"s3://{BUCKET}/pp2"]
    )
    assert pp.result["saves"] == ["ok"], pp.result["saves"]
    assert_all_ended(pp)
    manifest = read_manifest(f"s3://{BUCKET}/pp2")
    assert (manifest.tp_size, manifest.pp_size) == (1, 2)
    shares = [sum(f.size for f in manifest.rank(0, i).files) for i in range(2)]
    # The PP=2 save was compiled: each stage also reads its own start-up artifacts (served at
    # the saved topology); the TP=2 checkpoint's are for another topology and never read.
    archives = [manifest.rank(0, i).startup.size if manifest.rank(0, i).startup else 0 for i in range(2)]
    for source in ("pp2", "tp2"):
        for proxy in bucket.proxies:
            proxy.sent = proxy.received = 0
        served = serve(cluster, bucket, f"s3://{BUCKET}/{source}", "sharded_state", f"pp-from-{source}", pipeline=True)
        assert served.result["token_ids"] == pp.result["token_ids"], source
        assert_all_ended(served)
        received = [proxy.received for proxy in bucket.proxies]
        if source == "pp2":  # each node's stage restores its own archive from the bucket
            restored = [log.read_text(errors="replace").count("restored start-up artifacts") for log in served.logs]
            assert restored == [1, 1], (restored, tails(served.logs))
        # Its own archive, read to restore it; and every rank's, which vLLM's own pull of a
        # bucket's non-weight files (config, tokenizer) downloads too: it skips weights only.
        own = [shares[i] + (archives[i] + sum(archives) if source == "pp2" else 0) for i in range(2)]
        # Each node is prepared as vLLM builds its configuration: vLLM's model-class inspection cache
        # restored from the first rank's archive (compiled kernels and all: larger on a machine with
        # AVX-512, where it outgrew the slack below).
        first = next((e.startup.size for e in read_manifest(f"s3://{BUCKET}/{source}").ranks if e.startup), 0)
        own = [o + first for o in own]
        print(f"PP=2 from {source}: bytes read per node {received}; each stage's share {own}")
        for i in range(2):
            assert own[i] <= received[i] < own[i] + shares[1 - i] / 2, (source, i, received, own)


def kill_follower_mid_read(cluster, bucket, name: str, source: str, after_load: bool = False, **spec) -> tuple:
    """Serve ``source`` on the two nodes with node 1's bucket proxy slowed to 256 kB/s (from the
    end of its start-up load on, with ``after_load``), and ``SIGKILL`` node 1's worker once half
    of its rank's bytes have come through: in the middle of its read. Returns the run and the
    seconds from the kill to the leader's end."""
    share = sum(f.size for f in read_manifest(spec.get("reload_from", source)).rank(1, 0).files)
    proxy, log = bucket.proxies[1], cluster.root / f"{name}-node-1.log"
    killed: dict = {}

    def reading() -> bool:
        if proxy.mode != "slow":
            if after_load and "loaded 23 tensors" not in log.read_text(errors="replace"):
                return False
            proxy.sent = proxy.received = 0
            proxy.mode, proxy.limit = "slow", 256 * 1024
        return proxy.received > share // 2

    if not after_load:
        reading()
    killer = threading.Thread(target=kill_worker_when, args=(log, reading, killed), daemon=True)
    killer.start()
    envs = [node_environment(cluster, bucket, i) for i in range(cluster.count)]
    try:
        served = serve_tp2(cluster, source, "sharded_state", name, envs, failing=True, timeout=300, **spec)
    finally:
        proxy.mode = "pass"
    killer.join(timeout=5)
    assert killed, f"node 1's worker was not killed:\n{tails(served.logs)}"
    return served, time.monotonic() - killed["at"]


def test_a_follower_killed_while_it_reads_its_parts_fails_the_load_on_the_leader_naming_it(cluster, bucket, reference):
    """Node 1's worker dies (``SIGKILL``) halfway through reading its rank's part from the bucket
    (through a slowed proxy), as when that machine fails during start-up: the leader's worker,
    waiting for it after its own reads, ends the start within seconds, naming the lost worker
    and its node (gloo names only an address); every process on both nodes ends."""
    served, ended = kill_follower_mid_read(cluster, bucket, "killed-load", f"s3://{BUCKET}/tp2")
    assert "loaded 23 tensors" not in served.logs[1].read_text(errors="replace"), "killed after its read"
    leader = served.logs[0].read_text(errors="replace")
    said = next((line for line in leader.splitlines() if "WorkerLost:" in line), "")
    print(f"the leader ended {ended:.1f} s after the kill: {said}")
    assert served.result is None and served.leader_exit != 0 and ended < 60, tails(served.logs)
    assert "another worker of this load stopped answering" in said, tails(served.logs)
    assert "tp_rank=1 (TP=2, PP=1) on node-1" in said, said
    assert_all_ended(served)


def test_a_follower_killed_during_a_weight_update_fails_it_naming_the_worker_and_leaves_no_layer_empty(
    cluster, bucket, reference
):
    """Node 1's worker dies halfway through reading a weight update (``reload_weights`` from
    another model's checkpoint in the bucket). The update fails within seconds, naming the lost
    worker and its node; the leader's worker puts its layers back, so the engine's next request
    meets the lost worker too (gloo's "Connection closed by peer"), not layers that the failed
    update left empty ("Meta tensors"); every process on both nodes ends."""
    other = build_model(str(cluster.root / "update-killed-hf"), "llama", num_hidden_layers=2, seed=7)
    target = f"s3://{BUCKET}/update-killed"
    convert_checkpoint(other, target, 2)
    source = f"s3://{BUCKET}/tp2"
    served, ended = kill_follower_mid_read(
        cluster, bucket, "killed-update", source, after_load=True, reload_from=target
    )
    print(f"the leader ended {ended:.1f} s after the kill: {served.result}")
    assert "read an update of" not in served.logs[1].read_text(errors="replace"), "killed after its read"
    assert served.result is not None and ended < 60, tails(served.logs)
    error, then = served.result.get("reload_error", ""), served.result.get("generate_error", "")
    assert "another worker of this update stopped answering" in error, served.result
    assert "tp_rank=1 (TP=2, PP=1) on node-1" in error, error
    assert "Meta tensors" not in then and "Connection closed by peer" in then, then
    assert_all_ended(served)
