"""The geometry of Mamba-2's mixer (vLLM's ``MambaMixer2``), which cuts its own layers.

Hybrid models (Mamba-2 layers beside attention: Nemotron-H, Granite 4.0-H, Falcon-H1, Bamba,
Zamba2) hold their state-space layers in this mixer. Its ``in_proj`` and ``conv1d`` are vLLM
linear layers, but with one group of B/C states the mixer puts in a loader of its own that gives
every rank a copy of the group, and its own parameters (``A``, ``D``, ``dt_bias``) and gated
norm are cut by the heads: no layer class says so (:mod:`.layer_geometry` would record them
``opaque``), so the mixer is read here.
"""

from __future__ import annotations

from typing import Any

import torch

from ..format import geometry as rs


def _mamba2_geometry(mixer: Any, child: str, param: str) -> rs.TensorGeometry | None:
    """A parameter of vLLM's Mamba-2 mixer (``MambaMixer2``) or of its ``in_proj``, ``conv1d`` and
    ``norm``, as the mixer cuts it at every TP size (None: not one described here, opaque).

    The mixer splits its heads across the ranks: ``A``, ``D`` and ``dt_bias`` one entry per head,
    the gated norm's weight and the gate and x rows of ``in_proj`` (``conv1d``: x) by the heads'
    channels. Its B and C rows hold ``n_groups`` groups of states: split by whole groups where the
    TP size divides them, or with one group (where vLLM puts in ``mamba_v2_sharded_weight_loader``)
    copied to every rank; vLLM refuses any other TP size. ``in_proj`` ends with one dt row per head.
    Quantized projections are left opaque.
    """
    norm = getattr(mixer, "norm", None)
    groups, heads = getattr(norm, "n_groups", None), getattr(mixer, "num_heads", None)
    inner, state = getattr(mixer, "intermediate_size", None), getattr(mixer, "ssm_state_size", None)
    if not all(isinstance(v, int) and v > 0 for v in (groups, heads, inner, state)):
        return None
    if child == "" and param in ("A", "D", "dt_bias"):
        return rs.column_parallel([heads], type(mixer).__name__)
    if child == "norm" and param == "weight":
        return rs.column_parallel([inner], type(norm).__name__)
    layer = getattr(mixer, child, None) if child in ("in_proj", "conv1d") else None
    if layer is None or type(getattr(layer, "quant_method", None)).__name__ != "UnquantizedLinearMethod":
        return None
    group = {"heads": groups, "head_size": state, "replicate_heads": True}
    b, c = (rs.Segment(name, groups * state, **group) for name in "BC")
    segments = [rs.Segment("x", inner), b, c]
    if child == "in_proj":
        segments = [rs.Segment("gate", inner), *segments, rs.Segment("dt", heads)]
    rows = sum(s.size for s in segments)
    # Named for the mixer: vLLM makes these layers of another class at TP=1 (merged) than above it.
    tensor = getattr(layer, param, None)
    if param == "bias" and tensor is not None:
        return rs.grouped_column_parallel([rows], segments, type(mixer).__name__)
    if param == "weight" and tensor is not None:
        # conv1d's weight is [channels, 1, kernel] (vLLM unsqueezes it), in_proj's [rows, hidden].
        return rs.grouped_column_parallel([rows, *tensor.shape[1:]], segments, type(mixer).__name__)
    return None


def mamba2_mixers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's Mamba-2 mixers, by module name (none in most models)."""
    return {name: m for name, m in model.named_modules() if type(m).__name__ == "MambaMixer2"}


def mixer_geometry(
    mixers: dict[str, torch.nn.Module], module_name: str, param: str, shape: tuple[int, ...]
) -> rs.TensorGeometry | None:
    """The geometry of a parameter of one of ``mixers`` (:func:`mamba2_mixers`) or of its ``in_proj``,
    ``conv1d`` or ``norm`` (opaque where :func:`_mamba2_geometry` does not describe it); None for any
    other parameter."""
    parent, _, child = module_name.rpartition(".")
    if module_name in mixers:
        mixer, child = mixers[module_name], ""
    elif parent in mixers and child in ("in_proj", "conv1d", "norm"):
        mixer = mixers[parent]
    else:
        return None
    return _mamba2_geometry(mixer, child, param) or rs.TensorGeometry(rs.OPAQUE, type(mixer).__name__, shape)
