"""The same checkpoint checks on every object store: S3 (SeaweedFS), Azure (Azurite), GCS (fake-gcs-server),
and the in-process ``memory://`` (obstore's MemoryStore: the object store's protocol without a server).

Each store runs as a real server on loopback, one per module (``examples/s3_server.py``,
``examples/cloud_servers.py``), reached through the settings users set for that cloud
(``AWS_ENDPOINT_URL``; ``AZURE_STORAGE_USE_EMULATOR``, or a connection string;
``STORAGE_EMULATOR_HOST``). On every store: a checkpoint loads at its topology and
resharded, bit-exact; a missing part, a truncated object, a flipped byte and an object
replaced during the load are refused naming the object; ``verify``, ``inspect`` and
``reshard`` work. Where obstore can write (S3, Azure): saves, the lock, overwrite refused,
a failed save leaving nothing. fake-gcs-server refuses obstore's uploads (XML API ``PUT``,
"invalid uploadType"), so on GCS checkpoints go up through the emulator's JSON API and
the save protocol's writes are covered by the other two stores (see docs/serving.md).
``tests/test_s3.py`` holds the S3-only cases (multipart cleanup, network faults, races).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from examples.cloud_servers import Azurite, FakeGCS
from tests.support.checkpoints import save_model, source_of, stage_state
from tests.support.reference import llama_like
from tests.support.stores import Failing, InMemory, load_from, save_to_bucket, stores_pointed_at
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest, verify_checkpoint
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import MANIFEST_NAME
from vllm_sharded_loader.format.errors import (
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointNotFound,
    InvalidOption,
    SaveRefused,
    StorageError,
)
from vllm_sharded_loader.format.names import LOCK_NAME
from vllm_sharded_loader.storage import object_lock, objects
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.tools.offline import inspect_checkpoint, reshard_checkpoint

BUCKET = "stores"  # its own bucket in the session's SeaweedFS (tests/conftest.py: seaweed)
STORES = ("s3", "az", "gs", "memory")


@dataclass
class Store:
    """A running server of one kind, and its own API for what tests do behind the loader's back."""

    scheme: str
    server: Any
    writes: bool  # obstore can write there (fake-gcs-server refuses its uploads)

    def new_url(self) -> str:
        return f"{self.scheme}://{BUCKET}/{uuid.uuid4().hex[:8]}"

    def raw_put(self, url: str, name: str, data: bytes) -> None:
        key = objects.ObjectPrefix.parse(url).key(name)
        if self.scheme == "s3":
            self.server.client().put_object(Bucket=BUCKET, Key=key, Body=data)
        else:
            self.server.upload(BUCKET, key, data)

    def raw_get(self, url: str, name: str) -> bytes:
        key = objects.ObjectPrefix.parse(url).key(name)
        if self.scheme == "s3":
            return self.server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()
        return self.server.download(BUCKET, key)

    def keys(self, url: str) -> list[str]:
        prefix = objects.ObjectPrefix.parse(url).prefix
        if self.scheme == "s3":
            listed = self.server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
            return sorted(o["Key"][len(prefix) :] for o in listed)
        return [k[len(prefix) :] for k in self.server.keys(BUCKET, prefix)]

    def save(self, tmp_path, model, tp: int) -> tuple[str, Any]:
        """A TP=``tp`` checkpoint under a new prefix: saved straight into the store where obstore
        writes, else saved locally and uploaded object by object through the emulator's API."""
        url = self.new_url()
        if self.writes:
            return url, save_to_bucket(url, model, tp)
        local = tmp_path / f"local-{uuid.uuid4().hex[:6]}"
        save_model(local, model, tp, 1)
        for name in sorted(os.listdir(local)):
            self.raw_put(url, name, (local / name).read_bytes())
        return url, read_manifest(url)


@pytest.fixture(scope="module", params=STORES)
def store(request, tmp_path_factory):
    """One server per store (S3: the session's SeaweedFS), with that cloud's usual settings pointing at it."""
    scheme = request.param
    with contextlib.ExitStack() as stack:
        if scheme == "s3":
            server = request.getfixturevalue("seaweed")
        elif scheme == "memory":
            server = InMemory()
        else:
            workdir = str(tmp_path_factory.mktemp(f"store-{scheme}"))
            server = stack.enter_context({"az": Azurite, "gs": FakeGCS}[scheme](workdir))
        environment = server.aws_environment() if scheme == "s3" else server.environment()
        with stores_pointed_at(environment):
            server.create_bucket(BUCKET)
            yield Store(scheme, server, writes=scheme != "gs")


