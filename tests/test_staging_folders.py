"""Local staging folders of saves into object storage: removed by their owner, and after a kill by the next save.

Engine-free and real: owners are separate processes, killed with ``SIGKILL`` (no ``finally`` or
``atexit`` of theirs runs), and the sweep of :func:`make_staging_folder` decides from the
kernel's ``flock`` alone. What is not provably ours and dead (a live owner's folder, a
folder without our marker, a symbolic link, an engine's capture still held) is left alone.
The sweep after a save killed at a step of the object-storage protocol is tested in
``tests/test_s3.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_sharded_loader.storage.staging_folders import (
    FOLDER_MARKER,
    STAGING_PREFIX,
    make_staging_folder,
    remove_dead_staging_folders,
    staging_folder,
)

ROOT = Path(__file__).resolve().parent.parent

# An owner of a staging folder in another process: makes it, fills it, says where, then waits
# for a line on stdin (or its kill) and removes it.
OWNER = textwrap.dedent(
    """
    import sys
    from vllm_sharded_loader.storage.staging_folders import make_staging_folder
    folder = make_staging_folder(sys.argv[1])
    with open(folder.path + "/.model-rank-0-part-0.safetensors.abc000000000.partial", "wb") as f:
        f.write(b"x" * 4096)
    print(folder.path, flush=True)
    sys.stdin.readline()
    folder.remove()
    """
)


def child(code: str, *args: str, **pipes: int) -> subprocess.Popen:
    """``code`` run by this Python in a process of its own, with the repository importable."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], cwd=ROOT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, **pipes
    )


