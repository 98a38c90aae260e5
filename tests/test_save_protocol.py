"""The one save driver over a group of several members, without an engine, on every backend (a local
folder, and the in-process ``memory://`` object store, whose steps are object storage's).

Each member is a thread running :func:`run_save` with its own store of the location, as each worker
of an engine does; :class:`Members` (the engine's group) exchanges their outcomes over threads as the
engine's workers exchange them (every member reaches every exchange, a failure anywhere is raised
everywhere, ``agreed``). A member fails at each step in turn: every member then fails with
the same error, nothing is published (the previous checkpoint loads bit-exactly), and the
abandon removes this save's files and lock and nothing else.
"""

from __future__ import annotations

import hashlib
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.faultkit import model_folder
from tests.support.manifests import edit_manifest
from tests.support.members import in_threads as in_member_threads
from tests.support.states import SOURCE
from tests.support.stores import Backend
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest, verify_checkpoint
from vllm_sharded_loader.checkpoint.group import Members
from vllm_sharded_loader.checkpoint.protocol import FolderNotShared, OneProcess, SaveJob, run_save
from vllm_sharded_loader.checkpoint.save import RankHooks, SaveOptions, save_checkpoint
from vllm_sharded_loader.format import Manifest, ShardedStateError
from vllm_sharded_loader.format.errors import SaveFailedAfterPublish, SaveRefused
from vllm_sharded_loader.format.manifest import CarriedFile, RankEntry
from vllm_sharded_loader.format.names import LOCK_NAME
from vllm_sharded_loader.storage.folder import LocalStore
from vllm_sharded_loader.storage.location import Store, open_store
from vllm_sharded_loader.storage.staged import stage_rank

MEMBERS = 3
MANIFEST = "sharded_state.json"


def tensors(value: float, rank: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((64, 32), value + 10 * rank + i) for i in range(3)}


def in_threads(member: Callable[[int, Members], Any]) -> list[Any]:
    """Run ``member(index, group)`` for every member at once, each with the save protocol's group
    (:class:`Members`) over threads; returns each one's result or error."""
    return in_member_threads(
        MEMBERS, lambda index, exchange: member(index, Members(exchange, RankInfo(index, MEMBERS))), 120
    )


def failing_store(where: str, fail_at: str | None) -> Store:
    """The store of ``where``, whose ``fail_at`` step fails on this member (a real error, raised there)."""

    class Failing(type(open_store(where))):  # type: ignore[misc]
        def _maybe_fail(self, step: str) -> None:
            if step == fail_at:
                raise ShardedStateError(f"{step} failed here")

        def lock(self, token: str, overwrite: bool, patterns: tuple[str, ...]) -> None:
            self._maybe_fail("lock")
            super().lock(token, overwrite, patterns)

        def join(self, token: str) -> bool:
            self._maybe_fail("join")
            return super().join(token)

        def place(self, staged: Any) -> RankEntry:
            placed = super().place(staged)  # placed first: the abandon must remove it again
            self._maybe_fail("place")
            return placed

        def publish(self, manifest: Manifest) -> None:
            self._maybe_fail("publish")
            super().publish(manifest)

        def clean(self, manifest: Manifest) -> None:
            self._maybe_fail("clean")
            super().clean(manifest)

    return Failing(where)


def save_in_threads(where: str, value: float, fail_at: str | None = None, failing: int = 1) -> list[Any]:
    """Every member saves its rank of ``value``'s state; returns each member's result or error."""

    def member(index: int, group: Members) -> Any:
        target = failing_store(where, fail_at if index == failing else None)
        info = RankInfo(index, MEMBERS)

        def stage(target: Store) -> Any:
            if fail_at == "stage" and index == failing:
                raise ShardedStateError("stage failed here")
            yield stage_rank(target.staging(), tensors(value, index), info, None, 8192, target.token), None

        def manifest(entries: list[tuple[RankEntry, None]]) -> Manifest:
            return Manifest(
                MEMBERS, 1, "float32", "model-rank-{rank}-part-{part}.safetensors", SOURCE, tuple(e for e, _ in entries)
            )

        return run_save(target, group, SaveJob(stage, manifest, overwrite=True))

    return in_threads(member)


