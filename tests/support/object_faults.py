"""An object-storage save stopped at each step of its protocol, the same on every store the tests run
(SeaweedFS for S3 in ``tests/test_s3.py``, Azurite for Azure in ``tests/test_cloud_faults.py``).

A save of A publishes; a save of B over it, in another process, is stopped at one kill point
(``vllm_sharded_loader/storage/faults.py``) by Ctrl-C or ``SIGKILL``; a save of C then runs. Each
store's test gives a :class:`Bucket`: how to read all of it, put a user's object and list a prefix.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.engines import ROOT, package_process
from tests.support.faultkit import assert_published, carried_of, model_folder
from tests.support.stores import load_from
from vllm_sharded_loader.checkpoint import read_manifest
from vllm_sharded_loader.checkpoint.verify import verify_checkpoint
from vllm_sharded_loader.format.names import LOCK_NAME, MANIFEST_NAME
from vllm_sharded_loader.storage import faults, object_lock, objects
from vllm_sharded_loader.storage.location import open_store

BEFORE_PUBLISH = ("s3.locked", "s3.recorded", "s3.uploaded", "s3.uploaded:3", "s3.fencing", "local.carried")
AFTER_PUBLISH = ("s3.published", "s3.cleaned")
# The steps at which the save's local staging folder exists (it is removed before the carried files are put).
WHILE_STAGED = ("s3.recorded", "s3.uploaded", "s3.uploaded:3")
SAVER = """
import sys
from tests.support.states import SOURCE
from tests.support.faultkit import states
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.storage.location import open_store
save_checkpoint(sys.argv[1], states(float(sys.argv[2])), dtype="float32", source=SOURCE,
                options=SaveOptions(max_size=8192, overwrite=True, carry=open_store(sys.argv[3])))
"""


@dataclass
class Bucket:
    """One store under test, as the kill tests see it."""

    #: Every object of the bucket or container, all prefixes (and unfinished uploads), to a digest.
    digest: Callable[[], dict[str, str]]
    #: Put a user's object under a key.
    put: Callable[[str, bytes], None]
    #: The names under a checkpoint's URL.
    names: Callable[[str], list[str]]


def _saver(url: str, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess]:
    def save(value: float, env: dict | None = None) -> subprocess.CompletedProcess:
        return package_process(["-c", SAVER, url, str(value), str(model_folder(tmp_path, value))], env)

    return save


def interrupted_save_loses_nothing(bucket: Bucket, url: str, kill_at: str, staging_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT: a KeyboardInterrupt raised there, where every ``except`` of the save runs) at
    ``kill_at``: before the manifest's put the store is as it was, A published and the lock released;
    from the put on, B is published and whole (nothing of it taken back), and the next save needs
    no lock deleted by hand before it."""
    save = _saver(url, tmp_path)
    assert save(1.0).returncode == 0
    before = bucket.digest()
    stopped = save(2.0, {faults.KILL_ENV: kill_at, faults.KILL_SIGNAL_ENV: "INT"})
    assert stopped.returncode != 0 and "KeyboardInterrupt" in stopped.stderr, (kill_at, stopped.stderr[-2000:])
    assert list(staging_dir.iterdir()) == []
    if kill_at in BEFORE_PUBLISH:
        assert bucket.digest() == before
        assert_published(url, 1.0)
    else:
        assert_published(url, 2.0)  # A's parts stay until a cleanup: verify names them as left over
        assert [p for p in verify_checkpoint(open_store(url)) if "does not list" not in p and LOCK_NAME not in p] == []
        object_lock.release_lock(objects.ObjectPrefix.parse(url))  # object storage cannot tell a dead save's lock
    again = save(3.0)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_published(url, 3.0)
    assert verify_checkpoint(open_store(url)) == []


