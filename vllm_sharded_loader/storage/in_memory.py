"""``memory://BUCKET/prefix``: checkpoints in this process's memory, through obstore's ``MemoryStore``,
which keeps the conditional puts and reads the save protocol relies on. Tests use it without a
server; a bucket lives as long as the process, and no other process sees it."""

from __future__ import annotations

import threading
from typing import Any

from .object_clients import CLIENTS, SETTINGS

SCHEME = "memory"
_buckets: dict[str, Any] = {}
_made = threading.Lock()


def bucket(name: str, account: str | None = None) -> Any:
    """The in-memory obstore store of bucket ``name``, made on first use and kept for the process's life."""
    from obstore.store import MemoryStore

    with _made:
        return _buckets.setdefault(name, MemoryStore())


CLIENTS[SCHEME] = bucket
SETTINGS[SCHEME] = "nothing: a memory:// bucket lives in this process only"
