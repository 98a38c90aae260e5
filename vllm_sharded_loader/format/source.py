"""The identity of the model a checkpoint was saved from: architecture and config hash. Pure."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

# Config keys that say nothing about the weights: paths, transformers versions, the dtype (cast at load).
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"})


@dataclass(frozen=True)
class SourceModel:
    """Identity of the model the checkpoint was saved from."""

    architecture: str
    config_sha256: str
    config: dict[str, Any] = field(default_factory=dict, compare=False)


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a HF config that identifies the weights, as canonical JSON data."""
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    # Through JSON, so tuples, numpy scalars and nested configs compare alike after a reload.
    return json.loads(json.dumps(kept, sort_keys=True, default=str))


def config_sha256(config: dict[str, Any]) -> str:
    """Hash of :func:`normalize_config` of a HF config dict."""
    text = json.dumps(normalize_config(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def config_differences(saved: dict[str, Any], serving: dict[str, Any], limit: int = 8) -> list[str]:
    """Human-readable ``key: saved -> serving`` lines for differing config keys."""
    a, b = normalize_config(saved), normalize_config(serving)
    lines = [
        f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])
