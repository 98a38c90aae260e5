"""Issue 34, class 3: a save lock's owner is decided by its ``flock``, not by host names or process ids.

A save killed in another UTS and PID namespace (another "node" of a shared folder, a
container restarted with a new PID namespace) leaves a lock naming a host and pid that mean
nothing here; its ``flock`` is free, so the next save with overwrite takes it over and
publishes. A live owner in such a namespace is never taken over. Where a mount's ``flock``
is not shared between hosts, a free ``flock`` proves nothing: the save says so and refuses.
Real processes, real namespaces (``unshare``, as root, like tests/support/nodes.py), real kills.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.states import load, save
from vllm_sharded_loader.checkpoint.verify import verify_checkpoint
from vllm_sharded_loader.format.errors import CheckpointLocked, ShardedStateError
from vllm_sharded_loader.format.names import LOCK_NAME
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.lock import flock_problem, owner_is_alive, read_lock, save_is_running


def snapshot(directory: Path) -> dict[str, str]:
    """Every file's content hash: a refused save must leave the directory as it was."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


# A save in its own UTS and PID namespaces (hostname "elsewhere", pid 1 there) that holds the
# lock of ``directory`` and stages its first rank, then waits (killed there by the test, or
# by its kill point).
SAVER = textwrap.dedent(
    """
    import os, sys, time
    import vllm_sharded_loader.checkpoint.save as save
    from tests.support.states import save as save_states
    stage = save.stage_rank
    def stage_and_wait(*args, **kwargs):
        staged = stage(*args, **kwargs)
        print("STAGED", os.getpid(), flush=True)
        time.sleep(3600)
    save.stage_rank = stage_and_wait
    save_states({directory!r}, overwrite=True)
    """
)


def namespaces_available() -> bool:
    return (
        os.geteuid() == 0
        and shutil.which("unshare") is not None
        and subprocess.run(["unshare", "--uts", "--pid", "--fork", "true"], capture_output=True).returncode == 0
    )


needs_namespaces = pytest.mark.skipif(
    not namespaces_available(), reason="another UTS and PID namespace needs unshare, as root"
)


