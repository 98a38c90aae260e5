"""Hostile inputs end in bounded time with a clear error: crafted headers, FIFOs and devices in every path slot.

Every case runs in a subprocess with a timeout, through the real entry points (a load,
``vllm-sharded verify`` and ``inspect``, the copy of non-weight files, the lock), so that a
regression fails the test instead of hanging the suite: a plain ``open()`` of a FIFO waits
for a writer forever.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from examples.tiny_models import engine_environment
from tests.support import ROOT
from tests.support.engines import package_process, python_process
from tests.support.states import save
from vllm_sharded_loader.format import LOCK_NAME, MANIFEST_NAME
from vllm_sharded_loader.format.errors import SaveRefused
from vllm_sharded_loader.storage.location import open_store

BOUND_S = 60  # generous: each case takes well under a second when it does not hang


def run(code: str, fresh: bool = False, vllm: bool = False) -> subprocess.CompletedProcess:
    """``code`` in a process of its own, started in the repository (``tests.support`` importable): forked
    from the tests' package fork server, with ``vllm`` from the engines' one (vLLM imported, in the
    engines' environment; stdout and stderr then both hold all of the output), or with ``fresh`` a new
    interpreter (whose peak memory is its own: a forked child's starts at its parent's). A hang fails
    the test at BOUND_S."""
    try:
        if vllm:
            return python_process(["-c", textwrap.dedent(code)], {**os.environ, **engine_environment()}, BOUND_S)
        if fresh:
            return subprocess.run(
                [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=BOUND_S
            )
        return package_process(["-c", textwrap.dedent(code)], timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {BOUND_S} s: {code.strip().splitlines()[-1]}")


def header_file(path: Path, header: dict, data: bytes = b"\0" * 4) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    ("shape", "what"),
    [
        ([2**30] * 400_000, "many huge dimensions (a 4.4 MB header: quadratic products before)"),
        ([1] * 17, "more dimensions than any tensor has"),
        ([10**30], "a dimension beyond 2^60"),
        ([-1], "a negative dimension"),
    ],
    ids=["many-huge-dims", "17-dims", "huge-dim", "negative-dim"],
)
def test_crafted_safetensors_header_is_refused_fast_naming_the_file(tmp_path, shape, what):
    path = tmp_path / "model-rank-0-part-0.safetensors"
    header_file(path, {"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}})
    done = run(
        f"""
        from vllm_sharded_loader.storage.local import read_header
        from vllm_sharded_loader.format import ShardedStateError
        try:
            read_header({str(path)!r})
        except ShardedStateError as e:
            print("REFUSED", str(e)[:400])
        """
    )
    assert done.returncode == 0, (what, done.stderr[-2000:])
    assert f"REFUSED {path}: header entry of 't' is malformed" in done.stdout, (what, done.stdout)


def test_absurd_offsets_are_refused(tmp_path):
    path = tmp_path / "p.safetensors"
    for offsets in ([0, 2**70], [-4, 0], [4, 0]):
        header_file(path, {"t": {"dtype": "F32", "shape": [1], "data_offsets": offsets}})
        done = run(
            f"""
            from vllm_sharded_loader.storage.local import read_header
            from vllm_sharded_loader.format import ShardedStateError
            try:
                read_header({str(path)!r})
            except ShardedStateError as e:
                print("REFUSED", e)
            """
        )
        assert f"REFUSED {path}" in done.stdout, (offsets, done.stdout, done.stderr[-2000:])
        # Reversed offsets are named as such, not as a truncated file.
        assert ("which end before they begin" in done.stdout) == (offsets == [4, 0]), (offsets, done.stdout)


def make_special(path: Path, kind: str) -> None:
    """A FIFO, a device node, or a symlink to a device, where a regular file should be."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        try:
            os.mknod(path, 0o600 | 0o020000, os.makedev(1, 5))  # a character device (/dev/zero's numbers)
        except PermissionError as e:
            pytest.skip(f"cannot create a device node here: {e}")
    elif kind == "socket":  # (open(2) refuses it with ENXIO, which verify reported bare, and stopped)
        short = tempfile.mkdtemp(dir=path.parent.anchor)  # (a socket's path has at most 107 bytes)
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(os.path.join(short, "s"))
        os.rename(os.path.join(short, "s"), path)
        os.rmdir(short)
    elif kind == "link-loop":  # (ELOOP, likewise)
        os.symlink(path.name, path)
    else:
        os.symlink("/dev/zero", path)


SLOTS = {
    # slot -> (file name in the checkpoint, code run on the checkpoint folder D (its store S), text the error names)
    "manifest (load)": (MANIFEST_NAME, "load(D)", MANIFEST_NAME),
    "part (load)": ("model-rank-0-part-0.safetensors", "load(D)", "model-rank-0-part-0.safetensors"),
    "part (verify)": ("model-rank-1-part-0.safetensors", "print(verify_checkpoint(S))", "model-rank-1-part-0"),
    "lock (load)": (LOCK_NAME, "load(D)", LOCK_NAME),
    "manifest (inspect)": (MANIFEST_NAME, "inspect_checkpoint(S)", MANIFEST_NAME),
}
CODE = """
from tests.support.states import load
from vllm_sharded_loader.checkpoint import verify_checkpoint
from vllm_sharded_loader.tools.offline import inspect_checkpoint
from vllm_sharded_loader.format import ShardedStateError
from vllm_sharded_loader.storage.location import open_store
D = {directory!r}
S = open_store(D)
try:
    {call}
except ShardedStateError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("kind", ["fifo", "device", "link-to-device", "socket", "link-loop"])
@pytest.mark.parametrize("slot", list(SLOTS))
def test_special_file_in_a_path_slot_is_refused_without_blocking(tmp_path, slot, kind):
    directory = tmp_path / "ckpt"
    save(directory)
    name, call, named = SLOTS[slot]
    if name == LOCK_NAME:
        (directory / MANIFEST_NAME).unlink()  # a lock is read for a load only where nothing is published
    make_special(directory / name, kind)
    done = run(CODE.format(directory=str(directory), call=call))
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "REFUSED" in out or "regular file was expected" in out or "outside the checkpoint" in out, (slot, kind, out)
    assert named in out, (slot, kind, out)
    if slot == "part (verify)" and kind != "link-to-device":  # one problem, listed once (a socket was twice)
        assert out.count(named) == 1, (kind, out)
    if name == LOCK_NAME:
        # An unreadable lock names no holder: the directory is refused as held, at once.
        assert "is being saved or its save was interrupted" in out, out
    elif kind != "link-to-device":
        assert "where a regular file was expected" in out, out
    else:
        # A link out of the checkpoint is refused by containment, before anything is opened.
        assert "outside the checkpoint directory" in out or "where a regular file was expected" in out, out


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_special_file_among_the_non_weight_files_is_refused_without_blocking(tmp_path, kind):
    source, output = tmp_path / "model", tmp_path / "out"
    source.mkdir()
    (source / "config.json").write_text("{}")
    make_special(source / "tokenizer.json", kind)
    done = run(
        f"""
        from vllm_sharded_loader.storage.model_files import copy_non_weight_files
        from vllm_sharded_loader.format import ShardedStateError
        try:
            copy_non_weight_files({str(source)!r}, {str(output)!r})
        except ShardedStateError as e:
            print("REFUSED", e)
        """
    )
    assert f"REFUSED {source / 'tokenizer.json'} is a" in done.stdout, (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize("filler", ["[]", "{}", '""'])
def test_a_manifest_that_would_take_gigabytes_to_parse_is_refused_before_parsing(tmp_path, filler):
    """Parsing a manifest took about 22x its size in memory for a file of empty lists (a 256 MiB
    manifest: 5.6 GB per worker), more for empty objects. Such a file is now refused, naming
    it, in a child process whose peak memory stays within a few times the file's size."""
    save(tmp_path, tp_size=1)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    manifest["source"]["config"]["padding"] = json.loads("[" + ",".join([filler] * 4_000_000) + "]")
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest, separators=(",", ":")))
    size = (tmp_path / MANIFEST_NAME).stat().st_size
    done = run(
        f"""
        import resource
        from vllm_sharded_loader.checkpoint import read_manifest
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        try:
            read_manifest({str(tmp_path)!r})
        except Exception as e:
            print(*[c.__name__ for c in type(e).__mro__[:-3]], e)  # CheckpointCorrupt ShardedStateError
        print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
        """,
        fresh=True,
    )
    assert "ShardedStateError" in done.stdout and "would take about" in done.stdout, done.stdout + done.stderr
    assert MANIFEST_NAME in done.stdout
    peak = int(done.stdout.split("PEAK")[1])
    assert peak < 4 * size, f"reading a {size}-byte manifest took {peak} bytes"


