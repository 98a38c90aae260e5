"""Restoring start-up artifacts onto a node under hostile archives and real faults, no engine: a
refused or failed restore leaves the cache folder as it was, and what is not ours is never replaced."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from vllm_sharded_loader.checkpoint import startup_artifacts as sa
from vllm_sharded_loader.format.errors import CheckpointCorrupt, ShardedStateError

ROOT = Path(__file__).resolve().parent.parent


def raw(info: tarfile.TarInfo, data: bytes | None = None) -> bytes:
    """One member as tar writes it: its header, then its bytes padded to a block."""
    if data is not None:
        info.size = len(data)
    data = data or b""
    return info.tobuf(tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def archive(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    return b"".join(raw(info, data) for info, data in members) + b"\0" * (2 * tarfile.BLOCKSIZE)


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def listing(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, a link's target, a folder as "/"."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        found[name] = os.readlink(path) if path.is_symlink() else "/" if path.is_dir() else path.read_bytes()
    return found


def pax_path(path: str) -> tarfile.TarInfo:
    """A member whose name comes from a PAX record (which may hold what a header's name field cannot)."""
    info = member("h1/plain")
    info.pax_headers = {"path": path}
    return info


def huge_claim() -> bytes:
    """A member whose header claims a gigabyte the archive does not hold."""
    info = tarfile.TarInfo("h1/big")
    info.size = 1 << 30
    return info.tobuf(tarfile.PAX_FORMAT) + b"z" * tarfile.BLOCKSIZE + b"\0" * (2 * tarfile.BLOCKSIZE)


def shared_bytes() -> bytes:
    """Members whose sizes, from a PAX record their headers did not consume, all reach the end of
    the archive: each within it, together eight times what it holds."""
    heads = []
    for i in range(8):
        info = member(f"h1/m{i}")
        info.pax_headers = {"GNU.sparse.realsize": "0"}
        heads.append(info)
    tail = raw(member("h1/tail"), b"t" * 4096) + b"\0" * (2 * tarfile.BLOCKSIZE)
    length = len(raw(heads[0])) * len(heads) + len(tail)
    for i, info in enumerate(heads):
        info.pax_headers["GNU.sparse.realsize"] = str(length - len(raw(heads[0])) * (i + 1))
    return b"".join(raw(info) for info in heads) + tail


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda: archive([(member("../outside"), b"x")]), "not a plain file inside"),
        (lambda: archive([(member("h1/hard", tarfile.LNKTYPE, "h1/a"), None)]), "not a plain file inside"),
        (lambda: archive([(member("h1/null", tarfile.CHRTYPE), None)]), "not a plain file inside"),
        (lambda: archive([(member("h1/soft", tarfile.SYMTYPE, "/etc/passwd"), None)]), "not a plain file inside"),
        (lambda: archive([(member("h1/fifo", tarfile.FIFOTYPE), None)]), "not a plain file inside"),
        (lambda: archive([(member("h1/dir", tarfile.DIRTYPE), None)]), "not a plain file inside"),
        (lambda: archive([(member("/tmp/absolute"), b"x")]), "not a plain file inside"),
        (lambda: archive([(pax_path("h1/a\0b"), b"x")]), "not a plain file inside"),
        (huge_claim, "past the end of the"),
        (shared_bytes, "more than the .*-byte archive holds"),
    ],
)
def test_a_refused_archive_writes_nothing(tmp_path, bad, message):
    cache = tmp_path / "cache"
    (cache / "h1").mkdir(parents=True)
    (cache / "h1" / "mine").write_bytes(b"the user's")
    before = listing(cache)
    # Good members first: the refusal comes after them in the archive, yet none of them is written.
    data = raw(member("h1/a"), b"aot") + raw(member("h2/b"), b"graph") + bad()
    with pytest.raises(CheckpointCorrupt, match=message):
        sa.restore(data, str(cache))
    assert listing(cache) == before
    assert not (tmp_path / "outside").exists()


@pytest.mark.parametrize("name", ["modelinfos", "modelinfos/."])
def test_a_member_in_the_place_of_a_restored_folder_is_refused(tmp_path, name):
    """Restoring some top-level folders only (``prepare_node``: ``modelinfos``), a member named as
    the folder itself would be a file where vLLM keeps that folder: refused, nothing written."""
    cache = tmp_path / "cache"
    data = archive([(member("modelinfos/a.json"), b"{}"), (member(name), b"{}")])
    with pytest.raises(CheckpointCorrupt, match="not a plain file inside"):
        sa.restore(data, str(cache), [sa.MODEL_INFO_FOLDER])
    assert not cache.exists()


