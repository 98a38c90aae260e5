"""A local save killed at every step of its protocol, or starved of disk: nothing is ever lost.

Each test saves checkpoint A, then runs a real save of checkpoint B over it in another
process and makes that process die (``SIGKILL`` at a named kill point of
``vllm_sharded_loader.storage.faults``) or fail (a full file system). Whatever the step,
exactly one of A and B is published, bit-exact and verified: A before the manifest's
rename, B from it on. Files that are not ours, in the directory and beside it, are
byte-identical (``tests/support/faultkit.py: tree_digest``), and the next save cleans up after
the dead one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.support.engines import package_process
from tests.support.faultkit import assert_published, carried_of, model_folder, save_states, states, tree_digest
from tests.support.states import SOURCE
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest, verify_checkpoint
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
from vllm_sharded_loader.format import LOCK_NAME, MANIFEST_NAME
from vllm_sharded_loader.format.errors import (
    CheckpointLocked,
    CheckpointNotFound,
    InvalidOption,
    SaveFailedAfterPublish,
    SaveRefused,
)
from vllm_sharded_loader.format.names import is_staged_name
from vllm_sharded_loader.storage import faults
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.lock import acquire_save_lock, release_save_lock

# Steps before the manifest's rename leave A published; from it on, B.
BEFORE_PUBLISH = (
    "local.locked",
    "local.staged",
    "local.placed",
    "local.manifest_written",
    "local.backed_up",
    "local.carried",
)
AFTER_PUBLISH = ("local.published", "local.cleaning", "local.cleaned")
# Steps reached more than once (per rank, per part, per removed file) are also killed the second time.
REPEATED = ("local.staged:2", "local.placed:2", "local.placed:4", "local.carried:2", "local.cleaning:2")
# The one step that is not atomic with the manifest: changed config and tokenizer files are
# renamed into place one by one between the manifest's fsync and its rename. A kill between leaves A's parts (whole, and
# verified) beside some of B's non-weight files: a load then refuses the config loudly
# (its hash is in the manifest), and the next save puts everything right.
CARRIED = ("local.carried", "local.carried:2", "local.backed_up")


SAVER = textwrap.dedent(
    """
    import sys, torch
    from tests.support.states import SOURCE
    from tests.support.faultkit import states
    from vllm_sharded_loader.checkpoint.save import RankHooks, SaveOptions, save_checkpoint
    from vllm_sharded_loader.storage.location import open_store
    carry = {carry!r}
    save_checkpoint(
        {directory!r}, states({value}), dtype="float32", source=SOURCE,
        options=SaveOptions(max_size=8192, overwrite=True, carry=None if carry is None else open_store(carry)),
        hooks=RankHooks(parallel={parallel!r}),
    )
    """
)


def save_in_process(
    directory: Path, value: float, env: dict[str, str] | None = None, parallel: bool = False
) -> subprocess.CompletedProcess:
    """Save ``value``'s states over ``directory`` in another process (``parallel``: the ranks staged
    at once, one thread each, as ``convert`` stages them)."""
    carry = str(model_folder(directory.parent, value))
    code = SAVER.format(directory=str(directory), value=value, carry=carry, parallel=parallel)
    return package_process(["-c", code], env, timeout=120)


def listed(directory: Path) -> set[str]:
    manifest = read_manifest(str(directory))
    return {f.name for entry in manifest.ranks for f in entry.files} | {MANIFEST_NAME}


def assert_carried(directory: Path, value: float) -> None:
    for name, text in carried_of(value).items():
        assert (directory / name).read_text() == text, (name, value)


@pytest.fixture
def checkpoint_a(tmp_path: Path) -> tuple[Path, Path]:
    """Checkpoint A, a foreign file inside it, and a neighbour folder beside it."""
    directory, neighbour = tmp_path / "ckpt", tmp_path / "neighbour"
    save_states(str(directory), 1.0, max_size=8192, carry=str(model_folder(tmp_path, 1)))
    assert_carried(directory, 1.0)
    (directory / "notes.txt").write_text("the user's own file")
    neighbour.mkdir()
    (neighbour / "model-rank-0-part-9.safetensors").write_bytes(b"not ours")
    return directory, neighbour


def test_every_local_kill_point_is_covered():
    """A kill point added to the protocol without a place in these tests fails here."""
    local = {step for step in faults.KILL_POINTS if step.startswith("local.")}
    assert local == set(BEFORE_PUBLISH) | set(AFTER_PUBLISH)


@pytest.mark.parametrize("kill_at", [*BEFORE_PUBLISH, *AFTER_PUBLISH, *REPEATED])
def test_save_killed_at_each_step_loses_nothing(checkpoint_a, kill_at):
    directory, neighbour = checkpoint_a
    before, beside = tree_digest(str(directory)), tree_digest(str(neighbour))
    a_files = listed(directory)

    result = save_in_process(directory, 2.0, {faults.KILL_ENV: kill_at})
    assert result.returncode == -signal.SIGKILL, (kill_at, result.returncode, result.stderr[-2000:])

    after = tree_digest(str(directory))
    assert tree_digest(str(neighbour)) == beside
    assert after["notes.txt"] == before["notes.txt"]
    if kill_at.partition(":")[0] in BEFORE_PUBLISH:
        # A is published, and each of its files is byte-identical.
        assert {n: after.get(n) for n in a_files} == {n: before[n] for n in a_files}
        assert_published(directory, 1.0)
        # verify finds only the dead save's leftovers, nothing wrong with A's files.
        assert not [p for p in verify_checkpoint(open_store(str(directory))) if any(f"/{n}:" in p for n in a_files)]
        if kill_at not in CARRIED:
            assert_carried(directory, 1.0)
            assert not (directory / "chat_template.jinja").exists()
    else:
        assert_published(directory, 2.0)
        assert_carried(directory, 2.0)
    # Anything else left is the dead save's own: its lock, staged or placed files, A's old parts,
    # and, killed while carrying, the non-weight files it placed.
    for name in set(after) - set(before) - listed(directory):
        assert name == LOCK_NAME or is_staged_name(name) or name.startswith("model-rank-") or name in carried_of(2), (
            name
        )

    # The next save takes the dead save's lock over and leaves nothing of it behind.
    again = save_in_process(directory, 3.0)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_published(directory, 3.0)
    assert_carried(directory, 3.0)
    assert verify_checkpoint(open_store(str(directory))) == []
    assert sorted(tree_digest(str(directory))) == sorted(listed(directory) | {"notes.txt", "tok"} | set(carried_of(3)))
    assert tree_digest(str(directory))["notes.txt"] == before["notes.txt"]
    assert tree_digest(str(neighbour)) == beside


FAILS_AFTER_PUBLISH = textwrap.dedent(
    """
    import errno, os, signal, sys
    from tests.support.faultkit import states
    from tests.support.states import SOURCE
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    from vllm_sharded_loader.format.errors import SaveFailedAfterPublish

    def fail(*_):  # the error an fsync of the folder gives after the manifest's rename (EIO)
        raise OSError(errno.EIO, "Input/output error")

    signal.signal(signal.SIGUSR1, fail)
    directory, options = sys.argv[1], SaveOptions(max_size=8192, overwrite=True)
    try:
        save_checkpoint(directory, states(2.0), dtype="float32", source=SOURCE, options=options)
    except SaveFailedAfterPublish as e:
        print("failed after its publish:", e)
    os.environ.pop("SHARDED_STATE_KILL_AT")
    print("lock left:", os.path.exists(os.path.join(directory, "sharded_state.lock")))
    save_checkpoint(directory, states(3.0), dtype="float32", source=SOURCE, options=options)
    print("saved again")
    """
)


def test_a_save_killed_after_placing_never_completes_the_published_checkpoint_with_its_parts(checkpoint_a):
    """A's rank-0 files are missing (a copy cut short): A is refused. B's parts took "fresh" names from
    the folder's listing only, so its rank 0 got exactly the names A lists for the missing files; killed
    once they were placed, B left A's manifest finding every file at its size and header, and a load
    (verify="size", the default) served B's rank 0 beside A's rank 1. The names the published manifest
    lists are taken, there or not."""
    directory, _ = checkpoint_a
    a = read_manifest(str(directory))
    for f in a.ranks[0].files:
        (directory / f.name).unlink()
    killed = save_in_process(directory, 2.0, {faults.KILL_ENV: f"local.placed:{len(a.ranks[0].files)}"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert read_manifest(str(directory)).to_json() == a.to_json()  # A is still the published one
    assert not any((directory / f.name).exists() for f in a.ranks[0].files)  # and still incomplete
    info, tensors = next(iter(states(1.0).items()))
    with pytest.raises(CheckpointNotFound, match=r"model-rank-0-part-0.safetensors: listed in .* but missing"):
        load_rank(
            LoadRequest(open_store(str(directory)), a, serving=SOURCE),
            {n: torch.zeros_like(t) for n, t in tensors.items()},
            info,
        )
    again = save_in_process(directory, 3.0)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_published(directory, 3.0)


def test_verify_notes_a_file_a_save_placed_before_it_died_unpublished(checkpoint_a):
    """B, killed once it placed its chat template (A lacks one) and before its manifest: A stays
    published, with B's template beside it, which no manifest records and a server reads. verify
    passed it without a word; it now names it in a note (it may be the user's: never a problem)."""
    directory, _ = checkpoint_a
    result = save_in_process(directory, 2.0, {faults.KILL_ENV: "local.carried"})
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert_published(directory, 1.0)
    assert (directory / "chat_template.jinja").exists()
    notes: list[str] = []
    verify_checkpoint(open_store(str(directory)), notes=notes)
    named = [n for n in notes if "chat_template.jinja" in n]
    assert len(named) == 1 and "are not among the files its save carried" in named[0], notes
    assert "notes.txt" in named[0]  # the user's own file too: only the user can tell


SHORT_LOCK = textwrap.dedent(
    """
    import resource, sys
    from tests.support.faultkit import states
    from tests.support.states import SOURCE
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    from vllm_sharded_loader.format.errors import SaveRefused

    resource.setrlimit(resource.RLIMIT_FSIZE, (50, resource.RLIM_INFINITY))  # less than the lock's JSON
    try:
        save_checkpoint(sys.argv[1], states(2.0), dtype="float32", source=SOURCE,
                        options=SaveOptions(max_size=8192, overwrite=True))
    except SaveRefused as e:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # (stdout)
        print("refused:", e)
    """
)


def test_a_lock_file_cut_short_by_a_file_size_limit_refuses_the_save_and_is_taken_back(checkpoint_a):
    """The lock's holder record written short (RLIMIT_FSIZE; a full disk) went unnoticed: the lock
    read back as no one's, the save ended with a bare StopIteration and left the lock behind."""
    directory, _ = checkpoint_a
    before = tree_digest(str(directory))
    result = package_process(["-c", SHORT_LOCK, str(directory)], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"refused: {directory}: taking the save lock {directory / LOCK_NAME} failed: "), (
        result.stdout
    )
    assert "the lock file took 50 of" in result.stdout and "any previous checkpoint there is intact" in result.stdout
    assert tree_digest(str(directory)) == before
    assert_published(directory, 1.0)


def test_an_error_right_after_the_publish_releases_the_lock_for_the_next_save_of_the_process(checkpoint_a):
    """An error once the manifest is renamed (an fsync of the folder failing: here raised at the
    kill point just after the rename) fails the save as published, and released neither the lock file
    nor its flock: every later save of the process (an engine's) was refused as another's."""
    directory, _ = checkpoint_a
    env = {faults.KILL_ENV: "local.published", faults.KILL_SIGNAL_ENV: "USR1"}
    result = package_process(["-c", FAILS_AFTER_PUBLISH, str(directory)], env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[1:] == ["lock left: False", "saved again"], result.stdout
    assert "the new checkpoint is published and complete" in result.stdout.splitlines()[0]
    assert_published(directory, 3.0)
    assert verify_checkpoint(open_store(str(directory))) == []


@pytest.mark.parametrize("kill_at", ["local.published", "local.cleaning"])
def test_a_save_killed_before_its_clean_up_leaves_a_record_of_the_other_models_files(tmp_path, kill_at):
    """Model 2's checkpoint carries a chat template that model 1 lacks. A save of model 1 over it,
    killed once its manifest is out and before its clean-up removed the template, leaves it beside
    model 1's weights, where a server would read it. The new manifest recorded it before the publish:
    verify names it, reshard refuses to copy it, the interrupt's message names it, and the next save
    removes it, even after a second save killed the same way (the record carries over)."""
    from vllm_sharded_loader.format.errors import CheckpointCorrupt, InterruptedAfterPublish
    from vllm_sharded_loader.tools.cli import _after_interrupt
    from vllm_sharded_loader.tools.offline import reshard_checkpoint

    directory = tmp_path / "ckpt"
    save_states(str(directory), 2.0, carry=str(model_folder(tmp_path, 2)))
    for _ in range(2):
        result = save_in_process(directory, 1.0, {faults.KILL_ENV: kill_at})
        assert result.returncode == -signal.SIGKILL, (kill_at, result.returncode, result.stderr[-2000:])
        assert_published(directory, 1.0)
        assert (directory / "chat_template.jinja").exists()
        assert read_manifest(str(directory)).stale_files == ("chat_template.jinja",)
        named = [p for p in verify_checkpoint(open_store(str(directory))) if "chat_template.jinja" in p]
        assert len(named) == 1 and "carried by the checkpoint this one replaced" in named[0], named
        with pytest.raises(CheckpointCorrupt, match=r"chat_template\.jinja: carried by the checkpoint this one"):
            reshard_checkpoint(open_store(str(directory)), str(tmp_path / "copy"), 1)
        assert not (tmp_path / "copy").exists()
        stopped = InterruptedAfterPublish(str(directory), open_store(str(directory)))
        assert "(chat_template.jinja)" in _after_interrupt(stopped)

    assert save_in_process(directory, 1.0).returncode == 0
    assert not (directory / "chat_template.jinja").exists()
    assert_carried(directory, 1.0)
    assert verify_checkpoint(open_store(str(directory))) == []
    stopped = InterruptedAfterPublish(str(directory), open_store(str(directory)))
    assert "chat_template" not in _after_interrupt(stopped)


@pytest.mark.parametrize("kill_at", [*BEFORE_PUBLISH, *AFTER_PUBLISH])
def test_save_interrupted_at_each_step_loses_nothing(checkpoint_a, kill_at):
    """Ctrl-C (SIGINT: a KeyboardInterrupt raised there) at each step, where every ``except`` of
    the save runs: before the publish, A stays published and whole and the save takes back all it
    wrote; from the publish on, B is published and whole (nothing of it taken back)."""
    directory, neighbour = checkpoint_a
    before, beside = tree_digest(str(directory)), tree_digest(str(neighbour))
    result = save_in_process(directory, 2.0, {faults.KILL_ENV: kill_at, faults.KILL_SIGNAL_ENV: "INT"})
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr, (kill_at, result.stderr[-2000:])
    assert tree_digest(str(neighbour)) == beside
    if kill_at in BEFORE_PUBLISH:
        assert tree_digest(str(directory)) == before
        assert_published(directory, 1.0)
        assert_carried(directory, 1.0)
    else:
        assert_published(directory, 2.0)
        assert_carried(directory, 2.0)
        assert [p for p in verify_checkpoint(open_store(str(directory))) if "NOTE" not in p] == []
    again = save_in_process(directory, 3.0)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_published(directory, 3.0)
    assert verify_checkpoint(open_store(str(directory))) == []


def test_a_save_interrupted_after_carrying_a_file_into_a_new_subfolder_removes_the_folder(tmp_path):
    """A over a model without ``tok/``, then Ctrl-C once B's ``tok/vocab.txt`` was placed: the file was
    taken back, but the ``tok`` folder the save made for it stayed in A's checkpoint."""
    directory, model = tmp_path / "ckpt", model_folder(tmp_path, 1.0)
    (model / "tok" / "vocab.txt").unlink()
    (model / "tok").rmdir()
    save_states(str(directory), 1.0, carry=str(model))
    before = tree_digest(str(directory))
    # B's changed files in order: chat_template.jinja, config.json, tok/vocab.txt.
    result = save_in_process(directory, 2.0, {faults.KILL_ENV: "local.carried:3", faults.KILL_SIGNAL_ENV: "INT"})
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr, result.stderr[-2000:]
    assert tree_digest(str(directory)) == before
    assert verify_checkpoint(open_store(str(directory))) == []


def test_a_save_interrupted_after_carrying_a_file_over_a_link_to_a_folder_puts_the_link_back(tmp_path):
    """A's ``tokenizer.json`` is a link to a folder (the user's), then Ctrl-C once B's own
    ``tokenizer.json`` had replaced it: the link was taken for a folder (``os.path.isdir`` follows it),
    so no backup was made, and taking B's file back removed the name: the link was gone for good."""
    directory = tmp_path / "ckpt"
    save_states(str(directory), 1.0, carry=str(model_folder(tmp_path, 1)))
    (tmp_path / "elsewhere").mkdir()
    (directory / "tokenizer.json").unlink()
    (directory / "tokenizer.json").symlink_to(tmp_path / "elsewhere")
    before = tree_digest(str(directory))
    # B's changed files in order: chat_template.jinja, config.json, tok/vocab.txt, tokenizer.json.
    result = save_in_process(directory, 2.0, {faults.KILL_ENV: "local.carried:4", faults.KILL_SIGNAL_ENV: "INT"})
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr, result.stderr[-2000:]
    assert tree_digest(str(directory)) == before
    assert_published(directory, 1.0)


@pytest.mark.parametrize("kill_at", [*BEFORE_PUBLISH, "local.placed:3"])
def test_a_parallel_save_interrupted_before_its_publish_takes_back_all_it_wrote(checkpoint_a, kill_at):
    """As above, with the ranks staged at once (convert's save): Ctrl-C once every rank's parts were
    staged (``local.staged``) left them all behind (as large as the checkpoint), since the staging
    threads' ranks were not yet handed to the save that takes them back."""
    directory, neighbour = checkpoint_a
    before, beside = tree_digest(str(directory)), tree_digest(str(neighbour))
    env = {faults.KILL_ENV: kill_at, faults.KILL_SIGNAL_ENV: "INT"}
    result = save_in_process(directory, 2.0, env, parallel=True)
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr, (kill_at, result.stderr[-2000:])
    assert tree_digest(str(directory)) == before and tree_digest(str(neighbour)) == beside
    assert_published(directory, 1.0)
    again = save_in_process(directory, 3.0, parallel=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert_published(directory, 3.0)
    assert verify_checkpoint(open_store(str(directory))) == []


SLOW_PARALLEL_SAVER = textwrap.dedent(
    """
    import sys, time, torch
    from tests.support.states import SOURCE
    from vllm_sharded_loader.checkpoint import RankInfo
    from vllm_sharded_loader.checkpoint.save import RankHooks, SaveOptions, save_checkpoint
    from vllm_sharded_loader.storage.writer import LazyTensor

    def slow(i):
        def produce():
            time.sleep(0.25)  # a slow source (convert's reads): 5 s a rank in all
            with open(sys.argv[2], "a") as log:  # one line a tensor produced
                log.write(f"w{i}\\n")
            return torch.full((1024,), float(i))
        return LazyTensor((1024,), torch.float32, produce)

    ranks = {RankInfo(r, 2): {f"w{i}": slow(i) for i in range(20)} for r in range(2)}
    save_checkpoint(sys.argv[1], ranks, dtype="float32", source=SOURCE, options=SaveOptions(max_size=4096),
                    hooks=RankHooks(parallel=True))
    """
)


def test_ctrl_c_stops_a_parallel_save_at_its_next_write_and_takes_back_every_rank(tmp_path):
    """Ctrl-C in a save that stages its ranks at once (convert's), while they write: the threads
    stop at their next write instead of writing the whole checkpoint first, and no rank's parts stay
    (the rank whose thread the interrupt met while the save waited for it was lost, its parts left)."""
    import time

    output, produced = tmp_path / "out", tmp_path / "produced"
    command = [sys.executable, "-c", SLOW_PARALLEL_SAVER, str(output), str(produced)]
    with subprocess.Popen(command, cwd=Path(__file__).parent.parent, stderr=subprocess.PIPE, text=True) as saving:
        deadline = time.monotonic() + 120
        while not (output.is_dir() and any(n.endswith(".partial") for n in os.listdir(output))):
            assert saving.poll() is None and time.monotonic() < deadline, saving.stderr.read()[-2000:]
            time.sleep(0.02)
        saving.send_signal(signal.SIGINT)
        _, err = saving.communicate(timeout=120)
    assert saving.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    # Sent once the first part was begun: each rank stops at its next write, far from its 20th tensor.
    assert len(produced.read_text().splitlines()) < 40, "the ranks wrote every tensor after Ctrl-C"
    assert not output.exists(), os.listdir(output)


# A save whose placed ranks each get one more file (as convert's start-up artifacts), killed by the
# kernel (SIGXFSZ, its default action restored: Python ignores it) once that file's write passes the
# file size limit, which every part and the lock are under.
KILLED_WRITING_A_RANK_FILE = textwrap.dedent(
    """
    import resource, signal
    from tests.support.faultkit import states
    from tests.support.states import SOURCE
    from vllm_sharded_loader.checkpoint.save import RankHooks, SaveOptions, save_checkpoint
    def placed(target, entry):
        target.write_rank_file("startup-artifacts-pp0-tp0.tar", bytes(1 << 20))
        return entry
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    save_checkpoint({directory!r}, states(2.0), dtype="float32", source=SOURCE,
                    options=SaveOptions(max_size=8192, overwrite=True), hooks=RankHooks(placed=placed))
    """
)


def test_a_rank_file_left_half_written_by_a_killed_save_goes_with_the_next_save(checkpoint_a):
    """A save killed while it wrote a rank's start-up artifacts left that file's temporary under a name
    of its own (``.startup-artifacts-...tar.XXXXXX.tmp``) that no later save removed: the next save took
    the dead save's lock over and removed its staged parts, but that file stayed, an archive's size."""
    directory, _ = checkpoint_a
    killed = package_process(["-c", KILLED_WRITING_A_RANK_FILE.format(directory=str(directory))], timeout=120)
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-2000:]
    assert any(n.startswith(".startup-artifacts-") for n in os.listdir(directory))  # half-written, hidden
    assert_published(directory, 1.0)
    save_states(str(directory), 3.0, max_size=8192, overwrite=True)
    assert_published(directory, 3.0)
    assert [n for n in os.listdir(directory) if n.startswith(".")] == []
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(directory)), notes=notes) == []
    assert not [n for n in notes if ".startup-artifacts-" in n], notes