def start_elsewhere(directory: Path) -> subprocess.Popen:
    """A save of ``directory`` on "another node": its own hostname and PID namespace; returns once it staged."""
    code = SAVER.format(directory=str(directory))
    proc = subprocess.Popen(
        [
            "unshare",
            "--uts",
            "--pid",
            "--fork",
            "sh",
            "-c",
            f'hostname elsewhere && exec {sys.executable} -c "$0"',
            code,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    line = proc.stdout.readline()
    assert line.startswith("STAGED"), (line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
    return proc


def kill(proc: subprocess.Popen, directory: Path) -> None:
    """SIGKILL the save and everything in its namespace; returns once the kernel has let go of its lock."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    # unshare is reaped first; its child (pid 1 of the namespace) dies a moment later.
    deadline = time.monotonic() + 60
    while save_is_running(str(directory)):
        assert time.monotonic() < deadline, "the killed save still holds its flock"
        time.sleep(0.05)


@needs_namespaces
def test_dead_owner_from_another_uts_and_pid_namespace_is_taken_over(tmp_path):
    directory = tmp_path / "ckpt"
    save(directory)
    proc = start_elsewhere(directory)
    try:
        holder = read_lock(str(directory))
        # What the lock names means nothing here: another host, and pid 1 of another namespace.
        assert holder is not None and holder["host"] == "elsewhere" and holder["pid"] == 1
        assert save_is_running(str(directory))
    finally:
        kill(proc, directory)
    assert not save_is_running(str(directory))
    # Without overwrite the interrupted save is named, and nothing changes.
    before = snapshot(directory)
    with pytest.raises(CheckpointLocked, match=r"pid 1 on elsewhere.*was interrupted. Save again with overwrite"):
        save(directory, overwrite=False)
    assert snapshot(directory) == before
    # The next save allowed to take it over does, publishes, and removes the dead save's staged files.
    save(directory, tp_size=1, overwrite=True)
    assert not (directory / LOCK_NAME).exists()
    assert verify_checkpoint(open_store(str(directory))) == []
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".")) == []
    load(directory, tp_size=1)


@needs_namespaces
def test_live_owner_in_another_namespace_is_never_taken_over(tmp_path):
    directory = tmp_path / "ckpt"
    save(directory)
    proc = start_elsewhere(directory)
    try:
        before = snapshot(directory)
        for _ in range(2):  # overwrite or not, a running save keeps its lock
            with pytest.raises(CheckpointLocked, match=r"pid 1 on elsewhere.*wait for it to finish"):
                save(directory, overwrite=True)
        assert snapshot(directory) == before
        assert proc.poll() is None
        assert read_lock(str(directory))["host"] == "elsewhere"
    finally:
        kill(proc, directory)
    save(directory, overwrite=True)
    assert verify_checkpoint(open_store(str(directory))) == []


# /proc/self/mountinfo lines: (mount id, parent, dev, root, point, options, [optional,] -, type, source, super options)
MOUNTINFO = textwrap.dedent(
    """\
    22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw
    30 22 0:40 / /shared rw,relatime - nfs4 server:/export rw,vers=4.2,local_lock=none
    31 22 0:41 / /nolock rw,relatime - nfs server:/export rw,vers=3,nolock,local_lock=all
    32 22 0:42 / /flocklocal rw,relatime - nfs4 server:/export rw,vers=4.1,local_lock=flock
    33 22 0:43 / /smb rw,relatime - cifs //srv/share rw,nobrl
    34 22 0:44 / /bucket rw,nosuid shared:5 - fuse.gcsfuse bucket rw,user_id=0
    35 22 0:45 / /with\\040space rw - nfs server:/x rw,nolock
    """
)


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("/", None),
        ("/data/ckpt", None),
        ("/shared/ckpt", None),  # NFSv4 keeps flock across its clients
        ("/sharedx/ckpt", None),  # not under /shared
        ("/nolock/ckpt", "nfs mount with nolock"),
        ("/flocklocal", "nfs4 mount with local_lock=flock"),
        ("/smb/a/b", "cifs mount with nobrl"),
        ("/bucket/ckpt", "FUSE mount (fuse.gcsfuse)"),
        ("/with space/ckpt", "nfs mount with nolock"),
    ],
)
def test_mounts_whose_flock_is_not_shared_are_named(path, problem):
    found = flock_problem(path, MOUNTINFO)
    assert (found is None) if problem is None else (problem in found), found


def test_a_free_lock_on_a_mount_without_shared_flock_is_not_taken_over(tmp_path, monkeypatch):
    """Where flock is each host's own, a free flock may hide a save on another host: refuse, say why and what to do."""
    from vllm_sharded_loader.storage import lock as lock_module

    directory = tmp_path / "ckpt"
    save(directory)
    (directory / LOCK_NAME).write_text('{"pid": 12345, "host": "node-7", "token": "dead0000beef", "started": 0}')
    before = snapshot(directory)
    # This machine's mounts are real; the mount table is the one thing stood in for (an NFS
    # mount with nolock cannot be made here), read by the same parser as /proc/self/mountinfo.
    mountinfo = f"22 1 0:21 / / rw - ext4 /dev/sda1 rw\n40 22 0:50 / {tmp_path} rw - nfs server:/x rw,vers=3,nolock\n"
    monkeypatch.setattr(lock_module, "flock_problem", lambda d, m=None: flock_problem(d, mountinfo))
    with pytest.raises(CheckpointLocked, match=r"nfs mount with nolock.*cannot be told. If no save runs, remove"):
        save(directory, overwrite=True)
    assert snapshot(directory) == before
    assert lock_module.save_is_running(str(directory))
    assert owner_is_alive(str(directory), "dead0000beef") is False  # no marker: nothing to keep


def test_a_lock_without_flock_whose_pid_runs_here_is_still_judged_by_its_flock(tmp_path):
    """An older version's lock names pid 1 of this host (alive): its free flock decides, not the pid."""
    assert issubclass(CheckpointLocked, ShardedStateError)
    directory = tmp_path / "ckpt"
    save(directory)
    (directory / LOCK_NAME).write_text(f'{{"pid": 1, "host": "{socket.gethostname()}"}}')
    with pytest.raises(CheckpointLocked, match="interrupted \\(or is one of an older version\\)"):
        save(directory, overwrite=False)
    save(directory, overwrite=True)
    assert verify_checkpoint(open_store(str(directory))) == []


# A live process that holds the flock of the file it is given, and says so.
HOLD_FLOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("HELD", flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("pid", [10**30, -(10**30)])
def test_a_live_lock_naming_a_pid_that_is_no_process_is_refused_by_name(tmp_path, pid):
    """A lock whose flock a live process holds, naming this host and a pid past C's long (10**30):
    naming its holder called ``os.kill(pid, 0)``, whose bare OverflowError took the place of
    CheckpointLocked."""
    directory = tmp_path / "ckpt"
    save(directory)
    before = snapshot(directory)
    lock = directory / LOCK_NAME
    written = f'{{"pid": {pid}, "host": "{socket.gethostname()}", "token": "ab12", "started": 0}}'
    lock.write_text(written)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_FLOCK, str(lock)], stdout=subprocess.PIPE, text=True
    )  # a live process holding the lock's flock
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(CheckpointLocked, match=rf"another save holds {lock} \(pid {pid} on .*wait for it"):
            save(directory, overwrite=True)
    finally:
        holder.kill()
        holder.wait()
    assert lock.read_text() == written
    assert snapshot(directory) == before | {LOCK_NAME: hashlib.sha256(written.encode()).hexdigest()}


# What a save killed while it took its lock leaves: its lock written and flocked under the staging
# name, killed (SIGKILL, as the OOM killer does) before it linked that name as the lock.
KILLED_TAKING_THE_LOCK = """
import fcntl, json, os, signal, socket, sys, time
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
info = {"pid": os.getpid(), "host": socket.gethostname(), "token": sys.argv[2], "started": time.time()}
os.write(fd, json.dumps(info).encode())
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_lock_staging_name_left_by_a_killed_save_goes_with_the_next_save_and_a_live_one_stays(tmp_path):
    """A save killed after creating ``.sharded_state.lock.<token>.new``, before linking it as the lock,
    left that hidden file for good: no later save removed it. The next save's cleanup now does, its
    flock being free; one whose save holds its flock (taking the lock this moment) stays."""
    import fcntl

    directory = tmp_path / "ckpt"
    save(directory)
    dead = directory / f"{LOCK_NAME}.{'d' * 32}.new"
    killed = subprocess.run([sys.executable, "-c", KILLED_TAKING_THE_LOCK, str(dead), "d" * 32], timeout=60)
    assert killed.returncode == -signal.SIGKILL and dead.exists()
    live = directory / f"{LOCK_NAME}.{'a' * 32}.new"
    fd = os.open(live, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        save(directory)
        assert not dead.exists() and live.exists()
        assert verify_checkpoint(open_store(str(directory))) == []
    finally:
        os.close(fd)
    save(directory)
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".")) == []