def start_owner(base: Path) -> tuple[subprocess.Popen, Path]:
    proc = child(OWNER, str(base), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    return proc, Path(proc.stdout.readline().strip())


def folders(base: Path) -> set[str]:
    return {p.name for p in base.iterdir()}


def test_a_folder_is_marked_while_in_use_and_removed_on_exit_and_on_failure(tmp_path):
    with staging_folder(str(tmp_path)) as path:
        assert Path(path).parent == tmp_path and Path(path).name.startswith(STAGING_PREFIX)
        assert (Path(path) / FOLDER_MARKER).is_file()
        (Path(path) / "part").write_bytes(b"staged")
    assert folders(tmp_path) == set()
    with pytest.raises(OSError, match="No space"), staging_folder(str(tmp_path)) as path:
        raise OSError(28, "No space left on device")
    assert folders(tmp_path) == set()
    folder = make_staging_folder(str(tmp_path))
    folder.remove()
    folder.remove()  # a second call does nothing
    assert folders(tmp_path) == set()


def test_a_killed_owners_folder_goes_with_the_next_staging_and_a_live_ones_stays(tmp_path):
    dead, dead_path = start_owner(tmp_path)
    live, live_path = start_owner(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert dead_path.is_dir()  # a killed process cleans nothing up
        with staging_folder(str(tmp_path)) as mine:
            assert folders(tmp_path) == {live_path.name, Path(mine).name}
            assert (live_path / ".model-rank-0-part-0.safetensors.abc000000000.partial").stat().st_size == 4096
    finally:
        live.communicate("done\n", timeout=60)
    assert live.returncode == 0
    assert folders(tmp_path) == set()  # the live owner removed its own


def test_what_is_not_provably_ours_and_dead_is_left_alone(tmp_path):
    base, outside, nested = tmp_path / "base", tmp_path / "outside", tmp_path / "base" / "nested"
    for folder in (base, outside, nested):
        folder.mkdir()
    # A dead owner's folder outside the base, reached through a symbolic link of our prefix.
    dead, dead_path = start_owner(outside)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    (base / f"{STAGING_PREFIX}link").symlink_to(dead_path)
    # Another program's folder of the same prefix, without our marker.
    foreign = base / f"{STAGING_PREFIX}foreign"
    foreign.mkdir()
    (foreign / "theirs.bin").write_bytes(b"not ours")
    # A folder whose marker is a symbolic link to a file nobody locks.
    (base / f"{STAGING_PREFIX}linked-marker").mkdir()
    (tmp_path / "unlocked").write_text("")
    (base / f"{STAGING_PREFIX}linked-marker" / FOLDER_MARKER).symlink_to(tmp_path / "unlocked")
    # A plain file of our prefix, and a dead owner's folder one level down (not directly under the base).
    (base / f"{STAGING_PREFIX}file").write_text("a file")
    below, nested_path = start_owner(nested)
    below.send_signal(signal.SIGKILL)
    below.wait()
    before = folders(base)
    assert remove_dead_staging_folders(str(base)) == []
    assert folders(base) == before
    assert (foreign / "theirs.bin").read_bytes() == b"not ours" and dead_path.is_dir() and nested_path.is_dir()
    # Reached directly under its own base, the dead folder goes.
    assert remove_dead_staging_folders(str(outside)) == [str(dead_path)]
    assert remove_dead_staging_folders(str(nested)) == [str(nested_path)]


CAPTURER = textwrap.dedent(
    """
    import sys
    from vllm_sharded_loader.storage.lock import hold_owner_marker
    hold_owner_marker(sys.argv[1], "c0ffee000000")
    print("held", flush=True)
    sys.stdin.readline()
    """
)


def test_a_folder_whose_owner_died_is_kept_while_an_engine_worker_still_holds_its_capture(tmp_path):
    """The save script makes the folder; its engine's workers capture into it, each holding an
    owner marker. Killed, the script leaves workers that may live on a moment: the folder
    waits for them."""
    script, folder = start_owner(tmp_path)
    worker = child(CAPTURER, str(folder), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert worker.stdout.readline().strip() == "held"
        script.send_signal(signal.SIGKILL)
        script.wait()
        assert remove_dead_staging_folders(str(tmp_path)) == []
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    assert remove_dead_staging_folders(str(tmp_path)) == [str(folder)]


def test_the_marker_of_a_folder_that_dies_while_being_made_is_not_taken_for_ours(tmp_path):
    """Killed between making its folder and marking it, an owner leaves a folder without our
    marker: it cannot be told from another program's, so it stays (empty, or with the
    unrenamed marker)."""
    half = tmp_path / f"{STAGING_PREFIX}half"
    half.mkdir()
    (half / f"{FOLDER_MARKER}.new").write_text("")
    assert remove_dead_staging_folders(str(tmp_path)) == []
    assert half.is_dir()


SWEEPER = textwrap.dedent(
    """
    import os, sys
    from vllm_sharded_loader.storage.staging_folders import staging_folder
    for i in range(int(sys.argv[2])):
        with staging_folder(sys.argv[1]) as path:
            part = os.path.join(path, "part")
            with open(part, "wb") as f:
                f.write(os.urandom(1024))
            os.listdir(path)
            with open(part, "rb") as f:
                assert len(f.read()) == 1024, "a concurrent save removed this save's staged part"
    """
)


def test_concurrent_saves_on_one_host_never_remove_each_others_folders(tmp_path):
    """Two processes make, fill, read back and remove staging folders as fast as they can, each
    sweeping the other's on every make: both succeed, and nothing is left."""
    runs = [child(SWEEPER, str(tmp_path), "2000", stderr=subprocess.PIPE) for _ in range(2)]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
    assert folders(tmp_path) == set()


@pytest.mark.parametrize("base", ["afile", "fifo", "afile/below"])
def test_a_staging_setting_that_names_no_folder_is_refused_by_name_and_leaves_the_bucket_as_it_was(
    tmp_path, monkeypatch, base
):
    """``SHARDED_STATE_STAGING_DIR`` naming a file, a FIFO, or a path under a file failed a save into
    object storage with the bare ``FileExistsError`` or ``NotADirectoryError`` of ``os.makedirs``, which
    neither is a ShardedStateError nor names the setting. (The bucket: obstore's in-process store.)"""
    from obstore.store import MemoryStore

    from tests.support.states import save
    from vllm_sharded_loader.format.errors import SaveRefused
    from vllm_sharded_loader.storage import objects
    from vllm_sharded_loader.storage.staging_folders import STAGING_ENV

    bucket = MemoryStore()
    monkeypatch.setattr(objects, "_store", lambda *_: bucket)
    (tmp_path / "afile").write_text("the user's")
    os.mkfifo(tmp_path / "fifo")
    monkeypatch.setenv(STAGING_ENV, str(tmp_path / base))
    kind = "a FIFO" if base == "fifo" else "a file"
    with pytest.raises(
        SaveRefused, match=rf"{STAGING_ENV}=.*{base}: cannot be made the folder .* is {kind}\); nothing"
    ):
        save("s3://bucket/ckpt", overwrite=True)
    assert [m["path"] for batch in bucket.list() for m in batch] == []  # its lock too
    assert (tmp_path / "afile").read_text() == "the user's" and (tmp_path / "fifo").is_fifo()


def test_a_staging_folder_on_a_full_file_system_is_refused_naming_it_and_leaves_nothing(tmp_path, monkeypatch):
    """A save into object storage whose staging base is full (a real 256 KiB tmpfs, filled) failed with
    a bare ``OSError: [Errno 28] No space left on device`` (the staging folder's marker could not be
    written), naming no path, where a SaveRefused naming the folder and what to do was due."""
    from obstore.store import MemoryStore

    from tests.support.states import save
    from vllm_sharded_loader.format.errors import SaveRefused
    from vllm_sharded_loader.storage import objects
    from vllm_sharded_loader.storage.staging_folders import STAGING_ENV

    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()})")
    try:
        with pytest.raises(OSError), open(mount / "filler", "wb") as f:
            f.write(b"\0" * 512 * 1024)  # (fills it: the rest does not fit)
        bucket = MemoryStore()
        monkeypatch.setattr(objects, "_store", lambda *_: bucket)
        monkeypatch.setenv(STAGING_ENV, str(mount))
        with pytest.raises(SaveRefused, match=rf"Making a staging folder under {mount} failed: No space left"):
            save("s3://bucket/ckpt", overwrite=True)
        assert [m["path"] for batch in bucket.list() for m in batch] == []  # its lock too
        assert os.listdir(mount) == ["filler"]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