def writing(store: Store) -> None:
    if not store.writes:
        pytest.skip("fake-gcs-server refuses obstore's uploads (XML API PUT); saves are covered on S3 and Azure")


def model_of():
    return llama_like(num_layers=2, vocab=1000, kv_heads=2)


# ------------------------------------------------------------------------------ loads


@pytest.mark.parametrize(("saved", "serving"), [(2, 2), (2, 1), (1, 2)])
def test_a_checkpoint_in_the_store_loads_bit_exact_at_its_topology_and_resharded(store, tmp_path, saved, serving):
    model = model_of()
    url, manifest = store.save(tmp_path, model, saved)
    assert manifest.tp_size == saved and MANIFEST_NAME in store.keys(url) and LOCK_NAME not in store.keys(url)
    for rank in range(serving):
        stats, targets, expected = load_from(url, model, serving, rank, verify="checksum")
        for name, x in expected.items():
            assert torch.equal(targets[name], x), name
        assert stats.bytes_mapped == 0  # objects are read, never mapped
        assert (stats.resharded_from is None) == (saved == serving)


def test_a_missing_part_is_refused_naming_it(store, tmp_path):
    model = model_of()
    url, manifest = store.save(tmp_path, model, 2)
    part = manifest.rank(0, 0).files[0].name
    objects.delete(objects.ObjectPrefix.parse(url), [part])
    with pytest.raises(CheckpointNotFound, match=f"{store.scheme}://.*{part}: listed in {MANIFEST_NAME}.*missing"):
        load_from(url, model, 2, 0)
    assert any(part in p and "missing" in p for p in verify_checkpoint(open_store(url)))


def test_a_truncated_object_is_refused_before_a_byte_is_read(store, tmp_path):
    model = model_of()
    url, manifest = store.save(tmp_path, model, 2)
    part = manifest.rank(0, 0).files[0]
    store.raw_put(url, part.name, store.raw_get(url, part.name)[:-7])
    targets = {name: torch.full_like(x, -7) for name, x in stage_state(model, 2, 1, 0, 0).items()}
    with pytest.raises(CheckpointCorrupt, match=f"{part.name}: {part.size - 7} bytes in the store.*truncated"):
        load_rank(LoadRequest(open_store(url), read_manifest(url), serving=source_of(model)), targets, RankInfo(0, 2))
    assert all(bool((t == -7).all()) for t in targets.values())


def test_a_flipped_byte_is_refused_by_its_checksum(store, tmp_path):
    model = model_of()
    url, manifest = store.save(tmp_path, model, 2)
    part = manifest.rank(0, 0).files[0]
    data = bytearray(store.raw_get(url, part.name))
    data[-3] ^= 0x40  # in the last tensor's bytes, not the header
    store.raw_put(url, part.name, bytes(data))
    with pytest.raises(CheckpointCorrupt, match=f"{part.name}.*checksum"):
        load_from(url, model, 2, 0, verify="checksum")
    assert any(part.name in p for p in verify_checkpoint(open_store(url)))


def test_an_object_replaced_during_the_load_is_never_read(store, tmp_path):
    """Reads are conditional on the version seen when the part was opened (ETag; GCS: generation)."""
    url, manifest = store.save(tmp_path, model_of(), 2)
    part = manifest.rank(0, 0).files[0]
    opened = objects.open_part(objects.ObjectPrefix.parse(url), part)
    data = bytearray(store.raw_get(url, part.name))
    data[-1] ^= 1
    store.raw_put(url, part.name, bytes(data))
    with pytest.raises(CheckpointCorrupt, match=f"{part.name}: the object was replaced or deleted during the load"):
        opened.read_at(0, 8)
    with pytest.raises(CheckpointCorrupt):
        opened.check_unchanged()


def test_no_manifest_is_refused(store):
    with pytest.raises(CheckpointNotFound, match=f"no {MANIFEST_NAME}"):
        load_rank(LoadRequest(open_store(store.new_url()), None, serving=source_of(model_of())), {}, RankInfo(0, 1))


# ------------------------------------------------------------------------------ saves