def test_our_own_large_manifests_parse_within_the_bound(tmp_path):
    """The bound refuses no manifest this package writes: many tensors, many checksum blocks, compact or indented."""
    from tests.support.states import SOURCE
    from vllm_sharded_loader.format.manifest import (
        MAX_PARSE_EXPANSION,
        FileChecksum,
        FileEntry,
        Manifest,
        RankEntry,
        TensorEntry,
    )
    from vllm_sharded_loader.format.untrusted import parse_cost

    part = "model-rank-0-part-{}.safetensors"
    tensors = {
        f"model.layers.{i}.mlp.experts.{e}.w{k}": TensorEntry(part.format(i % 9), "bfloat16", (1408, 2048), 1 << 30)
        for i in range(60)
        for e in range(64)
        for k in range(3)
    }
    blocks = FileChecksum("blake3", 16 << 20, tuple("ab" * 32 for _ in range(320)))
    files = tuple(FileEntry(part.format(p), 5 << 30, blocks) for p in range(9))
    text = Manifest(
        1, 1, "bfloat16", "model-rank-{rank}-part-{part}.safetensors", SOURCE, (RankEntry(0, 0, files, tensors),)
    ).to_json()
    compact = json.dumps(json.loads(text), separators=(",", ":"))
    for form in (text, compact):
        assert len(form) > 1 << 20
        assert parse_cost(form) < MAX_PARSE_EXPANSION * len(form)
        assert len(Manifest.from_json(form).ranks[0].tensors) == len(tensors)