@pytest.fixture
def small_filesystem(tmp_path: Path):
    """A real file system of 256 KiB of its own (tmpfs), unmounted afterwards; skipped where mounting is denied."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()}); test_full_disk_during_save covers EFBIG")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_file_system_loses_nothing(small_filesystem):
    """A save that runs out of space (ENOSPC, a real full tmpfs) fails clearly; A stays whole."""
    directory = small_filesystem / "ckpt"
    save_states(str(directory), 1.0, max_size=8192)
    (small_filesystem / "filler").write_bytes(b"\0" * (256 * 1024 - 3 * 64 * 1024))  # room for less than B
    before = tree_digest(str(small_filesystem))
    with pytest.raises(SaveRefused, match=r"No space left on device.*previous checkpoint, if any, is intact"):
        big = {info: {n: t.repeat(4, 1) for n, t in tensors.items()} for info, tensors in states(2.0).items()}
        save_checkpoint(
            str(directory), big, dtype="float32", source=SOURCE, options=SaveOptions(max_size=8192, overwrite=True)
        )
    assert tree_digest(str(small_filesystem)) == before
    assert_published(directory, 1.0)
    assert verify_checkpoint(open_store(str(directory))) == []
    # Parts that fit, a tokenizer that does not: the save stops before its manifest, A's files as they were.
    model = small_filesystem.parent / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_bytes(b"t" * 200 * 1024)
    with pytest.raises(SaveRefused, match=r"No space left on device"):
        save_states(str(directory), 2.0, max_size=8192, overwrite=True, carry=str(model))
    assert tree_digest(str(small_filesystem)) == before
    assert_published(directory, 1.0)


def test_a_failed_save_into_a_new_nested_folder_leaves_none_of_the_folders_it_made(tmp_path):
    """A save into ``new/nested/out`` (none of them there) that fails or is interrupted before its
    publish removed ``out`` but left ``new/nested``, which it had made too."""
    output = tmp_path / "new" / "nested" / "out"
    with pytest.raises(InvalidOption, match=r"has no \{part\} field"):  # refused once the folders are made
        save_states(str(output), 1.0, pattern="w-{rank}.bin")
    assert sorted(os.listdir(tmp_path)) == []
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "mine.txt").write_text("the user's")  # a folder with something else in it stays
    with pytest.raises(InvalidOption, match=r"has no \{part\} field"):
        save_states(str(output), 1.0, pattern="w-{rank}.bin")
    assert sorted(os.listdir(tmp_path / "new")) == ["mine.txt"]


def test_a_published_capture_rewritten_by_another_save_is_never_republished(tmp_path):
    """The silent wrong weights of issue 25: an engine's second save reused its start-up capture's
    files by name after other saves had rewritten them (same names, same sizes). The capture is
    now reused only when its content matches the checksums taken as it was written."""
    from vllm_sharded_loader.checkpoint.loaded_state import check_capture_content
    from vllm_sharded_loader.checkpoint.save import SaveOptions
    from vllm_sharded_loader.format import Manifest
    from vllm_sharded_loader.storage.staged import new_token, stage_rank

    directory = tmp_path / "ckpt"
    info = RankInfo(0, 1)
    captured = stage_rank(str(directory), {"w": torch.full((64, 32), 1.0)}, info, max_size=8192)
    store = open_store(str(directory))  # the engine's first save publishes its capture in place
    store.lock(new_token(), True, ())
    entry = store.place(captured)
    store.publish(Manifest(1, 1, "float32", captured.pattern, SOURCE, (entry,)))
    store.clean(Manifest(1, 1, "float32", captured.pattern, SOURCE, (entry,)))
    store.release()
    check_capture_content(captured)  # untouched: reusable
    # Two saves of other weights alternate the part names back to the capture's, same sizes.
    for value in (5.0, 6.0):
        save_checkpoint(
            str(directory),
            {info: {"w": torch.full((64, 32), value)}},
            dtype="float32",
            source=SOURCE,
            options=SaveOptions(max_size=8192, overwrite=True),
        )
    assert os.path.getsize(captured.paths()[0]) == entry.files[0].size  # same name, same size: sizes cannot tell
    with pytest.raises(SaveRefused):
        check_capture_content(captured)


def test_a_save_into_a_folder_of_the_users_replaces_none_of_its_files_without_overwrite(tmp_path):
    """A folder that holds no checkpoint but the user's own ``config.json`` (another model's, or
    edited): a save that carries a different one is refused before its first part, naming it, and
    the folder is as it was; the same file, or overwrite asked, is no conflict."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"the user": "own"}')
    (out / "tokenizer.json").write_text("{}")  # the same as the model's: nothing to replace
    (out / "notes.txt").write_text("mine")
    before = tree_digest(str(out))
    carry = str(model_folder(tmp_path, 1.0))
    with pytest.raises(SaveRefused, match=r"holds files that differ .*: config\.json; refusing") as refused:
        save_states(str(out), 1.0, carry=carry)
    assert str(out) in str(refused.value) and "overwrite" in str(refused.value)
    assert tree_digest(str(out)) == before
    (out / "config.json").write_text((Path(carry) / "config.json").read_text())  # now the same: saved
    save_states(str(out), 1.0, carry=carry)
    assert verify_checkpoint(open_store(str(out))) == [] and (out / "notes.txt").read_text() == "mine"
    carry = str(model_folder(tmp_path, 2.0))  # another config: replacing the checkpoint's needs overwrite
    save_states(str(out), 2.0, carry=carry, overwrite=True)
    assert (out / "config.json").read_text() == (Path(carry) / "config.json").read_text()


