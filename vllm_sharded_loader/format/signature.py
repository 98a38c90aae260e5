"""The manifest's signature: who vouches for the code a checkpoint carries. It covers the whole
manifest but itself, as canonical JSON, so what a reader parsed is what was signed. Pure."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .untrusted import JsonReader

SIGNATURE_FIELD = "signature"
ALGORITHMS = ("ed25519", "ecdsa-sha256")
# Signed: this prefix and the canonical manifest's SHA-256, so another message of the key never passes.
SIGNED_PREFIX = b"vllm-sharded-state manifest v1\n"
KEY_ID = re.compile(r"[0-9a-f]{64}\Z")
MAX_SIGNATURE_CHARS = 1024


@dataclass(frozen=True)
class Signature:
    """Algorithm, signing key's id (SHA-256 of its DER public key) and the signature, base64."""

    algorithm: str
    key_id: str
    value: str

    @property
    def short_id(self) -> str:
        """The key id as messages show it."""
        return self.key_id[:16]

    def to_dict(self) -> dict[str, str]:
        return {"algorithm": self.algorithm, "key_id": self.key_id, "value": self.value}

    @classmethod
    def from_dict(cls, reader: JsonReader, value: Any) -> Signature:
        obj = reader.mapping(value, SIGNATURE_FIELD)
        algorithm, key_id, signed = (reader.string(obj, k) for k in ("algorithm", "key_id", "value"))
        if algorithm not in ALGORITHMS:
            raise reader.fail(f"signature algorithm {algorithm[:40]!r} is not one of {', '.join(ALGORITHMS)}")
        if not KEY_ID.match(key_id) or len(signed) > MAX_SIGNATURE_CHARS:
            raise reader.fail("the signature's key_id must be 64 hexadecimal digits and its value a base64 string")
        return cls(algorithm, key_id, signed)


def signed_message(data: dict[str, Any]) -> bytes:
    """The bytes a signature of the parsed manifest ``data`` signs (its canonical form, unsigned, hashed).

    >>> signed_message({"b": 1, "a": [1.5], "signature": {}}) == signed_message({"a": [1.5], "b": 1})
    True
    """
    unsigned = {k: v for k, v in data.items() if k != SIGNATURE_FIELD}
    canonical = json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return SIGNED_PREFIX + hashlib.sha256(canonical.encode()).hexdigest().encode()
