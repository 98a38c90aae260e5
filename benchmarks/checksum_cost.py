"""What checksums cost: on save (hashed while writing) and with ``verify: checksum`` on load.

    python -m benchmarks.checksum_cost [--gib 1.0] [--runs 3] [--dir DIR] [--json OUT]

Engine-free: the same save and load functions the vLLM layer calls, on one rank's worth of
bfloat16 tensors (a Llama-style layer mix). In one run it measures, medians of ``--runs``:

- raw write: the same bytes written with plain ``write`` + ``fsync`` (the storage's bandwidth);
- save: :func:`save_checkpoint` (lock, staged parts hashed while written, fsync, rename, manifest);
- hash only: BLAKE3 over the same bytes, in memory;
- load, verify=size and verify=checksum, from the page cache (warm), into preallocated tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import record
from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
from vllm_sharded_loader.checkpoint.save import save_checkpoint
from vllm_sharded_loader.format import SourceModel
from vllm_sharded_loader.storage.integrity import BlockHasher
from vllm_sharded_loader.storage.location import open_store
from vllm_sharded_loader.storage.tensors import byte_view


def make_tensors(gib: float) -> dict[str, torch.Tensor]:
    hidden = 2048
    per_layer = 4 * hidden * hidden + 3 * hidden * 5632  # attention + MLP weights
    layers = max(1, int(gib * 2**30 / 2 / per_layer))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.randn(3 * hidden, hidden, generator=g)
        tensors[f"model.layers.{i}.self_attn.o_proj.weight"] = torch.randn(hidden, hidden, generator=g)
        tensors[f"model.layers.{i}.mlp.gate_up_proj.weight"] = torch.randn(2 * 5632, hidden, generator=g)
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(hidden, 5632, generator=g)
    return {k: v.to(torch.bfloat16) for k, v in tensors.items()}


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def raw_write(directory: str, tensors: dict[str, torch.Tensor]) -> None:
    with open(os.path.join(directory, "raw.bin"), "wb") as f:
        for t in tensors.values():
            f.write(byte_view(t))
        f.flush()
        os.fsync(f.fileno())


def hash_only(tensors: dict[str, torch.Tensor]) -> None:
    hasher = BlockHasher()
    for t in tensors.values():
        hasher.update(byte_view(t))
    hasher.finish()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="write the raw numbers here")
    args = parser.parse_args()
    tensors = make_tensors(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    source = SourceModel("Benchmark", "0" * 64)
    rank = RankInfo(0, 1)
    times: dict[str, list[float]] = {k: [] for k in ("raw_write", "save", "hash_only", "load_size", "load_checksum")}
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        for _ in range(args.runs):
            ckpt = os.path.join(root, "ckpt")
            shutil.rmtree(ckpt, ignore_errors=True)
            times["raw_write"].append(timed(lambda: raw_write(root, tensors)))
            os.remove(os.path.join(root, "raw.bin"))
            save = lambda ckpt=ckpt: save_checkpoint(ckpt, {rank: tensors}, dtype="bfloat16", source=source)  # noqa: E731
            times["save"].append(timed(save))
            times["hash_only"].append(timed(lambda: hash_only(tensors)))
            manifest = read_manifest(ckpt)
            # Touched memory (zeros, not empty): first-touch page faults would otherwise be
            # charged to whichever mode runs first.
            targets = {k: torch.zeros_like(v) for k, v in tensors.items()}
            for mode in ("size", "checksum") if len(times["load_size"]) % 2 == 0 else ("checksum", "size"):
                times[f"load_{mode}"].append(
                    timed(
                        lambda mode=mode, ckpt=ckpt, targets=targets, manifest=manifest: load_rank(
                            LoadRequest(open_store(ckpt), manifest, verify=mode), targets, rank
                        )
                    )
                )
            assert all(torch.equal(targets[k], tensors[k]) for k in tensors)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        **record(),
        "bytes": nbytes,
        "runs": args.runs,
        "seconds": times,
        "median_seconds": median,
        "GB_per_s": {k: nbytes / v / 1e9 for k, v in median.items()},
        "hash_share_of_save": median["hash_only"] / median["save"],
        "save_vs_raw_write": median["save"] / median["raw_write"],
        "checksum_load_overhead": median["load_checksum"] / median["load_size"] - 1,
    }
    print(f"{nbytes / 1e9:.2f} GB, medians of {args.runs} runs:")
    for k, v in median.items():
        print(f"  {k:14s} {v:7.3f} s  {nbytes / v / 1e9:6.2f} GB/s")
    print(f"  hashing is {result['hash_share_of_save']:.1%} of the save time")
    print(f"  save takes {result['save_vs_raw_write']:.2f}x the raw write of the same bytes")
    print(f"  verify=checksum loads take {result['checksum_load_overhead']:+.1%} over verify=size")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