def test_a_carried_file_is_never_written_through_a_link_out_of_the_output(tmp_path):
    """An output whose ``tok`` subfolder is a link to a folder elsewhere: the save renamed the model's
    ``tok/vocab.txt`` through it, creating a file in that folder, and with overwrite replacing the one
    there. Now it is refused, naming the link, and both folders are as they were."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "tok").symlink_to(elsewhere)
    carry = str(model_folder(tmp_path, 1.0))
    for overwrite in (False, True):
        if overwrite:
            (elsewhere / "vocab.txt").write_text("the user's shared vocabulary")
        before, beside = tree_digest(str(out)), tree_digest(str(elsewhere))
        with pytest.raises(SaveRefused, match=rf"^{out}/tok resolves to {elsewhere}, outside {out} \(a symbolic"):
            save_states(str(out), 1.0, carry=carry, overwrite=overwrite)
        assert tree_digest(str(out)) == before and tree_digest(str(elsewhere)) == beside


def test_a_carried_file_already_the_same_through_a_link_out_of_the_output_is_refused(tmp_path):
    """The same link, to a folder that already holds the model's very ``vocab.txt``: the save left it as
    the same file and recorded it, so the checkpoint it published failed its own verify (a carried
    file outside the checkpoint). Now refused, naming the link, with both folders as they were."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    carry = str(model_folder(tmp_path, 1.0))
    save_states(str(out), 1.0, carry=carry)
    (out / "tok").rename(elsewhere)
    (out / "tok").symlink_to(elsewhere)
    before, beside = tree_digest(str(out)), tree_digest(str(elsewhere))
    with pytest.raises(SaveRefused, match=rf"^{out}/tok resolves to {elsewhere}, outside {out} \(a symbolic"):
        save_states(str(out), 1.0, carry=carry, overwrite=True)
    assert tree_digest(str(out)) == before and tree_digest(str(elsewhere)) == beside
    assert_published(out, 1.0)


