"""The reader's real CUDA staging path, on a GPU: casts, FP8, non-contiguous targets, checksums.

Runs only where CUDA is available (a lent GPU machine: ``python -m pytest tests/test_gpu_staging.py``);
everywhere else each test is skipped with the reason. ``tests/test_reader_device.py`` checks
the same path's use of streams and devices without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.support.pagecache import evict
from vllm_sharded_loader.format import HASH_NAME, FileChecksum
from vllm_sharded_loader.format.errors import CheckpointCorrupt
from vllm_sharded_loader.storage import direct, local, tensor_files
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.reader import ReadOptions

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the staging path copies into device memory)"
)
BLOCK = 64 * 1024


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
        [local.read_header(path)], targets, options=ReadOptions(threads=threads, span_bytes=BLOCK)
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
    with pytest.raises(CheckpointCorrupt):
        tensor_files.read_files([header], targets, {path: checksum}, options=ReadOptions(threads=2))


@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize(
    ("saved", "serving"),
    [((1, 1), (2, 1)), ((2, 1), (1, 1)), ((2, 2), (1, 4))],
    ids=["tp1-to-tp2", "tp2-to-tp1-rows-joined", "tp2pp2-to-pp4"],
)
def test_a_resharded_load_lands_on_the_gpu_as_on_the_cpu(tmp_path, monkeypatch, mode, saved, serving):
    """``load_rank`` (a worker's whole load, vLLM aside) onto CUDA parameters, resharded (row-parallel
    halves joined on the way), with checksums when blake3 is there: equal to vLLM's sharding rule."""
    from tests.support.checkpoints import save_model, source_of, stage_state
    from tests.support.reference import llama_like
    from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest

    monkeypatch.setenv(direct.ENV, mode)
    model = llama_like(num_layers=4, vocab=1000, kv_heads=2)
    save_model(tmp_path, model, *saved)
    manifest = read_manifest(str(tmp_path))
    verify = "checksum" if _has_blake3() else "size"
    tp_size, pp_size = serving
    for p in range(pp_size):
        for t in range(tp_size):
            expected = stage_state(model, tp_size, pp_size, t, p)
            targets = {name: torch.full_like(x, -7, device="cuda") for name, x in expected.items()}
            stats = load_rank(
                LoadRequest(
                    open_store(str(tmp_path)), manifest, verify=verify, serving=source_of(model), tied=model.tied_groups
                ),
                targets,
                RankInfo(t, tp_size, p, pp_size),
            )
            torch.cuda.synchronize()
            assert stats.resharded_from == saved
            for name, x in expected.items():
                assert targets[name].device.type == "cuda", name
                assert torch.equal(targets[name].cpu(), x), (name, t, p)


def _has_blake3() -> bool:
    try:
        import blake3  # noqa: F401
    except ImportError:
        return False
    return True
