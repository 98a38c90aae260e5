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

import uuid

import pytest

from examples.cloud_servers import AZURITE_ACCOUNT, Azurite
from tests.support import object_faults
from tests.support.reference import llama_like
from tests.support.stores import (
    load_from,
    overwrite_at_tp1,
    overwrite_at_tp2,
    proxied,
    save_to_bucket,
    stores_pointed_at,
)
from vllm_sharded_loader.checkpoint import read_manifest, verify_checkpoint
from vllm_sharded_loader.format import MANIFEST_NAME
from vllm_sharded_loader.format.errors import CheckpointLocked, SaveFailedAfterPublish, StorageError
from vllm_sharded_loader.format.names import LOCK_NAME
from vllm_sharded_loader.storage import object_lock, objects
from vllm_sharded_loader.storage.location import open_store

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


def through_proxy(server, mode: str, limit: int = 0, match: bytes = b"", **settings: str):
    """Point every Azure client of this process at a fault proxy in front of the server."""
    return proxied(server, "AZURITE_BLOB_STORAGE_URL", mode, limit, match, **settings)


def put_line(url: str, name: str) -> bytes:
    return f"PUT /{AZURITE_ACCOUNT}/{BUCKET}/{objects.ObjectPrefix.parse(url).key(name)}".encode()


SETTINGS = {"AWS_MAX_ATTEMPTS": "2", "SHARDED_STATE_S3_RETRY_TIMEOUT": "10"}


def test_conditional_puts_are_honoured_by_the_emulator(store):
    """The protocol's two conditions: create-only (the lock, a first manifest) and replace-exactly
    (the manifest of an overwrite). Azurite honours both; fake-gcs-server takes no put of obstore's."""
    where = objects.ObjectPrefix.parse(new_prefix())
    objects.put(where, "x", b"one")
    seen = objects.head(where, "x")
    with pytest.raises(objects.AlreadyExists):
        objects.put(where, "x", b"two", create=True)
    objects.put(where, "x", b"three")
    with pytest.raises(objects.AlreadyExists):
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
        with pytest.raises(StorageError):
            overwrite_at_tp2(url, model, max_size=None)
        assert proxy.dropped
    assert container_digest(store) == before
    load_from(url, model, 2, 0)
    assert verify_checkpoint(open_store(url)) == []


def test_an_overwrite_whose_manifest_put_never_arrives_keeps_the_old_checkpoint_whole(store):
    """Every PUT of the manifest is cut before it reaches Azurite: the save fails, and the abandon
    deletes none of the parts the still published old manifest lists."""
    model, url, manifest, _ = saved_url(store)
    before = container_digest(store)
    with through_proxy(store, "drop_matching", match=put_line(url, MANIFEST_NAME) + b" ", **SETTINGS) as proxy:
        with pytest.raises(StorageError):
            overwrite_at_tp1(url, model)
        assert proxy.dropped
    assert read_manifest(url) == manifest
    assert verify_checkpoint(open_store(url)) == []
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
    object_faults.assert_the_save_published(url, new, model, lambda url: keys(store, url))


def test_a_lock_put_whose_answer_is_lost_is_the_saves_own_lock(store):
    """The lock's create-only put is taken and its answer lost: the retry's 409 finds the save's own token."""
    url, model = new_prefix(), model_of()
    new = saved_with_an_answer_lost(store, url, LOCK_NAME, model)
    object_faults.assert_the_save_published(url, new, model, lambda url: keys(store, url))


def test_a_held_prefix_is_refused_as_checkpoint_locked(store):
    """Another save's lock blob: the typed refusal a local save gives, and nothing written."""
    url = new_prefix()
    object_lock.acquire_lock(objects.ObjectPrefix.parse(url), "someone-else")
    with pytest.raises(CheckpointLocked):
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
        with pytest.raises(SaveFailedAfterPublish, match=f"published and complete.*{part}") as raised:
            overwrite_at_tp1(url, model)
        # The store's refusal is named (a lease), not sent to the endpoint and credentials.
        assert "lease" in str(raised.value) and "credentials" not in str(raised.value), raised.value
        assert (
            read_manifest(url).tp_size == 1 and verify_checkpoint(open_store(url)) != []
        )  # the leased part is left over
        assert LOCK_NAME not in keys(store, url)
    finally:
        lease.release()
    new = overwrite_at_tp1(url, model)
    assert keys(store, url) == sorted({f.name for e in new.ranks for f in e.files} | {MANIFEST_NAME})
    assert verify_checkpoint(open_store(url)) == []