def test_a_non_weight_file_whose_name_the_manifest_cannot_record_is_refused_and_changes_nothing(tmp_path):
    """A model file named with a backslash (one plain name on Linux): the save recorded it in
    ``carried_files``, whose parser refuses such a name, so the checkpoint it published over A could
    not be read at all. Now refused by name before the publish: A published, whole and verified."""
    out = tmp_path / "out"
    save_states(str(out), 1.0, carry=str(model_folder(tmp_path, 1.0)))
    model = model_folder(tmp_path, 2.0)
    (model / "notes\\draft.txt").write_text("a file of the model")
    before = tree_digest(str(out))
    with pytest.raises(SaveRefused, match=r"'notes\\\\draft\.txt' has a name that a checkpoint's manifest cannot"):
        save_states(str(out), 2.0, carry=str(model), overwrite=True)
    assert tree_digest(str(out)) == before
    assert_published(out, 1.0)
    assert verify_checkpoint(open_store(str(out))) == []


def test_a_folder_where_a_carried_file_goes_or_a_file_where_its_folder_goes_is_refused_and_changes_nothing(tmp_path):
    """A folder of the user's at ``chat_template.jinja``, or a file at ``tok``: the save failed only at
    its place step, with the system's error, and left its staged copy in the checkpoint. Now refused
    by name before the publish, and the folder is as it was."""
    out = tmp_path / "out"
    save_states(str(out), 1.0, carry=str(model_folder(tmp_path, 1.0)))
    (out / "chat_template.jinja").mkdir()
    (out / "chat_template.jinja" / "mine.txt").write_text("the user's")
    carry = str(model_folder(tmp_path, 2.0))
    for path, kind, name in (("chat_template.jinja", "a directory", "chat_template.jinja"), ("tok", "a file", "tok")):
        if name == "tok":
            (out / "chat_template.jinja" / "mine.txt").unlink()
            (out / "chat_template.jinja").rmdir()
            (out / "tok" / "vocab.txt").unlink()
            (out / "tok").rmdir()
            (out / "tok").write_text("the user's")
        before = tree_digest(str(out))
        with pytest.raises(SaveRefused, match=rf"^{out / path} is {kind}, where the save carries the model's "):
            save_states(str(out), 2.0, carry=carry, overwrite=True)
        assert tree_digest(str(out)) == before
        assert_published(out, 1.0)