def killed_save_loses_nothing(bucket: Bucket, url: str, kill_at: str, staging_dir: Path, tmp_path: Path) -> None:
    """SIGKILL at ``kill_at``: before the manifest's put, A is published and every object of it is
    unchanged; from it on, B is. Nothing outside the prefix changes. Once the dead save's lock is
    deleted (object storage cannot tell a dead save from a slow one), the next save publishes and
    leaves no stray part, upload record or lock, no local staging folder, and the user's object."""
    where = objects.ObjectPrefix.parse(url)
    save = _saver(url, tmp_path)
    assert save(1.0).returncode == 0
    assert list(staging_dir.iterdir()) == []
    bucket.put(where.key("notes.txt"), b"the user's own")
    before = bucket.digest()
    a_objects = {k: v for k, v in before.items() if k.startswith(where.prefix)}
    killed = save(2.0, {faults.KILL_ENV: kill_at})
    assert killed.returncode == -signal.SIGKILL, (kill_at, killed.returncode, killed.stderr[-2000:])
    # Killed while its parts were staged (they are uploaded from there), it leaves its folder.
    assert len(list(staging_dir.iterdir())) == (kill_at in WHILE_STAGED)
    after = bucket.digest()
    outside = lambda d: {k: v for k, v in d.items() if not k.startswith(where.prefix)}  # noqa: E731
    assert outside(after) == outside(before)
    if kill_at in BEFORE_PUBLISH:
        if kill_at != "local.carried":  # the carried objects are put one by one just before the manifest
            assert {k: after.get(k) for k in a_objects} == a_objects
        assert_published(url, 1.0)
    else:
        assert_published(url, 2.0)
    # The dead save's lock and parts are notes, not problems of the published checkpoint (they were
    # "a part that the manifest does not list ... Remove it": removing them under a running save
    # breaks its publish, and object storage cannot tell a dead save from a running one).
    notes: list[str] = []
    problems = verify_checkpoint(open_store(url), notes=notes)
    if kill_at != "local.carried":  # (there, the config of A's record is B's now: a real problem)
        assert problems == [] and any(LOCK_NAME in n and "died holding it" in n for n in notes), (problems, notes)
    object_lock.release_lock(where)
    again = save(3.0)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_published(url, 3.0)
    assert list(staging_dir.iterdir()) == []
    manifest = read_manifest(url)
    listed = {f.name for e in manifest.ranks for f in e.files}
    names = set(bucket.names(url))
    assert {n for n in names if n.endswith(".safetensors")} == listed
    assert not [n for n in names if n.startswith(".")], names  # no upload record, lock or staged object
    assert {"notes.txt", MANIFEST_NAME, *carried_of(3)} <= names
    assert verify_checkpoint(open_store(url)) == []
    assert {n: objects.read_object(where, n).decode() for n in carried_of(3)} == carried_of(3)


def assert_the_save_published(url: str, new, model, names: Callable[[str], list[str]]) -> None:
    """The save that returned the manifest ``new`` published it, whatever answers it lost: the
    checkpoint is whole and loads ``model``'s tensors, and the prefix holds its parts and manifest
    alone (no lock, no upload record)."""
    import torch

    assert read_manifest(url) == new
    assert verify_checkpoint(open_store(url)) == []
    _, targets, expected = load_from(url, model, 1)
    assert all(torch.equal(targets[n], x) for n, x in expected.items())
    assert names(url) == sorted({f.name for e in new.ranks for f in e.files} | {MANIFEST_NAME})


def stopped_save_leaves_a_record_of_the_other_models_files(url: str, tmp_path: Path) -> None:
    """As in a folder (tests/test_save_faults.py): model 1 saved over model 2's checkpoint, stopped
    once its manifest is put, leaves model 2's chat template; the manifest recorded it, verify names
    it, and the next save removes it."""
    save = _saver(url, tmp_path)
    assert save(2.0).returncode == 0
    stopped = save(1.0, {faults.KILL_ENV: "s3.published", faults.KILL_SIGNAL_ENV: "INT"})
    assert stopped.returncode != 0 and "KeyboardInterrupt" in stopped.stderr, stopped.stderr[-2000:]
    assert_published(url, 1.0)
    assert read_manifest(url).stale_files == ("chat_template.jinja",)
    named = [p for p in verify_checkpoint(open_store(url)) if "chat_template.jinja" in p]
    assert len(named) == 1 and "carried by the checkpoint this one replaced" in named[0], named
    object_lock.release_lock(objects.ObjectPrefix.parse(url))
    assert save(1.0).returncode == 0
    assert_published(url, 1.0)
    assert verify_checkpoint(open_store(url)) == []
    assert "chat_template.jinja" not in objects.list_names(objects.ObjectPrefix.parse(url))


def stalled_save_whose_lock_was_taken_over_does_not_publish(url: str, tmp_path: Path) -> None:
    """Save X stalls (SIGSTOP) in its publish once it has read the manifest it replaces; its lock is
    deleted by hand, as for a dead save, and save Y takes the prefix and publishes; then X resumes.
    X read the manifest it replaces after Y published and put its own over Y's, whose parts its
    clean-up then deleted; now it fails, and Y's checkpoint stays published and whole."""
    import os
    import sys

    save = _saver(url, tmp_path)
    assert save(1.0).returncode == 0
    env = {**os.environ, faults.KILL_ENV: "s3.fencing", faults.KILL_SIGNAL_ENV: "STOP"}
    code = ["-c", SAVER, url, "3.0", str(model_folder(tmp_path, 3.0))]
    stalled = subprocess.Popen([sys.executable, *code], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        while not _stopped(stalled.pid):
            assert stalled.poll() is None, stalled.stderr.read()[-2000:]
            time.sleep(0.05)
        object_lock.release_lock(objects.ObjectPrefix.parse(url))  # "delete the lock of a save that died"
        assert save(2.0).returncode == 0
        os.kill(stalled.pid, signal.SIGCONT)
        _, err = stalled.communicate(timeout=120)
    finally:
        stalled.kill()
    assert stalled.returncode != 0 and "lock was deleted while it ran; it does not publish" in err, err[-2000:]
    assert_published(url, 2.0)
    assert verify_checkpoint(open_store(url)) == []


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"