MODEL_SLOTS = ["config.json", "tokenizer.json", "model.safetensors.index.json", "model.safetensors"]


def model_folder(path: Path) -> Path:
    """A Hugging Face model folder's shape (config, tokenizer, one weight file): nothing reads past the slot."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    header_file(path / "model.safetensors", {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})
    return path


def test_a_failed_save_command_leaves_none_of_the_folders_it_made(tmp_path):
    """``save -o new/deeper/out`` whose engine fails (here vLLM refuses the model's empty config) removed
    only the last folder it had made: the parents it made stayed behind, empty. A folder that was
    there before stays."""
    source = model_folder(tmp_path / "model")
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "new" / "deeper" / "out"
    done = run(
        f"""
        from vllm_sharded_loader.engine.save_cli import save_sharded_state
        try:
            save_sharded_state({{"model": {str(source)!r}}}, {str(out)!r})
        except Exception as e:
            print("FAILED", type(e).__name__)
        """,
        vllm=True,
    )
    assert "FAILED" in done.stdout, done.stdout[-3000:]
    assert os.listdir(tmp_path / "kept") == []


@pytest.mark.parametrize(
    ("slot", "kind"),
    # (Each case runs vLLM's CLI code in a process of its own: a socket and a loop of links, which open(2)
    # refuses before any mode check, in one slot; the slots differ only in what lists them.)
    [(slot, kind) for slot in MODEL_SLOTS for kind in ("fifo", "device")]
    + [("config.json", "socket"), ("tokenizer.json", "link-loop")],
)
def test_a_special_file_in_a_source_model_is_refused_before_vllm_reads_the_folder(tmp_path, slot, kind):
    """vLLM opens a model's config and tokenizer plainly: convert, save and serve refuse the folder first."""
    source = model_folder(tmp_path / "model")
    make_special(source / slot, kind)
    checkpoint = tmp_path / "ckpt"
    save(checkpoint)
    make_special(checkpoint / slot, kind)
    out = tmp_path / "out"
    done = run(
        f"""
        from vllm_sharded_loader.tools.convert import convert_checkpoint
        from vllm_sharded_loader.engine.save_cli import save_sharded_state
        from vllm_sharded_loader.engine.serve_cli import main as serve
        from vllm_sharded_loader.format import ShardedStateError
        for call in (
            lambda: convert_checkpoint({str(source)!r}, {str(out)!r}, 2),
            lambda: save_sharded_state({{"model": {str(source)!r}}}, {str(out)!r}),
        ):
            try:
                call()
            except ShardedStateError as e:
                print("REFUSED", e)
        try:
            serve([{str(checkpoint)!r}, "--load-format", "sharded_state"])
        except SystemExit as e:
            print("EXIT", e.code)
        """,
        vllm=True,
    )
    kinds = {
        "fifo": "a FIFO",
        "device": "a character device",
        "socket": "a socket",
        "link-loop": "a loop of symbolic links",
    }
    expected = f"{source / slot} is {kinds[kind]}, where a regular file was expected"
    assert done.stdout.count(f"REFUSED {expected}") == 2, (done.stdout, done.stderr[-2000:])
    assert "EXIT 2" in done.stdout and f"{checkpoint / slot} is {kinds[kind]}" in done.stderr, done.stderr[-2000:]
    assert not out.exists()


def test_verify_names_a_special_file_among_a_checkpoints_carried_files(tmp_path):
    from vllm_sharded_loader.checkpoint import verify_checkpoint

    checkpoint = tmp_path / "ckpt"
    save(checkpoint)
    assert verify_checkpoint(open_store(str(checkpoint))) == []
    make_special(checkpoint / "config.json", "fifo")
    (checkpoint / "tokenizer").mkdir()
    problems = verify_checkpoint(open_store(str(checkpoint)))
    assert problems == [
        f"{checkpoint / 'config.json'} is a FIFO, where a regular file was expected; refusing to read it. Replace "
        "it with the real file (copy or save the checkpoint again)."
    ]


def test_verify_names_a_fifo_where_the_save_carried_a_config_without_blocking(tmp_path):
    """A FIFO where the save recorded its config.json: named once, with what the save carried there, and
    the check does not wait for a writer (run in a thread that must end)."""
    import threading

    from tests.support.states import CONFIG, SOURCE, rank_state
    from vllm_sharded_loader.checkpoint import verify_checkpoint
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    from vllm_sharded_loader.checkpoint.state import saveable_state
    from vllm_sharded_loader.planning.topology import RankInfo

    model, checkpoint = tmp_path / "model", tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    ranks = {RankInfo(r, 2): saveable_state(rank_state(r, 2)) for r in range(2)}
    save_checkpoint(
        str(checkpoint), ranks, dtype="bfloat16", source=SOURCE, options=SaveOptions(carry=open_store(str(model)))
    )
    make_special(checkpoint / "config.json", "fifo")
    found: list[list[str]] = []
    thread = threading.Thread(target=lambda: found.append(verify_checkpoint(open_store(str(checkpoint)))), daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "verify blocks on the FIFO"
    size = (model / "config.json").stat().st_size
    assert len(found[0]) == 1 and found[0][0].startswith(
        f"{checkpoint / 'config.json'} is a FIFO, where a regular file was expected; refusing to read it. Replace "
        f"it with the real file (copy or save the checkpoint again). The save carried a regular file there ({size} "
        "bytes, SHA-256 "
    ), found


def test_verify_names_a_carried_file_that_links_out_of_the_checkpoint_without_reading_it(tmp_path):
    """A carried config.json replaced by a link to a file outside the checkpoint, even one of the very
    bytes the save recorded, is named as a link out of it (verify hashed the outside file and passed)."""
    from tests.support.states import CONFIG, SOURCE, rank_state
    from vllm_sharded_loader.checkpoint import verify_checkpoint
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    from vllm_sharded_loader.checkpoint.state import saveable_state
    from vllm_sharded_loader.planning.topology import RankInfo

    model, checkpoint = tmp_path / "model", tmp_path / "ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    ranks = {RankInfo(r, 2): saveable_state(rank_state(r, 2)) for r in range(2)}
    save_checkpoint(
        str(checkpoint), ranks, dtype="bfloat16", source=SOURCE, options=SaveOptions(carry=open_store(str(model)))
    )
    (checkpoint / "config.json").unlink()
    (checkpoint / "config.json").symlink_to(model / "config.json")
    problems = verify_checkpoint(open_store(str(checkpoint)))
    assert len(problems) == 1 and problems[0].startswith(
        f"{checkpoint / 'config.json'} resolves to {model / 'config.json'}, outside the checkpoint directory "
        f"{checkpoint} (a symlink or path that escapes it); refusing to read it. Copy the real file into the "
        "checkpoint. The save carried a regular file there ("
    ), problems


def test_a_safetensors_index_that_is_a_fifo_or_names_files_outside_its_folder_is_refused(tmp_path):
    from vllm_sharded_loader.format.errors import CheckpointCorrupt
    from vllm_sharded_loader.storage.hf_source import INDEX_NAME, weight_files

    source = model_folder(tmp_path / "model")
    for outside in ("../model.safetensors", str(source / "model.safetensors"), ".."):
        (source / INDEX_NAME).write_text(json.dumps({"weight_map": {"t": outside}}))
        with pytest.raises(CheckpointCorrupt, match=rf"{INDEX_NAME} lists .*: a file outside the folder"):
            weight_files(open_store(str(source)))
    make_special(source / INDEX_NAME, "fifo")
    done = run(
        f"""
        from vllm_sharded_loader.storage.hf_source import weight_files
        from vllm_sharded_loader.storage.location import open_store
        from vllm_sharded_loader.format import ShardedStateError
        try:
            weight_files(open_store({str(source)!r}))
        except ShardedStateError as e:
            print("REFUSED", e)
        """
    )
    assert f"REFUSED {source / INDEX_NAME} is a FIFO" in done.stdout, (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize(
    "index",
    ['{"weight_map": {"t": 1}}', '{"weight_map": {"t": null}}', '{"weight_map": {"t": true}}', "[" * 100_000],
    ids=["a-number", "null", "true", "nested-past-the-recursion-limit"],
)
def test_a_safetensors_index_that_names_no_file_is_refused_naming_it(tmp_path, index):
    """A weight_map that gives a tensor a number or null instead of a file name, or an index nested
    deeper than Python's recursion limit: convert's first step (its read-ahead) and its source's
    listing raised a bare TypeError or RecursionError, a traceback instead of the index's name."""
    from vllm_sharded_loader.format.errors import CheckpointCorrupt
    from vllm_sharded_loader.storage.hf_source import INDEX_NAME, read_ahead, weight_files

    source = model_folder(tmp_path / "model")
    (source / INDEX_NAME).write_text(index)
    assert read_ahead(str(source))() == 0  # (a source that cannot be listed is read by none)
    refused = rf"^{re.escape(str(source / INDEX_NAME))}: not a safetensors index \(.+\)\. Download the model again"
    with pytest.raises(CheckpointCorrupt, match=refused):
        weight_files(open_store(str(source)))


NESTED_PAST_THE_RECURSION_LIMIT = "[" * 100_000


def test_a_modules_json_nested_past_the_recursion_limit_names_no_module_folder(tmp_path):
    """As any unreadable modules.json: convert's check of the source folder (which lists the files a
    checkpoint carries), and verify of a checkpoint carrying it, raised a bare RecursionError."""
    from vllm_sharded_loader.checkpoint import verify_checkpoint
    from vllm_sharded_loader.storage.location import check_no_special_files, open_store

    source = model_folder(tmp_path / "model")
    (source / "2_Dense").mkdir()
    (source / "2_Dense" / "model.safetensors").write_bytes(b"")
    (source / "modules.json").write_text(NESTED_PAST_THE_RECURSION_LIMIT)
    check_no_special_files(open_store(str(source)))
    assert open_store(str(source)).non_weight_files() == ["config.json", "modules.json", "tokenizer.json"]
    checkpoint = tmp_path / "ckpt"
    save(checkpoint)
    (checkpoint / "modules.json").write_text(NESTED_PAST_THE_RECURSION_LIMIT)
    verify_checkpoint(open_store(str(checkpoint)), checksums=False)


def test_a_lock_file_nested_past_the_recursion_limit_is_a_lock_of_unknown_holder(tmp_path):
    """A save lock whose JSON nests deeper than Python's recursion limit, as one that is not JSON:
    convert's look at its output (``is_locked``), a save into it and verify raised a bare RecursionError."""
    from vllm_sharded_loader.checkpoint import verify_checkpoint
    from vllm_sharded_loader.format.errors import CheckpointLocked

    checkpoint = tmp_path / "ckpt"
    save(checkpoint)
    (checkpoint / LOCK_NAME).write_text(NESTED_PAST_THE_RECURSION_LIMIT)
    assert open_store(str(checkpoint)).is_locked()
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(checkpoint)), checksums=False, notes=notes) == []
    died = f"{checkpoint / LOCK_NAME} (pid ? on ?, ?): the lock of a save that died"
    assert any(note.startswith(died) for note in notes), notes
    with pytest.raises(CheckpointLocked, match=r"that save was interrupted .*Save again with overwrite"):
        save(checkpoint, overwrite=False)


@pytest.mark.parametrize("kind", ["file", "fifo", "under-a-file", "dangling-link"])
def test_an_output_that_is_not_a_folder_is_refused_by_name_and_left_as_it_was(tmp_path, kind):
    from vllm_sharded_loader.tools.convert import convert_checkpoint

    there = tmp_path / "taken"
    if kind == "fifo":
        os.mkfifo(there)
    elif kind == "dangling-link":
        there.symlink_to(tmp_path / "nowhere")
    else:
        there.write_text("not ours")
    output = there / "ckpt" if kind == "under-a-file" else there
    what = {"fifo": "a FIFO", "dangling-link": "a link to nothing"}.get(kind, "a file")
    named = f"{output}: {there}" if kind == "under-a-file" else f"{output}"
    message = rf"^{named} is {what}, where a checkpoint folder was expected; nothing was written"
    for overwrite in (True, False):  # (without overwrite, the checkpoint rule looked first: "Not a directory")
        with pytest.raises(SaveRefused, match=message):
            save(output, overwrite=overwrite)  # the save protocol (reshard, the save hook)
    source = model_folder(tmp_path / "model")
    with pytest.raises(SaveRefused, match=message):
        convert_checkpoint(str(source), str(output), 2)  # before vLLM is imported
    if kind == "dangling-link":
        assert there.is_symlink() and not (tmp_path / "nowhere").exists()
    else:
        assert there.is_fifo() if kind == "fifo" else there.read_text() == "not ours"


@pytest.mark.parametrize("kind", ["link-out", "dangling-link", "fifo", "directory", "hard-link", "socket"])
def test_a_lock_that_is_not_a_regular_file_is_refused_by_name_and_nothing_outside_is_written(tmp_path, kind):
    """Taking a dead save's lock over rewrites the lock file: through a link it wrote over the file
    the link points at, outside the checkpoint; a FIFO or a folder there gave a bare errno. A hard
    link is a regular file that is also the victim (no flock held on it): the takeover truncated
    the victim and wrote the lock's JSON into it. A socket (which open(2) refuses with ENXIO) was
    refused as a lock that could not be taken, "No such device or address", with advice to free space."""
    from vllm_sharded_loader.format.errors import CheckpointLocked

    directory, victim = tmp_path / "ckpt", tmp_path / "notes.txt"
    save(directory)
    manifest = (directory / MANIFEST_NAME).read_bytes()
    victim.write_text("not ours")
    lock = directory / LOCK_NAME
    if kind == "link-out":
        lock.symlink_to(victim)
    elif kind == "dangling-link":
        lock.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "hard-link":
        os.link(victim, lock)
    elif kind == "socket":
        listening = socket.socket(socket.AF_UNIX)
        listening.bind(str(lock))
        listening.close()  # (the socket file stays)
    else:
        lock.mkdir()
    what = {"fifo": "a FIFO", "directory": "a directory", "hard-link": r"a file with 1 other name\(s\) \(a hard link\)"}
    what["socket"] = "a socket"
    what = what.get(kind, "a symbolic link")
    with pytest.raises(CheckpointLocked, match=rf"^{directory}: {lock} is {what}, where a save's lock file was"):
        save(directory)  # with overwrite: a dead save's lock would be taken over
    assert victim.read_text() == "not ours"
    assert (directory / MANIFEST_NAME).read_bytes() == manifest
    if kind == "hard-link":
        assert lock.read_text() == "not ours" and os.stat(lock).st_ino == os.stat(victim).st_ino
    elif kind == "socket":
        assert lock.is_socket()
    else:
        assert lock.is_symlink() if "link" in kind else lock.is_fifo() if kind == "fifo" else lock.is_dir()


@pytest.mark.parametrize("started", ["1e300", "NaN", "-1e20"])
def test_a_lock_whose_start_time_is_no_time_is_named_without_one(tmp_path, started):
    """A lock's start time out of the platform's range (or NaN, which JSON parsing takes) raised a bare
    OverflowError or ValueError where the lock is named: verify and inspect printed a traceback, a save
    crashed instead of refusing."""
    from vllm_sharded_loader.format.errors import CheckpointLocked
    from vllm_sharded_loader.storage.lock import check_not_locked

    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / LOCK_NAME).write_text(f'{{"pid": 1, "host": "elsewhere", "token": "ab12", "started": {started}}}')
    named = rf"{directory / LOCK_NAME} \(pid 1 on elsewhere, \?\)"
    with pytest.raises(CheckpointLocked, match=rf"being saved or its save was interrupted: {named} exists"):
        check_not_locked(str(directory))  # a load's, verify's and inspect's check
    with pytest.raises(CheckpointLocked, match=rf"another save holds {named}; that save was interrupted"):
        save(directory, overwrite=False)


