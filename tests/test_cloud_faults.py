"""The save protocol's faults on Azure (Azurite), as ``tests/test_s3.py`` runs them on S3 (SeaweedFS).

A real Azurite on loopback, reached through Azure's emulator settings; the faults are real: a
TCP proxy (``tests/support/faultproxy.py``) that cuts a connection mid-upload, drops the
manifest's put, or lets Azurite take a put and loses its answer; saves in another process
stopped (SIGINT) or killed (SIGKILL) at each step of the protocol (``storage/faults.py``; the
``s3.*`` steps are every object store's). Azurite honours both conditions the protocol puts
on a write (create-only, and replace-exactly by ETag). fake-gcs-server takes none of obstore's
uploads (``tests/test_object_stores.py``), so no GCS save runs here: its loads' faults (a
missing, truncated or replaced part) are in ``tests/test_object_stores.py``.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import uuid

import pytest
import torch

from examples.cloud_servers import AZURITE_ACCOUNT, Azurite
from tests.support.checkpoints import source_of, stage_state
from tests.support.engines import package_process
from tests.support.reference import llama_like
from tests.support.stores import load_from, save_to_bucket, stores_pointed_at
from vllm_sharded_loader.checkpoint import RankInfo, read_manifest, verify_checkpoint
from vllm_sharded_loader.checkpoint.save import save_checkpoint
from vllm_sharded_loader.format import MANIFEST_NAME, ShardedStateError
from vllm_sharded_loader.format.errors import CheckpointLocked, SaveFailedAfterPublish
from vllm_sharded_loader.format.names import LOCK_NAME
from vllm_sharded_loader.storage import faults, objects

BUCKET = "faults"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Azurite with this module's container, and Azure's usual emulator settings pointing at it."""
    with Azurite(str(tmp_path_factory.mktemp("azurite"))) as server, stores_pointed_at(server.environment()):
        server.create_bucket(BUCKET)
        yield server


def new_prefix() -> str:
    return f"az://{BUCKET}/{uuid.uuid4().hex[:8]}"


def model_of():
    return llama_like(num_layers=2, vocab=1000, kv_heads=2)


def keys(server, url: str) -> list[str]:
    prefix = objects.ObjectPrefix.parse(url).prefix
    return [k[len(prefix) :] for k in server.keys(BUCKET, prefix)]


def container_digest(server) -> dict[str, str]:
    """Every blob in the container (committed or only staged blocks) and its ETag."""
    container = server.client().get_container_client(BUCKET)
    return {b.name: str(b.etag) for b in container.list_blobs(include=["uncommittedblobs"])}


def saved_url(server, tp: int = 2):
    model = model_of()
    url = new_prefix()
    manifest = save_to_bucket(url, model, tp)
    return model, url, manifest, objects.ObjectPrefix.parse(url)


@contextlib.contextmanager
def through_proxy(server, mode: str, limit: int = 0, match: bytes = b"", **settings: str):
    """Point every Azure client of this process at a fault proxy in front of Azurite."""
    from tests.support.faultproxy import FaultProxy

    port = int(server.endpoint.rsplit(":", 1)[1])
    with (
        FaultProxy(port, mode, limit, match=match) as proxy,
        stores_pointed_at({"AZURITE_BLOB_STORAGE_URL": proxy.url, **settings}),
    ):
        yield proxy


def put_line(url: str, name: str) -> bytes:
    return f"PUT /{AZURITE_ACCOUNT}/{BUCKET}/{objects.ObjectPrefix.parse(url).key(name)}".encode()


def overwrite_at_tp1(url, model):
    ranks = {RankInfo(0, 1): stage_state(model, 1, 1, 0, 0)}
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    return save_checkpoint(
        url, ranks, dtype="int32", source=source_of(model), max_size=4096, geometry=geometry, overwrite=True
    )


SETTINGS = {"AWS_MAX_ATTEMPTS": "2", "SHARDED_STATE_S3_RETRY_TIMEOUT": "10"}


