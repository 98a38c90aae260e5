"""Pipeline stages: which decoder layers each stage holds, as vLLM splits them. Pure."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..format.errors import CheckpointCorrupt, CheckpointMismatch, InvalidOption
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME


def pp_layer_ranges(num_hidden_layers: int, pp_size: int, partition: Sequence[int] | None = None) -> tuple[range, ...]:
    """The layer indices each pipeline stage holds, as vLLM's ``get_pp_indices`` splits them.

    >>> pp_layer_ranges(11, 4)
    (range(0, 3), range(3, 6), range(6, 9), range(9, 11))
    >>> pp_layer_ranges(10, 4)
    (range(0, 2), range(2, 5), range(5, 8), range(8, 10))
    """
    if num_hidden_layers < 0 or pp_size < 1:
        raise InvalidOption(
            f"Cannot split {num_hidden_layers} layers into {pp_size} pipeline stages: both must be positive."
        )
    if partition is not None:
        sizes = list(partition)
        if len(sizes) != pp_size or sum(sizes) != num_hidden_layers or any(s < 0 for s in sizes):
            raise InvalidOption(
                f"Layer partition {sizes} does not split {num_hidden_layers} layers into {pp_size} stages "
                "(one non-negative count per stage, adding up to the layer count)."
            )
    else:
        sizes = [num_hidden_layers // pp_size] * pp_size
        for i in range(2, num_hidden_layers % pp_size + 2):
            sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(pp_size)]
    return tuple(range(start, start + size) for start, size in zip(starts, sizes, strict=True))


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")
MAX_LAYER_DIGITS = 18  # no model has 10^18 layers (and int() refuses more than 4300 digits)


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter belongs to, or None for embeddings, final norm, LM head.

    >>> layer_index("model.layers.7.mlp.down_proj.weight")
    7
    >>> layer_index("lm_head.weight") is None
    True
    """
    match = _LAYER_INDEX.search(name)
    if match is None:
        return None
    digits = match.group(1).lstrip("0") or "0"
    if len(digits) > MAX_LAYER_DIGITS:
        raise CheckpointCorrupt(
            f"Tensor {name[:120]!r}{'...' if len(name) > 120 else ''} names a decoder layer index of {len(digits)} "
            f"digits; no model has that many layers. The manifest is damaged: save the checkpoint again."
        )
    return int(digits)


# The decoder layer count's names, in order; a multimodal model's language model has its own config.
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")


def config_layers(config: Mapping[str, Any]) -> int | None:
    """The number of decoder layers vLLM splits into pipeline stages, from a Hugging Face config dict.

    >>> config_layers({"model_type": "bloom", "n_layer": 24})
    24
    >>> config_layers({"text_config": {"num_hidden_layers": 32}, "vision_config": {"num_hidden_layers": 24}})
    32
    >>> config_layers({}) is None
    True
    """
    for key in TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, Mapping) and (found := config_layers(nested)) is not None:
            return found
    for key in LAYER_COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def stage_names(manifest: Manifest, pp_size: int, pp_rank: int, where: str = MANIFEST_NAME) -> list[str]:
    """The tensors a pipeline stage holds at ``pp_size``, under the names a worker would use: what was
    saved at the same size, else :func:`stage_split` of the saved config's layers."""
    if pp_size == manifest.pp_size:
        return list(manifest.rank(0, pp_rank).tensors)
    layers = config_layers(manifest.source.config)
    if layers is None or layers < pp_size:
        raise CheckpointMismatch(
            f"Cannot split the layers into {pp_size} pipeline stages: the saved config gives "
            f"{'no number of layers' if layers is None else f'{layers} layers'} ({', '.join(LAYER_COUNT_KEYS)})."
        )
    saved = [n for r in manifest.ranks for n in r.tensors]
    # A saved layer beyond the config's is in no stage: a reshard would publish a checkpoint without it.
    beyond = sorted({n for n in saved if (index := layer_index(n)) is not None and index >= layers})
    if beyond:
        raise CheckpointMismatch(
            f"{where}: {len(beyond)} saved tensors belong to decoder layers beyond the {layers} layers its config "
            f"gives ({', '.join(LAYER_COUNT_KEYS)}), such as {beyond[:3]}; no pipeline stage of PP={pp_size} would "
            f"hold them, and the output would lack them. Keep the saved pipeline parallel size "
            f"(PP={manifest.pp_size}), or save the checkpoint again from an engine at PP={pp_size}."
        )
    return stage_split(saved, manifest.tied, layers, pp_size, pp_rank)


def stage_split(
    saved: Sequence[str], tied: Sequence[Sequence[str]], layers: int, pp_size: int, pp_rank: int
) -> list[str]:
    """The names of ``saved`` (and of their ``tied`` groups) that stage ``pp_rank`` of ``pp_size`` holds:
    decoder layers as vLLM splits them, the input embedding first, the rest last; a tie once per stage.

    >>> stage_split(["model.embed_tokens.weight", "model.layers.0.w", "model.layers.1.w", "lm_head.weight"],
    ...     [], 2, 2, 1)
    ['lm_head.weight', 'model.layers.1.w']
    """
    ranges = pp_layer_ranges(layers, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    names = set()
    for name in set(saved) | {n for g in tied for n in g}:
        layer = layer_index(name)
        if layer is not None:
            keep = layer in ranges[pp_rank]
        elif "embed_tokens" in name:
            keep = first
        else:
            keep = last
        if keep:
            names.add(name)
    for group in tied:
        present = sorted(n for n in group if n in names)
        for extra in present[1:]:
            names.discard(extra)
    return sorted(names)