@pytest.mark.parametrize("started", ["1e300", "NaN", "-1e20"])
def test_a_lock_object_whose_time_is_no_time_is_named_without_one(monkeypatch, started):
    """As above, for the lock object of an object-storage prefix (its bucket served by obstore's
    in-process store): every load, verify and save of the prefix failed with a bare ValueError or
    OverflowError from the lock's time, where a CheckpointLocked naming the lock was due."""
    from obstore.store import MemoryStore

    from vllm_sharded_loader.format.errors import CheckpointLocked
    from vllm_sharded_loader.storage import object_lock, objects

    bucket = MemoryStore()
    monkeypatch.setattr(objects, "_store", lambda *_: bucket)
    bucket.put(f"ckpt/{LOCK_NAME}", f'{{"pid": 1, "host": "elsewhere", "token": "ab12", "time": {started}}}'.encode())
    where = objects.ObjectPrefix.parse("s3://bucket/ckpt")
    named = re.escape(f"s3://bucket/ckpt/{LOCK_NAME} (pid 1 on elsewhere, since ?)")
    with pytest.raises(CheckpointLocked, match=rf"a save is running or was interrupted there \({named}\)"):
        object_lock.check_not_locked(where)  # a load's, verify's and inspect's check
    with pytest.raises(CheckpointLocked, match=rf"another save holds {named}\. If it is no longer running"):
        save("s3://bucket/ckpt", overwrite=False)


