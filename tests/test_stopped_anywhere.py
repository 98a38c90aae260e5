"""A Ctrl-C right after any file-changing call of a reshard, not only at the named kill points.

A signal that arrives while a system call runs is raised by Python as the call returns, before the
next line: a rename done but not yet recorded, a lock linked but not yet counted as held. Here the
reshard runs in this process with each file-changing ``os`` call wrapped; the k-th raises
``KeyboardInterrupt`` once it has done its work, for every k before the manifest's rename. The
output folder and everything beside it must be as they were, and the same command must then
succeed (a lock left unheld made it refuse; a part renamed unrecorded stayed under its final name).
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import shutil

import pytest

from tests.support.checkpoints import save_model
from tests.support.faultkit import tree_digest
from tests.support.reference import llama_like
from vllm_sharded_loader.format import MANIFEST_NAME
from vllm_sharded_loader.tools.cli import main as cli

CALLS = ("replace", "rename", "link", "remove", "unlink", "rmdir", "mkdir", "makedirs", "open", "symlink")
WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT


class Stopper:
    """Wraps the file-changing calls of ``os`` (and ``open`` for writing); the ``stop_after``-th raises
    ``KeyboardInterrupt`` as it returns. Records each call, to find the manifest's rename."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stop_after: int | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.stop_after = stop_after
        for name in CALLS:
            monkeypatch.setattr(os, name, self._wrap(name, getattr(os, name)))
        monkeypatch.setattr(builtins, "open", self._wrap("open", builtins.open))

    def _wrap(self, name: str, real):
        def call(*args, **kwargs):
            if name == "open" and not self._writes(args, kwargs):
                return real(*args, **kwargs)
            done = real(*args, **kwargs)
            self.calls.append((name, str(args[-1] if name in ("replace", "rename", "link") else args[0])))
            if len(self.calls) == self.stop_after:
                raise KeyboardInterrupt(f"stopped as {name}{args[:2]} returned")
            return done

        return call

    @staticmethod
    def _writes(args: tuple, kwargs: dict) -> bool:
        """Whether ``os.open`` (flags) or ``open`` (a mode) opens for writing."""
        mode = args[1] if len(args) > 1 else kwargs.get("flags", kwargs.get("mode", "r"))
        return bool(mode & WRITING) if isinstance(mode, int) else any(c in mode for c in "wax+")


def reshard(args: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return cli(args)
        except KeyboardInterrupt:
            return 130


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A TP=2 checkpoint carrying a config and a tokenizer folder, and an older one to be replaced."""
    root = tmp_path_factory.mktemp("stopped-anywhere")
    for name, seed in (("src", 0), ("old", 1)):
        folder = root / name
        save_model(folder, llama_like(tied=True, num_layers=2, seed=seed), 2, 1)
        (folder / "config.json").write_text(json.dumps({"seed": seed}))
        (folder / "tok").mkdir()
        (folder / "tok" / "vocab.txt").write_text(f"vocab {seed}")
    old = root / "old-tp4"
    assert reshard(["reshard", str(root / "old"), "-tp", "4", "-o", str(old)]) == 0
    return root / "src", old


@pytest.mark.parametrize("into", ["a new folder", "the user's folder", "a checkpoint, overwritten"])
def test_a_reshard_stopped_as_any_file_call_returns_takes_back_what_it_wrote(sources, tmp_path, monkeypatch, into):
    source, old = sources
    parent = tmp_path / "parent"
    out = parent / "out"
    command = ["reshard", str(source), "-tp", "4", "-o", str(out)]
    command += ["--overwrite"] if into == "a checkpoint, overwritten" else []

    def prepare() -> dict:
        shutil.rmtree(parent, ignore_errors=True)
        parent.mkdir()
        (parent / "beside.txt").write_text("the user's")
        if into == "the user's folder":
            (out / "data").mkdir(parents=True)
            (out / "notes.txt").write_text("the user's")
            (out / "data" / "x.bin").write_bytes(b"x" * 100)
        elif into == "a checkpoint, overwritten":
            shutil.copytree(old, out)
        return tree_digest(str(parent))

    prepare()
    with monkeypatch.context() as patch:
        counted = Stopper(patch)
        assert reshard(command) == 0
    published = counted.calls.index(("replace", str(out / MANIFEST_NAME))) + 1
    assert published > 10, counted.calls  # the parts, the lock, the carried files: every call before it
    for k in range(1, published):
        before = prepare()
        fds = open_fds()
        with monkeypatch.context() as patch:
            stopper = Stopper(patch, stop_after=k)
            assert reshard(command) == 130, (k, stopper.calls[k - 1])
        for fd in open_fds() - fds:  # the process would have ended here, and its descriptors (flocks) with it
            with contextlib.suppress(OSError):
                os.close(int(fd))
        assert tree_digest(str(parent)) == before, (k, stopper.calls[k - 1])
        assert reshard(command) == 0, (k, stopper.calls[k - 1])