def test_a_link_where_an_artifact_goes_is_never_replaced(tmp_path):
    cache = tmp_path / "cache"
    (cache / "h1").mkdir(parents=True)
    os.symlink(tmp_path / "not-yet", cache / "h1" / "a")  # the user's link, dangling
    assert sa.restore(archive([(member("h1/a"), b"aot"), (member("h1/b"), b"graph")]), str(cache)) == (1, 1)
    assert os.readlink(cache / "h1" / "a") == str(tmp_path / "not-yet")
    assert not (tmp_path / "not-yet").exists() and (cache / "h1" / "b").read_bytes() == b"graph"


def test_a_file_where_a_folder_goes_refuses_the_restore_and_it_removes_what_it_wrote(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "h2").write_bytes(b"the user's file")
    before = listing(cache)
    with pytest.raises(ShardedStateError, match=r"cache: cannot unpack start-up artifacts .*File exists.*h2"):
        sa.restore(archive([(member("h1/deep/a"), b"aot"), (member("h2/b"), b"graph")]), str(cache))
    assert listing(cache) == before


def test_a_folder_that_cannot_be_made_leaves_none_of_those_made_before_it(tmp_path):
    """On a fresh node the cache folder and the member's first folder are made, then its next one
    fails (a name too long; no space, no permission alike): none of them is left."""
    cache = tmp_path / "fresh"
    with pytest.raises(ShardedStateError, match="what this restore wrote was removed"):
        sa.restore(archive([(member("h1/" + "x" * 300 + "/a"), b"aot")]), str(cache))
    assert not cache.exists()


# Run inside a user and mount namespace, on a tmpfs of 256 KiB mounted over the cache folder: a real
# full disk. It prints what the restore said and what the folder holds afterwards.
FULL_DISK = """
import json, os, sys
from vllm_sharded_loader.checkpoint import startup_artifacts as sa
cache = sys.argv[1]
os.makedirs(os.path.join(cache, "h1"))
with open(os.path.join(cache, "h1", "mine"), "wb") as f:
    f.write(b"the user's")
try:
    said = repr(sa.restore(open(sys.argv[2], "rb").read(), cache))
except Exception as e:
    said = f"{type(e).__name__}: {e}"
entries = {os.path.relpath(os.path.join(d, n), cache) for d, ds, fs in os.walk(cache) for n in ds + fs}
print(json.dumps([said, sorted(entries)]))
"""