def test_a_folder_link_out_of_the_checkpoint_is_not_walked_nor_carried(tmp_path):
    """A link to a folder outside (``extra -> /usr``) was walked as the checkpoint's own: verify
    stat-ed, and reshard copied, the whole tree it points at (1.3 GB of /usr in a minute)."""
    from tests.support.checkpoints import save_reshardable
    from vllm_sharded_loader.checkpoint import verify_checkpoint
    from vllm_sharded_loader.tools.offline import reshard_checkpoint

    directory, outside, out = tmp_path / "ckpt", tmp_path / "outside", tmp_path / "out"
    save_reshardable(directory)
    (directory / "config.json").write_text("{}")
    outside.mkdir()
    (outside / "secret.txt").write_text("not the checkpoint's")
    os.mkfifo(outside / "pipe")
    (directory / "extra").symlink_to(outside)
    assert verify_checkpoint(open_store(str(directory))) == []
    reshard_checkpoint(open_store(str(directory)), str(out), tp_size=1)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-rank-0-part-0.safetensors", MANIFEST_NAME]
    assert verify_checkpoint(open_store(str(out))) == []


def test_a_manifest_naming_a_part_with_a_number_of_thousands_of_digits_is_refused_naming_it(tmp_path, capsys):
    """A manifest's file names are not bounded by the file system's 255 bytes: a part named with a rank
    of 5000 digits made the check of its name against the pattern raise Python's bare ValueError (int()
    takes at most 4300 digits), and ``inspect`` printed a traceback instead of naming the manifest."""
    from tests.support.manifests import edit_manifest
    from vllm_sharded_loader.checkpoint import read_manifest
    from vllm_sharded_loader.format.errors import CheckpointCorrupt
    from vllm_sharded_loader.tools.cli import main

    directory = tmp_path / "ckpt"
    save(directory)

    def rename_first_part(data: dict) -> None:
        old = data["ranks"][0]["files"][0]["name"]
        new = old.replace("rank-0", "rank-" + "0" * 5000)
        data["ranks"][0]["files"][0]["name"] = new
        for tensor in data["ranks"][0]["tensors"].values():
            if tensor["file"] == old:
                tensor["file"] = new

    edit_manifest(directory, rename_first_part)
    with pytest.raises(CheckpointCorrupt, match=rf"^{re.escape(str(directory / MANIFEST_NAME))}: file 'model-rank-0+"):
        read_manifest(str(directory))
    assert main(["inspect", str(directory)]) == 2
    assert "does not name that rank's files so" in capsys.readouterr().err