def assert_published(where: str, value: float) -> None:
    manifest = read_manifest(where)
    assert manifest is not None
    for index in range(MEMBERS):
        expected = tensors(value, index)
        loaded = {n: torch.zeros_like(t) for n, t in expected.items()}
        load_rank(
            LoadRequest(open_store(where), manifest, verify="checksum", serving=SOURCE),
            loaded,
            RankInfo(index, MEMBERS),
        )
        assert all(torch.equal(loaded[n], t) for n, t in expected.items())


@pytest.fixture(params=["local", "memory"])
def backend(request, tmp_path: Path) -> Backend:
    return Backend(request.param, tmp_path)


@pytest.fixture
def checkpoint_a(backend: Backend) -> tuple[Backend, str]:
    where = backend.location("ckpt")
    assert all(isinstance(r, tuple) for r in save_in_threads(where, 1.0))
    backend.put(where, "notes.txt", b"the user's own file")
    return backend, where


def test_members_save_together(checkpoint_a):
    backend, where = checkpoint_a
    assert_published(where, 1.0)
    results = save_in_threads(where, 2.0)
    assert all(isinstance(r, tuple) and r[0] == results[0][0] for r in results)  # one manifest for all
    assert_published(where, 2.0)
    # The old save's parts went; what is not ours stayed.
    listed = {f.name for e in read_manifest(where).ranks for f in e.files}
    assert backend.names(where) == listed | {"sharded_state.json", "notes.txt"}


@pytest.mark.parametrize("fail_at", ["lock", "join", "stage", "place", "publish"])
def test_a_member_failing_before_the_publish_fails_every_member_and_publishes_nothing(checkpoint_a, fail_at):
    backend, where = checkpoint_a
    failing = 0 if fail_at in ("lock", "publish") else 1  # those steps run on the first member only
    before = backend.everything()
    results = save_in_threads(where, 2.0, fail_at, failing)
    # Every member fails, with the same agreed error naming the failing member's own.
    assert all(isinstance(r, ShardedStateError) for r in results), results
    assert {str(r) for r in results} == {str(results[0])}
    assert f"tp_rank={failing} (TP={MEMBERS}, PP=1) on" in str(results[0]) and f"{fail_at} failed here" in str(
        results[0]
    )
    assert all(r.agreed for r in results)
    # Nothing published: A loads, and the abandon removed every file of this save and the lock.
    assert_published(where, 1.0)
    assert backend.everything() == before


def test_a_member_failing_after_the_publish_leaves_the_new_checkpoint(checkpoint_a):
    """The clean fails on the first member: the new checkpoint stands, and the driver releases the
    lock all the same (whatever the store's clean did), so that the next save is not refused."""
    backend, where = checkpoint_a
    results = save_in_threads(where, 2.0, "clean", failing=0)
    assert all(isinstance(r, SaveFailedAfterPublish) and r.agreed for r in results), results
    assert "published and complete" in str(results[0])
    assert_published(where, 2.0)
    assert LOCK_NAME not in backend.names(where)


def test_a_folder_not_shared_is_refused_before_a_part_is_written(tmp_path):
    """Member 2 sees another folder under the same path (another node's disk): refused on every member."""

    class OwnDisk(LocalStore):
        def __init__(self, where: str, blind: bool) -> None:
            super().__init__(where)
            self.blind = blind

        def join(self, token: str) -> bool:
            return super().join(token) and not self.blind

    directory = tmp_path / "ckpt"
    job = SaveJob(lambda target: iter(()), lambda entries: pytest.fail("no manifest is built"))
    results = in_threads(lambda index, group: run_save(OwnDisk(str(directory), index == 2), group, job))
    assert all(isinstance(r, FolderNotShared) and r.agreed for r in results)
    assert "tp_rank=2 (TP=3, PP=1) on" in str(results[0]) and "Nothing was written" in str(results[0])
    assert not directory.exists()  # made by the save's lock, removed again by its abandon


