"""The core reader straight to a GPU, against pinned host-to-device bandwidth and safetensors.

Needs torch with CUDA and safetensors, not vLLM (the lent GPU machines have no vLLM):

    python -m benchmarks.gpu_reader --gb 2 --runs 3 --json gpu_reader.json

Builds a bfloat16 safetensors file of ``--gb`` GB (Llama-like tensor sizes), then, with the
file in the page cache (warm), measures medians of ``--runs`` runs of:

- ``h2d_pinned``: one pinned host buffer copied to the GPU (the bound);
- ``safe_open_cuda``: ``safe_open(path, "pt", device="cuda")`` and every ``get_tensor``;
- ``ours``: :func:`vllm_sharded_loader.storage.tensor_files.read_files` into preallocated CUDA tensors
  (pinned staging, two buffers per thread, non-blocking copies on per-thread streams).

Checks that our tensors equal safetensors'. Target: ours at 80% or more of ``h2d_pinned``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_sharded_loader.storage import local, reader, tensor_files
from vllm_sharded_loader.storage.reader import ReadOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=reader.DEFAULT_THREADS)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark measures the reader's GPU path")
    elements = 2048 * 5632
    count = max(1, int(args.gb * 1e9 // (elements * 2)))
    work = tempfile.mkdtemp()
    path = os.path.join(work, "weights.safetensors")
    save_file({f"w{i}": torch.randn(elements, dtype=torch.bfloat16) for i in range(count)}, path)
    nbytes = os.path.getsize(path)
    header = local.read_header(path)
    with open(path, "rb") as f:  # warm: the file is in the page cache
        while f.read(64 << 20):
            pass

    def h2d() -> float:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        started = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def library() -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with safe_open(path, "pt", device="cuda") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        torch.cuda.synchronize()
        library.tensors = tensors  # type: ignore[attr-defined]
        return time.perf_counter() - started

    def ours() -> float:
        targets = {n: torch.empty(e.shape, dtype=torch.bfloat16, device="cuda") for n, e in header.tensors.items()}
        torch.cuda.synchronize()
        started = time.perf_counter()
        tensor_files.read_files([header], targets, options=ReadOptions(threads=args.threads))
        torch.cuda.synchronize()
        ours.tensors = targets  # type: ignore[attr-defined]
        return time.perf_counter() - started

    results: dict[str, list[float]] = {"h2d_pinned": [], "safe_open_cuda": [], "ours": []}
    for _ in range(args.runs):
        results["h2d_pinned"].append(nbytes / h2d() / 1e9)
        results["safe_open_cuda"].append(nbytes / library() / 1e9)
        results["ours"].append(nbytes / ours() / 1e9)
    for name, t in ours.tensors.items():  # type: ignore[attr-defined]
        assert torch.equal(t, library.tensors[name]), name  # type: ignore[attr-defined]
    summary = {k: statistics.median(v) for k, v in results.items()}
    report = {
        "device": torch.cuda.get_device_name(),
        "bytes": nbytes,
        "gbps": results,
        "median": summary,
        "ours_over_h2d": summary["ours"] / summary["h2d_pinned"],
        "ours_over_safe_open": summary["ours"] / summary["safe_open_cuda"],
    }
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