def test_reshard_into_an_existing_checkpoint_writes_nothing_before_the_overwrite_rule(tmp_path):
    """``vllm-sharded reshard SRC --output OUT`` copied SRC's config and tokenizer into OUT before
    refusing to overwrite OUT's checkpoint: the refusal now leaves OUT byte-identical."""
    from tests.support.checkpoints import save_reshardable
    from vllm_sharded_loader.tools.offline import reshard_checkpoint

    source, output = tmp_path / "src", tmp_path / "out"
    save_reshardable(source)
    (source / "config.json").write_text('{"model": "the source"}')
    (source / "tokenizer.json").write_text("{}")
    save_reshardable(output)
    (output / "config.json").write_text('{"model": "the output\'s own"}')
    before = tree_digest(str(output))
    with pytest.raises(SaveRefused):
        reshard_checkpoint(open_store(str(source)), str(output), tp_size=1)
    assert tree_digest(str(output)) == before
    # With overwrite, the files come along with the parts.
    reshard_checkpoint(open_store(str(source)), str(output), tp_size=1, overwrite=True)
    assert (output / "config.json").read_text() == '{"model": "the source"}' and (output / "tokenizer.json").exists()
    assert verify_checkpoint(open_store(str(output))) == []


@pytest.mark.engine
def test_a_worker_killed_mid_save_ends_the_save_promptly_and_loses_nothing(models, tmp_path):
    """A TP=2 engine's save whose second worker dies (SIGKILL) after placing a part: the save
    ends in bounded time, not at the 30-minute collective timeout; the checkpoint that was
    there is byte-identical and verifies; no process of the engine is left; the next save
    takes the dead save's lock over and publishes."""
    import json
    import time

    from tests.support.engines import run_engine, run_python
    from vllm_sharded_loader.checkpoint.loaded_state import CAPTURE_DIR_ENV, OVERWRITE_ENV

    out = tmp_path / "ckpt"
    spec = {"model": models["llama"], "tp": 2, "save_to": str(out), "generate": False}
    spec["env"] = {CAPTURE_DIR_ENV: str(tmp_path / "capture-a")}
    assert run_engine(spec).result.get("saved")
    before = tree_digest(str(out))

    killed = {**spec, "env": {CAPTURE_DIR_ENV: str(tmp_path / "capture-b"), OVERWRITE_ENV: "1"}}
    killed["env"][faults.KILL_ENV] = "local.placed@1"
    started = time.monotonic()
    run = run_python(["-m", "tests.support.engine_runner", json.dumps(killed)], tp=2)
    elapsed = time.monotonic() - started
    assert elapsed < 240, f"the save took {elapsed:.0f} s to end after its worker died"
    result = run.result or {}
    assert not result.get("saved"), run.tail()
    assert "another worker of this save stopped answering" in result.get("save_error", ""), run.tail()
    assert "previous checkpoint there is intact" in result["save_error"]
    assert not (out / LOCK_NAME).exists()  # the surviving worker released the lock
    after = tree_digest(str(out))
    assert {n: after.get(n) for n in before} == before  # every file of the checkpoint as it was
    # verify finds the dead save's leftovers only, nothing wrong with the checkpoint's own files.
    assert not [p for p in verify_checkpoint(open_store(str(out))) if any(f"/{n}:" in p for n in before)]
    print(f"the save ended {elapsed:.1f} s after its start; exit code {run.returncode}; {result}")
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "capture-b")], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", f"engine processes left running: {leftover.stdout}"

    again = {**spec, "env": {CAPTURE_DIR_ENV: str(tmp_path / "capture-c"), OVERWRITE_ENV: "1"}}
    assert run_engine(again).result.get("saved")
    assert verify_checkpoint(open_store(str(out))) == []
    assert not [n for n in os.listdir(out) if is_staged_name(n) or n == LOCK_NAME]


