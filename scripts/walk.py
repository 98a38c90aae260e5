"""The rooms one engine-free load and one save pass through: the package modules entered, in order.

    python scripts/walk.py            # from the repository root (PYTHONPATH=. for another checkout)

A stop is a call from one package module into another (calls within a module stay in its room);
rooms are the distinct modules; re-entries are stops into a room already visited.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

from vllm_sharded_loader.storage.location import open_store

PKG = "vllm_sharded_loader"


def walk(call, depth: int = 3):
    """The package modules entered by ``call`` from another module, down to ``depth`` package calls deep."""
    path: list[str] = []
    stack: list[str] = []  # the package modules of the frames open, the innermost last

    def profiler(frame, event, arg):
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith(PKG) or event not in ("call", "return"):
            return
        if event == "call":
            room = mod[len(PKG) + 1 :]
            if len(stack) < depth and (not stack or stack[-1] != room) and (not path or path[-1] != room):
                path.append(room)
            stack.append(room)
        elif stack:
            stack.pop()
            if stack and len(stack) <= depth and path and path[-1] != stack[-1]:
                path.append(stack[-1])  # back in the caller's room

    sys.setprofile(profiler)
    try:
        call()
    finally:
        sys.setprofile(None)
    return path


def summary(name, path):
    rooms = list(dict.fromkeys(path))
    layers = sorted({r.split(".")[0] for r in rooms})
    print(f"{name}: {len(path)} stops in {len(rooms)} rooms ({len(path) - len(rooms)} re-entries), layers {layers}")
    print("  " + " > ".join(path))


def main():
    from vllm_sharded_loader.checkpoint import LoadRequest, load_rank, read_manifest
    from vllm_sharded_loader.checkpoint.save import save_checkpoint
    from vllm_sharded_loader.format.source import SourceModel, config_sha256, normalize_config
    from vllm_sharded_loader.planning.topology import RankInfo

    source = SourceModel("TinyForCausalLM", config_sha256({}), normalize_config({}))
    ranks = {
        RankInfo(r, 2): {"model.norm.weight": torch.full((64,), float(r)), "lm.weight": torch.ones(32, 8)}
        for r in range(2)
    }
    folder = tempfile.mkdtemp()
    out = os.path.join(folder, "ckpt")
    save_checkpoint(out, ranks, dtype="float32", source=source)  # warm-up: imports
    out2 = os.path.join(folder, "ckpt2")
    summary(
        "save_checkpoint (TP=2, one process)",
        walk(lambda: save_checkpoint(out2, ranks, dtype="float32", source=source)),
    )
    targets = {n: torch.zeros_like(t) for n, t in ranks[RankInfo(0, 2)].items()}
    request = LoadRequest(open_store(out), read_manifest(out))
    load_rank(request, targets, RankInfo(0, 2))
    summary("load_rank (TP=2 rank 0, a folder)", walk(lambda: load_rank(request, targets, RankInfo(0, 2))))


if __name__ == "__main__":
    main()
