"""The trainer side of a weight update: write a sharded checkpoint, then have a running server take it.

A training job that holds each rank's slice in vLLM's layout (the state a sharded checkpoint
stores: fused ``qkv_proj``, ``gate_up_proj``, each TP rank's rows or columns) writes it with
``vllm_sharded_loader.checkpoint.save.save_checkpoint`` (one process, every rank) and hands the
folder to the server through vLLM's RL API; each server worker then reads only its own slice,
resharded if the trainer's TP size differs from the server's. This example plays the trainer:
it takes the served checkpoint's tensors, applies a "training step" (seeded noise), writes the
result beside it, and updates the server, timing each part of the cycle::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model CKPT \\
        --load-format sharded_state --weight-transfer-config '{"backend": "sharded_state"}'
    python examples/update_weights.py --checkpoint CKPT --output NEW --url http://127.0.0.1:8000

Without ``--url`` it starts an engine in process (``LLM``) and uses the offline API instead.
A trainer whose weights are in the Hugging Face format saves them with
``examples/save_sharded_state.py`` (an engine at the served TP size) instead of the first step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import urllib.error
import urllib.request

import torch
from safetensors.torch import load_file

from vllm_sharded_loader.checkpoint import RankInfo, read_manifest
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint


def train_step(checkpoint: str, output: str, seed: int) -> float:
    """Write ``checkpoint``'s weights plus seeded noise to ``output`` as a sharded checkpoint; its seconds."""
    started = time.perf_counter()
    manifest = read_manifest(checkpoint)
    if manifest is None:
        raise SystemExit(f"{checkpoint} has no manifest: save it with examples/save_sharded_state.py first.")
    generator = torch.Generator().manual_seed(seed)
    ranks = {}
    for entry in manifest.ranks:
        tensors: dict[str, torch.Tensor] = {}
        for part in entry.files:
            tensors.update(load_file(os.path.join(checkpoint, part.name)))
        for t in tensors.values():
            if t.is_floating_point() and t.numel() > 1:
                noise = torch.randn(t.shape, generator=generator, dtype=torch.float32) * 0.01
                t.copy_((t.float() * (1 + noise)).to(t.dtype))
        ranks[RankInfo(entry.tp_rank, manifest.tp_size, entry.pp_rank, manifest.pp_size)] = tensors
    # The same model (source), dtype, geometry (so a server at another TP size reshards it) and ties.
    save_checkpoint(
        output,
        ranks,
        dtype=manifest.dtype,
        source=manifest.source,
        options=SaveOptions(geometry=manifest.geometry, tied=manifest.tied, overwrite=True),
    )
    return time.perf_counter() - started


def post(url: str, body: dict | None = None) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=600).read()


def update_online(url: str, path: str) -> float:
    """vLLM's RL routes: pause, update, resume. ``finish_weight_update`` runs after a refusal too
    (at TP>1 it ends the session on the workers that did not raise the refusal)."""
    started = time.perf_counter()
    post(f"{url}/pause")
    try:
        post(f"{url}/start_weight_update")
        try:
            post(f"{url}/update_weights", {"update_info": {"path": path}})
        except urllib.error.HTTPError:
            with contextlib.suppress(urllib.error.HTTPError):  # no session left on the last worker
                post(f"{url}/finish_weight_update")
            raise
        post(f"{url}/finish_weight_update")
    finally:
        post(f"{url}/resume")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the sharded checkpoint the server serves")
    parser.add_argument("--output", required=True, help="where the trainer writes the updated checkpoint")
    parser.add_argument("--url", help="the server (started with VLLM_SERVER_DEV_MODE=1); default: an engine here")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    written = train_step(args.checkpoint, args.output, args.seed)
    if args.url:
        post(f"{args.url}/init_weight_transfer_engine", {"init_info": {}})
        updated = update_online(args.url, os.path.abspath(args.output))
    else:
        from vllm import LLM

        llm = LLM(
            model=args.checkpoint,
            load_format="sharded_state",
            weight_transfer_config={"backend": "sharded_state"},
            enforce_eager=True,
        )
        llm.init_weight_transfer_engine({"init_info": {}})
        started = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"path": os.path.abspath(args.output)}})
        llm.finish_weight_update()
        updated = time.perf_counter() - started
    print(f"update cycle: trainer wrote {args.output} in {written:.2f} s, server took it in {updated:.2f} s")


if __name__ == "__main__":
    main()
