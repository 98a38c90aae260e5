"""A rank's cut of a TP=1 tensor (``convert``), as views the writer takes one after another where it can."""

from __future__ import annotations

import math

import torch

from ..planning.layout import ShardLayout
from ..storage.memory import BufferPool

# The most views a stacked tensor's cut is written from (experts x fused segments), and the fewest
# bytes of each; beyond either, the pieces are joined first.
MAX_STACKED = 4096
MIN_STACKED_BYTES = 64 << 10


def rank_parts(tensor: torch.Tensor, layout: ShardLayout, pool: BufferPool | None = None) -> tuple[torch.Tensor, ...]:
    """A rank's local tensor from the TP=1 tensor, as parts whose bytes, one after another, are its bytes.

    Pieces that cannot be views (within :data:`MAX_STACKED`) are joined into ``pool``'s memory.
    """
    if layout.split_dim is None:
        return (tensor,)
    pieces = [tensor.narrow(layout.split_dim, p.global_offset, p.length) for p in layout.pieces]
    if layout.split_dim == 0 or len(pieces) == 1:
        return tuple(pieces)
    stacked = _stacked_pieces(pieces, layout.split_dim)
    if stacked is not None and sum(p.numel() for p in stacked) == math.prod(layout.shape):
        return stacked
    if pool is None or joined_shape(tuple(pieces), layout.split_dim) != tuple(layout.shape):
        return (torch.cat(pieces, dim=layout.split_dim),)  # another shape: the writer refuses it
    return (torch.cat(pieces, dim=layout.split_dim, out=pool.empty(tuple(layout.shape), tensor.dtype)),)


def _stacked_pieces(pieces: list[torch.Tensor], dim: int) -> tuple[torch.Tensor, ...] | None:
    """``pieces`` (narrowed along ``dim``) in row-major order as views, block by block; None where too
    many or not viewable."""
    blocks = math.prod(pieces[0].shape[:dim])
    smallest = min(p.numel() for p in pieces) // max(blocks, 1) * pieces[0].element_size()
    if blocks * len(pieces) > MAX_STACKED or smallest < MIN_STACKED_BYTES:
        return None
    try:
        flat = [p.view(blocks, *p.shape[dim:]) for p in pieces]
    except RuntimeError:  # leading dims not one stride apart
        return None
    return tuple(f[i] for i in range(blocks) for f in flat)


def joined_shape(parts: tuple[torch.Tensor, ...], split_dim: int | None) -> tuple[int, ...] | None:
    """The shape of ``parts`` joined along ``split_dim`` (0 where there is none); None where they do not join. Pure.

    >>> joined_shape((torch.empty(2, 3), torch.empty(1, 3)), 0)
    (3, 3)
    >>> joined_shape((torch.empty(2, 3), torch.empty(2, 4)), 0) is None
    True
    """
    if len(parts) == 1:
        return tuple(parts[0].shape)
    dim = split_dim or 0
    shapes = [list(p.shape) for p in parts]
    if any(len(s) <= dim for s in shapes) or len({tuple(s[:dim] + s[dim + 1 :]) for s in shapes}) != 1:
        return None
    joined = shapes[0]
    joined[dim] = sum(s[dim] for s in shapes)
    return tuple(joined)
