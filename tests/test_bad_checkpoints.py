"""A corpus of bad checkpoints: each is refused with its own clear error, nothing is
loaded into the model, nothing on disk is lost, and ``vllm-sharded verify`` names it.

Engine-free: real files and tensors, the same `load_rank` the loader calls. The
truncated-part, bit-flip and stale-part cases also run through a real engine in
tests/test_engine.py. Damaged manifests of a reshardable checkpoint go through every path
(same-topology load, resharding load, offline reshard, verify); then a save over a
checkpoint during its load, and two saves racing for one interrupted save's lock.
"""

import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.checkpoints import RESHARD_MODEL, save_reshardable, source_of, stage_state
from tests.support.engines import package_process
from tests.support.manifests import edit_manifest
from tests.support.reference import llama_like
from tests.support.states import CONFIG, SOURCE, assert_untouched, fresh_targets, load, rank_state, save
from vllm_sharded_loader.checkpoint import (
    LoadRequest,
    RankInfo,
    ReadOptions,
    load_rank,
    read_manifest,
    saveable_state,
    verify_checkpoint,
)
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import LOCK_NAME, MANIFEST_NAME, SourceModel, config_sha256
from vllm_sharded_loader.format.entries import DIGEST_METADATA
from vllm_sharded_loader.format.errors import (
    CheckpointCorrupt,
    CheckpointLocked,
    CheckpointMismatch,
    CheckpointNotFound,
    InvalidOption,
    SaveRefused,
)
from vllm_sharded_loader.format.manifest import MAX_BLOCK_SIZE, MAX_DIMS, MAX_RANKS, RankEntry
from vllm_sharded_loader.format.names import parse_file_name, staged_name, staged_token
from vllm_sharded_loader.storage import integrity
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.lock import SaveLock, acquire_save_lock, read_lock, release_save_lock
from vllm_sharded_loader.tools.cli import main as cli
from vllm_sharded_loader.tools.offline import reshard_checkpoint

PART0 = "model-rank-0-part-0.safetensors"
ROOT = Path(__file__).resolve().parent.parent


def snapshot(directory: Path) -> dict[str, str]:
    """Every file's content hash: a failed load must leave the directory as it was."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def data_offset(path: Path) -> int:
    """An offset inside the tensor data of a part (past its header)."""
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    return 8 + header_len + 40


def symlink_outside(d: Path) -> None:
    outside = d.parent / f"{d.name}-outside.safetensors"
    os.replace(d / PART0, outside)
    os.symlink(outside, d / PART0)


def absurd_header_shape(d: Path) -> None:
    raw = (d / PART0).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    del header["__metadata__"]  # room for the longer shape, so the header keeps its length
    header["model.norm.weight"]["shape"] = [10**12, 10**12]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n, "the edited header must keep its length"
    (d / PART0).write_bytes(raw[:8] + text + raw[8 + n :])


def header_longer_than_file(d: Path) -> None:
    raw = (d / PART0).read_bytes()
    (d / PART0).write_bytes((len(raw) * 2).to_bytes(8, "little") + raw[8:])


def duplicate_tensor_across_files(d: Path) -> None:
    # Parts of 300 bytes; part 0 rewritten to also hold a tensor that part 1 holds.
    manifest = save(d, max_size=300)
    entry = manifest.rank(0, 0)
    part0 = entry.files[0].name  # a save over a checkpoint numbers its parts past the old ones
    state = saveable_state(rank_state(0, 2))
    in_part0 = [n for n, t in entry.tensors.items() if t.file == part0]
    other = next(n for n, t in entry.tensors.items() if t.file != part0)
    save_file({n: state[n].contiguous() for n in [*in_part0, other]}, str(d / part0), metadata={"format": "pt"})

    def patch(m):
        f = m["ranks"][0]["files"][0]
        f["size"] = (d / part0).stat().st_size
        f.pop("checksum")

    edit_manifest(d, patch)


def another_models_checkpoint(d: Path) -> None:
    other = dict(CONFIG, hidden_size=32)
    edit_manifest(d, lambda m: m["source"].update(config_sha256=config_sha256(other), config=other))


# (name, corruption, error the load raises[, whether `vllm-sharded verify` reports it: default yes])
CASES = [
    ("truncated part", lambda d: (d / PART0).write_bytes((d / PART0).read_bytes()[:-7]), r"truncated"),
    ("empty part", lambda d: (d / PART0).write_bytes(b""), r"0 bytes on disk, but sharded_state.json records"),
    ("missing part", lambda d: os.remove(d / PART0), r"listed in sharded_state.json .* but missing"),
    ("bit flip in a header", lambda d: flip_bit(d / PART0, 12), r"model-rank-0-part-0.safetensors"),
    ("no manifest and a missing rank", lambda d: (os.remove(d / MANIFEST_NAME), os.remove(d / PART0)), r"no file"),
    ("wrong manifest version", lambda d: edit_manifest(d, lambda m: m.update(format_version=7)), r"format_version 7"),
    ("not a manifest", lambda d: (d / MANIFEST_NAME).write_text('{"weights": "elsewhere"}'), r"not a vllm-sharded"),
    ("manifest that does not parse", lambda d: (d / MANIFEST_NAME).write_text("{'tp_size': 2,"), r"not valid JSON"),
    (
        "manifest with duplicate keys",
        lambda d: (d / MANIFEST_NAME).write_text(
            (d / MANIFEST_NAME).read_text().replace('"tp_size": 2,', '"tp_size": 2, "tp_size": 1,')
        ),
        r"duplicate key 'tp_size'",
    ),
    (
        "manifest and file size disagree",
        lambda d: edit_manifest(
            d, lambda m: m["ranks"][0]["files"][0].update(size=m["ranks"][0]["files"][0]["size"] + 8)
        ),
        r"bytes on disk, but sharded_state.json records",
    ),
    (
        "wrong topology",
        lambda d: edit_manifest(d, lambda m: (m.update(tp_size=1), m["ranks"].pop())),
        r"saved with tensor_parallel_size=1",
    ),
    # Only the load knows which model it serves: offline, this checkpoint is sound.
    ("another model's checkpoint", another_models_checkpoint, r"hidden_size: 32 -> 16", False),
    (
        "path escaping with ..",
        lambda d: edit_manifest(d, lambda m: m["ranks"][0]["files"][0].update(name="../x.safetensors")),
        r"not a plain file name",
    ),
    (
        "absolute path",
        lambda d: edit_manifest(d, lambda m: m["ranks"][0]["files"][0].update(name="/etc/passwd")),
        r"not a plain file name",
    ),
    ("symlink pointing outside", symlink_outside, r"outside the checkpoint directory"),
    (
        "absurd shape in the manifest",
        lambda d: edit_manifest(
            d, lambda m: m["ranks"][0]["tensors"]["model.norm.weight"].update(shape=[10**12, 10**12])
        ),
        r"model.norm.weight saved \[1000000000000, 1000000000000\] but the model expects \[16\]",
    ),
    ("absurd shape in a header", absurd_header_shape, r"needs 2000000000000000000000000 bytes"),
    ("header longer than its file", header_longer_than_file, r"header claims"),
    ("tensor stored in two files", duplicate_tensor_across_files, r"holds tensors \['.*'\] not in sharded_state.json"),
    (
        # A save dies before its first manifest: the lock stays, and nothing is published.
        "interrupted first save (lock left, no manifest)",
        lambda d: (
            (d / LOCK_NAME).write_text(json.dumps({"pid": 999999999, "host": "elsewhere"})),
            (d / MANIFEST_NAME).unlink(),
        ),
        r"save was interrupted: .*\.sharded_state\.lock",
    ),
]


# The error type of each case whose load does not raise CheckpointCorrupt.
REFUSED_AS = {
    "missing part": CheckpointNotFound,
    "no manifest and a missing rank": CheckpointNotFound,
    "wrong manifest version": CheckpointMismatch,
    "wrong topology": CheckpointMismatch,
    "another model's checkpoint": CheckpointMismatch,
    "absurd shape in the manifest": CheckpointMismatch,
    "interrupted first save (lock left, no manifest)": CheckpointLocked,
}


@pytest.mark.parametrize(
    ("corrupt", "error", "offline", "kind"),
    [(*(*c[1:], True)[:3], REFUSED_AS.get(c[0], CheckpointCorrupt)) for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_checkpoint_is_refused_nothing_loaded_nothing_lost(tmp_path, corrupt, error, offline, kind, capsys):
    directory = tmp_path / "ckpt"
    save(directory)
    corrupt(directory)
    before = snapshot(directory)
    targets = fresh_targets(0, 2)
    with pytest.raises(kind, match=error):
        load(directory, targets=targets)
    assert_untouched(targets)
    assert snapshot(directory) == before
    # The offline check names the problem too, and exits 1.
    assert cli(["verify", str(directory)]) == (1 if offline else 0)
    assert ("BAD" in capsys.readouterr().out) == offline


def test_bit_flip_in_data_is_caught_by_checksums(tmp_path, capsys):
    save(tmp_path)
    flip_bit(tmp_path / PART0, data_offset(tmp_path / PART0))
    load(tmp_path)  # "size" cannot see it: same size, same header
    # The file is shorter than a checksum block: its one block ends where the file does.
    mismatch = f"{PART0}: checksum mismatch in bytes 0..{(tmp_path / PART0).stat().st_size} (block 0)"
    with pytest.raises(CheckpointCorrupt, match=re.escape(mismatch)):
        load(tmp_path, verify="checksum")
    load(tmp_path, tp_rank=1, verify="checksum")  # the other rank's files are sound
    assert cli(["verify", str(tmp_path)]) == 1
    assert mismatch in capsys.readouterr().out
    assert cli(["verify", "--size-only", str(tmp_path)]) == 0


def test_checksums_span_blocks_and_catch_a_flip_in_any_block(tmp_path, monkeypatch):
    import vllm_sharded_loader.storage.integrity as integrity

    monkeypatch.setattr(integrity, "BLOCK_SIZE", 256)  # many blocks in a small file
    manifest = save(tmp_path)
    blocks = len(manifest.rank(0, 0).files[0].checksum.blocks)
    assert blocks > 3
    load(tmp_path, verify="checksum")
    flip_bit(tmp_path / PART0, (tmp_path / PART0).stat().st_size - 3)  # in the last block
    last, size = blocks - 1, (tmp_path / PART0).stat().st_size
    # The message names the block's real bytes: the last block ends with the file.
    with pytest.raises(CheckpointCorrupt, match=rf"bytes {last * 256}\.\.{size} \(block {last}\)"):
        load(tmp_path, verify="checksum")


def test_stale_part_is_ignored_by_the_loader_and_reported_by_verify(tmp_path, capsys):
    save(tmp_path)
    stale = tmp_path / "model-rank-0-part-1.safetensors"
    save_file({"model.norm.weight": torch.zeros(16, dtype=torch.bfloat16)}, str(stale))
    _, targets = load(tmp_path)
    assert torch.equal(targets["model.norm.weight"], torch.ones(16, dtype=torch.bfloat16))
    assert cli(["verify", str(tmp_path)]) == 1
    assert "model-rank-0-part-1.safetensors: a part that sharded_state.json does not list" in capsys.readouterr().out
    # Without a manifest (vLLM's format), the stale part would be read: refused instead.
    os.remove(tmp_path / MANIFEST_NAME)
    with pytest.raises(CheckpointCorrupt, match=r"'model.norm.weight' is stored in both"):
        load(tmp_path)


def test_checksum_verification_needs_checksums(tmp_path):
    save(tmp_path)
    edit_manifest(tmp_path, lambda m: [f.pop("checksum") for r in m["ranks"] for f in r["files"]])
    load(tmp_path)
    with pytest.raises(CheckpointMismatch):
        load(tmp_path, verify="checksum")
    os.remove(tmp_path / MANIFEST_NAME)
    with pytest.raises(CheckpointMismatch, match=r"no sharded_state.json .* no checksums to verify"):
        load(tmp_path, verify="checksum")
    with pytest.raises(InvalidOption, match="verify='bytes' is not a verification mode"):
        load(tmp_path, verify="bytes")


def test_sound_checkpoint_verifies(tmp_path, capsys):
    save(tmp_path, max_size=300)
    assert verify_checkpoint(open_store(str(tmp_path))) == []
    assert cli(["verify", str(tmp_path)]) == 0
    assert "OK" in capsys.readouterr().out
    load(tmp_path, verify="checksum")


def save_carrying(directory: Path) -> Path:
    """A sound TP=2 checkpoint that carries a model's config, tokenizer and generation config."""
    model = directory.parent / f"{directory.name}-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    (model / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(200)}}}))
    (model / "generation_config.json").write_text('{"temperature": 0.6}')
    ranks = {RankInfo(r, 2): saveable_state(rank_state(r, 2)) for r in range(2)}
    save_checkpoint(
        str(directory), ranks, dtype="bfloat16", source=SOURCE, options=SaveOptions(carry=open_store(str(model)))
    )
    assert verify_checkpoint(open_store(str(directory))) == []
    return directory