OWNER = textwrap.dedent(
    """
    import sys, time, torch
    from vllm_sharded_loader.checkpoint import RankInfo
    from vllm_sharded_loader.storage.staged import stage_rank
    from vllm_sharded_loader.storage.lock import hold_owner_marker
    directory, token = sys.argv[1], sys.argv[2]
    hold_owner_marker(directory, token)
    stage_rank(directory, {"w": torch.ones(8)}, RankInfo(0, 1), token=token)  # as an engine's capture
    print("staged", flush=True)
    time.sleep(float(sys.argv[3]))
    """
)


def test_a_dead_engines_capture_is_cleaned_and_a_live_ones_kept(checkpoint_a):
    """Start-up captures (staged files outside any save) were never removed. Each capture's
    process now holds a marker's flock: a save into the folder removes the staged files of a
    capture whose process is gone, never those of a live one, and verify notes only the dead."""
    directory, _ = checkpoint_a
    command = [sys.executable, "-c", OWNER, str(directory)]
    live = subprocess.Popen([*command, "aaaa11110000", "600"], stdout=subprocess.PIPE)
    try:
        assert live.stdout.readline().strip() == b"staged"
        dead = subprocess.run([sys.executable, "-c", OWNER, str(directory), "bbbb22220000", "0"], capture_output=True)
        assert dead.returncode == 0, dead.stderr
        names = os.listdir(directory)
        assert any("aaaa11110000" in n for n in names) and any("bbbb22220000" in n for n in names)
        # The dead engine's leftovers are noted, never problems of the checkpoint (issue 34, class 5).
        notes: list[str] = []
        assert verify_checkpoint(open_store(str(directory)), notes=notes) == []
        assert any("bbbb22220000" in n for n in notes) and not any("aaaa11110000" in n for n in notes), notes

        result = save_in_process(directory, 2.0)
        assert result.returncode == 0, result.stderr[-2000:]
        names = os.listdir(directory)
        assert not any("bbbb22220000" in n for n in names), names  # the dead engine's capture and marker are gone
        assert len([n for n in names if "aaaa11110000" in n]) == 2, names  # the live one's part and marker stay
        assert_published(directory, 2.0)
    finally:
        live.kill()
        live.wait()
    again = save_in_process(directory, 3.0)  # now that it is gone, its files go too
    assert again.returncode == 0, again.stderr[-2000:]
    assert not any("aaaa11110000" in n for n in os.listdir(directory))
    assert verify_checkpoint(open_store(str(directory))) == []