def test_a_tied_group_of_many_names_costs_time_and_memory_linear_in_it(tmp_path):
    """One ``tied`` group of 40,000 names (a 450 KB manifest) made the tie lookup list, for every name,
    every other: 1.6 billion entries (13 GB) before any name was checked, on an engine's load at the
    saved topology (the served geometry's check) as on a resharding load or an offline reshard. Here
    with 1 GiB of address space to spare, the load and the reshard end as on any manifest."""
    directory = tmp_path / "ckpt"
    code = f"""
        import resource
        from pathlib import Path

        import torch
        from tests.support.checkpoints import RESHARD_MODEL, save_reshardable, stage_state
        from tests.support.manifests import edit_manifest
        from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
        from vllm_sharded_loader.tools.offline import reshard_checkpoint
        from vllm_sharded_loader.storage.location import open_store

        directory = {str(directory)!r}
        save_reshardable(directory)
        edit_manifest(Path(directory), lambda m: m.update(tied=[[f"t{{i}}" for i in range(40_000)]]))
        geometry = {{name: t.geometry for name, t in RESHARD_MODEL.tensors.items()}}
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
        expected = stage_state(RESHARD_MODEL, 2, 1, 0, 0)
        targets = {{name: torch.zeros_like(x) for name, x in expected.items()}}
        request = LoadRequest(open_store(directory), read_manifest(directory), geometry=geometry)
        load_rank(request, targets, RankInfo(0, 2))
        assert all(torch.equal(targets[name], x) for name, x in expected.items())
        reshard_checkpoint(open_store(directory), {str(tmp_path / "out")!r}, 1)
        print("loaded and resharded")
    """
    out = run(code, fresh=True)
    assert out.returncode == 0 and "loaded and resharded" in out.stdout, out.stderr[-2000:]