def test_verify_names_a_carried_file_that_changed_or_was_deleted(tmp_path, capsys):
    """A flipped byte in the tokenizer, a truncated one and a deleted generation config: each named
    with what the save recorded and what is there; a load, which does not read them, is unchanged."""
    d = save_carrying(tmp_path / "ckpt")
    tokenizer, generation = d / "tokenizer.json", d / "generation_config.json"
    size = tokenizer.stat().st_size
    flip_bit(tokenizer, size // 2)
    generation.unlink()
    recorded = r"\d+ bytes, SHA-256 [0-9a-f]{16}\.\.\."
    remedy = r"Restore it from the model the checkpoint was saved from \(or copy the checkpoint again\), or save"
    missing = rf"{re.escape(str(generation))}: missing, but the save carried it \({recorded}\) .*{remedy}"
    problems = verify_checkpoint(open_store(str(d)))
    assert len(problems) == 2, problems
    assert re.fullmatch(missing + ".*", problems[0])
    assert re.fullmatch(
        rf"{re.escape(str(tokenizer))}: SHA-256 [0-9a-f]{{16}}\.\.\., but the save recorded {size} bytes, SHA-256 "
        rf"[0-9a-f]{{16}}\.\.\.: the file was modified after the save\. {remedy}.*",
        problems[1],
    )
    assert verify_checkpoint(open_store(str(d)), checksums=False) == problems[:1]  # same size: hashed only
    tokenizer.write_bytes(tokenizer.read_bytes()[: size - 5])
    truncated = rf"{re.escape(str(tokenizer))}: {size - 5} bytes, but the save recorded {size} bytes, SHA-256 "
    assert re.match(
        truncated + r".*the file is truncated or was replaced",
        verify_checkpoint(open_store(str(d)), checksums=False)[1],
    )
    assert cli(["verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert "has 2 problem(s)" in out and f"{generation}: missing" in out and f"{tokenizer}: {size - 5} bytes" in out
    load(d)


def test_a_manifest_that_records_no_carried_files_verifies_and_says_so(tmp_path, capsys):
    """A manifest of an earlier version (no ``carried_files``) still loads and verifies; verify says
    that the files beside the parts were not checked."""
    d = save_carrying(tmp_path / "ckpt")
    edit_manifest(d, lambda m: m.pop("carried_files"))
    flip_bit(d / "tokenizer.json", 3)
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(d)), notes=notes) == []
    assert notes == [
        f"{d / MANIFEST_NAME} records no carried files (a save by an earlier version): the config, tokenizer and "
        "other files beside the parts were not checked. Save the checkpoint again to record them."
    ]
    assert cli(["verify", str(d)]) == 0
    out = capsys.readouterr().out
    assert f"NOTE: {notes[0]}" in out and "OK" in out
    load(d)


def test_an_empty_record_of_carried_files_beside_files_verifies_and_says_so(tmp_path):
    """The save hook records no carried file when it copies none (saving into the served model's own
    folder): verify says that the files beside the parts were not checked, and names some."""
    d = save_carrying(tmp_path / "ckpt")
    edit_manifest(d, lambda m: m.update(carried_files={}))
    flip_bit(d / "tokenizer.json", 3)
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(d)), notes=notes) == []
    assert len(notes) == 1 and notes[0].startswith(f"{d / MANIFEST_NAME} records no carried files, but "), notes
    assert "tokenizer.json" in notes[0] and "they were not checked" in notes[0]
    for name in set(os.listdir(d)) - read_manifest(str(d)).listed_files() - {MANIFEST_NAME}:
        path = d / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    notes.clear()
    assert (
        verify_checkpoint(open_store(str(d)), notes=notes) == [] and notes == []
    )  # nothing beside the parts: nothing to say


