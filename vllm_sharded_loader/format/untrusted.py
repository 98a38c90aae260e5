"""Parsing untrusted JSON (manifests, safetensors headers): strict types, no silent merges."""

from __future__ import annotations

import json
from typing import Any

from .errors import CheckpointCorrupt, ShardedStateError

# Bounds on what untrusted data may claim, checked before anything is sized from it.
MAX_DIMS = 16
MAX_BYTES = 1 << 60  # a size, offset or dimension


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


# Bytes of Python objects per container, string and element, to bound what parsing a text costs.
_OBJECT_COSTS = {"{": 240, "[": 64, '"': 30, ",": 24}
_CHEAP_JSON_BYTES = 1 << 20


def parse_cost(text: str | bytes) -> int:
    """An upper estimate of the bytes of Python objects that parsing ``text`` makes.

    >>> parse_cost('[[], [], []]') > 10 * len('[[], [], []]')
    True
    """
    if isinstance(text, str):
        return sum(cost * text.count(char) for char, cost in _OBJECT_COSTS.items())
    return sum(cost * text.count(char.encode()) for char, cost in _OBJECT_COSTS.items())


def load_json(text: str | bytes, where: str, max_expansion: float | None = None) -> Any:
    """Parse untrusted JSON; duplicate keys (which json would silently merge) are an error. A text over
    1 MiB whose :func:`parse_cost` exceeds ``max_expansion`` times its size is refused unparsed."""
    if max_expansion is not None and len(text) > _CHEAP_JSON_BYTES:
        cost = parse_cost(text)
        if cost > max_expansion * len(text):
            raise CheckpointCorrupt(
                f"{where}: {len(text)} bytes of JSON that would take about {cost / 1e6:.0f} MB of memory to "
                f"parse (more than {max_expansion:g}x its size: mostly empty lists, objects or strings); it is "
                "not a manifest this package wrote. Save the checkpoint again."
            )
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointCorrupt(f"{where} is not valid JSON ({e}). Save the checkpoint again.") from e


def is_int(value: Any) -> bool:
    """A JSON integer (``bool`` is an ``int`` in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_shape(value: Any) -> bool:
    """A JSON list of at most :data:`MAX_DIMS` sizes, each in ``[0, MAX_BYTES]``."""
    return isinstance(value, list) and len(value) <= MAX_DIMS and all(is_int(d) and 0 <= d <= MAX_BYTES for d in value)


class JsonReader:
    """Typed accessors for untrusted JSON; each error starts with ``where`` and ends with ``advice``."""

    def __init__(self, where: str, advice: str = "Save the checkpoint again.") -> None:
        self.where, self.advice = where, advice

    def fail(self, what: str) -> ShardedStateError:
        return CheckpointCorrupt(f"{self.where}: {what}. {self.advice}")

    def mapping(self, value: Any, what: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} must be an object, found {type(value).__name__}")
        return value

    def sequence(self, obj: dict[str, Any], key: str) -> list[Any]:
        value = obj.get(key)
        if not isinstance(value, list):
            raise self.fail(f"{key!r} must be a list, found {type(value).__name__}")
        return value

    def integer(self, obj: dict[str, Any], key: str, minimum: int = 0, maximum: int = MAX_BYTES) -> int:
        value = obj.get(key)
        if not is_int(value) or value < minimum:
            raise self.fail(f"{key!r} must be an integer >= {minimum}, found {value!r}")
        if value > maximum:
            raise self.fail(f"{key!r} must be an integer <= {maximum}, found {value!r}")
        return value

    def optional_integer(self, obj: dict[str, Any], key: str, minimum: int = 0) -> int | None:
        return None if obj.get(key) is None else self.integer(obj, key, minimum)

    def boolean(self, obj: dict[str, Any], key: str) -> bool:
        value = obj.get(key)
        if not isinstance(value, bool):
            raise self.fail(f"{key!r} must be true or false, found {value!r}")
        return value

    def string(self, obj: dict[str, Any], key: str, non_empty: bool = False) -> str:
        value = obj.get(key)
        if not isinstance(value, str) or (non_empty and not value):
            raise self.fail(f"{key!r} must be a {'non-empty ' if non_empty else ''}string, found {value!r}")
        return value
