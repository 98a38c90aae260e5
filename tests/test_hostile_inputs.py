"""Hostile inputs end in bounded time with a clear error: crafted headers, FIFOs and devices in every path slot.

Every case runs in a subprocess with a timeout, through the real entry points (a load,
``vllm-sharded verify`` and ``inspect``, the copy of non-weight files, the lock), so that a
regression fails the test instead of hanging the suite: a plain ``open()`` of a FIFO waits
for a writer forever.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from states import save

from vllm_sharded_loader.format import LOCK_NAME, MANIFEST_NAME

TESTS = Path(__file__).resolve().parent
BOUND_S = 60  # generous: each case takes well under a second when it does not hang


def run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (tests/ on the path); a hang fails the test at BOUND_S."""
    prelude = f"import sys; sys.path.insert(0, {str(TESTS)!r})\n"
    try:
        return subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=BOUND_S
        )
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
    else:
        os.symlink("/dev/zero", path)


SLOTS = {
    # slot -> (file name in the checkpoint, code run on the checkpoint folder D, text the error names)
    "manifest (load)": (MANIFEST_NAME, "load(D)", MANIFEST_NAME),
    "part (load)": ("model-rank-0-part-0.safetensors", "load(D)", "model-rank-0-part-0.safetensors"),
    "part (verify)": ("model-rank-1-part-0.safetensors", "print(verify_checkpoint(D))", "model-rank-1-part-0"),
    "lock (load)": (LOCK_NAME, "load(D)", LOCK_NAME),
    "manifest (inspect)": (MANIFEST_NAME, "inspect_checkpoint(D)", MANIFEST_NAME),
}
CODE = """
from states import load
from vllm_sharded_loader.checkpoint import verify_checkpoint
from vllm_sharded_loader.tools.offline import inspect_checkpoint
from vllm_sharded_loader.format import ShardedStateError
D = {directory!r}
try:
    {call}
except ShardedStateError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("kind", ["fifo", "device", "link-to-device"])
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
        from vllm_sharded_loader.storage.local import copy_non_weight_files
        from vllm_sharded_loader.format import ShardedStateError
        try:
            copy_non_weight_files({str(source)!r}, {str(output)!r})
        except ShardedStateError as e:
            print("REFUSED", e)
        """
    )
    assert f"REFUSED {source / 'tokenizer.json'} is a" in done.stdout, (done.stdout, done.stderr[-2000:])