@pytest.mark.parametrize("own", ["model-rank-0-part-0.safetensors", MANIFEST_NAME])
def test_a_record_of_carried_files_naming_the_checkpoints_own_file_is_named_as_damage(tmp_path, capsys, own):
    """A ``carried_files`` record of one of the checkpoint's own files (a part, with its true size and
    SHA-256): verify called the checkpoint sound, and every reshard refused it as a file "changed since
    ... Try again once it is done", since a reshard carries only the non-weight files. Now the
    manifest is refused as damaged, by verify, a load and a reshard alike."""
    d = tmp_path / "ckpt"
    save_reshardable(d)
    data = (d / own).read_bytes()
    record = {own: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    edit_manifest(d, lambda m: m.update(carried_files=record))
    damaged = (
        rf"^{re.escape(str(d / MANIFEST_NAME))}: 'carried_files' records \['{re.escape(own)}'\], the checkpoint's own "
        r"files .* The manifest is damaged: save the checkpoint again\.$"
    )
    problems = verify_checkpoint(open_store(str(d)))
    assert len(problems) == 1 and re.match(damaged, problems[0]), problems
    with pytest.raises(CheckpointCorrupt, match=damaged):
        reshard_checkpoint(open_store(str(d)), str(tmp_path / "out"), 1)
    assert not (tmp_path / "out").exists()
    assert cli(["inspect", str(d)]) == 2
    assert "'carried_files' records" in capsys.readouterr().err


# ------------------------------------------------------------------------ saves


def test_existing_checkpoint_is_not_overwritten_unless_asked(tmp_path):
    save(tmp_path, tp_size=4)
    before = snapshot(tmp_path)
    with pytest.raises(SaveRefused):
        save(tmp_path, overwrite=False)
    assert snapshot(tmp_path) == before
    assert not (tmp_path / LOCK_NAME).exists()
    # Overwriting a TP=4 save at TP=2 leaves no part of ranks 2 and 3 behind.
    manifest = save(tmp_path, tp_size=2, overwrite=True)
    listed = sorted(f.name for entry in manifest.ranks for f in entry.files)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*listed, MANIFEST_NAME])
    assert [parse_file_name(manifest.pattern, n)["tp_rank"] for n in listed] == [0, 1]
    assert verify_checkpoint(open_store(str(tmp_path))) == []


def test_save_while_another_runs_fails_clearly_and_takes_nothing(tmp_path):
    save(tmp_path)
    before = snapshot(tmp_path)
    lock = acquire_save_lock(str(tmp_path), "other-save", overwrite=True)  # a save running in this process
    with pytest.raises(CheckpointLocked, match=rf"another save holds .*{LOCK_NAME} \(pid {os.getpid()}.*wait for it"):
        save(tmp_path, overwrite=True)
    release_save_lock(lock)
    assert snapshot(tmp_path) == before
    load(tmp_path)


SAVER = textwrap.dedent(
    """
    import sys, torch
    from tests.support.states import SOURCE
    from vllm_sharded_loader.checkpoint import RankInfo
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    {prelude}
    big = {{RankInfo(r, 2): {{"w": torch.full((2048, 1024), float(r))}} for r in range(2)}}
    save_checkpoint({directory!r}, big, dtype="float32", source=SOURCE,
                    options=SaveOptions(max_size=2**20, overwrite=True))
    print("SAVED", flush=True)
    """
)


def run_saver(directory: Path, prelude: str = "") -> subprocess.Popen:
    code = SAVER.format(directory=str(directory), prelude=prelude)
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# The saver holds its lock, before staging, until the file ``gate`` exists (at most 120 s): a
# concurrent save meets it held however slowly its own process starts on a busy machine.
STAGING_AFTER_GATE = """
import os, time, vllm_sharded_loader.checkpoint.save as s
stage = s.stage_rank
def gated_stage(*a, **k):
    deadline = time.monotonic() + 120
    while not os.path.exists({gate!r}) and time.monotonic() < deadline:
        time.sleep(0.01)
    return stage(*a, **k)
s.stage_rank = gated_stage
"""


def test_concurrent_saves_one_wins_the_other_fails_clearly(tmp_path):
    gate = tmp_path.parent / f"{tmp_path.name}-gate"
    first = run_saver(tmp_path, prelude=STAGING_AFTER_GATE.format(gate=str(gate)))  # holds the lock until the gate
    deadline = time.monotonic() + 60
    while not (tmp_path / LOCK_NAME).exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.01)
    second = run_saver(tmp_path)
    _, err = second.communicate(timeout=120)
    gate.touch()
    assert second.returncode != 0 and "another save holds" in err and "wait for it to finish" in err
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert verify_checkpoint(open_store(str(tmp_path))) == []


def test_interrupted_save_loses_nothing_and_can_be_redone(tmp_path):
    save(tmp_path)
    before = snapshot(tmp_path)
    proc = run_saver(tmp_path, prelude="import time; time.sleep(0)")
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".partial") for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # killed while it writes its parts
    proc.wait()
    # The published checkpoint is untouched, and loads: the killed save never reached its manifest.
    assert {k: v for k, v in snapshot(tmp_path).items() if k in before} == before
    load(tmp_path)
    # verify notes the dead save's leftovers, and finds nothing wrong with the checkpoint (issue 34, class 5).
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(tmp_path)), notes=notes) == []
    assert any(".partial" in n for n in notes) and any(LOCK_NAME in n for n in notes), notes
    # Saving again (overwrite) takes the stale lock over and removes the killed save's partial files.
    save(tmp_path, overwrite=True)
    assert verify_checkpoint(open_store(str(tmp_path))) == []
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial") or p.name == LOCK_NAME]


def test_full_disk_during_save_loses_nothing(tmp_path):
    save(tmp_path)
    before = snapshot(tmp_path)
    # A real write failure: the file size limit makes write() fail with EFBIG mid-save.
    prelude = (
        "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 2**20, 3 * 2**20))"
    )
    proc = run_saver(tmp_path, prelude=prelude)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "SaveRefused: Writing " in err and "File too large" in err and "previous checkpoint" in err
    assert snapshot(tmp_path) == before, "the failed save must remove its partial files and its lock"
    load(tmp_path)
    assert verify_checkpoint(open_store(str(tmp_path))) == []


def test_save_refuses_escaping_or_colliding_patterns(tmp_path):
    ranks = {RankInfo(r, 2): saveable_state(rank_state(r, 2)) for r in range(2)}
    source = SourceModel("TinyForCausalLM", "0" * 64)
    with pytest.raises(InvalidOption, match="plain file"):
        save_checkpoint(
            str(tmp_path), ranks, dtype="bfloat16", source=source, options=SaveOptions(pattern="../w-{rank}-{part}")
        )
    with pytest.raises(InvalidOption, match="tensor parallel rank"):
        save_checkpoint(
            str(tmp_path), ranks, dtype="bfloat16", source=source, options=SaveOptions(pattern="w-{part}.safetensors")
        )
    with pytest.raises(InvalidOption, match="uses a format spec"):
        save_checkpoint(
            str(tmp_path),
            ranks,
            dtype="bfloat16",
            source=source,
            options=SaveOptions(pattern="w-{rank:>999999999}-{part}"),
        )
    assert not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------- every path: load, reshard, offline, verify
#
# A checkpoint with geometry (servable at another TP size), saved at TP=2 with one part per
# rank, so that rank 0's part holds several tensors of one shape and dtype. Each corruption
# must be refused by the same-topology load (TP=2), the resharding load (TP=1), the offline
# `reshard` and `verify`, with a message naming the file and the field, before any byte
# reaches a parameter or the output.

RANK0 = "model-rank-0-part-0.safetensors"
NORM_A, NORM_B = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"


def rank0_tensors(m: dict) -> dict[str, dict]:
    return next(r for r in m["ranks"] if (r["tp_rank"], r["pp_rank"]) == (0, 0))["tensors"]


def swap_offsets(m: dict) -> None:
    tensors = rank0_tensors(m)
    a, b = tensors[NORM_A], tensors[NORM_B]
    assert (a["file"], a["dtype"], a["shape"]) == (b["file"], b["dtype"], b["shape"]) and a["offset"] != b["offset"]
    a["offset"], b["offset"] = b["offset"], a["offset"]


def shift_offset(m: dict) -> None:
    rank0_tensors(m)[NORM_A]["offset"] += 4  # one int32 further, still inside the file


def overlap(m: dict) -> None:
    tensors = rank0_tensors(m)
    tensors[NORM_B]["offset"] = tensors[NORM_A]["offset"] + 64  # B starts in the middle of A


def set_tensor(name: str, **fields: object) -> Callable[[dict], None]:
    return lambda m: rank0_tensors(m)[name].update(fields)


def set_checksum(**fields: object) -> Callable[[dict], None]:
    return lambda m: next(r for r in m["ranks"] if r["tp_rank"] == 0)["files"][0]["checksum"].update(fields)


