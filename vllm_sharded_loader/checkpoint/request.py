"""What one rank's load asks for, as a value: the checkpoint's store, how to check it, and the model it serves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..format.geometry import TensorGeometry
from ..format.manifest import Manifest
from ..format.source import SourceModel
from ..storage.location import Store, require_store


@dataclass(frozen=True)
class LoadRequest:
    """A checkpoint to load one rank of, and what to check it against.

    Attributes:
        store: where it lives (resolved once, by :func:`..storage.location.open_store`).
        manifest: the checkpoint's; None for vLLM's own save, found by ``pattern`` (its parts' names).
        verify: ``"size"`` (manifest, sizes, headers) or ``"checksum"`` (also every byte read).
        serving: the served model's identity, checked against the manifest's when given.
        geometry: how the served layers split each tensor, checked likewise.
        tied: groups of names the served model shares, so one saved name serves the others.
    """

    store: Store
    manifest: Manifest | None
    verify: str = "size"
    serving: SourceModel | None = None
    geometry: Mapping[str, TensorGeometry] | None = None
    tied: Sequence[Sequence[str]] = ()
    pattern: str | None = None

    def __post_init__(self) -> None:
        require_store(self.store, "LoadRequest")

    @property
    def where(self) -> str:
        """The checkpoint, as messages name it."""
        return self.store.where