def test_a_geometry_of_the_most_segments_allowed_is_planned_in_bounded_time(tmp_path):
    """A manifest may record up to 65,536 segments for one tensor: an offline reshard planned such a
    geometry in time quadratic in them (each target piece scanned every saved rank's pieces), about
    8 minutes for one tensor of a 4.8 MB manifest, before any file was checked. Planned in linear
    time, the reshard reaches the check of the files, which refuses the edited tensor."""
    from vllm_sharded_loader.format.geometry import MAX_SEGMENTS

    directory = tmp_path / "ckpt"
    code = f"""
        from pathlib import Path

        from tests.support.checkpoints import save_reshardable
        from tests.support.manifests import edit_manifest
        from vllm_sharded_loader.format import CheckpointCorrupt
        from vllm_sharded_loader.storage.location import open_store
        from vllm_sharded_loader.tools.offline import reshard_checkpoint

        segments, name = {MAX_SEGMENTS}, "model.norm.weight"

        def edit(m):
            m["geometry"][name] = {{
                "kind": "merged_column_parallel",
                "layer_class": "MergedColumnParallelLinear",
                "shape": [2 * segments],
                "split_dim": 0,
                "segments": [{{"name": f"segment-{{i:040d}}", "size": 2}} for i in range(segments)],
            }}
            for rank in m["ranks"]:
                rank["tensors"][name]["shape"] = [segments]

        save_reshardable({str(directory)!r})
        edit_manifest(Path({str(directory)!r}), edit)
        try:
            reshard_checkpoint(open_store({str(directory)!r}), {str(tmp_path / "out")!r}, 1)
        except CheckpointCorrupt as e:
            print(e)
    """
    out = run(code, fresh=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"tensor 'model.norm.weight' is I32[32] in the file but I32[{MAX_SEGMENTS}]" in out.stdout
    assert not (tmp_path / "out").exists()


# A checkpoint this process may not read: case -> (the file or folder made unreadable, its mode, and
# for each entry point whether it must refuse naming that path; False: it needs no such access).
UNREADABLE = {
    "a part": ("model-rank-0-part-0.safetensors", 0o000, dict(load=True, verify=True, inspect=False, reshard=True)),
    "the manifest": (MANIFEST_NAME, 0o000, dict(load=True, verify=True, inspect=True, reshard=True)),
    "the folder": ("", 0o000, dict(load=True, verify=True, inspect=True, reshard=True)),
    "a folder not to be searched": ("", 0o444, dict(load=True, verify=True, inspect=True, reshard=True)),
    "a folder not to be listed": ("", 0o111, dict(load=False, verify=True, inspect=False, reshard=True)),
}
UNREADABLE_CODE = """
import json, sys
from tests.support.reference import llama_like
from tests.support.stores import load_from
from vllm_sharded_loader.checkpoint import verify_checkpoint
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.tools.offline import inspect_checkpoint, reshard_checkpoint
MODEL = llama_like(tied=True, num_layers=2)
CALLS = {
    "load": lambda d, out: load_from(d, MODEL, 2) and "",
    "verify": lambda d, out: verify_checkpoint(open_store(d)),
    "inspect": lambda d, out: inspect_checkpoint(open_store(d)) and "",
    "reshard": lambda d, out: reshard_checkpoint(open_store(d), out, 1) and "",
}
seen = {}
for d in sys.argv[1:]:
    for name, call in CALLS.items():
        try:
            seen[d + " " + name] = ["ok", call(d, d + "-" + name)]
        except BaseException as e:
            seen[d + " " + name] = [type(e).__name__, str(e)]
print(json.dumps(seen))
"""


def test_a_checkpoint_this_process_may_not_read_is_named_as_such(tmp_path):
    """A part, the manifest or the folder that the user running the load may not read: each entry
    point names the path and the permission (a :class:`StorageError`; verify lists it as a problem),
    never a bare ``PermissionError``, and a folder it may not search is never taken for one whose
    save was interrupted (its lock unread)."""
    import shutil

    from tests.support.checkpoints import save_model
    from tests.support.reference import llama_like
    from vllm_sharded_loader.format.errors import StorageError

    command = [sys.executable, "-c", UNREADABLE_CODE]
    if os.geteuid() == 0:  # root reads everything: the same uid without the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("running as root, and util-linux's setpriv (to drop CAP_DAC_OVERRIDE) is not installed")
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    model, folders = llama_like(tied=True, num_layers=2), {}
    for i, (case, (name, mode, _)) in enumerate(UNREADABLE.items()):
        folders[case] = tmp_path / f"ckpt{i}"
        save_model(folders[case], model, 2, 1)
        os.chmod(folders[case] / name, mode)
    try:
        done = subprocess.run(
            [*command, *map(str, folders.values())], cwd=ROOT, capture_output=True, text=True, timeout=BOUND_S
        )
    finally:
        for case, (name, _, _) in UNREADABLE.items():
            os.chmod(folders[case] / name, 0o644 if name else 0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for case, (name, _, refused) in UNREADABLE.items():
        denied = f"{str(folders[case] / name).rstrip('/')}: permission denied"
        for call, named in refused.items():
            kind, said = seen[f"{folders[case]} {call}"]
            if call == "verify":
                assert kind == "ok" and [p for p in said if p.startswith(denied)], (case, said)
                assert not [p for p in said if "is being saved" in p], (case, said)
            elif named:
                assert kind == StorageError.__name__ and said.startswith(denied), (case, call, kind, said)
            else:
                assert kind == "ok", (case, call, kind, said[:300])