def huge_shape_with_geometry(m: dict) -> None:
    """A shape the geometry agrees with: only the file's header can tell it is false."""
    for r in m["ranks"]:
        r["tensors"]["model.norm.weight"]["shape"] = [10**15]
    m["geometry"]["model.norm.weight"]["shape"] = [10**15]


IN_RANK0 = rf"{RANK0}: tensor "
MANIFEST_FIELD = rf"{MANIFEST_NAME}: "
# (name, manifest edit, error every path raises)
EVERY_PATH_CASES = [
    (
        "offsets of two same-shape tensors swapped",
        swap_offsets,
        rf"{IN_RANK0}'({NORM_A}|{NORM_B})' starts at byte \d+ in the file but at \d+ in {MANIFEST_NAME}",
    ),
    (
        "offset shifted within the file",
        shift_offset,
        rf"{IN_RANK0}'{NORM_A}' starts at byte \d+ in the file but at \d+ in {MANIFEST_NAME}; the manifest is "
        "damaged",
    ),
    (
        "two tensors overlapping",
        overlap,
        rf"{IN_RANK0}'{NORM_B}' starts at byte \d+ in the file but at \d+ in {MANIFEST_NAME}",
    ),
    (
        "negative offset",
        set_tensor(NORM_A, offset=-8),
        rf"{MANIFEST_FIELD}tensor '{NORM_A}' has offset -8, expected a byte position",
    ),
    (
        "fractional offset",
        set_tensor(NORM_A, offset=12.5),
        rf"{MANIFEST_FIELD}tensor '{NORM_A}' has offset 12.5, expected a byte position",
    ),
    (
        "offset as a string",
        set_tensor(NORM_A, offset="1024"),
        rf"{MANIFEST_FIELD}tensor '{NORM_A}' has offset '1024', expected a byte position",
    ),
    (
        "offset past any file",
        set_tensor(NORM_A, offset=2**62),
        rf"{MANIFEST_FIELD}tensor '{NORM_A}' has offset {2**62}, expected a byte position",
    ),
    (
        "digest not a digest",
        lambda m: rank0_files(m)[0].update(digest="../" * 99),
        rf"{MANIFEST_FIELD}'digest' of '{RANK0}' must be 32 hexadecimal digits, found '\.\./\.\./",
    ),
    (
        "digest of other weights",
        lambda m: rank0_files(m)[0].update(digest="0123456789abcdef" * 2),
        rf"{RANK0}: holds other weights than the save {MANIFEST_NAME} lists it from wrote \(its header's digest "
        r"is '[0-9a-f]{32}', the manifest's '0123456789abcdef0123456789abcdef'\): a stale copy",
    ),
    (
        "huge checksum block_size",
        set_checksum(block_size=2**40),
        rf"{MANIFEST_FIELD}checksum block_size {2**40} of '{RANK0}' is above {MAX_BLOCK_SIZE}",
    ),
    (
        "zero checksum block_size",
        set_checksum(block_size=0),
        rf"{MANIFEST_FIELD}'block_size' must be an integer >= 1, found 0",
    ),
    (
        "pattern with a format spec",
        lambda m: m.update(pattern="model-rank-{rank:>999999999}-part-{part}.safetensors"),
        r"File pattern 'model-rank-\{rank:>999999999\}-part-\{part\}.safetensors' uses a format spec",
    ),
    (
        "pattern with a conversion",
        lambda m: m.update(pattern="model-rank-{rank!r}-part-{part}.safetensors"),
        r"uses a format spec or conversion",
    ),
    (
        "huge tp_size",
        lambda m: m.update(tp_size=2**40),
        rf"{MANIFEST_FIELD}TP={2**40} x PP=1 is more than {MAX_RANKS} ranks",
    ),
    (
        "huge world size",
        lambda m: m.update(tp_size=2**9, pp_size=2**9),
        rf"{MANIFEST_FIELD}TP=512 x PP=512 is more than {MAX_RANKS} ranks",
    ),
    (
        "shape dimension above any size",
        set_tensor("model.norm.weight", shape=[2**61]),
        rf"{MANIFEST_FIELD}tensor 'model.norm.weight' has shape \[{2**61}\], expected a list of sizes",
    ),
    (
        "huge shape dimension",
        set_tensor("model.norm.weight", shape=[10**12, 32]),
        r"model\.norm\.weight.*\[1000000000000, 32\]",
    ),
    (
        "huge shape dimension, geometry agreeing",
        huge_shape_with_geometry,
        r"model\.norm\.weight.*\[1000000000000000\]",
    ),
    (
        "too many dims",
        set_tensor("model.norm.weight", shape=[1] * 17),
        rf"{MANIFEST_FIELD}tensor 'model.norm.weight' has shape \[1(, 1){{16}}\], expected a list of sizes "
        rf"\(at most {MAX_DIMS}",
    ),
    (
        "negative dimension",
        set_tensor("model.norm.weight", shape=[-32]),
        rf"{MANIFEST_FIELD}tensor 'model.norm.weight' has shape \[-32\], expected a list of sizes",
    ),
    (  # the offline reshard plans a stage from tp_rank 0's names: it left the tensor out, and verified
        "a tensor missing from tp_rank 0",
        lambda m: rank0_tensors(m).pop(NORM_A),
        rf"{MANIFEST_FIELD}pp_rank=0 tp_rank=1 and pp_rank=0 tp_rank=0 list different tensors \(1, such as "
        rf"\['{NORM_A}'\]\)",
    ),
    (
        "a tensor missing from tp_rank 1",
        lambda m: next(r for r in m["ranks"] if r["tp_rank"] == 1)["tensors"].pop(NORM_A),
        rf"{MANIFEST_FIELD}pp_rank=0 tp_rank=1 and pp_rank=0 tp_rank=0 list different tensors",
    ),
]


def refused_on_every_path(
    directory: Path, error: str, out: Path, at_load: type[Exception] | tuple[type[Exception], ...] = CheckpointCorrupt
) -> None:
    """The same-topology load, the resharding load, the offline reshard and verify all refuse it
    (the loads with ``at_load``: a damaged shape may read as another model's)."""
    model = RESHARD_MODEL
    for tp_size in (2, 1):  # as saved, then resharded
        targets = {n: torch.full_like(x, -7) for n, x in stage_state(model, tp_size, 1, 0, 0).items()}
        with pytest.raises(at_load, match=error):
            manifest = read_manifest(str(directory))
            load_rank(
                LoadRequest(open_store(str(directory)), manifest, serving=source_of(model)),
                targets,
                RankInfo(0, tp_size),
            )
        untouched = [n for n, t in targets.items() if not bool((t == -7).all())]
        assert not untouched, f"written before the TP={tp_size} load was refused: {untouched}"
    with pytest.raises(CheckpointCorrupt, match=error):
        reshard_checkpoint(open_store(str(directory)), str(out), tp_size=1)
    assert not out.exists() or not os.listdir(out), "a refused reshard must leave no output"
    problems = verify_checkpoint(open_store(str(directory)))
    assert any(re.search(error, p) for p in problems), problems


# A shape no file holds: a load that checks the served model's shapes first refuses it as another model's.
SHAPE_CASES = {"huge shape dimension", "huge shape dimension, geometry agreeing"}


@pytest.mark.parametrize(
    ("corrupt", "error", "at_load"),
    [
        (*c[1:], (CheckpointCorrupt, CheckpointMismatch) if c[0] in SHAPE_CASES else CheckpointCorrupt)
        for c in EVERY_PATH_CASES
    ],
    ids=[c[0] for c in EVERY_PATH_CASES],
)
def test_bad_manifest_is_refused_on_every_path(tmp_path, corrupt, error, at_load, capsys):
    directory = tmp_path / "ckpt"
    save_reshardable(directory)
    edit_manifest(directory, corrupt)
    before = snapshot(directory)
    refused_on_every_path(directory, error, tmp_path / "out", at_load)
    assert snapshot(directory) == before
    assert cli(["verify", str(directory)]) == 1
    assert "BAD" in capsys.readouterr().out


def test_two_ranks_parts_swapped_by_name_are_refused_on_every_path_without_checksums(tmp_path, capsys):
    """Rank 0's and rank 1's parts hold the same tensors, shapes and offsets: swapped by renaming (or one
    copied over the other), every check but a checksum passed, and a load with the default
    ``verify="size"`` served each rank the other's slice, silently. Each part's header now names its rank."""
    directory = tmp_path / "ckpt"
    save_reshardable(directory)
    part0, part1 = directory / PART0, directory / "model-rank-1-part-0.safetensors"
    os.rename(part0, directory / "swap")
    os.rename(part1, part0)
    os.rename(directory / "swap", part1)
    refused_on_every_path(
        directory,
        rf"{PART0}: holds the slice of rank 'tp1-pp0' \(its header says so\), where .* as a file of rank 'tp0-pp0'",
        tmp_path / "out",
    )
    assert cli(["verify", "--size-only", str(directory)]) == 1
    assert "renamed or copied over each other" in capsys.readouterr().out


