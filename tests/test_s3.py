"""Checkpoints in object storage, against a real S3 server (SeaweedFS on loopback, ``examples/s3_server.py``).

Engine-free: a checkpoint saved straight into a bucket loads at its topology and resharded,
equal to the saved tensors; every bad case a local load refuses is refused from the bucket
too (a missing part, a truncated object, a flipped byte, a save still holding the prefix,
an object replaced during the load); a failing or interrupted save publishes nothing; the
offline commands work on ``s3://``. With engines: a model saved to the bucket at TP=2 by
the save script serves from the bucket at TP=2 and, resharded, at TP=1, with the default
loader's greedy ids.
"""

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

from tests.support import object_faults
from tests.support.checkpoints import moe_weights, save_model, save_replicas, serving_ranks, source_of, stage_state
from tests.support.engines import start_python
from tests.support.reference import llama_like
from tests.support.states import SOURCE, OverwritingProgress, save
from tests.support.stores import (
    Failing,
    bucket_on,
    load_from,
    overwrite_at_tp1,
    overwrite_at_tp2,
    proxied,
    save_to_bucket,
)
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest, verify_checkpoint
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import MANIFEST_NAME, ShardedStateError
from vllm_sharded_loader.format.errors import (
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointNotFound,
    SaveRefused,
    StorageError,
)
from vllm_sharded_loader.format.names import LOCK_NAME
from vllm_sharded_loader.storage import faults, object_lock, objects, reader
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.tensors import DTYPES
from vllm_sharded_loader.tools.offline import inspect_checkpoint, reshard_checkpoint

BUCKET = "models"


@pytest.fixture(scope="module")
def s3(seaweed):
    """The session's SeaweedFS S3 server with this module's bucket, and the usual AWS settings pointing at it."""
    with bucket_on(seaweed, BUCKET):
        yield seaweed


def new_prefix() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


def keys(server, url: str) -> list[str]:
    prefix = objects.ObjectPrefix.parse(url).prefix
    listed = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"][len(prefix) :] for o in listed)


def test_the_test_server_takes_writes_in_many_new_buckets(seaweed):
    # Each new bucket takes volumes of its own: a server sized by the disk's free space ran out
    # after a few buckets on CI, and every write to the next one failed with 500 InternalError.
    client = seaweed.client()
    for i in range(12):
        name = f"many-buckets-{i}"
        seaweed.create_bucket(name)
        client.put_object(Bucket=name, Key="k", Body=b"v")
        assert client.get_object(Bucket=name, Key="k")["Body"].read() == b"v"


@pytest.mark.parametrize(("saved", "serving"), [(2, 2), (2, 1), (1, 2)])
@pytest.mark.parametrize("verify", ["size", "checksum"])
def test_a_checkpoint_in_a_bucket_loads_at_its_topology_and_resharded(s3, saved, serving, verify):
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    url = new_prefix()
    manifest = save_to_bucket(url, model, saved)
    assert manifest.tp_size == saved and MANIFEST_NAME in keys(s3, url) and LOCK_NAME not in keys(s3, url)
    for rank in range(serving):
        stats, targets, expected = load_from(url, model, serving, rank, verify=verify)
        for name, x in expected.items():
            assert torch.equal(targets[name], x), name
        assert stats.bytes_mapped == 0  # objects are read, never mapped
        assert (stats.resharded_from is None) == (saved == serving)