def test_a_leased_manifest_is_refused_for_its_lease_not_as_another_saves_publish(store):
    """Azure answers 412 to any write of a leased blob, as to a failed If-Match. An overwrite whose
    manifest a lease held failed saying that another save had replaced the manifest and published
    first: none had, and the message sent the user looking for a save that never ran. Now it names
    the lease; the old checkpoint stays published and whole, and the lock is released."""
    model, url, manifest, where = saved_url(store)
    before = container_digest(store)
    lease = store.client().get_blob_client(BUCKET, where.key(MANIFEST_NAME)).acquire_lease(lease_duration=-1)
    try:
        with pytest.raises(StorageError, match=f"{MANIFEST_NAME}: the store refused the write.*lease") as raised:
            overwrite_at_tp1(url, model)
        assert "another save" not in str(raised.value)
    finally:
        lease.release()
    assert read_manifest(url) == manifest and verify_checkpoint(open_store(url)) == []
    assert container_digest(store) == before


def container_of(server) -> object_faults.Bucket:
    """The test container, as the kill tests see a store."""
    return object_faults.Bucket(
        digest=lambda: container_digest(server),
        put=lambda key, data: server.upload(BUCKET, key, data),
        names=lambda url: keys(server, url),
    )


@pytest.mark.parametrize("kill_at", object_faults.BEFORE_PUBLISH + object_faults.AFTER_PUBLISH)
def test_a_save_interrupted_at_each_step_loses_nothing(store, tmp_path, kill_at, staging_dir):
    """Ctrl-C at each step, as on S3 (``tests/support/object_faults.py``)."""
    object_faults.interrupted_save_loses_nothing(container_of(store), new_prefix(), kill_at, staging_dir, tmp_path)


@pytest.mark.parametrize("kill_at", object_faults.BEFORE_PUBLISH + object_faults.AFTER_PUBLISH)
def test_a_save_killed_at_each_step_loses_nothing(store, tmp_path, kill_at, staging_dir):
    """SIGKILL at each step, as on S3 (``tests/support/object_faults.py``)."""
    object_faults.killed_save_loses_nothing(container_of(store), new_prefix(), kill_at, staging_dir, tmp_path)


def test_a_save_whose_network_goes_down_reports_the_upload_not_its_clean_up(store):
    """The connection dies mid-upload and stays down: the save's clean-up (its uploads, its lock)
    reaches no server either. The error is the upload's, with the clean-up's failure added to it
    (what may be left, and what to do), never the clean-up's alone."""
    model, url, _, where = saved_url(store)
    with through_proxy(store, "down_after", 20000, **SETTINGS) as proxy:
        with pytest.raises(StorageError) as failed:
            overwrite_at_tp1(url, model)
        assert proxy.dropped and proxy.refused
    notes = "\n".join(getattr(failed.value, "__notes__", []))
    assert "Undoing the save also failed" in notes and LOCK_NAME in notes, notes
    # What the note says may remain does: the lock, which the save could not delete; the old checkpoint stands.
    assert objects.head(where, LOCK_NAME) is not None
    load_from(url, model, 2, 0)


def test_a_save_that_cannot_read_its_lock_back_fails_as_such_and_keeps_the_old_checkpoint(store):
    """Every GET of the lock is cut (the save checks that it still holds the lock before its
    manifest's put, and reads it again to release it): the save fails with the network's error,
    the old checkpoint whole. Before, the failed read counted as "a lock of no known holder": the
    check said the lock was taken over by another save, and a release kept the lock and said nothing."""
    model, url, manifest, where = saved_url(store)
    get_lock = f"GET /{AZURITE_ACCOUNT}/{BUCKET}/{where.key(LOCK_NAME)} ".encode()
    with through_proxy(store, "drop_matching", match=get_lock, **SETTINGS) as proxy:
        with pytest.raises(StorageError) as failed:
            overwrite_at_tp1(url, model)
        assert proxy.dropped
    assert str(failed.value).startswith(f"{where.url(LOCK_NAME)}: GET of bytes 0-"), failed.value
    assert "taken over" not in str(failed.value)
    assert f"its lock {LOCK_NAME}) may remain" in failed.value.__notes__[0]  # (its release could not read it either)
    assert read_manifest(url) == manifest
    load_from(url, model, 2, 0)
    object_lock.release_lock(where)  # as the error says, for a lock it could not release
    overwrite_at_tp1(url, model)
    assert verify_checkpoint(open_store(url)) == []