def test_one_process_is_the_same_driver(backend):
    """``save_checkpoint`` is the driver over a group of one; its failure abandons alike."""
    where = backend.location("ckpt")
    ranks = {RankInfo(r, 2): tensors(1.0, r) for r in range(2)}
    manifest = save_checkpoint(where, ranks, dtype="float32", source=SOURCE, options=SaveOptions(max_size=8192))
    assert read_manifest(where) == manifest
    assert OneProcess().run(lambda: 7) == [7]
    with pytest.raises(SaveRefused):
        save_checkpoint(where, ranks, dtype="float32", source=SOURCE)
    assert read_manifest(where) == manifest


@pytest.mark.parametrize("parallel", [True, False])
def test_each_ranks_staging_says_how_it_ended(backend, parallel):
    """``ended(rank, error)``: every rank's staging reports its end in the thread that staged it, with
    the error that ended it (convert's ranks share components, and must not wait for a rank that
    stopped); the failed save publishes nothing."""
    from vllm_sharded_loader.storage.writer import LazyTensor

    def full_disk() -> torch.Tensor:
        raise OSError(28, "No space left on device")

    ranks = {RankInfo(0, 2): tensors(1.0, 0), RankInfo(1, 2): {"w": LazyTensor((4,), torch.float32, full_disk)}}
    ended: dict[int, tuple[BaseException | None, str]] = {}

    def end(rank: RankInfo, error: BaseException | None) -> None:
        ended[rank.tp_rank] = (error, threading.current_thread().name)

    where = backend.location("ckpt")
    with pytest.raises(Exception, match="No space left on device"):
        save_checkpoint(where, ranks, dtype="float32", source=SOURCE, hooks=RankHooks(parallel=parallel, ended=end))
    assert "No space left on device" in str(ended[1][0])
    if parallel:
        assert ended[0][0] is None and ended[0][1] != ended[1][1]  # each in its own staging thread
    assert read_manifest(where) is None and backend.files(where) == {}