def test_conditional_puts_are_honoured_by_the_emulator(store):
    """The protocol's two conditions: create-only (the lock, a first manifest) and replace-exactly
    (the manifest of an overwrite). Azurite honours both; fake-gcs-server takes no put of obstore's."""
    where = objects.ObjectPrefix.parse(new_prefix())
    objects.put(where, "x", b"one")
    seen = objects.head(where, "x")
    with pytest.raises(objects.AlreadyExists, match="already exists"):
        objects.put(where, "x", b"two", create=True)
    objects.put(where, "x", b"three")
    with pytest.raises(objects.AlreadyExists, match="replaced by another save"):
        objects.put(where, "x", b"four", match=seen)
    assert objects.read_object(where, "x") == b"three"


def test_a_connection_dropped_mid_upload_loses_nothing_and_touches_nothing_else(store):
    """A save over a checkpoint whose part uploads die mid-body: it fails naming the upload, the old
    checkpoint stays published and whole, and no blob in the container changed (a foreign one
    included), not even a block staged for a blob that was never committed."""
    model, url, _, _ = saved_url(store)
    store.upload(BUCKET, "someone-else/data.bin", b"theirs")
    before = container_digest(store)
    # Parts of one rank whole (tens of kB): the cut hits their uploads, not the small requests
    # of the cleanup (Azure's batch delete of a dozen names is itself a few kB).
    with through_proxy(store, "drop_after", 20000, **SETTINGS) as proxy:
        with pytest.raises(ShardedStateError, match="upload failed"):
            save_checkpoint(
                url,
                {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)},
                dtype="int32",
                source=source_of(model),
                max_size=None,
                overwrite=True,
            )
        assert proxy.dropped
    assert container_digest(store) == before
    load_from(url, model, 2, 0)
    assert verify_checkpoint(url) == []


def test_an_overwrite_whose_manifest_put_never_arrives_keeps_the_old_checkpoint_whole(store):
    """Every PUT of the manifest is cut before it reaches Azurite: the save fails, and the abandon
    deletes none of the parts the still published old manifest lists."""
    model, url, manifest, _ = saved_url(store)
    before = container_digest(store)
    with through_proxy(store, "drop_matching", match=put_line(url, MANIFEST_NAME) + b" ", **SETTINGS) as proxy:
        with pytest.raises(ShardedStateError, match="upload failed"):
            overwrite_at_tp1(url, model)
        assert proxy.dropped
    assert read_manifest(url) == manifest
    assert verify_checkpoint(url) == []
    load_from(url, model, 2, 0)
    assert container_digest(store) == before


def saved_with_an_answer_lost(server, url: str, name: str, model):
    """``model`` saved at TP=1 into ``url`` while the proxy loses the answer to every put of ``name``
    (Azurite took it); the manifest the save returned."""
    with through_proxy(server, "lose_answer", match=put_line(url, name), **SETTINGS) as proxy:
        new = overwrite_at_tp1(url, model)
        assert proxy.dropped, f"the proxy lost the answer to the put of {name}"
    return new


@pytest.mark.parametrize("over", [True, False], ids=["overwrite", "first"])
def test_a_manifest_put_whose_answer_is_lost_is_a_published_save(store, over):
    """Azurite takes the manifest's conditional put and the answer is lost; the retry's condition
    fails (409 or 412). The save published: it ends as one, its parts kept, its lock released."""
    model = model_of()
    url = saved_url(store)[1] if over else new_prefix()
    new = saved_with_an_answer_lost(store, url, MANIFEST_NAME, model)
    assert read_manifest(url) == new
    assert verify_checkpoint(url) == []
    _, targets, expected = load_from(url, model, 1)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())
    assert keys(store, url) == sorted({f.name for e in new.ranks for f in e.files} | {MANIFEST_NAME})


def test_a_lock_put_whose_answer_is_lost_is_the_saves_own_lock(store):
    """The lock's create-only put is taken and its answer lost: the retry's 409 finds the save's own token."""
    url = new_prefix()
    new = saved_with_an_answer_lost(store, url, LOCK_NAME, model_of())
    assert verify_checkpoint(url) == []
    assert keys(store, url) == sorted({f.name for e in new.ranks for f in e.files} | {MANIFEST_NAME})