def listing(root: Path) -> dict[str, tuple[int, int]]:
    """``relative path -> (size, mtime in ns)`` of everything under ``root``, ``root`` itself included."""
    out = {".": (0, os.lstat(root).st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_size, st.st_mtime_ns)
    return out


def test_a_refused_save_leaves_the_folder_as_it_was_its_mtime_included(checkpoint_a):
    """A save refused (a checkpoint there and no overwrite; a running save's lock) changes nothing, not
    even the folder's mtime: it used to create and remove its lock (or a lock's staging name) first."""
    directory, _ = checkpoint_a
    before = listing(directory)
    with pytest.raises(SaveRefused):
        save_states(str(directory), 2.0, max_size=8192)
    assert listing(directory) == before
    running = acquire_save_lock(str(directory), "aaaa11110000", overwrite=True)  # a save that runs
    try:
        before = listing(directory)
        with pytest.raises(CheckpointLocked):
            save_states(str(directory), 2.0, max_size=8192, overwrite=True)
        assert listing(directory) == before
    finally:
        release_save_lock(running)
    assert_published(directory, 1.0)


def test_what_a_save_would_refuse_is_said_before_it_starts_and_changes_nothing(checkpoint_a, monkeypatch):
    """``refuse_before_save`` (the save command's and convert's check before vLLM builds a model) refuses
    what the save's lock refuses, with its words, and takes nothing: a checkpoint without overwrite, a
    running save even with overwrite, an interrupted one without it; the same for an object prefix
    (obstore's in-process store), whose lock object is never taken over."""
    from obstore.store import MemoryStore

    from vllm_sharded_loader.storage import objects

    directory, _ = checkpoint_a
    before = listing(directory)
    with pytest.raises(SaveRefused, match=f"{directory} already holds a checkpoint"):
        open_store(str(directory)).refuse_before_save(overwrite=False)
    open_store(str(directory)).refuse_before_save(overwrite=True)
    running = acquire_save_lock(str(directory), "aaaa11110000", overwrite=True)
    try:
        with pytest.raises(CheckpointLocked, match=r"another save holds .*; wait for it to finish"):
            open_store(str(directory)).refuse_before_save(overwrite=True)
    finally:
        os.close(running.fd)  # its flock gone with it, the lock left: as a killed save leaves it
    held = listing(directory)
    with pytest.raises(CheckpointLocked, match=r"another save holds .*; that save was interrupted"):
        open_store(str(directory)).refuse_before_save(overwrite=False)
    open_store(str(directory)).refuse_before_save(overwrite=True)  # the save would take it over
    assert listing(directory) == held and set(held) == {*before, LOCK_NAME}
    with pytest.raises(SaveRefused):
        open_store(str(directory / MANIFEST_NAME)).refuse_before_save(overwrite=True)

    bucket = MemoryStore()
    monkeypatch.setattr(objects, "_store", lambda *_: bucket)
    url = "s3://bucket/ckpt"
    open_store(url).refuse_before_save(overwrite=False)  # an empty prefix
    bucket.put(f"ckpt/{MANIFEST_NAME}", b"{}")
    with pytest.raises(SaveRefused, match=f"{url}/? already holds a checkpoint"):
        open_store(url).refuse_before_save(overwrite=False)
    open_store(url).refuse_before_save(overwrite=True)
    bucket.put(f"ckpt/{LOCK_NAME}", b'{"pid": 1, "host": "elsewhere", "token": "ab12"}')
    with pytest.raises(CheckpointLocked, match=rf"another save holds .*pid 1 on elsewhere.*delete {url}/{LOCK_NAME}"):
        open_store(url).refuse_before_save(overwrite=True)
    assert sorted(o["path"] for o in bucket.list().collect()) == [f"ckpt/{LOCK_NAME}", f"ckpt/{MANIFEST_NAME}"]


@pytest.mark.parametrize("pattern", ["x-{rank}{part}.st", "x-{rank}.st", "x-{foo}-{part}.st", "../x-{rank}-{part}.st"])
def test_a_save_refused_for_its_file_pattern_leaves_the_folder_as_it_was_its_mtime_included(checkpoint_a, pattern):
    """An engine-free save (save_checkpoint, as reshard and convert write) checked its file pattern only
    once it held the lock: a refused pattern created and removed the lock in the output, changing the
    folder's mtime. The save hook checked it before its lock; now every save does."""
    directory, _ = checkpoint_a
    before = listing(directory)
    with pytest.raises(InvalidOption):
        save_states(str(directory), 2.0, pattern=pattern, overwrite=True)
    assert listing(directory) == before
    assert_published(directory, 1.0)


@pytest.mark.parametrize("kind", ["missing", "file", "fifo"])
def test_a_save_whose_carry_source_is_no_folder_is_refused_by_name_before_its_lock(checkpoint_a, kind):
    """A carry source (the model whose config and tokenizer go beside the parts) that is missing, a file
    or a FIFO was found only at the carry step, once every part was written and placed: the save failed
    with the bare FileNotFoundError or NotADirectoryError of a listing, and had taken its lock and
    changed the folder. Now it is refused by name before the lock."""
    directory, _ = checkpoint_a
    source = directory.parent / f"model-{kind}"
    if kind == "file":
        source.write_text("{}")
    elif kind == "fifo":
        os.mkfifo(source)
    before = listing(directory)
    what = {"missing": "does not exist", "file": "is a file", "fifo": "is a FIFO"}[kind]
    with pytest.raises(SaveRefused, match=rf"^{source} {what}, where the model folder whose config .* was expected"):
        save_states(str(directory), 2.0, overwrite=True, carry=str(source))
    assert listing(directory) == before
    assert_published(directory, 1.0)


def test_files_in_the_saves_own_pattern_are_a_checkpoint_refused_without_overwrite(tmp_path):
    """A folder whose files are named in the save's (custom) pattern holds a checkpoint to vLLM's
    loader, as one in vLLM's default patterns does: a save without overwrite is refused and changes
    nothing. It was not: the save published beside them, and its cleanup deleted them as stale parts."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "weights-0-0.safetensors").write_bytes(b"the user's")
    (directory / "weights-1-3.safetensors").write_bytes(b"also the user's")
    before = listing(directory)
    with pytest.raises(SaveRefused):
        save_states(str(directory), 1.0, pattern="weights-{rank}-{part}.safetensors")
    assert listing(directory) == before
    # With overwrite, they are replaced as any checkpoint is.
    save_states(str(directory), 1.0, pattern="weights-{rank}-{part}.safetensors", overwrite=True)
    assert_published(directory, 1.0)
    assert verify_checkpoint(open_store(str(directory))) == []


def test_a_start_up_archive_in_the_folder_is_a_checkpoint_refused_without_overwrite(tmp_path):
    """A folder holding only a file named as a rank's start-up artifacts (``startup-artifacts-*.tar``):
    a save without overwrite published beside it, and its cleanup deleted it as an old save's archive
    that the new manifest does not list. Now it counts as a checkpoint, as parts named so do."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "startup-artifacts-pp0-tp0.tar").write_bytes(b"the user's archive")
    before = listing(directory)
    with pytest.raises(SaveRefused):
        save_states(str(directory), 1.0, max_size=8192)
    assert listing(directory) == before
    save_states(str(directory), 1.0, max_size=8192, overwrite=True)
    assert sorted(os.listdir(directory)) == sorted(listed(directory))


def test_an_overwrite_under_another_pattern_removes_every_part_of_the_old_checkpoint(tmp_path):
    """The cleanup removed unlisted parts by name, in the new manifest's pattern and vLLM's defaults
    only: a checkpoint saved under another pattern kept all of its parts beside the new one (which
    vLLM's loader, given the old pattern, would read), and verify did not see them. What the
    replaced manifest listed goes, whatever its names; a file of the user's stays."""
    directory = tmp_path / "ckpt"
    save_states(str(directory), 1.0, max_size=8192, pattern="w-{rank}-{part}.bin")
    (directory / "notes.txt").write_text("the user's own file")
    new = save_states(str(directory), 2.0, max_size=8192, overwrite=True)
    assert_published(directory, 2.0)
    assert sorted(os.listdir(directory)) == sorted(new.listed_files() | {MANIFEST_NAME, "notes.txt"})


def test_a_checkpoint_under_a_pattern_of_its_own_carries_none_of_its_parts_and_verify_names_none(tmp_path):
    """A checkpoint whose parts no weight file pattern names (``w-{rank}-{part}.dat``) had them taken for
    its model's files: a reshard (or a save carrying from it) copied the old weights beside the new
    parts, recorded as carried config files, and verify told the user to remove the checkpoint's own
    parts as files a dead save left beside them. Its parts (and any a dead save placed under its
    pattern) are its own; its config and tokenizer are still carried."""
    from vllm_sharded_loader.tools.offline import reshard_checkpoint

    source, out = tmp_path / "src", tmp_path / "out"
    save_states(str(source), 1.0, max_size=8192, pattern="w-{rank}-{part}.dat", carry=str(model_folder(tmp_path, 1)))
    notes: list[str] = []
    assert verify_checkpoint(open_store(str(source)), notes=notes) == []
    assert not [n for n in notes if "w-0-0.dat" in n], notes
    (source / "w-0-9.dat").write_bytes(b"placed by a save that died before its publish")
    reshard_checkpoint(open_store(str(source)), str(out), tp_size=2)
    assert sorted(read_manifest(str(out)).carried_files) == sorted(carried_of(1.0))
    assert not [n for n in os.listdir(out) if n.endswith(".dat")], sorted(os.listdir(out))
    assert_published(out, 1.0)


def test_a_file_system_too_full_for_the_lock_fails_typed_and_leaves_nothing(small_filesystem):
    """With not a byte free, the lock's own write failed as a bare OSError (not a ShardedStateError),
    and a save into a new folder left that folder behind."""
    directory = small_filesystem / "ckpt"
    save_states(str(directory), 1.0, max_size=8192)
    free = os.statvfs(small_filesystem)
    (small_filesystem / "filler").write_bytes(b"\0" * (free.f_bavail * free.f_frsize))
    before = tree_digest(str(small_filesystem))
    for where, overwrite in ((directory, True), (small_filesystem / "new", False)):
        with pytest.raises(SaveRefused, match=r"No space left on device"):
            save_states(str(where), 2.0, max_size=8192, overwrite=overwrite)
        assert tree_digest(str(small_filesystem)) == before
    assert_published(directory, 1.0)


def test_a_file_the_cleanup_cannot_remove_fails_after_the_publish_typed_and_frees_the_lock(checkpoint_a):
    """A stale part that cannot be removed (immutable, ``chattr +i``: even root gets EPERM) made the
    cleanup raise a bare OSError after the publish, stop there, and keep the lock's flock for as long
    as the process lived: every later save of that process (an engine's) was refused as another
    save's. Now the rest is cleaned, the lock released, and the error is SaveFailedAfterPublish."""
    import shutil

    if shutil.which("chattr") is None:
        pytest.skip("needs chattr to make a file that not even root can remove")
    directory, _ = checkpoint_a
    stuck = directory / "model-rank-7-part-0.safetensors"
    stuck.write_bytes(b"an older save's part")
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip(f"{directory}'s file system has no immutable files (chattr +i)")
    try:
        with pytest.raises(
            SaveFailedAfterPublish, match=r"model-rank-7-part-0.safetensors \(Operation not permitted\)"
        ):
            save_states(str(directory), 2.0, max_size=8192, overwrite=True)
        assert_published(directory, 2.0)
        assert not (directory / LOCK_NAME).exists()
        assert {n for n in os.listdir(directory) if n.startswith("model-")} == listed(directory) - {MANIFEST_NAME} | {
            stuck.name
        }
        with pytest.raises(SaveFailedAfterPublish):  # the next save in this process is not locked out
            save_states(str(directory), 3.0, max_size=8192, overwrite=True)
        assert_published(directory, 3.0)
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)


