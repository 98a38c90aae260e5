"""Quantized layers' tensors as the planner's executor sees them: their bytes as integers, one
saved rank's files.
"""

from __future__ import annotations

import numpy as np

from vllm_sharded_loader.format.geometry import OPAQUE, TensorGeometry
from vllm_sharded_loader.planning.reads import SavedRank, SavedTensor


def as_array(tensor) -> np.ndarray:
    """The tensor's bytes as integers of its item size (what the planner's executor yields)."""
    raw = tensor.detach().contiguous().view(-1).view(dtype=_int_dtype(tensor.element_size()))
    return raw.numpy().reshape(tuple(tensor.shape))


def _int_dtype(itemsize: int):
    import torch

    return {1: torch.int8, 2: torch.int16, 4: torch.int32}[itemsize]


def save_rank(
    geometry: dict[str, TensorGeometry], tensors: dict, rank: int, files: dict[str, bytearray], what: str
) -> tuple[dict[str, TensorGeometry], SavedRank]:
    """Saved rank ``rank`` as our save writes it: the geometry recorded for its tensors (none
    opaque; through the manifest's JSON, as a load reads it), and their bytes in file
    ``f{rank}`` of ``files``, between filler bytes a wrong offset would read."""
    opaque = [n for n, g in geometry.items() if g.kind == OPAQUE]
    assert not opaque, f"{what}: {opaque} recorded opaque"
    geometry = {n: TensorGeometry.from_dict(g.to_dict(), n) for n, g in geometry.items()}
    buf = bytearray(b"\x11" * (rank + 3))
    saved = {}
    for name, tensor in tensors.items():
        data = as_array(tensor)
        saved[name] = SavedTensor(f"f{rank}", len(buf), data.itemsize, data.shape, geometry[name])
        buf += data.tobytes() + b"\x22" * 5
    files[f"f{rank}"] = buf
    return geometry, SavedRank(rank, 0, saved)