def rank0_files(manifest: dict) -> list[dict]:
    return next(r for r in manifest["ranks"] if r["tp_rank"] == 0)["files"]


def same_header_but_the_digest(older: Path, newer: Path) -> tuple[RankEntry, RankEntry]:
    """Rank 0's entries of two saves whose parts have the same tensors, offsets and sizes."""
    old_entry, new_entry = (read_manifest(str(d)).ranks[0] for d in (older, newer))
    assert old_entry.tensors == new_entry.tensors
    assert [f.size for f in old_entry.files] == [f.size for f in new_entry.files]
    return old_entry, new_entry


def test_a_stale_part_of_an_older_save_with_the_same_header_is_refused_on_every_path(tmp_path, capsys):
    """The same model saved twice at the same topology, with other weights the first time (before a
    fine-tuning step, say): each save's parts hold the same tensors, shapes and offsets. A part of the
    older save copied over the newer one's (a sync cut short, an old backup restored) passed every
    check but a checksum, and a load with the default ``verify="size"`` served the old weights beside the
    new ones, silently. Each part's header now holds the digest of its contents, as the manifest does."""
    older, directory, model = tmp_path / "older", tmp_path / "ckpt", RESHARD_MODEL
    ranks = {RankInfo(t, 2): {n: x + 1 for n, x in stage_state(model, 2, 1, t, 0).items()} for t in range(2)}
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    save_checkpoint(str(older), ranks, dtype="int32", source=source_of(model), options=SaveOptions(geometry=geometry))
    save_reshardable(directory)
    old_entry, new_entry = same_header_but_the_digest(older, directory)
    assert old_entry.files[0].digest != new_entry.files[0].digest
    shutil.copyfile(older / PART0, directory / PART0)
    refused_on_every_path(
        directory,
        rf"{PART0}: holds other weights than the save {MANIFEST_NAME} lists it from wrote \(its header's digest "
        rf"is '{old_entry.files[0].digest}', the manifest's '{new_entry.files[0].digest}'\): a stale copy",
        tmp_path / "out",
    )
    assert cli(["verify", "--size-only", str(directory)]) == 1
    assert "a stale copy from an older save" in capsys.readouterr().out


def as_saved_before_digests(directory: Path) -> None:
    """Make a checkpoint what an earlier version's save of it was: no digest in any part's header (the
    key taken out, the header padded with spaces to its length, so every offset stays) nor in its
    manifest, whose block checksums are those of the parts as they now are."""
    files = {}
    for entry in read_manifest(str(directory)).ranks:
        for f in entry.files:
            path = directory / f.name
            data = path.read_bytes()
            (length,) = struct.unpack("<Q", data[:8])
            header = json.loads(data[8 : 8 + length])
            del header["__metadata__"][DIGEST_METADATA]
            text = json.dumps(header, separators=(",", ":")).encode()
            path.write_bytes(data[:8] + text.ljust(length) + data[8 + length :])
            hasher = integrity.BlockHasher(f.checksum.block_size)
            hasher.update(path.read_bytes())
            files[f.name] = hasher.finish().to_dict()

    def edit(m: dict) -> None:
        for rank in m["ranks"]:
            for f in rank["files"]:
                del f["digest"]
                f["checksum"] = files[f["name"]]

    edit_manifest(directory, edit)


def test_a_checkpoint_of_an_earlier_version_without_digests_passes_every_path(tmp_path):
    """Parts and a manifest saved before digests were recorded load, reshard and verify as before;
    the reshard's output records them."""
    directory, model = tmp_path / "ckpt", RESHARD_MODEL
    save_reshardable(directory)
    as_saved_before_digests(directory)
    manifest = read_manifest(str(directory))
    assert not any(f.digest for entry in manifest.ranks for f in entry.files)
    for tp_size, verify in itertools.product((2, 1), ("size", "checksum")):
        expected = stage_state(model, tp_size, 1, 0, 0)
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        request = LoadRequest(open_store(str(directory)), manifest, verify=verify, serving=source_of(model))
        load_rank(request, targets, RankInfo(0, tp_size))
        assert all(torch.equal(targets[n], x) for n, x in expected.items())
    assert verify_checkpoint(open_store(str(directory))) == []
    reshard_checkpoint(open_store(str(directory)), str(tmp_path / "out"), tp_size=1)
    assert all(f.digest for entry in read_manifest(str(tmp_path / "out")).ranks for f in entry.files)
    assert verify_checkpoint(open_store(str(tmp_path / "out"))) == []


def test_a_part_of_a_later_save_beside_a_manifest_without_digests_is_refused_on_every_path(tmp_path, capsys):
    """A checkpoint saved by an earlier version (no digests), then saved again by this one with other
    weights, then partly restored (the manifest and a part of the earlier save back, the other part
    still the later save's): every header has the same tensors, shapes and offsets, and a manifest
    that records no digest checked none, so ``verify="size"`` served the two saves' weights together.
    Every save that writes digests records them, so a digest in a header that the manifest lacks is
    the mark of a later save's part."""
    older, newer, model = tmp_path / "older", tmp_path / "newer", RESHARD_MODEL
    ranks = {RankInfo(t, 2): {n: x + 1 for n, x in stage_state(model, 2, 1, t, 0).items()} for t in range(2)}
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    save_checkpoint(str(older), ranks, dtype="int32", source=source_of(model), options=SaveOptions(geometry=geometry))
    as_saved_before_digests(older)
    save_reshardable(newer)
    _, new_entry = same_header_but_the_digest(older, newer)
    shutil.copyfile(newer / PART0, older / PART0)
    refused_on_every_path(
        older,
        rf"{PART0}: is from a later save than {MANIFEST_NAME}, which records no digest of its contents \(saved "
        rf"by an earlier version\) where its header holds one \('{new_entry.files[0].digest}'\): a stale manifest",
        tmp_path / "out",
    )
    assert cli(["verify", "--size-only", str(older)]) == 1
    assert "is from a later save than" in capsys.readouterr().out


def test_a_part_of_an_earlier_versions_save_of_the_same_weights_is_refused_as_such(tmp_path, capsys):
    """A part saved by an earlier version (no digest in its header) beside a manifest that records one is
    not the part that manifest's save wrote, and is refused on every path; its weights may be the same
    (here they are), so the refusal says what it lacks, not that it holds other weights."""
    older, directory = tmp_path / "older", tmp_path / "ckpt"
    save_reshardable(older)
    as_saved_before_digests(older)
    save_reshardable(directory)
    digest = read_manifest(str(directory)).ranks[0].files[0].digest
    shutil.copyfile(older / PART0, directory / PART0)
    refused_on_every_path(
        directory,
        rf"{PART0}: holds no digest of its contents, where {MANIFEST_NAME} records '{digest}': not the part this "
        r"checkpoint's save wrote, but a stale copy of the same tensors from a save by an earlier version",
        tmp_path / "out",
    )
    assert cli(["verify", "--size-only", str(directory)]) == 1
    assert "other weights" not in capsys.readouterr().out


def test_the_same_weights_saved_twice_give_the_same_files(tmp_path):
    """The digest depends on the bytes alone: two saves of one state are the same, byte for byte."""
    first, second = save_reshardable(tmp_path / "a"), save_reshardable(tmp_path / "b")
    assert first.ranks == second.ranks and all(f.digest for entry in first.ranks for f in entry.files)
    for f in first.ranks[0].files:
        assert (tmp_path / "a" / f.name).read_bytes() == (tmp_path / "b" / f.name).read_bytes()


def test_sound_reshardable_checkpoint_passes_every_path(tmp_path):
    """The corpus above fails for its corruption only: the same checkpoint, untouched, passes every path."""
    directory, model = tmp_path / "ckpt", RESHARD_MODEL
    save_reshardable(directory)
    manifest = read_manifest(str(directory))
    for tp_size in (2, 1):
        expected = stage_state(model, tp_size, 1, 0, 0)
        targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
        load_rank(
            LoadRequest(open_store(str(directory)), manifest, serving=source_of(model)), targets, RankInfo(0, tp_size)
        )
        assert all(torch.equal(targets[n], x) for n, x in expected.items())
    reshard_checkpoint(open_store(str(directory)), str(tmp_path / "out"), tp_size=1)
    assert verify_checkpoint(open_store(str(tmp_path / "out"))) == []
    assert verify_checkpoint(open_store(str(directory))) == []