def test_a_lock_that_cannot_be_finished_is_taken_back_and_its_flock_freed(checkpoint_a):
    """In a folder where names can be made but not removed (append-only, ``chattr +a``: even root),
    removing the lock's staging name failed after the lock was linked: the descriptor holding its
    flock was never closed, so every later save of that process (an engine's) was refused as another
    running save's, even once the folder was fixed. Now the flock goes with the failure, and the next
    save takes the lock it could not remove over, with the lock's staging name still linked to it."""
    import shutil

    if shutil.which("chattr") is None:
        pytest.skip("needs chattr to make a folder whose names cannot be removed")
    directory, _ = checkpoint_a
    if subprocess.run(["chattr", "+a", str(directory)], capture_output=True).returncode != 0:
        pytest.skip(f"{directory}'s file system has no append-only folders (chattr +a)")
    try:
        with pytest.raises(SaveRefused, match=r"taking the save lock .* failed: .*Operation not permitted"):
            save_states(str(directory), 2.0, max_size=8192, overwrite=True)
    finally:
        subprocess.run(["chattr", "-a", str(directory)], check=True)
    assert_published(directory, 1.0)
    save_states(str(directory), 3.0, max_size=8192, overwrite=True)
    assert_published(directory, 3.0)
    assert not [n for n in os.listdir(directory) if n.startswith(LOCK_NAME)]  # its staging name too