def test_a_held_prefix_and_an_existing_checkpoint_are_kept_unless_overwrite(store, tmp_path):
    writing(store)
    model = model_of()
    url, manifest = store.save(tmp_path, model, 2)
    where = objects.ObjectPrefix.parse(url)
    with pytest.raises(SaveRefused):
        save_to_bucket(url, model, 1)
    assert read_manifest(url) == manifest and LOCK_NAME not in store.keys(url)
    # The lock is a create-only put: a second save is refused while the first holds it.
    object_lock.acquire_lock(where, "someone-else")
    with pytest.raises(CheckpointLocked):
        object_lock.acquire_lock(where, "me")
    load_from(url, model, 2, 0)  # the published checkpoint still serves meanwhile
    object_lock.release_lock(where, "someone-else")
    # Overwrite at another topology: the manifest is replaced by a put conditional on the one
    # read (its ETag), the old ranks' parts go, the upload records too.
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
    assert {k for k in store.keys(url) if k != MANIFEST_NAME} == listed
    assert verify_checkpoint(open_store(url)) == []
    _, targets, expected = load_from(url, model, 1)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())


def test_the_manifest_put_refuses_a_manifest_replaced_meanwhile(store, tmp_path):
    """The publish step's condition: replacing exactly the manifest read, never another save's."""
    writing(store)
    url, manifest = store.save(tmp_path, model_of(), 2)
    where = objects.ObjectPrefix.parse(url)
    seen = objects.head(where, MANIFEST_NAME)
    # Another save published meanwhile (other bytes: S3's ETag is their MD5).
    objects.put(where, MANIFEST_NAME, (manifest.to_json() + "\n").encode())
    with pytest.raises(objects.AlreadyExists, match=f"{MANIFEST_NAME}: replaced by another save meanwhile"):
        objects.put(where, MANIFEST_NAME, b"{}", match=seen)
    assert read_manifest(url) == manifest


def test_a_failed_save_publishes_nothing_and_leaves_nothing(store, staging_dir):
    writing(store)
    model = model_of()
    url = store.new_url()
    ranks = {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)}
    ranks[RankInfo(1, 2)] = Failing(ranks[RankInfo(1, 2)])  # rank 0 uploads, then rank 1 fails
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(url, ranks, dtype="int32", source=source_of(model), options=SaveOptions(max_size=4096))
    assert store.keys(url) == []  # no manifest, no part, no upload record, no lock
    assert list(staging_dir.iterdir()) == []  # nor a local staging folder


def test_a_save_to_the_gcs_emulator_fails_naming_the_object_and_leaves_nothing(store):
    """What fake-gcs-server does to obstore's uploads, so that the limit of these tests is visible."""
    if store.writes:
        pytest.skip("only the GCS emulator refuses uploads")
    model = model_of()
    url = store.new_url()
    with pytest.raises(StorageError, match=f"{url}/{LOCK_NAME}: upload failed .*STORAGE_EMULATOR_HOST"):
        save_to_bucket(url, model, 1)
    assert store.keys(url) == []


# ------------------------------------------------------------------- offline commands


def test_verify_inspect_and_reshard_work_on_the_store(store, tmp_path, capsys):
    from vllm_sharded_loader.tools.cli import main

    model = model_of()
    url, _ = store.save(tmp_path, model, 2)
    assert main(["verify", url]) == 0 and main(["inspect", url]) == 0
    assert url in capsys.readouterr().out
    info = inspect_checkpoint(open_store(url))
    assert (info["tp_size"], info["directory"], info["locked"]) == (2, url, False)
    # store -> local, loading like the original.
    assert main(["reshard", url, "-tp", "1", "-o", str(tmp_path / "tp1")]) == 0
    _, targets, expected = load_from(str(tmp_path / "tp1"), model, 1)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())
    if store.writes:  # local -> store, and store -> store
        back = store.new_url()
        reshard_checkpoint(open_store(str(tmp_path / "tp1")), back, 2)
        again = store.new_url()
        reshard_checkpoint(open_store(back), again, 1)
        for where, tp in ((back, 2), (again, 1)):
            assert verify_checkpoint(open_store(where)) == []
            stats, targets, expected = load_from(where, model, tp, tp - 1)
            assert stats.resharded_from is None and all(torch.equal(targets[n], x) for n, x in expected.items())