def test_a_held_prefix_is_refused_as_checkpoint_locked(store):
    """Another save's lock blob: the typed refusal a local save gives, and nothing written."""
    url = new_prefix()
    objects.acquire_lock(objects.ObjectPrefix.parse(url), "someone-else")
    with pytest.raises(CheckpointLocked, match="another save holds"):
        save_to_bucket(url, model_of(), 1)
    assert keys(store, url) == [LOCK_NAME]


def test_a_stale_part_the_cleanup_cannot_delete_fails_after_the_publish_and_frees_the_lock(store):
    """An Azure lease on a part of the replaced checkpoint (a backup or copy tool holds one) refuses its
    delete (412) once the new manifest is out. The save failed after the publish as it should, but
    kept its lock: every later save, this process's included, was refused as "another save" until
    someone deleted the lock by hand, though the error said to save again. Now the lock is released,
    and the next save deletes what the cleanup left (the save's record of the replaced parts stays)."""
    model, url, _, where = saved_url(store)
    part = where.key(read_manifest(url).rank(1, 0).files[0].name)
    lease = store.client().get_blob_client(BUCKET, part).acquire_lease(lease_duration=-1)
    try:
        with pytest.raises(SaveFailedAfterPublish, match=f"published and complete.*{part}"):
            overwrite_at_tp1(url, model)
        assert read_manifest(url).tp_size == 1 and verify_checkpoint(url) != []  # the leased part is left over
        assert LOCK_NAME not in keys(store, url)
    finally:
        lease.release()
    new = overwrite_at_tp1(url, model)
    assert keys(store, url) == sorted({f.name for e in new.ranks for f in e.files} | {MANIFEST_NAME})
    assert verify_checkpoint(url) == []


def test_a_leased_manifest_is_refused_for_its_lease_not_as_another_saves_publish(store):
    """Azure answers 412 to any write of a leased blob, as to a failed If-Match. An overwrite whose
    manifest a lease held failed saying that another save had replaced the manifest and published
    first: none had, and the message sent the user looking for a save that never ran. Now it names
    the lease; the old checkpoint stays published and whole, and the lock is released."""
    model, url, manifest, where = saved_url(store)
    before = container_digest(store)
    lease = store.client().get_blob_client(BUCKET, where.key(MANIFEST_NAME)).acquire_lease(lease_duration=-1)
    try:
        with pytest.raises(ShardedStateError, match=f"{MANIFEST_NAME}: the store refused the write.*lease") as raised:
            overwrite_at_tp1(url, model)
        assert "another save" not in str(raised.value)
    finally:
        lease.release()
    assert read_manifest(url) == manifest and verify_checkpoint(url) == []
    assert container_digest(store) == before


BEFORE_PUBLISH = ("s3.locked", "s3.recorded", "s3.uploaded", "s3.uploaded:3", "local.carried")
AFTER_PUBLISH = ("s3.published", "s3.cleaned")
WHILE_STAGED = ("s3.recorded", "s3.uploaded", "s3.uploaded:3")
SAVER = """
import sys
from tests.support.states import SOURCE
from tests.support.faultkit import states
from vllm_sharded_loader.checkpoint.save import save_checkpoint
save_checkpoint(sys.argv[1], states(float(sys.argv[2])), dtype="float32", source=SOURCE, max_size=8192,
                overwrite=True, carry=sys.argv[3])
"""


