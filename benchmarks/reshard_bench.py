"""Resharded loads against same-topology loads, engine-free: ``load_rank`` into fresh tensors.

Builds a Llama-style bf16 model of the shape ``load_bench.py`` serves (hidden 2048,
intermediate 5632, 32 heads, 8 KV heads; 17 layers make 1.5 GB), saves it at TP=1 and at
TP=2 with ``save_checkpoint`` (geometry recorded), then times ``load_rank`` in a fresh
process per run, the way an engine's worker loads: fresh parameters, and ``adopt``
callbacks so that CPU targets may be served from file mappings (as ``engine/loader.py``
offers them). Cases, each warm (files in the page cache) and cold (evicted with
``POSIX_FADV_DONTNEED`` first):

- TP=1: the TP=1 files (same topology) and the TP=2 files resharded to TP=1;
- TP=2 rank 0: the TP=2 files (same topology) and the TP=1 files resharded to TP=2.

Prints a markdown table of medians with the ratio to the same-topology load of the same
run, and the cold sequential read speed of the files each load reads, taken just before each
cold load (on the project's VMs some files read two or three times faster than others), and
writes it with every run's time to ``--out``::

    python -m benchmarks.reshard_bench --runs 3 --out benchmarks/results/reshard_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.harness import ROOT, evict, record, warm
from vllm_sharded_loader.storage.location import open_store

CASES = (
    # (label, serving TP, saved TP)
    ("TP=1 same topology", 1, 1),
    ("TP=1 from TP=2 files", 1, 2),
    ("TP=2 same topology", 2, 2),
    ("TP=2 from TP=1 files", 2, 1),
)


def model_tensors(layers: int, vocab: int = 32000) -> dict:
    """name -> (geometry, full TP=1 tensor), Llama-style, bf16."""
    import torch

    from vllm_sharded_loader.format.geometry import (
        merged_column_parallel,
        qkv_parallel,
        replicated,
        row_parallel,
        vocab_parallel,
    )

    hidden, inter, heads, kv_heads = 2048, 5632, 32, 8
    head = hidden // heads
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.rand(shape, generator=g) - 0.5).to(torch.bfloat16)

    tensors = {}
    embed = vocab_parallel(vocab, hidden)
    tensors["model.embed_tokens.weight"] = (embed, rand(*embed.shape))
    for i in range(layers):
        p = f"model.layers.{i}."
        qkv_shape = ((heads + 2 * kv_heads) * head, hidden)
        tensors[p + "input_layernorm.weight"] = (replicated([hidden], "RMSNorm"), rand(hidden))
        tensors[p + "self_attn.qkv_proj.weight"] = (qkv_parallel(qkv_shape, heads, kv_heads, head), rand(*qkv_shape))
        tensors[p + "self_attn.o_proj.weight"] = (row_parallel([hidden, hidden]), rand(hidden, hidden))
        tensors[p + "post_attention_layernorm.weight"] = (replicated([hidden], "RMSNorm"), rand(hidden))
        gate_up = merged_column_parallel([2 * inter, hidden], [inter, inter])
        tensors[p + "mlp.gate_up_proj.weight"] = (gate_up, rand(2 * inter, hidden))
        tensors[p + "mlp.down_proj.weight"] = (row_parallel([hidden, inter]), rand(hidden, inter))
    tensors["model.norm.weight"] = (replicated([hidden], "RMSNorm"), rand(hidden))
    head_geometry = vocab_parallel(vocab, hidden, layer_class="ParallelLMHead")
    tensors["lm_head.weight"] = (head_geometry, rand(*head_geometry.shape))
    return tensors


def source():
    from vllm_sharded_loader.format import SourceModel, config_sha256, normalize_config

    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 17, "hidden_size": 2048}
    return SourceModel("LlamaForCausalLM", config_sha256(config), normalize_config(config))


def build(work: str, layers: int) -> dict[int, str]:
    """Save the model at TP=1 and TP=2 (the TP=2 shards are cut by the TP=1 resharding load)."""
    import torch

    from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank
    from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint
    from vllm_sharded_loader.planning.layout import shard_layout

    dirs = {tp: os.path.join(work, f"tp{tp}") for tp in (1, 2)}
    if all(os.path.exists(os.path.join(d, "sharded_state.json")) for d in dirs.values()):
        return dirs
    tensors = model_tensors(layers)
    geometry = {n: g.to_dict() for n, (g, _) in tensors.items()}
    full = {n: t for n, (_, t) in tensors.items()}
    options = SaveOptions(max_size=5 << 30, geometry=geometry, overwrite=True)
    save_checkpoint(dirs[1], {RankInfo(0, 1): full}, dtype="bfloat16", source=source(), options=options)
    from vllm_sharded_loader.checkpoint import read_manifest

    manifest = read_manifest(dirs[1])
    ranks = {}
    for rank in range(2):
        local = {
            n: torch.empty(shard_layout(g, 2, rank, n).shape, dtype=torch.bfloat16) for n, (g, _) in tensors.items()
        }
        load_rank(LoadRequest(open_store(dirs[1]), manifest), local, RankInfo(rank, 2))
        ranks[RankInfo(rank, 2)] = local
    save_checkpoint(dirs[2], ranks, dtype="bfloat16", source=source(), options=options)
    return dirs


def files_of(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def sequential_read(paths: list[str]) -> float:
    """GB/s of one thread reading the files from cold, 64 MiB at a time: what the storage gives now."""
    evict(paths)
    buffer = bytearray(64 << 20)
    total, started = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total / (time.perf_counter() - started) / 1e9


def files_read(directory: str, tp: int, saved: int) -> list[str]:
    """The files a rank-0 load reads: its own at the same TP size, every file when resharding."""
    if tp == saved:
        return [p for p in files_of(directory) if "-rank-0-" in os.path.basename(p)]
    return files_of(directory)


def child(spec: dict) -> None:
    """One timed load in this fresh process; prints a JSON line."""
    import torch

    from vllm_sharded_loader.checkpoint import LoadRequest, RankInfo, load_rank, read_manifest
    from vllm_sharded_loader.planning.layout import shard_layout

    directory, tp, verify = spec["directory"], spec["tp"], spec["verify"]
    manifest = read_manifest(directory)
    geometries = manifest.geometries
    targets = {n: torch.empty(shard_layout(g, tp, 0, n).shape, dtype=torch.bfloat16) for n, g in geometries.items()}
    adopted: dict[str, torch.Tensor] = {}
    adopt = {n: (lambda t, n=n: adopted.__setitem__(n, t)) for n in targets} if spec["mmap"] else None
    if spec["cold"]:
        evict(files_of(directory))
    started = time.perf_counter()
    stats = load_rank(
        LoadRequest(open_store(directory), manifest, verify=verify), targets, RankInfo(0, tp), adopt=adopt
    )
    seconds = time.perf_counter() - started
    mapped = sum(t.numel() * t.element_size() for t in adopted.values())
    print(json.dumps({"seconds": seconds, "bytes_read": stats.bytes_read, "bytes_mapped": mapped}), flush=True)


def run_child(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.reshard_bench", "--child", json.dumps(spec)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "sharded-reshard-bench"))
    parser.add_argument("--layers", type=int, default=17)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--verify", default="size", choices=("size", "checksum"))
    parser.add_argument("--no-mmap", action="store_true", help="offer no adopt callbacks: every tensor is copied")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    dirs = build(args.work, args.layers)
    times: dict[tuple[str, str], list[float]] = {}
    probes: dict[str, list[float]] = {}
    info: dict[tuple[str, str], dict] = {}
    for run in range(args.runs):
        for mode in ("warm", "cold"):
            for label, tp, saved in CASES:
                if mode == "warm":
                    warm(files_of(dirs[saved]))
                else:
                    # The same disk reads some files much faster than others (the host's cache):
                    # the storage's speed for exactly these files, just before the load.
                    probes.setdefault(label, []).append(sequential_read(files_read(dirs[saved], tp, saved)))
                spec = dict(
                    directory=dirs[saved], tp=tp, verify=args.verify, mmap=not args.no_mmap, cold=mode == "cold"
                )
                r = run_child(spec)
                times.setdefault((label, mode), []).append(r["seconds"])
                info[(label, mode)] = r
                print(f"run {run} {mode} {label}: {r['seconds']:.3f} s, mapped {r['bytes_mapped'] / 1e6:.0f} MB "
                      f"of {r['bytes_read'] / 1e6:.0f} MB", file=sys.stderr, flush=True)  # fmt: skip
    lines = [
        f"verify={args.verify}, mmap={not args.no_mmap}, {args.runs} runs, medians",
        "",
        "| load | warm (s) | / same topology | cold (s) | / same topology | MB read | MB in adopted tensors "
        "| cold GB/s | cold sequential read of its files, GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    medians = {key: statistics.median(v) for key, v in times.items()}
    for label, tp, _saved in CASES:
        same = next(c[0] for c in CASES if c[1] == tp and c[2] == tp)
        row = [label]
        for mode in ("warm", "cold"):
            m = medians[(label, mode)]
            row += [f"{m:.3f}", f"{m / medians[(same, mode)]:.2f}x"]
        r = info[(label, "warm")]
        row += [f"{r['bytes_read'] / 1e6:.0f}", f"{r['bytes_mapped'] / 1e6:.0f}"]
        row += [f"{r['bytes_read'] / medians[(label, 'cold')] / 1e9:.2f}", f"{statistics.median(probes[label]):.2f}"]
        lines.append("| " + " | ".join(row) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    **record(),
                    "runs": {f"{k[0]}|{k[1]}": v for k, v in times.items()},
                    "cold_sequential": probes,
                    "table": table,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