def test_a_checkpoint_under_a_source_prefix_is_not_carried_as_the_models_files(store, tmp_path):
    """As in a local folder: a checkpoint saved under the model's prefix is not the model's. Carried,
    its tokenizer was written over the one of a checkpoint at the same place under the output,
    recorded as the output's own, and removed as stale by the output's next save. And a module
    folder comes whole, its weights too (they were left behind)."""
    url = store.new_url()
    names = {
        "config.json": b"{}",
        "tokenizer.json": b"{}",
        "tok/vocab.txt": b"a",
        "inner/sharded_state.json": b"{}",
        "inner/tokenizer.json": b"{}",
        "parts/model-rank-0-part-0.safetensors": b"x",
        "parts/notes.txt": b"n",
        "saving/.sharded_state.lock": b"{}",
        "saving/chat_template.jinja": b"t",
        "modules.json": b'[{"path": ""}, {"path": "2_Dense"}]',  # (sentence-transformers)
        "2_Dense/config.json": b"{}",
        "2_Dense/model.safetensors": b"d",  # a module's own weights: carried
        "original/model.safetensors": b"o",  # a copy of the transformer's: not
    }
    for name, data in names.items():
        store.raw_put(url, name, data)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    carried = ["2_Dense/config.json", "2_Dense/model.safetensors", "config.json", "modules.json", "tok/vocab.txt"]
    carried.append("tokenizer.json")
    assert open_store(url).non_weight_files() == carried
    assert open_store(str(tmp_path)).non_weight_files() == carried  # the rule of a local folder


# -------------------------------------------------------- vLLM's config and tokenizer fetch


def test_runai_fetches_config_and_tokenizer_as_vllm_asks(store, tmp_path, monkeypatch):
    """vLLM pulls a ``gs://``/``az://`` model's small files through Run:ai's ``pull_files`` (its
    ``runai-model-streamer-gcs``/``-azure`` extras) before any loader runs: it reaches both
    emulators with the settings docs/serving.md gives."""
    if store.scheme in ("s3", "memory"):
        pytest.skip("s3:// is served by vLLM in tests/test_s3.py's engine test; memory:// is this process's own")
    from runai_model_streamer import pull_files

    url = store.new_url()
    for name, data in [("config.json", b"{}"), ("tokenizer/tokenizer.json", b"{}"), (MANIFEST_NAME, b"{}")]:
        store.raw_put(url, name, data)
    store.raw_put(url, "model-rank-0-part-0.safetensors", b"weights")
    if store.scheme == "gs":
        monkeypatch.setenv("RUNAI_STREAMER_GCS_USE_ANONYMOUS_CREDENTIALS", "true")  # the emulator takes no token
    else:
        monkeypatch.setenv(objects.AZURE_CONNECTION_STRING_ENV, store.server.connection_string())
    pull_files(url + "/", str(tmp_path), ["*.model", "*.py", "*.json"], None)  # vLLM's patterns
    fetched = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert fetched == sorted(["config.json", "tokenizer/tokenizer.json", MANIFEST_NAME])


# ------------------------------------------------------------------ Azure's URL forms


def test_azure_https_urls_and_a_connection_string_reach_the_same_blobs(store, tmp_path, monkeypatch):
    """``https://ACCOUNT.blob.core.windows.net/container/prefix`` names the account itself; a
    connection string alone (what Azure's SDKs and tools read) is enough to reach it."""
    if store.scheme != "az":
        pytest.skip("Azure only")
    model = model_of()
    url, _ = store.save(tmp_path, model, 2)
    where = objects.ObjectPrefix.parse(url)
    https = f"https://devstoreaccount1.blob.core.windows.net/{BUCKET}/{where.prefix}"
    assert objects.ObjectPrefix.parse(https).url(MANIFEST_NAME) == https + MANIFEST_NAME
    assert verify_checkpoint(open_store(https)) == []
    _, targets, expected = load_from(https, model, 2, 1)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())
    # Only the connection string now: no emulator flag.
    for name in store.server.environment():
        monkeypatch.delenv(name)
    monkeypatch.setenv(objects.AZURE_CONNECTION_STRING_ENV, store.server.connection_string())
    objects._store.cache_clear()
    try:
        copied = store.new_url()
        reshard_checkpoint(open_store(url), copied, 1)
        _, targets, expected = load_from(copied, model, 1)
        assert all(torch.equal(targets[n], x) for n, x in expected.items())
        monkeypatch.delenv(objects.AZURE_CONNECTION_STRING_ENV)
        objects._store.cache_clear()
        with pytest.raises(InvalidOption, match=r"no Azure storage account\. Set AZURE_STORAGE_ACCOUNT_NAME"):
            read_manifest(copied)
    finally:
        objects._store.cache_clear()


# ----------------------------------------------------------------- URLs (no server)