@pytest.mark.parametrize("kill_at", BEFORE_PUBLISH + AFTER_PUBLISH)
def test_a_save_interrupted_at_each_step_loses_nothing(store, tmp_path, kill_at, staging_dir):
    """Ctrl-C (SIGINT) at each step: before the manifest's put the container is as it was, A published
    and the lock released; from it on, B is published and whole."""
    from tests.support.faultkit import assert_published, model_folder

    url = new_prefix()

    def save(value: float, env: dict | None = None) -> subprocess.CompletedProcess:
        return package_process(["-c", SAVER, url, str(value), str(model_folder(tmp_path, value))], env)

    assert save(1.0).returncode == 0
    before = container_digest(store)
    stopped = save(2.0, {faults.KILL_ENV: kill_at, faults.KILL_SIGNAL_ENV: "INT"})
    assert stopped.returncode != 0 and "KeyboardInterrupt" in stopped.stderr, (kill_at, stopped.stderr[-2000:])
    assert list(staging_dir.iterdir()) == []
    if kill_at in BEFORE_PUBLISH:
        assert container_digest(store) == before
        assert_published(url, 1.0)
    else:
        assert_published(url, 2.0)
        assert [p for p in verify_checkpoint(url) if "does not list" not in p and LOCK_NAME not in p] == []
        objects.release_lock(objects.ObjectPrefix.parse(url))
    again = save(3.0)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_published(url, 3.0)
    assert verify_checkpoint(url) == []


@pytest.mark.parametrize("kill_at", BEFORE_PUBLISH + AFTER_PUBLISH)
def test_a_save_killed_at_each_step_loses_nothing(store, tmp_path, kill_at, staging_dir):
    """SIGKILL at each step: exactly one of A and B is published, bit-exact; nothing outside the prefix
    changes; once the dead save's lock is deleted, the next save leaves only what its manifest lists
    (and the user's own blob)."""
    from tests.support.faultkit import assert_published, carried_of, model_folder

    url = new_prefix()
    where = objects.ObjectPrefix.parse(url)

    def save(value: float, env: dict | None = None) -> subprocess.CompletedProcess:
        return package_process(["-c", SAVER, url, str(value), str(model_folder(tmp_path, value))], env)

    assert save(1.0).returncode == 0
    store.upload(BUCKET, where.key("notes.txt"), b"the user's own")
    before = container_digest(store)
    a_objects = {k: v for k, v in before.items() if k.startswith(where.prefix)}
    killed = save(2.0, {faults.KILL_ENV: kill_at})
    assert killed.returncode == -signal.SIGKILL, (kill_at, killed.returncode, killed.stderr[-2000:])
    assert len(list(staging_dir.iterdir())) == (kill_at in WHILE_STAGED)
    after = container_digest(store)
    outside = lambda d: {k: v for k, v in d.items() if not k.startswith(where.prefix)}  # noqa: E731
    assert outside(after) == outside(before)
    if kill_at in BEFORE_PUBLISH:
        if kill_at != "local.carried":
            assert {k: after.get(k) for k in a_objects} == a_objects
        assert_published(url, 1.0)
    else:
        assert_published(url, 2.0)
    objects.release_lock(where)
    again = save(3.0)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_published(url, 3.0)
    assert list(staging_dir.iterdir()) == []
    manifest = read_manifest(url)
    listed = {f.name for e in manifest.ranks for f in e.files}
    names = set(keys(store, url))
    assert {n for n in names if n.endswith(".safetensors")} == listed
    assert not [n for n in names if n.startswith(".")], names
    assert {"notes.txt", MANIFEST_NAME, *carried_of(3)} <= names
    assert verify_checkpoint(url) == []


def test_a_save_whose_network_goes_down_reports_the_upload_not_its_clean_up(store):
    """The connection dies mid-upload and stays down: the save's clean-up (its uploads, its lock)
    reaches no server either. The error is the upload's, with the clean-up's failure added to it
    (what may be left, and what to do), never the clean-up's alone."""
    model, url, _, where = saved_url(store)
    with through_proxy(store, "down_after", 20000, **SETTINGS) as proxy:
        with pytest.raises(ShardedStateError, match="upload failed") as failed:
            overwrite_at_tp1(url, model)
        assert proxy.dropped and proxy.refused
    notes = "\n".join(getattr(failed.value, "__notes__", []))
    assert "Undoing the save also failed" in notes and objects.LOCK_NAME in notes, notes
    # What the note says may remain does: the lock, which the save could not delete; the old checkpoint stands.
    assert objects.head(where, objects.LOCK_NAME) is not None
    load_from(url, model, 2, 0)
