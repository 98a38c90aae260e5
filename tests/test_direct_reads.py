"""Reads that bypass the page cache (:mod:`vllm_sharded_loader.storage.direct`), on real files."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import save_file

from tests.support.pagecache import evict
from vllm_sharded_loader.format import HASH_NAME, FileChecksum
from vllm_sharded_loader.format.errors import CheckpointCorrupt, InvalidOption
from vllm_sharded_loader.planning.spans import Piece
from vllm_sharded_loader.storage import direct, local, memory, reader, tensor_files
from vllm_sharded_loader.storage.reader import ReadOptions

BLOCK = 64 * 1024


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def open_direct(path: str, window: int) -> direct.DirectStream:
    with local.OpenFile.open(path) as f:
        stream = direct.DirectStream.open(path, f.fd, f.size, window)
    if stream is None:
        pytest.skip(f"the file system of {path} refuses O_DIRECT")
    return stream


def test_direct_stream_serves_unaligned_requests_across_windows_and_at_the_end(tmp_path):
    data = os.urandom(3 * direct.ALIGN * 5 + 123)
    path = write(tmp_path / "f", data)
    stream = open_direct(path, window=2 * direct.ALIGN)
    try:
        for offset, sizes in [(0, [1]), (7, [100, 0, 5000]), (direct.ALIGN * 3 - 3, [9000]), (len(data) - 50, [50])]:
            views = [memoryview(bytearray(n)) for n in sizes]
            stream.readv(views, offset)
            assert b"".join(bytes(v) for v in views) == data[offset : offset + sum(sizes)]
        stream.hold(10, len(data))  # one request for the rest of the file, then copies out of it
        view = memoryview(bytearray(len(data) - 10))
        stream.readv([view], 10)
        assert bytes(view) == data[10:]
        with pytest.raises(CheckpointCorrupt):
            stream.readv([memoryview(bytearray(10))], len(data) - 5)
    finally:
        stream.close()


def test_the_setting_decides_the_path(tmp_path, monkeypatch):
    path = write(tmp_path / "f", os.urandom(64 * direct.ALIGN))
    with local.OpenFile.open(path) as f:
        evict(path)
        # auto keeps the page cache, cold or warm, on every target (measured no slower: see direct.py).
        assert not direct.choose_direct([(f.fd, f.size)], "auto")
        assert direct.choose_direct([(f.fd, f.size)], "on") and not direct.choose_direct([(f.fd, f.size)], "off")
        assert not direct.choose_direct([], "on")
    monkeypatch.setenv(direct.ENV, "sometimes")
    with pytest.raises(InvalidOption, match="SHARDED_STATE_DIRECT_IO='sometimes'"):
        direct.direct_mode()


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a.weight": torch.randn(300, 77, generator=g).to(torch.bfloat16),  # not a multiple of a page
        "b.norm": torch.randn(13, generator=g),
        "c.weight": torch.randn(1000, 130, generator=g).to(torch.bfloat16),
        "d.scale": torch.randn(3, generator=g),
        "e.ids": torch.arange(5000, dtype=torch.int64),
    }


@pytest.mark.parametrize("mode", ["on", "off", "auto"])
def test_a_cold_load_reads_every_tensor_exactly_with_casts_and_checksums(tmp_path, monkeypatch, mode):
    monkeypatch.setenv(direct.ENV, mode)
    state = tensors()
    path = str(tmp_path / "part.safetensors")
    save_file(state, path)
    data = Path(path).read_bytes()
    blocks = [blake3.blake3(data[i : i + BLOCK]).hexdigest() for i in range(0, len(data), BLOCK)]
    evict(path)
    headers = [local.read_header(path)]
    # Casts (bf16 -> f32) are staged; a non-contiguous target is read whole, then copied.
    targets = {
        "a.weight": torch.zeros(300, 77, dtype=torch.float32),
        "b.norm": torch.zeros(13),
        "c.weight": torch.zeros(130, 1000, dtype=torch.bfloat16).t(),
        "d.scale": torch.zeros(3),
        "e.ids": torch.zeros(5000, dtype=torch.int64),
    }
    checksum = FileChecksum(HASH_NAME, BLOCK, tuple(blocks))
    stats = tensor_files.read_files(
        headers, targets, {path: checksum}, options=ReadOptions(threads=3, span_bytes=BLOCK)
    )
    assert stats.direct == (mode == "on")  # auto: CPU targets keep the page cache
    for name, t in state.items():
        assert torch.equal(targets[name], t.to(targets[name].dtype)), name
    # A corrupt block is still caught on the direct path.
    evict(path)
    with open(path, "r+b") as f:
        f.seek(len(data) - 100)
        f.write(bytes(10))
    evict(path)
    with pytest.raises(CheckpointCorrupt):
        tensor_files.read_files(headers, targets, {path: checksum}, options=ReadOptions(threads=2, span_bytes=BLOCK))


def test_mapped_targets_keep_the_page_cache_and_the_rest_is_read_directly(tmp_path, monkeypatch):
    monkeypatch.setenv(direct.ENV, "on")
    state = tensors()
    path = str(tmp_path / "part.safetensors")
    save_file(state, path)
    evict(path)
    adopted: dict[str, torch.Tensor] = {}
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    adopt = {"c.weight": lambda t: adopted.__setitem__("c.weight", t)}
    stats = tensor_files.read_files([local.read_header(path)], targets, adopt=adopt, options=ReadOptions(threads=2))
    assert stats.direct and stats.bytes_mapped == state["c.weight"].numel() * 2
    assert torch.equal(adopted.pop("c.weight"), state["c.weight"])
    for name in ("a.weight", "b.norm", "d.scale", "e.ids"):
        assert torch.equal(targets[name], state[name]), name


def test_a_file_truncated_after_its_header_was_read_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(direct.ENV, "on")
    path = write(tmp_path / "f", os.urandom(3 * BLOCK))
    target = memory.Target(torch.zeros(2 * BLOCK, dtype=torch.uint8), torch.uint8)
    with local.OpenFile.open(path) as f:
        os.truncate(path, BLOCK)
        with pytest.raises(CheckpointCorrupt, match=f"{path}: file ended"):
            reader.read_pieces([f], [Piece(0, BLOCK // 2, 2 * BLOCK, dest=0)], [target])