@pytest.mark.parametrize(
    ("url", "scheme", "bucket", "prefix", "account"),
    [
        ("s3://b/p/q", "s3", "b", "p/q/", None),
        ("gs://b/p/", "gs", "b", "p/", None),
        ("gs://b", "gs", "b", "", None),
        ("az://c/p", "az", "c", "p/", None),
        ("https://acct.blob.core.windows.net/c/p/q", "az", "c", "p/q/", "acct"),
    ],
)
def test_object_urls_name_their_store_bucket_and_prefix(url, scheme, bucket, prefix, account):
    where = objects.ObjectPrefix.parse(url)
    assert (where.scheme, where.bucket, where.prefix, where.account) == (scheme, bucket, prefix, account)
    assert objects.is_object_url(url) and where.url("x") == url.rstrip("/") + ("/x" if prefix or not account else "x")


def test_other_urls_are_not_object_storage_or_are_refused_with_the_forms():
    assert not objects.is_object_url("/models/llama") and not objects.is_object_url("https://example.com/x")
    with pytest.raises(InvalidOption, match="must name the container"):
        objects.ObjectPrefix.parse("https://acct.blob.core.windows.net/")
    with pytest.raises(InvalidOption, match="gs://bucket/prefix, az://container/prefix"):
        objects.ObjectPrefix.parse("gs:///nobucket")


def test_azure_connection_strings_become_obstore_settings():
    assert objects.azure_connection_string("AccountName=a;AccountKey=k==;EndpointSuffix=core.windows.net") == {
        "account_name": "a",
        "account_key": "k==",
    }
    assert objects.azure_connection_string("DefaultEndpointsProtocol=http;AccountName=a;AccountKey=k")["endpoint"] == (
        "http://a.blob.core.windows.net"
    )
    assert objects.azure_connection_string("UseDevelopmentStorage=true") == {"use_emulator": True}
    assert objects.azure_connection_string("BlobEndpoint=http://h:1/a;SharedAccessSignature=sv=1&sig=x")["sas_key"] == (
        "sv=1&sig=x"
    )


@pytest.mark.parametrize("url", ["s3://b/ckpt/", "S3://b/ckpt", "s3://b//ckpt", "s3://b/ckpt//"])
def test_one_prefix_under_any_spelling_is_one_location(url):
    # reshard and convert refuse an output that is their source: the same prefix, however it is written
    # (refused before any request: no server here).
    def same_location(a: str, b: str) -> bool:
        return open_store(a).same_as(open_store(b))

    def lies_inside(a: str, b: str) -> bool:
        return open_store(a).inside(open_store(b))

    assert same_location("s3://b/ckpt", url)
    assert not same_location("s3://b/ckpt", "s3://b/ckpt2") and not same_location("s3://b/ckpt", "gs://b/ckpt")
    # reshard also refuses an output inside its source: a longer prefix of the same bucket
    # ("ckpt///sub", an empty part inside the prefix, is refused as a URL: its subfolder is spelt once)
    assert lies_inside(url.rstrip("/") + "/sub", "s3://b/ckpt") and lies_inside("s3://b/ckpt/sub", "s3://b/")
    assert not lies_inside(url, "s3://b/ckpt") and not lies_inside("s3://b/ckpt2", url)
    assert not lies_inside("s3://c/ckpt/sub", url) and not lies_inside("gs://b/ckpt/sub", url)
    from vllm_sharded_loader.tools.convert import convert_checkpoint

    with pytest.raises(InvalidOption, match="another folder than the source model"):
        convert_checkpoint("s3://b/ckpt", url, 2)


@pytest.mark.parametrize("url", ["s3://b/ckpt?versionId=3", "gs://b/ckpt#v2", "s3://b/ckpt?", "az://c/we#ird/x"])
def test_a_query_or_fragment_is_refused_not_dropped(url):
    with pytest.raises(InvalidOption):
        open_store(url)


@pytest.mark.parametrize("url", ["s3://b/ckpt?versionId=1", "s3://b/ckpt#x"])
def test_a_query_or_fragment_is_refused_by_the_prefix_parser_itself(url):
    # Not only through open_store: every caller of the one parser of an object URL refuses it.
    with pytest.raises(InvalidOption):
        objects.ObjectPrefix.parse(url)


@pytest.mark.parametrize(
    "url", ["s3://b/a//b", "s3://b/a/../c", "s3://b/./x", "gs://b/x/.", "https://acct.blob.core.windows.net/c/a/../b"]
)
def test_a_prefix_with_an_empty_dot_or_dot_dot_part_is_refused_as_a_url_not_blamed_on_the_endpoint(url):
    """Keys are not paths: the stores refuse such a key (the message said to check the endpoint and
    credentials) or keep it as it is, another prefix than the one meant."""
    with pytest.raises(InvalidOption):
        open_store(url)
    for fine in ("s3://b//x", "s3://b/x/", "s3://b"):  # (slashes at the ends are no part)
        open_store(fine)
