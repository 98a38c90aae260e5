"""``memory://BUCKET/prefix``: checkpoints held in this process's memory, through obstore's in-process
``MemoryStore``, which keeps the promises the object store's save protocol relies on: a create-only
put (the lock, a first manifest) fails on an object that exists, a put conditional on an ETag (a
replaced manifest) and a read conditional on one (a part opened) fail once the object changed.

A backend that obstore serves is its client and its registration; everything else is
:class:`.object_store.ObjectStore`'s. Tests save, load, reshard and break checkpoints here without a
server; a bucket lives as long as the process (no other process, an engine's worker say, sees it).
"""

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
