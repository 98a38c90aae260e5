"""The reader's real CUDA staging path, on a GPU: casts, FP8, non-contiguous targets, checksums.

Runs only where CUDA is available (a lent GPU machine: ``python -m pytest tests/test_gpu_staging.py``);
everywhere else each test is skipped with the reason. ``tests/test_reader_device.py`` checks
the same path's use of streams and devices without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from vllm_sharded_loader.format import HASH_NAME, FileChecksum, ShardedStateError
from vllm_sharded_loader.storage import direct, local, tensor_files
from vllm_sharded_loader.storage.reader import ReadOptions

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the staging path copies into device memory)"
)
BLOCK = 64 * 1024


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def saved(tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    state = {
        "embed.weight": torch.randn(1000, 96, generator=g).to(torch.bfloat16),
        "qkv.weight": (torch.randn(384, 128, generator=g) * 0.5).to(torch.float8_e4m3fn),
        "qkv.weight_scale": torch.rand(384, 1, generator=g),
        "qkv.input_scale": torch.rand(1, generator=g),
        "norm.weight": torch.randn(96, generator=g).to(torch.bfloat16),
        "down.weight": torch.randn(128, 300, generator=g).to(torch.bfloat16),
    }
    path = str(tmp_path / "part.safetensors")
    save_file(state, path)
    return path, state


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().cpu().view(torch.uint8)


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("threads", [1, 4])
def test_every_tensor_lands_exactly_on_the_gpu(tmp_path, monkeypatch, mode, threads):
    monkeypatch.setenv(direct.ENV, mode)
    path, state = saved(tmp_path)
    evict(path)
    device = torch.device("cuda", torch.cuda.current_device())
    targets = {
        "embed.weight": torch.empty(1000, 96, dtype=torch.float32, device=device),  # cast bf16 -> f32
        "qkv.weight": torch.empty(384, 128, dtype=torch.float8_e4m3fn, device=device),  # FP8 as stored
        "qkv.weight_scale": torch.empty(384, 1, device=device),
        "qkv.input_scale": torch.empty(1, device=device),
        "norm.weight": torch.empty(96, dtype=torch.bfloat16, device=device),
        "down.weight": torch.empty(300, 128, dtype=torch.bfloat16, device=device).t(),  # not contiguous
    }
    stats = tensor_files.read_files(
        [local.read_header(path)], targets, options=ReadOptions(threads=threads), span_bytes=BLOCK
    )
    torch.cuda.synchronize()
    assert stats.direct == (mode == "on")
    assert torch.equal(targets["embed.weight"].cpu(), state["embed.weight"].float())
    for name in ("qkv.weight", "qkv.weight_scale", "qkv.input_scale", "norm.weight", "down.weight"):
        assert targets[name].device == device
        assert torch.equal(as_bytes(targets[name]), as_bytes(state[name])), name


def test_checksums_are_verified_on_the_way_to_the_gpu(tmp_path):
    blake3 = pytest.importorskip("blake3", reason="checksums need the blake3 package (carry its wheel)")
    path, state = saved(tmp_path)
    with open(path, "rb") as f:
        data = f.read()
    blocks = tuple(blake3.blake3(data[i : i + BLOCK]).hexdigest() for i in range(0, len(data), BLOCK))
    checksum = FileChecksum(HASH_NAME, BLOCK, blocks)
    header = local.read_header(path)
    targets = {n: torch.empty(t.shape, dtype=t.dtype, device="cuda") for n, t in state.items()}
    tensor_files.read_files([header], targets, {path: checksum}, options=ReadOptions(threads=2))
    torch.cuda.synchronize()
    for name, t in state.items():
        assert torch.equal(as_bytes(targets[name]), as_bytes(t)), name
    with open(path, "r+b") as f:
        f.seek(len(data) // 2)
        f.write(bytes(16))
    evict(path)
    with pytest.raises(ShardedStateError, match="checksum"):
        tensor_files.read_files([header], targets, {path: checksum}, options=ReadOptions(threads=2))