@pytest.mark.parametrize(("saved", "ranks_on_host"), [(2, 1), (2, 2), (1, 2), (2, 8)])
def test_the_ranks_of_one_host_split_its_requests_to_the_bucket(s3, saved, ranks_on_host):
    """Ranks loading together on one host each keep their share of the host's requests in
    flight (at the saved topology and resharded), and load the same bytes."""
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    url = new_prefix()
    save_to_bucket(url, model, saved)
    for rank in range(2):
        stats, targets, expected = load_from(url, model, 2, rank, threads=1, ranks_on_host=ranks_on_host)
        assert all(torch.equal(targets[name], x) for name, x in expected.items()), rank
        assert stats.threads == reader.remote_threads(ranks_on_host) == max(16 // ranks_on_host, 4)


def test_experts_saved_per_replica_into_a_bucket_load_at_every_rank(s3):
    """Experts saved under DP=2 x EP=2 into a bucket (each replica's own objects), loaded by both
    replicas at the saved placement and by TP=2 ranks without expert parallelism."""
    weights, url = moe_weights(), new_prefix()
    manifest = save_replicas(url, weights, 1, 2, "linear")
    assert manifest.replicas == 2 and "model-dp-1-rank-0-part-0.safetensors" in keys(s3, url)
    for serving in [(1, 2, "linear"), (2, None)]:
        for rank, expected in serving_ranks(weights, serving):
            targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
            load_rank(LoadRequest(open_store(url), read_manifest(url), verify="checksum"), targets, rank)
            assert all(torch.equal(targets[n], x) for n, x in expected.items()), rank


def test_reads_are_ranged_and_only_what_a_resharding_rank_needs(s3, tmp_path):
    """A TP=1 checkpoint served at TP=2 reads about half of it per rank, not the whole objects."""
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    url = new_prefix()
    manifest = save_to_bucket(url, model, 1, max_size=None)
    stats, _, _ = load_from(url, model, 2, 1)
    assert stats.bytes_read < 0.75 * manifest.nbytes


def test_a_local_checkpoint_uploaded_as_is_loads_from_the_bucket(s3, tmp_path):
    """Any copy tool works: files written locally, uploaded by plain PUTs, then served from the bucket."""
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    save_model(tmp_path, model, 2, 1)
    url = new_prefix()
    where = objects.ObjectPrefix.parse(url)
    for name in os.listdir(tmp_path):
        s3.client().upload_file(str(tmp_path / name), BUCKET, where.key(name))
    _, targets, expected = load_from(url, model, 2, 1, verify="checksum")
    assert all(torch.equal(targets[n], x) for n, x in expected.items())


def saved_url(s3, tp=2):
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    url = new_prefix()
    manifest = save_to_bucket(url, model, tp)
    return model, url, manifest, objects.ObjectPrefix.parse(url)


def first_part(manifest):
    return manifest.rank(0, 0).files[0]


def test_a_missing_part_is_refused_naming_it(s3):
    model, url, manifest, where = saved_url(s3)
    part = first_part(manifest).name
    objects.delete(where, [part])
    with pytest.raises(CheckpointNotFound, match=f"{part}: listed in {MANIFEST_NAME}.*missing"):
        load_from(url, model, 2, 0)
    assert any(part in p and "missing" in p for p in verify_checkpoint(open_store(url)))


def test_a_truncated_object_is_refused_before_a_byte_is_read(s3):
    model, url, manifest, where = saved_url(s3)
    part = first_part(manifest)
    data = s3.client().get_object(Bucket=BUCKET, Key=where.key(part.name))["Body"].read()
    s3.client().put_object(Bucket=BUCKET, Key=where.key(part.name), Body=data[:-7])
    expected = stage_state(model, 2, 1, 0, 0)
    targets = {name: torch.full_like(x, -7) for name, x in expected.items()}
    with pytest.raises(CheckpointCorrupt, match=f"{part.name}: {part.size - 7} bytes in the store.*truncated"):
        load_rank(LoadRequest(open_store(url), read_manifest(url), serving=source_of(model)), targets, RankInfo(0, 2))
    assert all(bool((t == -7).all()) for t in targets.values())


def test_a_flipped_byte_is_refused_by_its_checksum(s3):
    model, url, manifest, where = saved_url(s3)
    part = first_part(manifest)
    data = bytearray(s3.client().get_object(Bucket=BUCKET, Key=where.key(part.name))["Body"].read())
    data[-3] ^= 0x40  # in the last tensor's bytes, not the header
    s3.client().put_object(Bucket=BUCKET, Key=where.key(part.name), Body=bytes(data))
    with pytest.raises(CheckpointCorrupt, match=f"{part.name}.*checksum"):
        load_from(url, model, 2, 0, verify="checksum")
    assert any(part.name in p for p in verify_checkpoint(open_store(url)))


def test_a_prefix_held_by_a_save_refuses_saves_and_serves_its_published_checkpoint(s3):
    model, url, _, where = saved_url(s3)
    object_lock.acquire_lock(where, "someone-else")
    load_from(url, model, 2, 0)  # a save replaces last: the published manifest is whole meanwhile
    with pytest.raises(CheckpointLocked):
        save_to_bucket(url, model, 2)
    # Without a published manifest, a held prefix is refused.
    s3.client().delete_object(Bucket=BUCKET, Key=where.key(MANIFEST_NAME))
    with pytest.raises(CheckpointLocked):
        load_from(url, model, 2, 0)
    object_lock.release_lock(where)


def test_an_object_replaced_during_the_load_is_never_read(s3):
    """Reads are conditional on the ETag seen when the part was opened."""
    _model, _url, manifest, where = saved_url(s3)
    part = first_part(manifest)
    opened = objects.open_part(where, part)
    data = bytearray(s3.client().get_object(Bucket=BUCKET, Key=where.key(part.name))["Body"].read())
    data[-1] ^= 1
    s3.client().put_object(Bucket=BUCKET, Key=where.key(part.name), Body=bytes(data))
    with pytest.raises(CheckpointCorrupt):
        opened.read_at(0, 8)
    with pytest.raises(CheckpointCorrupt):
        opened.check_unchanged()


def test_an_existing_checkpoint_is_kept_unless_overwrite(s3):
    model, url, manifest, _ = saved_url(s3)
    with pytest.raises(SaveRefused):
        save_to_bucket(url, model, 1)
    assert read_manifest(url) == manifest and LOCK_NAME not in keys(s3, url)
    # Overwrite at another topology: the old ranks' parts go, the new manifest lists only its own.
    ranks = {RankInfo(0, 1): stage_state(model, 1, 1, 0, 0)}
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    new = save_checkpoint(
        url,
        ranks,
        dtype="int32",
        source=source_of(model),
        options=SaveOptions(max_size=4096, geometry=geometry, overwrite=True),
    )
    listed = {f.name for e in new.ranks for f in e.files}
    assert {k for k in keys(s3, url) if k.endswith(".safetensors")} == listed
    assert verify_checkpoint(open_store(url)) == []


def test_a_failed_save_publishes_nothing_and_leaves_no_upload(s3, staging_dir):
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    url = new_prefix()
    ranks = {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)}
    ranks[RankInfo(1, 2)] = Failing(ranks[RankInfo(1, 2)])  # rank 0 uploads, then rank 1 fails
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(url, ranks, dtype="int32", source=source_of(model), options=SaveOptions(max_size=4096))
    assert keys(s3, url) == []  # no manifest, no part, no lock
    assert s3.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    assert list(staging_dir.iterdir()) == []  # nor a local staging folder


