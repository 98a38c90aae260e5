"""Checkpoints derived from a saved one without an engine, for the issue 34 tests: other weights of the
same model, and copies with one rank's files bad."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_sharded_loader.checkpoint import RankInfo, read_manifest
from vllm_sharded_loader.checkpoint.save import SaveOptions, save_checkpoint


def tensors_of(directory: str) -> dict[tuple[int, int, str], torch.Tensor]:
    """Every tensor of a checkpoint, by (pp_rank, tp_rank, name)."""
    manifest = read_manifest(directory)
    found = {}
    for entry in manifest.ranks:
        for f in entry.files:
            for name, t in load_file(str(Path(directory, f.name))).items():
                found[(entry.pp_rank, entry.tp_rank, name)] = t
    return found


def changed_copy(source: str, out: str, scale: float = 1.25, overwrite: bool = False) -> str:
    """``source``'s checkpoint with every floating tensor changed (scaled and shifted): another set of weights
    for the same model, saved without an engine with the same geometry and tied names (over ``out``'s
    checkpoint with ``overwrite``, as a trainer rewrites its "latest" folder)."""
    manifest = read_manifest(source)
    ranks = {}
    for entry in manifest.ranks:
        tensors: dict[str, torch.Tensor] = {}
        for f in entry.files:
            tensors.update(load_file(str(Path(source, f.name))))
        rank = RankInfo(entry.tp_rank, manifest.tp_size, entry.pp_rank, manifest.pp_size, experts=manifest.experts)
        ranks[rank] = {
            name: (t * scale + 0.01).to(t.dtype) if t.is_floating_point() else t for name, t in tensors.items()
        }
    save_checkpoint(
        out,
        ranks,
        dtype=manifest.dtype,
        source=manifest.source,
        options=SaveOptions(
            geometry=manifest.geometry, tied=manifest.tied, experts=manifest.experts, overwrite=overwrite
        ),
    )
    return out


def rank_parts(directory: str, rank: int) -> list[Path]:
    """The parts of the manifest's ``rank``-th rank (ranks in the manifest's order: by PP rank, then TP rank)."""
    entry = read_manifest(directory).ranks[rank]
    return [Path(directory, f.name) for f in entry.files]


def one_rank_rewritten(source: str, out: str, rank: int) -> str:
    """``source`` with one part of its ``rank``-th rank rewritten in place, same size: only checksums tell."""
    shutil.copytree(source, out)
    part = max(rank_parts(out, rank), key=lambda p: p.stat().st_size)
    with open(part, "r+b") as f:
        f.seek(part.stat().st_size * 3 // 4)
        f.write(b"\x7f" * 256)
    return out


def one_rank_missing(source: str, out: str, rank: int) -> str:
    """``source`` with the parts of its ``rank``-th rank gone (a partly copied checkpoint)."""
    shutil.copytree(source, out)
    for part in rank_parts(out, rank):
        part.unlink()
    return out
