"""The test session's sweep of shared-memory segments left by killed engines (tests/support/shm.py)."""

from __future__ import annotations

import mmap
import os
import subprocess

from tests.support import shm


def test_only_new_unused_segments_of_vllms_kinds_are_removed(tmp_path):
    folder = str(tmp_path)

    def make(name: str) -> str:
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(b"\0" * mmap.PAGESIZE)
        return path

    make("psm_old")
    before = shm.segments(folder)
    make("psm_left")
    make("vllm_dist_left-cpushm_0")
    make("other_left")
    mapped = make("psm_mapped")
    held = make("vllm_dist_held-cpushm_1")
    old = os.stat(held).st_mtime - 2 * shm.MIN_AGE
    for name in os.listdir(folder):
        os.utime(os.path.join(folder, name), (old, old))
    make("psm_fresh")  # another session's engine, starting: not mapped yet

    with open(mapped, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)  # mapped by this process, its descriptor closed
    with open(held, "rb") as f:
        holder = subprocess.Popen(["sleep", "60"], stdin=f)  # open in another live process
    try:
        assert shm.remove_left(before, folder) == ["psm_left", "vllm_dist_left-cpushm_0"]
        assert sorted(os.listdir(folder)) == [
            "other_left",
            "psm_fresh",
            "psm_mapped",
            "psm_old",
            "vllm_dist_held-cpushm_1",
        ]
    finally:
        mapping.close()
        holder.kill()
        holder.wait()

    assert shm.remove_left(before, folder) == ["psm_mapped", "vllm_dist_held-cpushm_1"]
    assert sorted(os.listdir(folder)) == ["other_left", "psm_fresh", "psm_old"]
    assert shm.remove_left(before, folder, min_age=0) == ["psm_fresh"]