SAVE_AND_HANG = """
import sys, torch
from tests.support.reference import llama_like
from vllm_sharded_loader.checkpoint import RankInfo
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import SourceModel
big = {f"t{i}": torch.randn(4096, 4096) for i in range(6)}  # 6 parts of 64 MiB, multipart uploads
save_checkpoint(sys.argv[1], {RankInfo(0, 1): big}, dtype="float32",
                source=SourceModel("X", "0" * 64, {}), options=SaveOptions(max_size=64 << 20))
"""


def test_an_interrupted_save_leaves_no_manifest_and_the_next_save_cleans_up(s3, tmp_path, staging_dir):
    """A save killed outright: no manifest, the prefix refused as interrupted, then taken back.
    Its local staging folder stays until the next save on the host removes it."""
    url = new_prefix()
    where = objects.ObjectPrefix.parse(url)
    proc = subprocess.Popen([sys.executable, "-c", SAVE_AND_HANG, url], cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(k.endswith(".safetensors") for k in keys(s3, url)):
            assert proc.poll() is None, "the save finished before it could be interrupted"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    names = keys(s3, url)
    assert MANIFEST_NAME not in names and LOCK_NAME in names
    (left,) = staging_dir.iterdir()  # the killed save's staged parts, a model's worth
    assert any(p.name.endswith(".partial") for p in left.iterdir())
    with pytest.raises(CheckpointLocked):
        load_rank(LoadRequest(open_store(url), read_manifest(url)), {}, RankInfo(0, 1))
    assert any("a save is running or was interrupted" in p for p in verify_checkpoint(open_store(url)))
    # The error of the next save says what to do; done, the next save aborts what was left.
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    with pytest.raises(CheckpointLocked, match=f"delete {where.url(LOCK_NAME)}"):
        save_to_bucket(url, model, 1)
    object_lock.release_lock(where)
    # Another writer's unfinished upload under a name of our pattern: not the dead save's (it did
    # not record it), so left alone.
    theirs = s3.client().create_multipart_upload(Bucket=BUCKET, Key=where.key("model-rank-0-part-77.safetensors"))
    manifest = save_to_bucket(url, model, 1, max_size=None)  # one part: the killed save's others are stale
    assert list(staging_dir.iterdir()) == []  # the dead save's staging folder went with this save
    left = s3.client().list_multipart_uploads(Bucket=BUCKET, Prefix=where.prefix).get("Uploads", [])
    assert [u["UploadId"] for u in left] == [theirs["UploadId"]]
    s3.client().abort_multipart_upload(Bucket=BUCKET, Key=theirs["Key"], UploadId=theirs["UploadId"])
    assert verify_checkpoint(open_store(url)) == []
    assert {k for k in keys(s3, url) if k.endswith(".safetensors")} == {f.name for f in manifest.rank(0, 0).files}


def test_offline_commands_work_on_a_bucket(s3, tmp_path, capsys):
    from vllm_sharded_loader.tools.cli import main

    model, url, _manifest, _ = saved_url(s3)
    assert main(["verify", url]) == 0 and main(["inspect", url]) == 0
    assert url in capsys.readouterr().out
    info = inspect_checkpoint(open_store(url))
    assert (info["tp_size"], info["directory"], info["locked"]) == (2, url, False)
    # s3 -> local and local -> s3, each loading like the original.
    reshard_checkpoint(open_store(url), str(tmp_path / "tp1"), 1)
    _, targets, expected = load_from(str(tmp_path / "tp1"), model, 1)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())
    back = new_prefix()
    reshard_checkpoint(open_store(str(tmp_path / "tp1")), back, 2)
    assert verify_checkpoint(open_store(back)) == []
    stats, targets, expected = load_from(back, model, 2, 1)
    assert stats.resharded_from is None and all(torch.equal(targets[n], x) for n, x in expected.items())


