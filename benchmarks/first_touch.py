"""What first touch of fresh memory costs, against mapping the page cache: the next step of issue 3.

    python -m benchmarks.first_touch PATH.safetensors --runs 3

For a warm file (read just before), each run starts a fresh process (fresh memory, as an
engine worker has) and measures one of:

- ``read``: our reader into newly allocated tensors (what every loader does: copy into
  fresh parameters);
- ``map``: ``mmap(MAP_PRIVATE)`` of the file and a touch of every page (what serving weights
  from page-cache pages, copy-on-write, would cost at the first use of the weights).

Prints GB/s of each run, alternating the two.
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import time


def child(path: str, mode: str) -> float:
    import torch

    from vllm_sharded_loader.storage import local, tensor_files, tensors

    size = os.path.getsize(path)
    with open(path, "rb") as f:  # warm
        while f.read(64 << 20):
            pass
    started = time.perf_counter()
    if mode == "read":
        header = local.read_header(path)
        targets = {n: torch.empty(e.shape, dtype=tensors.torch_dtype(e.dtype, n)) for n, e in header.tensors.items()}
        tensor_files.read_files([header], targets)
    else:
        fd = os.open(path, os.O_RDONLY)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        torch.frombuffer(mapped, dtype=torch.uint8)[::4096].sum()  # one byte of every page
    return size / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", choices=("read", "map"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(child(args.path, args.child))
        return
    for run in range(args.runs):
        for mode in ("read", "map"):
            time.sleep(2)  # let the previous process's memory go back to the host, as between restarts
            out = subprocess.run(
                [sys.executable, __file__, args.path, "--child", mode], capture_output=True, text=True, check=True
            )
            print(f"run {run} {mode:4s} {float(out.stdout):.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
