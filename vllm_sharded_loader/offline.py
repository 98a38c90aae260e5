"""Checkpoint tools that need no engine: inspect, and reshard to another TP/PP size on disk.

Resharding offline uses the same plans as resharding at load (:mod:`.resharding`) and the
same save protocol (:mod:`.saving`), one tensor at a time: memory holds a single tensor,
never the model.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from . import resharding as rs
from .checkpoint import RankInfo, ReshardSource, read_manifest
from .format import LOCK_NAME, MANIFEST_NAME, Manifest, ShardedStateError
from .safetensors_io import LazyTensor
from .saving import DEFAULT_MAX_SIZE, read_lock, save_checkpoint


def require_manifest(directory: str) -> Manifest:
    manifest = read_manifest(directory)
    if manifest is None:
        raise ShardedStateError(
            f"{directory} has no {MANIFEST_NAME}: not a checkpoint of vllm-sharded-loader (or an incomplete one)."
        )
    return manifest


def inspect_checkpoint(directory: str) -> dict[str, Any]:
    """What a checkpoint holds, as JSON data: topology, files, dtype, tensors, source, geometry."""
    manifest = require_manifest(directory)
    kinds: dict[str, int] = {}
    for g in manifest.geometry.values():
        kind = g.get("kind", "?") if isinstance(g, dict) else "?"
        kinds[kind] = kinds.get(kind, 0) + 1
    names = {n for r in manifest.ranks for n in r.tensors}
    return {
        "directory": os.path.abspath(directory),
        "format_version": manifest.format_version,
        "tp_size": manifest.tp_size,
        "pp_size": manifest.pp_size,
        "dtype": manifest.dtype,
        "pattern": manifest.pattern,
        "source": {"architecture": manifest.source.architecture, "config_sha256": manifest.source.config_sha256},
        "bytes": manifest.nbytes,
        "tensors": len(names),
        "tensor_entries": sum(len(r.tensors) for r in manifest.ranks),
        "ranks": [
            {
                "pp_rank": r.pp_rank,
                "tp_rank": r.tp_rank,
                "tensors": len(r.tensors),
                "files": [{"name": f.name, "size": f.size, "checksum": f.checksum is not None} for f in r.files],
            }
            for r in manifest.ranks
        ],
        "checksums": all(f.checksum is not None for r in manifest.ranks for f in r.files),
        "geometry": {
            "tensors": len(manifest.geometry),
            "kinds": dict(sorted(kinds.items())),
            "reshardable": bool(manifest.geometry) and kinds.get(rs.OPAQUE, 0) == 0 and names <= set(manifest.geometry),
        },
        "tied": [list(g) for g in manifest.tied],
        "locked": read_lock(directory) is not None,
    }


def stage_names(manifest: Manifest, pp_size: int, pp_rank: int) -> list[str]:
    """The tensors a pipeline stage holds at ``pp_size``, saved under the names a worker would use.

    The same stage of the same PP size: exactly what was saved. Another PP size: decoder
    layers go to stages as vLLM's ``get_pp_indices`` splits them; the input embedding to
    the first stage; everything else (final norm, LM head) to the last. Tied names are
    written once per stage, under the name vLLM keeps (the one that sorts first).
    """
    if pp_size == manifest.pp_size:
        return list(manifest.rank(0, pp_rank).tensors)
    layers = manifest.source.config.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < pp_size:
        raise ShardedStateError(
            f"Cannot split the layers into {pp_size} pipeline stages: the saved config has num_hidden_layers="
            f"{layers!r}."
        )
    ranges = rs.pp_layer_ranges(layers, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    saved = {n for r in manifest.ranks for n in r.tensors}
    names = set()
    for name in saved | {n for g in manifest.tied for n in g}:
        layer = rs.layer_index(name)
        if layer is not None:
            keep = layer in ranges[pp_rank]
        elif "embed_tokens" in name:
            keep = first
        else:
            keep = last
        if keep:
            names.add(name)
    # Names sharing one tensor on this stage are saved once, as vLLM's state dict dedups them.
    for group in manifest.tied:
        present = sorted(n for n in group if n in names)
        for extra in present[1:]:
            names.discard(extra)
    return sorted(names)


def reshard_checkpoint(
    directory: str,
    output: str,
    tp_size: int,
    pp_size: int | None = None,
    *,
    max_size: int | None = DEFAULT_MAX_SIZE,
    overwrite: bool = False,
) -> Manifest:
    """Write ``directory``'s checkpoint resharded to ``tp_size`` x ``pp_size`` into ``output``.

    The output loads at the new topology without resharding at load time. Non-weight
    files (config, tokenizer) are copied first; the manifest is written last.
    """
    from .saving import copy_non_weight_files

    manifest = require_manifest(directory)
    if os.path.exists(os.path.join(directory, LOCK_NAME)):
        raise ShardedStateError(f"{directory} is being saved or its save was interrupted ({LOCK_NAME} exists).")
    pp_size = manifest.pp_size if pp_size is None else pp_size
    if tp_size < 1 or pp_size < 1:
        raise ShardedStateError(f"Sizes must be >= 1, got TP={tp_size} PP={pp_size}.")
    if os.path.abspath(output) == os.path.abspath(directory):
        raise ShardedStateError("--output must be another directory than the source checkpoint.")
    with ReshardSource(directory, manifest) as source:
        # Plan every rank before writing anything: a refused tensor leaves no output behind.
        plans = {}
        for pp_rank in range(pp_size):
            names = stage_names(manifest, pp_size, pp_rank)
            for tp_rank in range(tp_size):
                rank = RankInfo(tp_rank, tp_size, pp_rank, pp_size)
                plans[rank] = source.plan(names, rank)
        os.makedirs(output, exist_ok=True)
        copy_non_weight_files(directory, output)

        def lazy(tensor_plan: Any) -> LazyTensor:
            dtype = source.stored_dtype(tensor_plan)

            def produce() -> torch.Tensor:
                tensor = torch.empty(tensor_plan.shape, dtype=dtype)
                source.fill(tensor_plan, tensor)
                return tensor

            return LazyTensor(tuple(tensor_plan.shape), dtype, produce)

        ranks = {rank: {n: lazy(p) for n, p in plan.tensors.items()} for rank, plan in plans.items()}
        return save_checkpoint(
            output,
            ranks,
            dtype=manifest.dtype,
            source=manifest.source,
            max_size=max_size,
            overwrite=overwrite,
            geometry=manifest.geometry,
            tied=manifest.tied,
        )