def test_a_reshard_into_a_bucket_stopped_once_it_has_published_says_the_checkpoint_is_complete(s3, tmp_path):
    """As into a folder (tests/test_cli.py), SIGTERM once the manifest is put: the line says the new
    checkpoint is complete, and, object storage not telling a stopped save's lock from a running one's,
    to delete the lock before the next save with --overwrite removes the rest."""
    source, url = tmp_path / "tp2", new_prefix()
    save_model(source, llama_like(num_layers=2, vocab=128, kv_heads=2), 2, 1)
    reshard_checkpoint(open_store(str(source)), url, 1)
    command = [sys.executable, "-m", "vllm_sharded_loader.tools.cli", "reshard", str(source), "-tp", "2", "-o", url]
    env = {**os.environ, faults.KILL_ENV: "s3.published", faults.KILL_SIGNAL_ENV: "TERM"}
    stopped = subprocess.run([*command, "--overwrite"], env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == -signal.SIGTERM, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines() == [
        f"vllm-sharded: interrupted by SIGTERM. The new checkpoint in {url} was published and is complete; nothing "
        "needs to run again. Its save lock and any parts it replaced remain (our loader ignores them): delete "
        f"{url}/{LOCK_NAME}, then the next save into it with --overwrite removes them."
    ]
    assert read_manifest(url).tp_size == 2
    object_lock.release_lock(objects.ObjectPrefix.parse(url))
    reshard_checkpoint(open_store(str(source)), url, 2, overwrite=True)
    assert verify_checkpoint(open_store(url)) == []


def test_no_manifest_in_a_bucket_is_refused(s3):
    url = new_prefix()
    with pytest.raises(CheckpointNotFound, match=f"no {MANIFEST_NAME}"):
        load_rank(LoadRequest(open_store(url), None, serving=SOURCE), {}, RankInfo(0, 1))


@pytest.mark.engine
def test_an_engine_saves_to_a_bucket_and_serves_from_it_at_tp2_and_resharded_at_tp1(s3, models, default_outputs):
    """examples/save_sharded_state.py -o s3://... at TP=2; LLM(model="s3://...") at TP=2 and TP=1."""
    from tests.support.engines import run_engine, run_python

    url = new_prefix()
    saved = run_python(
        [
            *("examples/save_sharded_state.py", "--model", models["llama"], "-o", url),
            *("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
            *("--max-model-len", "512", "--enforce-eager", "--max-file-size", str(2 * 1024**2)),
        ],
        tp=2,
    )
    assert saved.returncode == 0, saved.tail()
    names = keys(s3, url)
    assert MANIFEST_NAME in names and "config.json" in names and LOCK_NAME not in names
    assert not any(n.endswith(".partial") for n in names)
    assert verify_checkpoint(open_store(url)) == []
    for tp in (2, 1):
        reference = default_outputs.get("llama", tp)
        served = run_engine(
            {"model": url, "tp": tp, "load_format": "sharded_state", "extra_config": {"verify": "checksum"}}
        )
        assert served.result["token_ids"] == reference["token_ids"]
        assert ("resharded from TP=2 PP=1 to TP=1 PP=1" in served.output) == (tp == 1)
        assert "0.0 MB mapped" in served.output  # read from the bucket, not from a local copy


@pytest.mark.engine
def test_the_save_script_killed_mid_upload_leaves_its_capture_folder_to_the_next_save(s3, models, staging_dir):
    """examples/save_sharded_state.py -o s3://... killed (SIGKILL) once the worker's start-up capture,
    staged in the script's staging folder, is recorded for upload: the folder stays with the
    capture in it (the script's process held it; nothing of ours runs after a kill). Once the
    dead save's lock object is deleted, the next save script on the host removes the folder,
    publishes, and leaves no staging folder of its own."""
    from tests.support.engines import run_python

    url = new_prefix()
    args = [
        *("examples/save_sharded_state.py", "--model", models["llama"], "-o", url),
        *("--max-model-len", "512", "--enforce-eager"),
    ]
    killed = run_python(args, env={faults.KILL_ENV: "s3.recorded"})
    assert killed.returncode == -signal.SIGKILL, killed.tail()
    (left,) = staging_dir.iterdir()
    assert any(".safetensors." in p.name and p.name.endswith(".partial") for p in left.iterdir()), list(left.iterdir())
    object_lock.release_lock(objects.ObjectPrefix.parse(url))
    saved = run_python(args)
    assert saved.returncode == 0, saved.tail()
    assert list(staging_dir.iterdir()) == []
    assert verify_checkpoint(open_store(url)) == []


@pytest.mark.engine
def test_the_save_script_that_survives_a_dead_worker_removes_its_staging_folder(s3, models, staging_dir):
    """At TP=2 the save script's process holds the staging folder that its two worker processes
    capture into. Worker 1 killed (SIGKILL) once its upload is recorded: the save fails, publishes
    nothing, and the script, which survives, removes the folder, capture and all."""
    from tests.support.engines import run_python

    url = new_prefix()
    args = [
        *("examples/save_sharded_state.py", "--model", models["llama"], "-o", url),
        *("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
        *("--max-model-len", "512", "--enforce-eager"),
    ]
    failed = run_python(args, tp=2, env={faults.KILL_ENV: "s3.recorded@1"})
    assert failed.returncode not in (0, -signal.SIGKILL), failed.tail()
    assert MANIFEST_NAME not in keys(s3, url)
    assert list(staging_dir.iterdir()) == []


@pytest.mark.engine
def test_one_engine_saves_again_and_again_locally_and_to_buckets(s3, models, tmp_path):
    """Saves in turn from one engine, each from what the one before left: the start-up capture
    published in place, then uploaded from its published files, uploaded again, saved elsewhere;
    and, in a second engine, a capture staged for an upload, then a second upload (which has no
    capture left to use: it reads the loaded state again). Every checkpoint verifies and holds
    the same tensors."""
    from tests.support.engines import run_engine

    local, again = str(tmp_path / "local"), str(tmp_path / "again")
    urls = [new_prefix() for _ in range(4)]
    first = run_engine({"model": models["llama"], "capture_dir": local, "saves": [local, urls[0], urls[1], again]})
    second = run_engine({"model": models["llama"], "capture_dir": str(tmp_path / "staging"), "saves": urls[2:]})
    assert first.result["saves"] == ["ok"] * 4, first.result["saves"]
    assert second.result["saves"] == ["ok"] * 2, second.result["saves"]
    checkpoints = [local, again, *urls]
    assert all(verify_checkpoint(open_store(c)) == [] for c in checkpoints)
    tensors = [load_rank_tensors(c) for c in checkpoints]
    for other in tensors[1:]:
        assert other.keys() == tensors[0].keys()
        assert all(torch.equal(other[name], t) for name, t in tensors[0].items())


def load_rank_tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    """The one rank's tensors of a TP=1 checkpoint, read by the loader into fresh tensors."""
    manifest = read_manifest(checkpoint)
    entries = manifest.rank(0, 0).tensors.items()
    targets = {name: torch.empty(e.shape, dtype=DTYPES[e.dtype]) for name, e in entries}
    load_rank(LoadRequest(open_store(checkpoint), manifest, serving=manifest.source), targets, RankInfo(0, 1))
    return targets


# ------------------------------------------------------------- network faults (a real proxy)


def bucket_of(server) -> object_faults.Bucket:
    """The test bucket, as the kill tests see a store."""
    return object_faults.Bucket(
        digest=lambda: bucket_digest(server),
        put=lambda key, data: server.client().put_object(Bucket=BUCKET, Key=key, Body=data),
        names=lambda url: keys(server, url),
    )


def bucket_digest(server) -> dict[str, str]:
    """Every object in the bucket (all prefixes) and its ETag, plus unfinished multipart uploads."""
    client = server.client()
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        found.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    uploads = client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
    found.update({f"upload:{u['Key']}:{u['UploadId']}": "" for u in uploads})
    return found


def through_proxy(server, mode: str, limit: int = 0, match: bytes = b"", **settings: str):
    """Point every S3 client of this process at a fault proxy in front of the server."""
    return proxied(server, "AWS_ENDPOINT_URL", mode, limit, match, **settings)


def test_a_connection_dropped_mid_upload_loses_nothing_and_touches_nothing_else(s3):
    """A save over a checkpoint whose uploads die mid-body (the proxy cuts every connection that
    sends more than 3000 bytes): the save fails clearly, the old checkpoint stays published and
    whole, and nothing in the bucket changed - a foreign object and a foreign unfinished upload included."""
    model, url, _, where = saved_url(s3)
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key="someone-else/data.bin", Body=b"theirs")
    client.create_multipart_upload(Bucket=BUCKET, Key=where.key("model-rank-0-part-99.safetensors.theirs"))
    before = bucket_digest(s3)
    with through_proxy(s3, "drop_after", 3000, AWS_MAX_ATTEMPTS="2", SHARDED_STATE_S3_RETRY_TIMEOUT="10") as proxy:
        with pytest.raises(StorageError):
            overwrite_at_tp2(url, model)
        assert proxy.dropped, "the proxy cut an upload"
    assert bucket_digest(s3) == before
    load_from(url, model, 2, 0)
    assert verify_checkpoint(open_store(url)) == []


def test_an_overwrite_whose_manifest_put_never_arrives_keeps_the_old_checkpoint_whole(s3):
    """Every PUT of the manifest is cut before it reaches the server: the save fails, and the old
    checkpoint, still the published one, keeps every part it lists. (The save's record of the parts
    its publish would replace was taken for its own uploads and deleted them.)"""
    model, url, manifest, where = saved_url(s3)
    before = bucket_digest(s3)
    put = f"PUT /{BUCKET}/{where.key(MANIFEST_NAME)} ".encode()
    settings = {"AWS_MAX_ATTEMPTS": "2", "SHARDED_STATE_S3_RETRY_TIMEOUT": "10"}
    with through_proxy(s3, "drop_matching", match=put, **settings) as proxy:
        with pytest.raises(StorageError):
            overwrite_at_tp1(url, model)
        assert proxy.dropped, "the proxy cut the manifest's put"
    assert read_manifest(url) == manifest
    assert verify_checkpoint(open_store(url)) == []
    load_from(url, model, 2, 0)
    assert bucket_digest(s3) == before


def saved_with_an_answer_lost(s3, url: str, name: str, model):
    """``model`` saved at TP=1 into ``url`` while a proxy loses the answer to the put of ``name``
    (the server took it); the manifest the save returned."""
    put = f"PUT /{BUCKET}/{objects.ObjectPrefix.parse(url).key(name)} ".encode()
    settings = {"AWS_MAX_ATTEMPTS": "2", "SHARDED_STATE_S3_RETRY_TIMEOUT": "10"}
    with through_proxy(s3, "lose_answer", match=put, **settings) as proxy:
        new = overwrite_at_tp1(url, model)
        assert proxy.dropped, f"the proxy lost the answer to the put of {name}"
    return new


@pytest.mark.parametrize("over", [True, False], ids=["overwrite", "first"])
def test_a_manifest_put_whose_answer_is_lost_is_a_published_save(s3, over):
    """The server takes the manifest's put, and the connection is cut before its answer: the retry's
    condition fails (the manifest is there now). That save published; it must end as one, with its
    parts and no lock, not be abandoned (which deleted the parts the published manifest lists)."""
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    url = saved_url(s3)[1] if over else new_prefix()
    new = saved_with_an_answer_lost(s3, url, MANIFEST_NAME, model)
    object_faults.assert_the_save_published(url, new, model, lambda url: keys(s3, url))


def test_a_lock_put_whose_answer_is_lost_is_the_saves_own_lock(s3):
    """The server takes the lock's create-only put and the answer is lost: the retry finds the lock
    there. It is this save's own (its token): the save goes on, instead of failing on itself as
    "another save" and leaving the prefix locked until someone deletes the lock by hand."""
    url, model = new_prefix(), llama_like(num_layers=2, vocab=1000, kv_heads=2)
    new = saved_with_an_answer_lost(s3, url, LOCK_NAME, model)
    object_faults.assert_the_save_published(url, new, model, lambda url: keys(s3, url))


def test_a_held_prefix_is_refused_as_checkpoint_locked_as_a_held_folder_is(s3, tmp_path):
    """A save meeting another save's lock raised the base ShardedStateError on object storage, where
    a local save raises CheckpointLocked: a caller branching on the type missed it."""
    model = llama_like(num_layers=2, vocab=1000, kv_heads=2)
    url = new_prefix()
    object_lock.acquire_lock(objects.ObjectPrefix.parse(url), "someone-else")
    with pytest.raises(CheckpointLocked):
        save_to_bucket(url, model, 1)
    assert keys(s3, url) == [LOCK_NAME]


def test_a_server_that_stops_answering_fails_the_load_in_bounded_time(s3):
    """Every request has a timeout and bounded retries: a stalled server is an error, not a hang."""
    model, url, _, _ = saved_url(s3)
    settings = {"SHARDED_STATE_S3_TIMEOUT": "1", "AWS_MAX_ATTEMPTS": "2", "SHARDED_STATE_S3_RETRY_TIMEOUT": "5"}
    with through_proxy(s3, "stall", **settings):
        outcome: list[BaseException | None] = []

        def load() -> None:
            try:
                load_from(url, model, 2, 0)
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=load, daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "the load hung on a stalled server"
    assert isinstance(outcome[0], ShardedStateError), outcome
    assert "Check the endpoint" in str(outcome[0])
    assert time.monotonic() - started < 120


def test_a_save_whose_lock_was_taken_over_neither_publishes_nor_frees_the_new_lock(s3):
    """Fencing: the lock carries the save's token, checked at publish and at release."""

    _, url, manifest, where = saved_url(s3)
    store = open_store(url)
    store.lock("aaaa", True, ())
    # The lock is deleted by hand (the save looked dead) and another save takes the prefix.
    s3.client().delete_object(Bucket=BUCKET, Key=where.key(LOCK_NAME))
    object_lock.acquire_lock(where, "bbbb")
    before = bucket_digest(s3)
    with pytest.raises(SaveRefused):
        store.publish(manifest)
    store.abandon(())
    assert bucket_digest(s3) == before, "the old save published or deleted the new holder's lock"
    assert object_lock.read_lock(where)["token"] == "bbbb"
    object_lock.release_lock(where, "bbbb")
    assert object_lock.read_lock(where) is None


RACER = """
import sys
from tests.support.faultkit import states
from tests.support.states import SOURCE
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import ShardedStateError
try:
    save_checkpoint(sys.argv[1], states(float(sys.argv[2])), dtype="float32", source=SOURCE,
                    options=SaveOptions(max_size=8192, overwrite=True))
except ShardedStateError as e:
    print("REFUSED", e)
    sys.exit(3)
"""


def test_two_saves_racing_for_one_prefix_publish_one_whole_checkpoint(s3, tmp_path):
    """Two processes save over the same prefix at once, three times: each save either publishes
    or is refused by the other's lock (never both half), the published checkpoint is one
    whole save's, bit-exact and verified, and nothing else is left: no part it does not
    list, no unfinished upload, no lock."""
    from tests.support.faultkit import assert_published

    url = new_prefix()
    where = objects.ObjectPrefix.parse(url)
    for round_ in range(3):
        values = (10.0 * round_ + 1, 10.0 * round_ + 2)
        logs = [tmp_path / f"racer-{round_}-{i}.log" for i in range(2)]
        # Forked from the package fork server: both start within milliseconds of each other.
        procs = [
            start_python(["-c", RACER, url, str(v)], dict(os.environ), str(log), package=True)
            for v, log in zip(values, logs, strict=True)
        ]
        codes = [p.wait(300) for p in procs]
        outputs = [log.read_text() for log in logs]
        assert all(c in (0, 3) for c in codes), outputs
        for code, out in zip(codes, outputs, strict=True):
            if code == 3:
                assert "another save holds" in out, out
        winners = [v for v, c in zip(values, codes, strict=True) if c == 0]
        assert winners, outputs
        manifest = read_manifest(url)
        published = [v for v in winners if _holds(url, v, assert_published)]
        assert len(published) == 1, (outputs, winners)
        assert verify_checkpoint(open_store(url)) == []
        listed = {f.name for e in manifest.ranks for f in e.files}
        assert {k for k in keys(s3, url) if k.endswith(".safetensors")} == listed, (round_, published)
        assert LOCK_NAME not in keys(s3, url)
        assert s3.client().list_multipart_uploads(Bucket=BUCKET, Prefix=where.prefix).get("Uploads", []) == []


def _holds(url, value, assert_published) -> bool:
    try:
        assert_published(url, value)
        return True
    except AssertionError:
        return False


def test_a_save_into_a_prefix_of_the_users_replaces_none_of_its_objects_without_overwrite(s3, tmp_path):
    """A prefix that holds no checkpoint but the user's own ``config.json``: a save that carries a
    different one is refused before its first part, naming it; every object is as it was."""
    from tests.support.faultkit import model_folder, states

    url = new_prefix()
    where = objects.ObjectPrefix.parse(url)
    s3.client().put_object(Bucket=BUCKET, Key=where.key("config.json"), Body=b'{"the user": "own"}')
    before = bucket_digest(s3)
    carry = str(model_folder(tmp_path, 1.0))
    with pytest.raises(SaveRefused, match=r"holds files that differ .*: config\.json; refusing"):
        save_checkpoint(url, states(1.0), dtype="float32", source=SOURCE, options=SaveOptions(carry=open_store(carry)))
    assert bucket_digest(s3) == before
    save_checkpoint(
        url, states(1.0), dtype="float32", source=SOURCE, options=SaveOptions(carry=open_store(carry), overwrite=True)
    )
    assert verify_checkpoint(open_store(url)) == []


def test_a_save_into_a_bucket_records_its_carried_files_and_verify_checks_them(s3, tmp_path):
    """The manifest of an object-storage save lists each carried file's size and SHA-256, and verify
    names an object changed or deleted since."""
    import hashlib

    from tests.support.faultkit import carried_of, model_folder, states

    url = new_prefix()
    where = objects.ObjectPrefix.parse(url)
    manifest = save_checkpoint(
        url,
        states(1.0),
        dtype="float32",
        source=SOURCE,
        options=SaveOptions(carry=open_store(str(model_folder(tmp_path, 1.0)))),
    )
    recorded = {name: (len(text), hashlib.sha256(text.encode()).hexdigest()) for name, text in carried_of(1.0).items()}
    assert {name: (f.size, f.sha256) for name, f in manifest.carried_files.items()} == recorded
    assert read_manifest(url) == manifest and verify_checkpoint(open_store(url)) == []
    s3.client().put_object(Bucket=BUCKET, Key=where.key("tokenizer.json"), Body=b"[]")  # same size, other bytes
    s3.client().delete_object(Bucket=BUCKET, Key=where.key("tok/vocab.txt"))
    problems = verify_checkpoint(open_store(url))
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{where.url('tok/vocab.txt')}: missing, but the save carried it (10 bytes")
    assert problems[1].startswith(f"{where.url('tokenizer.json')}: SHA-256 ")
    assert "the file was modified after the save" in problems[1]


def test_an_overwrite_in_a_bucket_removes_what_the_replaced_checkpoint_carried_and_the_new_one_does_not(s3, tmp_path):
    """As in a folder (tests/test_save_protocol.py): model 2's chat template goes when model 1 is
    saved over it; an object no manifest recorded stays."""
    from tests.support.faultkit import model_folder, states

    url = new_prefix()
    where = objects.ObjectPrefix.parse(url)
    save_checkpoint(
        url,
        states(2.0),
        dtype="float32",
        source=SOURCE,
        options=SaveOptions(carry=open_store(str(model_folder(tmp_path, 2.0)))),
    )
    assert s3.client().get_object(Bucket=BUCKET, Key=where.key("chat_template.jinja"))["Body"].read()
    s3.client().put_object(Bucket=BUCKET, Key=where.key("mine.txt"), Body=b"the user's")
    one = model_folder(tmp_path, 1.0)
    manifest = save_checkpoint(
        url,
        states(1.0),
        dtype="float32",
        source=SOURCE,
        options=SaveOptions(carry=open_store(str(one)), overwrite=True),
    )
    assert "chat_template.jinja" not in manifest.carried_files
    keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET, Prefix=where.key(""))["Contents"]}
    assert where.key("chat_template.jinja") not in keys and where.key("mine.txt") in keys
    assert verify_checkpoint(open_store(url)) == []


def test_verify_of_a_prefix_that_a_save_replaces_meanwhile_verifies_the_new_one(s3):
    """As in a folder (tests/test_cli.py): a save that publishes over the prefix and deletes the old
    parts while verify checks them is no "missing" part; verify checks the new checkpoint and says so."""
    url = new_prefix()
    first = save(url)
    notes: list[str] = []
    assert verify_checkpoint(open_store(url), notes=notes, progress=OverwritingProgress(url, saves=1)) == []
    assert read_manifest(url) != first
    assert len(notes) == 1 and notes[0].startswith(
        f"{url}/{MANIFEST_NAME}: a save replaced the checkpoint while it was being verified"
    ), notes


@pytest.mark.parametrize("kill_at", object_faults.BEFORE_PUBLISH + object_faults.AFTER_PUBLISH)
def test_an_s3_save_interrupted_at_each_step_loses_nothing(s3, tmp_path, kill_at, staging_dir):
    """Ctrl-C at each step of the object-storage protocol (``tests/support/object_faults.py``)."""
    object_faults.interrupted_save_loses_nothing(bucket_of(s3), new_prefix(), kill_at, staging_dir, tmp_path)


def test_an_s3_save_stopped_before_its_clean_up_leaves_a_record_of_the_other_models_files(s3, tmp_path):
    object_faults.stopped_save_leaves_a_record_of_the_other_models_files(new_prefix(), tmp_path)


def test_a_stalled_s3_save_whose_lock_was_taken_over_does_not_publish_over_the_new_holders(s3, tmp_path):
    object_faults.stalled_save_whose_lock_was_taken_over_does_not_publish(new_prefix(), tmp_path)


def test_every_s3_kill_point_is_covered():
    s3_points = {step for step in faults.KILL_POINTS if step.startswith("s3.")}
    steps = object_faults.BEFORE_PUBLISH + object_faults.AFTER_PUBLISH
    assert s3_points == {p.partition(":")[0] for p in steps if p.startswith("s3.")}


@pytest.mark.parametrize("kill_at", object_faults.BEFORE_PUBLISH + object_faults.AFTER_PUBLISH)
def test_an_s3_save_killed_at_each_step_loses_nothing(s3, tmp_path, kill_at, staging_dir):
    """SIGKILL at each step of the object-storage protocol (``tests/support/object_faults.py``); on
    S3, no unfinished multipart upload is left either."""
    url = new_prefix()
    object_faults.killed_save_loses_nothing(bucket_of(s3), url, kill_at, staging_dir, tmp_path)
    prefix = objects.ObjectPrefix.parse(url).prefix
    assert s3.client().list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", []) == []