def carried_record(folder: Path) -> dict[str, CarriedFile]:
    """Every file under ``folder`` but the checkpoint's own (parts, manifest) by relative name: its size and SHA-256."""
    files = (p for p in sorted(folder.rglob("*")) if p.is_file() and p.suffix != ".safetensors")
    return {
        str(p.relative_to(folder)): CarriedFile(p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in files
        if p.name != "sharded_state.json"
    }


def test_a_save_records_every_carried_file_it_staged_or_left_in_place(tmp_path):
    """The manifest lists each carried file's size and SHA-256: those a save copied, and those
    already identical that it left as they were; a save that carries nothing records none."""
    model, directory = model_folder(tmp_path, 1.0), tmp_path / "ckpt"
    ranks = {RankInfo(r, 2): tensors(1.0, r) for r in range(2)}
    manifest = save_checkpoint(
        str(directory), ranks, dtype="float32", source=SOURCE, options=SaveOptions(carry=open_store(str(model)))
    )
    assert manifest.carried_files == carried_record(model) == carried_record(directory)
    assert set(manifest.carried_files) == {"config.json", "tokenizer.json", "tok/vocab.txt"}
    assert read_manifest(str(directory)) == manifest
    # Saved again: every file is identical and stays where it is, and is recorded all the same.
    before = {p: p.stat().st_ino for p in map(directory.joinpath, manifest.carried_files)}
    again = save_checkpoint(
        str(directory),
        ranks,
        dtype="float32",
        source=SOURCE,
        options=SaveOptions(carry=open_store(str(model)), overwrite=True),
    )
    assert {p: p.stat().st_ino for p in before} == before
    assert again.carried_files == manifest.carried_files
    alone = save_checkpoint(str(tmp_path / "alone"), ranks, dtype="float32", source=SOURCE)
    assert alone.carried_files == {} and read_manifest(str(tmp_path / "alone")).carried_files == {}


def test_every_member_returns_the_published_record_of_the_carried_files(backend, tmp_path):
    """The first member carries the files; every member's manifest is the published one, with its record."""
    model, where = model_folder(tmp_path, 1.0), backend.location("ckpt")

    def member(index: int, group: Members) -> Any:
        def stage(target: Store) -> Any:
            yield (
                stage_rank(target.staging(), tensors(1.0, index), RankInfo(index, MEMBERS), None, 8192, target.token),
                None,
            )

        def manifest(entries: list[tuple[RankEntry, None]]) -> Manifest:
            return Manifest(
                MEMBERS, 1, "float32", "model-rank-{rank}-part-{part}.safetensors", SOURCE, tuple(e for e, _ in entries)
            )

        job = SaveJob(stage, manifest, carry=lambda carried: carried.stage(open_store(str(model))), overwrite=True)
        return run_save(open_store(where), group, job)[0]

    results = in_threads(member)
    assert all(r == read_manifest(where) for r in results), results
    assert results[0].carried_files == carried_record(model)
    placed = {n for n, digest in backend.files(where).items() if digest != "dir" and not n.endswith(".safetensors")}
    assert placed == {*results[0].carried_files, MANIFEST}


def test_an_overwrite_removes_what_the_replaced_checkpoint_carried_and_the_new_one_does_not(tmp_path):
    """Model 2 carries a chat template (and a nested file) that model 1 lacks: saving model 1 over
    model 2's checkpoint removes them (their emptied subfolder too), so nothing unrecorded of
    another model is served. A file no manifest recorded stays, as does what a folder linking
    out of the checkpoint holds; and a save that carries nothing (the engine hook into the
    served model's own folder) removes nothing."""
    two, one = model_folder(tmp_path, 2.0), model_folder(tmp_path, 1.0)
    for folder in ("extra", "linked"):
        (two / folder).mkdir()
        (two / folder / "notes.txt").write_text("model 2's")
    ranks = {RankInfo(r, 2): tensors(1.0, r) for r in range(2)}

    def save(directory: Path, carry: Path | None) -> Manifest:
        carried = None if carry is None else str(carry)
        return save_checkpoint(
            str(directory),
            ranks,
            dtype="float32",
            source=SOURCE,
            options=SaveOptions(carry=open_store(carried), overwrite=True),
        )

    alone = tmp_path / "alone"
    save(alone, two)
    assert save(alone, None).carried_files == {}
    assert (alone / "chat_template.jinja").exists() and (alone / "extra" / "notes.txt").exists()
    earlier = tmp_path / "earlier"  # a manifest of an earlier version: what it carried is unknown
    save(earlier, two)
    edit_manifest(earlier, lambda m: m.pop("carried_files"))
    assert save(earlier, one).carried_files == carried_record(one)
    assert (earlier / "chat_template.jinja").exists()
    # A record naming what no save carries (the manifest, the lock, weights): none of it goes.
    hostile, record = tmp_path / "hostile", {"size": 1, "sha256": "0" * 64}
    save(hostile, two)
    names = ["sharded_state.json", LOCK_NAME, "x.safetensors", "extra/y.bin"]
    edit_manifest(hostile, lambda m: m["carried_files"].update(dict.fromkeys(names, record)))
    (hostile / "x.safetensors").write_text("the user's")
    (hostile / "extra" / "y.bin").write_text("the user's")
    assert save(hostile, one) == read_manifest(str(hostile))
    assert (hostile / "x.safetensors").exists() and (hostile / "extra" / "y.bin").exists()
    assert not (hostile / LOCK_NAME).exists() and verify_checkpoint(open_store(str(hostile))) == []

    directory, outside = tmp_path / "ckpt", tmp_path / "outside"
    assert {"chat_template.jinja", "extra/notes.txt", "linked/notes.txt"} <= set(save(directory, two).carried_files)
    (directory / "mine.txt").write_text("the user's")
    outside.mkdir()
    (outside / "notes.txt").write_text("not the checkpoint's")
    shutil.rmtree(directory / "linked")
    (directory / "linked").symlink_to(outside)
    manifest = save(directory, one)
    assert manifest.carried_files == carried_record(one)
    assert not (directory / "chat_template.jinja").exists() and not (directory / "extra").exists()
    assert (directory / "mine.txt").read_text() == "the user's"
    assert (outside / "notes.txt").read_text() == "not the checkpoint's"
    assert verify_checkpoint(open_store(str(directory))) == []