@pytest.mark.parametrize("unrecorded", [False, True])
def test_offline_reshard_of_a_corrupt_part_is_refused_and_writes_nothing(tmp_path, capsys, unrecorded):
    """A flipped bit that only checksums see was copied into the resharded output, whose fresh
    checksums then certified it: verify passed on the output of a checkpoint verify refuses.
    Also where another file has no checksum record (``unrecorded``): that turned checking off for all."""
    directory, out = tmp_path / "ckpt", tmp_path / "out"
    save_reshardable(directory)
    if unrecorded:
        edit_manifest(directory, lambda m: m["ranks"][-1]["files"][-1].pop("checksum"))
        assert read_manifest(str(directory)).ranks[-1].files[-1].name != PART0
    flip_bit(directory / PART0, data_offset(directory / PART0))
    assert cli(["reshard", str(directory), "-tp", "1", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    if unrecorded:  # refused, naming the file whose record is missing (it cannot be checked)
        unchecked = read_manifest(str(directory)).ranks[-1].files[-1].name
        assert err.startswith(f"vllm-sharded: error: {directory / unchecked}: {MANIFEST_NAME} records no checksum")
    else:
        assert err.startswith(f"vllm-sharded: error: {directory / PART0}: checksum mismatch in bytes 0..")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_a_folder_named_like_a_part_in_the_output_is_left_alone_and_the_reshard_ends_cleanly(tmp_path, capsys):
    """The cleanup after the publish removed every unlisted name of the part pattern: on a folder
    so named it stopped with a bare "[Errno 21] Is a directory" and exit 2 although the new
    checkpoint was published, and left its lock behind."""
    directory, out = tmp_path / "ckpt", tmp_path / "out"
    save_reshardable(directory)
    reshard_checkpoint(open_store(str(directory)), str(out), tp_size=1)
    folder = out / "model-rank-7-part-0.safetensors"
    folder.mkdir()
    (folder / "notes.txt").write_text("not ours")
    assert cli(["reshard", str(directory), "-tp", "2", "-o", str(out), "--overwrite"]) == 0, capsys.readouterr().err
    assert (folder / "notes.txt").read_text() == "not ours"
    assert not (out / LOCK_NAME).exists()
    assert read_manifest(str(out)).tp_size == 2
    assert [p for p in verify_checkpoint(open_store(str(out))) if folder.name not in p] == []


def test_a_stale_part_that_cannot_be_removed_after_the_publish_is_reported_as_such(tmp_path, capsys):
    """A stale part the cleanup after the publish cannot remove (immutable, ``chattr +i``: even
    root gets EPERM) escaped as a bare "[Errno 1]": the published checkpoint is complete and
    loads, and the error says so, names the file and what to do."""
    import shutil

    if shutil.which("chattr") is None:
        pytest.skip("needs chattr to make a file that not even root can remove")
    directory, out = tmp_path / "ckpt", tmp_path / "out"
    save_reshardable(directory)
    reshard_checkpoint(open_store(str(directory)), str(out), tp_size=1)
    stale = out / "model-rank-7-part-0.safetensors"
    stale.write_bytes(b"an older save's part")
    if subprocess.run(["chattr", "+i", str(stale)], capture_output=True).returncode != 0:
        pytest.skip(f"{tmp_path}'s file system has no immutable files (chattr +i)")
    try:
        assert cli(["reshard", str(directory), "-tp", "2", "-o", str(out), "--overwrite"]) != 0
        err = capsys.readouterr().err
        assert "published and complete" in err and stale.name in err and "Save again" in err, err
        assert "Traceback" not in err
        assert read_manifest(str(out)).tp_size == 2
        assert [p for p in verify_checkpoint(open_store(str(out))) if stale.name not in p and LOCK_NAME not in p] == []
    finally:
        subprocess.run(["chattr", "-i", str(stale)], check=True)


def test_offline_reshard_checks_every_file_before_allocating_or_writing(tmp_path):
    """One tensor per part: the part of model.norm.weight is touched by no other tensor, so only
    a check of every file before the first tensor is produced refuses its false shape (4 PB)
    before allocating it, and before writing any output."""
    directory = tmp_path / "ckpt"
    manifest = save_reshardable(directory, max_size=1)
    assert [f for f in manifest.rank(0, 0).files if f.name == manifest.rank(0, 0).tensors["model.norm.weight"].file]
    assert len({t.file for t in manifest.rank(0, 0).tensors.values()}) == len(manifest.rank(0, 0).tensors)
    edit_manifest(directory, huge_shape_with_geometry)
    refused_on_every_path(directory, r"model\.norm\.weight.*\[1000000000000000\]", tmp_path / "out", CheckpointMismatch)


# ------------------------------------------------------- a save during a load


def save_other_weights(directory: Path, max_size: int | None = None) -> None:
    """A real second save over the checkpoint: another model's weights, every shape and offset the same."""
    model = llama_like(num_layers=2, vocab=128, kv_heads=2, seed=1)
    ranks = {RankInfo(t, 2): stage_state(model, 2, 1, t, 0) for t in range(2)}
    geometry = {name: t.geometry.to_dict() for name, t in model.tensors.items()}
    source = source_of(model)
    save_checkpoint(
        str(directory),
        ranks,
        dtype="int32",
        source=source,
        options=SaveOptions(geometry=geometry, max_size=max_size, overwrite=True),
    )


def first_call_saves_over(directory: Path, real: Callable, calls: list[int], max_size: int | None = None) -> Callable:
    """``real``, but its first call is preceded by a save over the checkpoint being read."""

    def wrapper(*args: object, **kwargs: object) -> object:
        if not calls:
            save_other_weights(directory, max_size)
        calls.append(1)
        return real(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize(
    ("tp_size", "read_step"),
    [(2, "vllm_sharded_loader.checkpoint.load.read_files"), (1, "vllm_sharded_loader.storage.lowering.read_pieces")],
    ids=["same topology", "resharding"],
)
def test_checkpoint_replaced_during_the_load_is_refused(tmp_path, monkeypatch, tp_size, read_step):
    directory = tmp_path / "ckpt"
    save_reshardable(directory)
    manifest = read_manifest(str(directory))
    old = stage_state(RESHARD_MODEL, tp_size, 1, 0, 0)
    module, name = read_step.rsplit(".", 1)
    calls: list[int] = []
    monkeypatch.setattr(read_step, first_call_saves_over(directory, getattr(sys.modules[module], name), calls))
    targets = {n: torch.full_like(x, -7) for n, x in old.items()}
    with pytest.raises(CheckpointCorrupt, match=r"\.safetensors: the file was replaced or modified during the load"):
        load_rank(
            LoadRequest(open_store(str(directory)), manifest, serving=source_of(RESHARD_MODEL)),
            targets,
            RankInfo(0, tp_size),
        )
    assert calls, "the read step ran"
    # Not a mix either: every byte was read through the descriptors of the files checked,
    # which are the first save's, whatever the second renamed over their paths.
    mixed = [n for n, x in old.items() if not torch.equal(targets[n], x)]
    assert not mixed, mixed
    monkeypatch.undo()
    # Loaded again, the checkpoint is the second save's, whole.
    new = stage_state(llama_like(num_layers=2, vocab=128, kv_heads=2, seed=1), tp_size, 1, 0, 0)
    assert any(not torch.equal(new[n], old[n]) for n in new)
    targets = {n: torch.full_like(x, -7) for n, x in new.items()}
    load_rank(LoadRequest(open_store(str(directory)), read_manifest(str(directory))), targets, RankInfo(0, tp_size))
    assert all(torch.equal(targets[n], x) for n, x in new.items())


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_part_rewritten_in_place_with_its_mtime_put_back_during_the_load_is_refused(tmp_path, mapped):
    """A part rewritten in place during the load, same size, its modification time put back
    (``cp -p`` or ``rsync -a --inplace`` onto it): same device, inode, size and mtime, but
    other bytes. The kernel-kept ctime tells; the load must not return the other rank's weights."""
    save(tmp_path, tp_size=2)
    part0, part1 = tmp_path / PART0, tmp_path / "model-rank-1-part-0.safetensors"
    other = part1.read_bytes()
    assert len(other) == part0.stat().st_size
    rewritten: list[int] = []

    def rewrite_before_the_reads(done: int, total: int) -> None:
        if not rewritten:
            st = part0.stat()
            with open(part0, "r+b") as f:
                f.write(other)
            os.utime(part0, ns=(st.st_atime_ns, st.st_mtime_ns))
            rewritten.append(1)

    targets = fresh_targets(0, 2)
    adopt = {n: (lambda t, n=n: targets.__setitem__(n, t)) for n in targets} if mapped else None
    with pytest.raises(CheckpointCorrupt, match=r"\.safetensors: the file was replaced or modified during the load"):
        load(tmp_path, 0, 2, targets=targets, threads=1, progress=rewrite_before_the_reads, adopt=adopt)
    assert rewritten, "the part was rewritten during the load"


@pytest.mark.parametrize("tp_size", [2, 1], ids=["same topology", "resharding"])
def test_a_load_refused_after_its_reads_hands_no_mapped_tensor_to_the_model(tmp_path, tp_size):
    """The parameters the loader would swap onto mappings of the files (``adopt``) are swapped only
    once the last check passed: a part modified during the reads is refused with the model as it was."""
    directory = tmp_path / "ckpt"
    save_reshardable(directory)
    part = directory / PART0
    modified: list[int] = []

    def modify_before_the_reads(done: int, total: int) -> None:
        if not modified:
            with open(part, "r+b") as f:
                f.seek(part.stat().st_size - 4)
                f.write(b"\x01\x02\x03\x04")
            modified.append(1)

    expected = stage_state(RESHARD_MODEL, tp_size, 1, 0, 0)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    adopted: list[str] = []
    adopt = {n: (lambda t, n=n: adopted.append(n)) for n in targets}
    request = LoadRequest(open_store(str(directory)), read_manifest(str(directory)), serving=source_of(RESHARD_MODEL))
    options = ReadOptions(threads=1, progress=modify_before_the_reads)
    with pytest.raises(CheckpointCorrupt, match=r"\.safetensors: the file was replaced or modified during the load"):
        load_rank(request, targets, RankInfo(0, tp_size), options, adopt)
    assert modified, "the part was modified during the load"
    assert adopted == [], "a mapped tensor was handed to the model before the load was refused"
    # Sound, the same load hands every mapped tensor over.
    sound = tmp_path / "sound"
    save_reshardable(sound)
    load_rank(
        LoadRequest(open_store(str(sound)), read_manifest(str(sound))), targets, RankInfo(0, tp_size), adopt=adopt
    )
    assert adopted


def test_a_part_truncated_before_its_rows_are_mapped_is_named(tmp_path, monkeypatch):
    """A resharding load maps the file range holding a dim-1 split's rows; a part truncated after its
    checks and before that mapping is a truncated part named by the load, not a bare ValueError."""
    import vllm_sharded_loader.storage.lowering as lowering

    directory = tmp_path / "ckpt"
    save_reshardable(directory)
    part = directory / PART0
    real = lowering.map_file_range
    truncated: list[int] = []

    def truncate_first(*args: object, **kwargs: object) -> object:
        if not truncated:
            os.truncate(part, part.stat().st_size // 2)
            truncated.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(lowering, "map_file_range", truncate_first)
    expected = stage_state(RESHARD_MODEL, 1, 1, 0, 0)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    request = LoadRequest(open_store(str(directory)), read_manifest(str(directory)), serving=source_of(RESHARD_MODEL))
    with pytest.raises(CheckpointCorrupt, match=r"rank-0-part-0\.safetensors: file ended at byte \d+ while reading"):
        load_rank(request, targets, RankInfo(0, 1), adopt={})  # a load that may map the files
    assert truncated, "the rows of a dim-1 split were mapped"


TRUNCATED_BEFORE_THE_ROWS_ARE_COPIED = textwrap.dedent(
    """
    import os, sys, torch
    from pathlib import Path
    import vllm_sharded_loader.storage.lowering as lowering
    from tests.support.checkpoints import RESHARD_MODEL, save_reshardable, source_of, stage_state
    from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
    from vllm_sharded_loader.format import ShardedStateError
    from vllm_sharded_loader.storage.location import open_store

    directory = Path(sys.argv[1])
    save_reshardable(directory)
    real = lowering._copy_rows

    def truncated_first(*args, **kwargs):
        for part in directory.glob("*.safetensors"):
            os.truncate(part, 0)
        return real(*args, **kwargs)

    lowering._copy_rows = truncated_first
    targets = {n: torch.full_like(x, -7) for n, x in stage_state(RESHARD_MODEL, 1, 1, 0, 0).items()}
    try:
        load_rank(LoadRequest(open_store(str(directory)), read_manifest(str(directory))), targets, RankInfo(0, 1))
    except ShardedStateError as e:
        print("REFUSED", e)
    """
)


def test_a_part_truncated_during_a_resharding_load_is_an_error_not_a_crash(tmp_path):
    """Rows of a dim-1 split joined at another TP size: a part truncated after its bytes were read
    and before the rows are copied out. A load that maps no file (``mmap`` off, an accelerator)
    must not die of SIGBUS on a mapping of the part: it is refused, naming the part."""
    run = package_process(["-c", TRUNCATED_BEFORE_THE_ROWS_ARE_COPIED, str(tmp_path / "ckpt")], timeout=120)
    assert run.returncode == 0, f"the load died (exit {run.returncode}): {run.stderr[-2000:]}"
    assert re.search(r"REFUSED .*model-rank-\d-part-0\.safetensors: (the file was replaced|file ended)", run.stdout), (
        run.stdout + run.stderr
    )


def test_save_running_when_the_reads_end_leaves_the_load_whole(tmp_path, monkeypatch):
    """A save that has taken the lock when the reads end: the load has the published checkpoint, whole.

    A save replaces a checkpoint last (new part names, then the manifest's rename), so a
    running save changes nothing a load of the published manifest reads.
    """
    import vllm_sharded_loader.checkpoint.load as load_module

    directory = tmp_path / "ckpt"
    save_reshardable(directory)
    read_files = load_module.read_files
    locks = []

    def reads_while_a_save_starts(*args: object, **kwargs: object) -> object:
        locks.append(acquire_save_lock(str(directory), "0123456789ab", overwrite=True))
        return read_files(*args, **kwargs)

    monkeypatch.setattr(load_module, "read_files", reads_while_a_save_starts)
    expected = stage_state(RESHARD_MODEL, 2, 1, 0, 0)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    load_rank(LoadRequest(open_store(str(directory)), read_manifest(str(directory))), targets, RankInfo(0, 2))
    assert locks, "the save started during the load"
    assert all(torch.equal(targets[n], x) for n, x in expected.items())
    release_save_lock(locks[0])


def test_offline_reshard_during_a_save_writes_one_checkpoint(tmp_path, monkeypatch):
    """Offline reshard opens every file first: a save over the source afterwards changes nothing it reads.

    One tensor per part, so most parts are first read after the save: had they been opened
    then, their headers (same shapes and offsets) would pass and the output would mix the two.
    """
    import vllm_sharded_loader.storage.lowering as lowering

    directory, out = tmp_path / "ckpt", tmp_path / "out"
    save_reshardable(directory, max_size=1)
    calls: list[int] = []
    saves_over = first_call_saves_over(directory, lowering.read_pieces, calls, max_size=1)
    monkeypatch.setattr(lowering, "read_pieces", saves_over)
    reshard_checkpoint(open_store(str(directory)), str(out), tp_size=1)
    assert calls
    expected = stage_state(RESHARD_MODEL, 1, 1, 0, 0)
    targets = {n: torch.full_like(x, -7) for n, x in expected.items()}
    load_rank(LoadRequest(open_store(str(out)), read_manifest(str(out)), verify="checksum"), targets, RankInfo(0, 1))
    assert all(torch.equal(targets[n], x) for n, x in expected.items()), "the output mixes two checkpoints"


# ------------------------------------------------------- two saves take over one stale lock

DEAD_SAVE = textwrap.dedent(
    """
    import os, sys
    from tests.support.states import rank_state
    from vllm_sharded_loader.checkpoint import RankInfo, saveable_state
    from vllm_sharded_loader.storage.staged import stage_rank
    from vllm_sharded_loader.storage.lock import acquire_save_lock
    acquire_save_lock({directory!r}, {token!r}, overwrite=True)
    stage_rank({directory!r}, saveable_state(rank_state(0, 2)), RankInfo(0, 2), token={token!r})
    os._exit(0)  # dies mid-save: its flock goes with it, its lock file and staged part stay
    """
)

# A save that, once it holds the lock and has staged its first rank, waits for the test's
# "release" flag: the other save then meets a lock that is held, whatever the scheduling.
RACER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    from tests.support.states import SOURCE
    from vllm_sharded_loader.checkpoint import RankInfo
    import vllm_sharded_loader.checkpoint.save as save

    flags, me = Path({flags!r}), {me!r}

    def wait_for(path):
        deadline = time.monotonic() + 120
        while not path.exists():
            if time.monotonic() > deadline:
                sys.exit(f"timed out waiting for {{path}}")
            time.sleep(0.002)

    stage = save.stage_rank

    def stage_and_hold(*args, **kwargs):
        staged = stage(*args, **kwargs)
        if not (flags / f"won-{{me}}").exists():
            (flags / f"won-{{me}}").write_text(str(os.getpid()))
            wait_for(flags / "release")
        return staged

    save.stage_rank = stage_and_hold
    (flags / f"ready-{{me}}").touch()
    wait_for(flags / "go")  # both saves reach the lock together
    ranks = {{RankInfo(r, 2): {{"w": torch.full((64, 16), {value})}} for r in range(2)}}
    save.save_checkpoint({directory!r}, ranks, dtype="float32", source=SOURCE, options=save.SaveOptions(overwrite=True))
    print("SAVED", flush=True)
    """
)

DEAD_TOKEN = "dead0000beef"


def staged_files(directory: Path) -> dict[str, list[str]]:
    """Staged (unpublished) files in a directory, by the token of the save that wrote them."""
    found: dict[str, list[str]] = {}
    for p in sorted(directory.iterdir()):
        token = staged_token(p.name)
        if token is not None:
            found.setdefault(token, []).append(p.name)
    return found


def wait_until(condition: Callable[[], bool], procs: list[subprocess.Popen], what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.005)


def test_two_saves_over_a_stale_lock_one_publishes_the_other_fails_clearly(tmp_path):
    directory, flags = tmp_path / "ckpt", tmp_path / "flags"
    flags.mkdir()
    save(directory)
    dead = package_process(["-c", DEAD_SAVE.format(directory=str(directory), token=DEAD_TOKEN)], timeout=120)
    assert dead.returncode == 0, dead.stderr
    stale = read_lock(str(directory))
    assert stale is not None and stale["token"] == DEAD_TOKEN
    assert list(staged_files(directory)) == [DEAD_TOKEN]

    racers: dict[str, subprocess.Popen] = {}
    try:
        for me, value in (("a", 1.0), ("b", 2.0)):
            code = RACER.format(flags=str(flags), me=me, value=value, directory=str(directory))
            racers[me] = subprocess.Popen(
                [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        procs = list(racers.values())
        wait_until(lambda: all((flags / f"ready-{me}").exists() for me in racers), procs, "both saves to start")
        (flags / "go").touch()

        # The loser fails while the winner holds the lock (the winner waits for "release").
        deadline = time.monotonic() + 120
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "neither save finished: a hang"
            time.sleep(0.005)
        (loser,) = [me for me, p in racers.items() if p.poll() is not None]
        (winner,) = [me for me in racers if me != loser]
        _, err = racers[loser].communicate(timeout=60)
        winner_pid = racers[winner].pid
        assert racers[loser].returncode == 1, err
        assert "CheckpointLocked" in err and f"another save holds {directory / LOCK_NAME} (pid {winner_pid} on" in err
        assert "wait for it to finish" in err
        assert not (flags / f"won-{loser}").exists()
        assert (flags / f"won-{winner}").read_text() == str(winner_pid)

        # The winner took the stale lock over; its staged rank and the dead save's are on disk,
        # and the loser neither staged nor removed anything.
        holder = read_lock(str(directory))
        assert holder is not None and holder["pid"] == winner_pid
        staged = staged_files(directory)
        assert set(staged) == {DEAD_TOKEN, holder["token"]}
        assert staged[holder["token"]] == [staged_name(PART0, holder["token"])]

        (flags / "release").touch()
        out, err = racers[winner].communicate(timeout=120)
        assert racers[winner].returncode == 0 and "SAVED" in out, err
    finally:
        for p in racers.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    # Published whole: no lock, no staged file (the dead save's removed by the winner), sound.
    assert verify_checkpoint(open_store(str(directory))) == []
    assert not staged_files(directory) and not (directory / LOCK_NAME).exists()
    value = {"a": 1.0, "b": 2.0}[winner]
    for rank in range(2):
        targets = {"w": torch.zeros(64, 16)}
        load_rank(
            LoadRequest(open_store(str(directory)), read_manifest(str(directory)), verify="checksum"),
            targets,
            RankInfo(rank, 2),
        )
        assert bool((targets["w"] == value).all())


def test_a_users_files_shaped_like_staged_names_are_left_alone(tmp_path):
    """A save's clean-up removes what a save that is gone staged, known by its token (12 hex
    digits): it took a user's ``.thesis.2024.partial`` in the output for such a file, and removed it."""
    mine = [".thesis.2024.partial", ".video.1.partial", ".draft.cafe.partial", f".{PART0}.0ddba11.partial"]
    for name in mine:
        (tmp_path / name).write_text("the user's")
    save(tmp_path)
    save(tmp_path)  # over a checkpoint too
    assert [(tmp_path / name).read_text() for name in mine] == ["the user's"] * len(mine)
    assert verify_checkpoint(open_store(str(tmp_path))) == []


def test_a_users_files_shaped_like_a_locks_staging_name_are_left_alone(tmp_path):
    """A save's clean-up removes a lock's staging name (``.sharded_state.lock.<token>.new``) whose
    save was killed: it took any name of that shape for one, whatever stood for the token, and
    removed a user's ``.sharded_state.lock.old.new`` from the output. Only a token of hexadecimal
    digits is a save's now; a dead save's staging name still goes."""
    mine = [f"{LOCK_NAME}.old.new", f"{LOCK_NAME}.2024-backup.new", f"{LOCK_NAME}.0ddba11.new", f"{LOCK_NAME}..new"]
    for name in mine:
        (tmp_path / name).write_text("the user's")
    dead = tmp_path / f"{LOCK_NAME}.{DEAD_TOKEN}.new"  # (no process holds its flock)
    dead.write_text("")
    save(tmp_path)
    save(tmp_path)  # over a checkpoint too
    assert [(tmp_path / name).read_text() for name in mine] == ["the user's"] * len(mine)
    assert not dead.exists()


def test_publishing_removes_only_its_own_and_the_taken_over_saves_staged_files(tmp_path):
    """A save's publish and clean-up remove the staged files of its save, of the save whose lock it took
    over and of owners that are gone, never those of a live owner (an engine's capture)."""
    from vllm_sharded_loader.storage.lock import OWNER_MARKER, hold_owner_marker, release_owner_marker

    manifest = save(tmp_path)
    ours, taken_over, other, gone = "0123456789ab", DEAD_TOKEN, "feedfacecafe", "0ddba11c0ffe"
    for token in (ours, taken_over, other, gone):
        (tmp_path / staged_name(PART0, token)).write_bytes(token.encode())
    owner = hold_owner_marker(str(tmp_path), other)  # a live engine's capture
    store = open_store(str(tmp_path))
    store.lock(ours, True, ())  # (a lock of its own: the one it takes over is named below)
    store.held = SaveLock(store.held.path, ours, store.held.fd, taken_over)
    store.publish(manifest)
    store.clean(manifest)
    store.release()
    assert staged_files(tmp_path) == {other: sorted([staged_name(PART0, other), staged_name(OWNER_MARKER, other)])}
    assert (tmp_path / staged_name(PART0, other)).read_bytes() == other.encode()
    assert not (tmp_path / LOCK_NAME).exists()
    load(tmp_path)
    # `verify` does not list a live owner's files; once the owner is gone, it notes them (not a problem).
    assert verify_checkpoint(open_store(str(tmp_path))) == []
    release_owner_marker(str(tmp_path), other, owner)
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(tmp_path)), notes=notes) == []
    assert any("a staged file or owner marker of a save or engine that is gone" in n for n in notes), notes


def test_save_taking_a_stale_lock_over_removes_that_saves_staged_files_only(tmp_path):
    from vllm_sharded_loader.storage.lock import OWNER_MARKER, hold_owner_marker

    save(tmp_path)
    other = "feedfacecafe"
    dead = package_process(["-c", DEAD_SAVE.format(directory=str(tmp_path), token=DEAD_TOKEN)], timeout=120)
    assert dead.returncode == 0, dead.stderr
    (tmp_path / staged_name("model-rank-1-part-0.safetensors", other)).write_bytes(b"not ours")
    owner = hold_owner_marker(str(tmp_path), other)  # a live engine's start-up capture
    assert set(staged_files(tmp_path)) == {DEAD_TOKEN, other}
    save(tmp_path, overwrite=True)
    assert staged_files(tmp_path) == {
        other: sorted([staged_name("model-rank-1-part-0.safetensors", other), staged_name(OWNER_MARKER, other)])
    }
    os.close(owner)
    assert not (tmp_path / LOCK_NAME).exists()
    load(tmp_path, verify="checksum")