def test_a_full_disk_during_restore_leaves_the_cache_as_it_was(tmp_path):
    namespace = ["unshare", "--user", "--map-root-user", "--mount"]
    probe = [*namespace, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("no unprivileged user and mount namespace here to mount a small tmpfs in")
    members = [(member(f"h1/part{i}/entry"), os.urandom(100 << 10)) for i in range(4)]  # 400 KiB > 256 KiB
    (tmp_path / "a.tar").write_bytes(archive(members))
    cache = tmp_path / "cache"
    cache.mkdir()
    mount = 'mount -t tmpfs -o size=256k tmpfs "$1" && exec "$2" -c "$3" "$1" "$4"'
    run = [*namespace, "sh", "-c", mount, "sh", str(cache), sys.executable, FULL_DISK, str(tmp_path / "a.tar")]
    done = subprocess.run(
        run, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stderr
    said, entries = json.loads(done.stdout.splitlines()[-1])
    assert said.startswith("ShardedStateError") and "No space left on device" in said, said
    assert "what this restore wrote was removed" in said
    assert entries == ["h1", "h1/mine"]  # no half-written temporary, no entry of the archive


RACER = """
import sys
from vllm_sharded_loader.checkpoint import startup_artifacts as sa
data = open(sys.argv[2], "rb").read()
print(*sa.restore(data, sys.argv[1]))
"""


def test_two_restores_racing_into_one_cache_both_succeed_and_leave_whole_files(tmp_path):
    files = {f"h1/{i % 7}/entry{i}": os.urandom(4096 + i) for i in range(300)}
    (tmp_path / "a.tar").write_bytes(archive([(member(name), data) for name, data in files.items()]))
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(cache), str(tmp_path / "a.tar")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for racer in racers:
        out, err = racer.communicate(timeout=120)
        assert racer.returncode == 0, err
        assert sum(map(int, out.split())) == len(files)  # each file written by it or already there
    assert {name: data for name, data in listing(cache).items() if not isinstance(data, str)} == files


# Writes the entry (only if absent) once the restore's temporary for it appears, and says whether it did.
WRITER = """
import os, sys
folder = sys.argv[1]
print("ready", flush=True)
while not (os.path.isdir(folder) and any(n.endswith(".tmp") for n in os.listdir(folder))):
    if os.path.lexists(os.path.join(folder, "entry")):
        sys.exit("too late")
try:
    with open(os.path.join(folder, "entry"), "xb") as f:
        f.write(b"theirs")
except FileExistsError:
    sys.exit("too late")
"""


def test_a_file_written_while_the_restore_writes_its_entry_is_kept(tmp_path):
    """Another process (this node's compile, a user) writes the entry's name after the restore found
    it absent and before the restore placed it: its file stays, counted as already there."""
    (tmp_path / "a.tar").write_bytes(archive([(member("h1/entry"), b"a" * (32 << 20))]))
    for attempt in range(5):  # the writer must write while the restore writes; retried if it was too late
        cache = tmp_path / f"cache{attempt}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(cache / "h1")], env=env, stdout=subprocess.PIPE)
        assert writer.stdout.readline() == b"ready\n"
        said = sa.restore((tmp_path / "a.tar").read_bytes(), str(cache))
        if writer.wait(timeout=60) == 0:
            break
    assert writer.returncode == 0, "the writer never wrote while the restore wrote"
    assert said == (0, 1) and (cache / "h1" / "entry").read_bytes() == b"theirs"
    assert [p.name for p in (cache / "h1").iterdir()] == ["entry"]


def test_bytes_that_are_no_archive_are_refused_as_corrupt(tmp_path):
    with pytest.raises(CheckpointCorrupt, match="not a tar archive"):
        sa.restore(b"not a tar archive" * 64, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_a_relative_cache_folder_is_made_and_filled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sa.restore(archive([(member("h1/a"), b"aot")]), "cache") == (1, 0)
    assert (tmp_path / "cache" / "h1" / "a").read_bytes() == b"aot"


def test_a_restore_killed_mid_write_leaves_a_temporary_the_next_restore_removes_never_a_live_ones(tmp_path):
    """A restore killed (``SIGKILL``) once an entry's temporary is written and before it is placed
    left that temporary, the entry's size, in vLLM's cache folder for good: no later restore knew
    it. The next restore into the folder now removes it (its writer's ``flock`` is free), and never
    the temporary of a restore that runs (here stopped, ``SIGSTOP``, at the same point), nor a
    file of that shape that is not a regular file."""
    import signal
    import time

    from vllm_sharded_loader.storage import faults

    files = {"h1/entry0": os.urandom(1 << 20), "h1/entry1": os.urandom(1 << 20)}
    (tmp_path / "a.tar").write_bytes(archive([(member(name), data) for name, data in files.items()]))
    cache, fifo = tmp_path / "cache", tmp_path / "cache" / "h1" / ".restore.fifo1234.tmp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), faults.KILL_ENV: "restore.written:2"}
    command = [sys.executable, "-c", RACER, str(cache), str(tmp_path / "a.tar")]
    killed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    dead = [p for p in (cache / "h1").iterdir() if p.name.endswith(".tmp")]
    assert [p.stat().st_size for p in dead] == [1 << 20]  # entry1's temporary, whole, never placed
    os.mkfifo(fifo)  # (of that shape, but no file a restore writes)
    # The next restore, stopped while it holds its own temporary of entry1.
    stopped = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**env, faults.KILL_ENV: "restore.written", faults.KILL_SIGNAL_ENV: "STOP"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        # (Stopped at the kill point, its temporary written: SIGCONT before its own SIGSTOP would be lost.)
        while Path(f"/proc/{stopped.pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
            assert stopped.poll() is None and time.monotonic() < deadline, "the next restore never stopped"
            time.sleep(0.01)
        live = set((cache / "h1").glob(".restore.*.tmp")) - {*dead, fifo}
        assert len(live) == 1, live
        assert not dead[0].exists()  # the dead restore's temporary: removed by the next restore
        # A third restore, while the second holds its temporary: it is left alone.
        assert sa.restore((tmp_path / "a.tar").read_bytes(), str(cache)) == (1, 1)
        assert all(p.exists() for p in live) and fifo.exists()
    finally:
        stopped.send_signal(signal.SIGCONT)
        out, _ = stopped.communicate(timeout=60)
    assert stopped.returncode == 0 and out.split() == ["0", "2"]  # (entry1 placed by the third meanwhile)
    assert {p.name for p in (cache / "h1").iterdir()} == {"entry0", "entry1", fifo.name}
    assert all((cache / name).read_bytes() == data for name, data in files.items())
