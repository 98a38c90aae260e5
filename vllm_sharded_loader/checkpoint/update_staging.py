"""A weight update's memory, outside the model (:mod:`..engine.reload` runs the update itself): the
new weights staged on the host, how many bytes of processed layers the device may hold until the
commit, the bytes a processed layer holds, and the memory given back afterwards.

Nothing here imports vLLM, so the device side (a GPU's free memory, the CUDA caching allocator, host
mappings copied into device tensors) is tested on a lent GPU machine without it
(``tests/test_gpu_update_staging.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Iterable, Mapping

import torch

from ..format.errors import InvalidOption
from ..storage.oscalls import available_memory
from .state import storage_key

# Bytes of processed layers an update may hold until its commit, beside the served weights
# (per worker): a number of bytes, or "auto".
BUDGET_ENV = "SHARDED_STATE_UPDATE_BUDGET"


def update_budget(ranks_on_host: int = 1) -> int:
    """How many bytes of processed layers this worker holds until the commit (see :data:`BUDGET_ENV`).

    ``auto``: half of what the device has free now (a GPU), or half of the host's available
    memory split among the ranks on it (CPU). Past the budget a layer is processed twice.
    """
    text = os.environ.get(BUDGET_ENV, "").strip().lower()
    if text not in ("", "auto"):
        try:
            budget = int(float(text))
        except (ValueError, OverflowError):  # (int(float("inf")) overflows)
            budget = -1
        if budget < 0:
            raise InvalidOption(f"{BUDGET_ENV}={text!r} is not a number of bytes (or 'auto').")
        return budget
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.mem_get_info()[0] // 2
    return available_memory() // (2 * max(ranks_on_host, 1))


def return_freed_memory() -> None:
    """After an update the previous packings and the let-go layers are free: give them back (the C
    heap's to the system, the CUDA caching allocator's to the device), so a KV cache woken or grown
    next finds them."""
    from ..storage import oscalls

    oscalls.release_free_heap()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class StagedWeights:
    """A rank's new weights, read by the loader before any layer is materialized: by state-dict name,
    on the host, each a private mapping of its file's bytes where the reader can map it (else read into
    host memory). Built over the model with every reloaded layer still on the meta device."""

    def __init__(self, targets: Mapping[str, torch.Tensor], tied: list[list[str]]) -> None:
        self.tensors = {name: _host_like(t) for name, t in targets.items()}
        self.mapped: set[str] = set()
        # Names a loaded tensor serves too (tied embeddings: the kept name first).
        self.also = {other: names[0] for names in tied for other in names[1:] if names[0] in self.tensors}

    def targets(self) -> dict[str, torch.Tensor]:
        """What the loader reads into (each name once)."""
        return dict(self.tensors)

    def adopt(self) -> dict[str, Callable[[torch.Tensor], None]]:
        """For the loader: each name may take a tensor over its file's mapping instead of a read."""
        return {name: _adopter(self, name) for name in self.tensors}

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(self.also.get(name, name))

    def names(self) -> set[str]:
        return {*self.tensors, *self.also}

    def mapped_storages(self) -> set[tuple[str, int]]:
        return {storage_key(self.tensors[name]) for name in self.mapped}


def _host_like(t: torch.Tensor) -> torch.Tensor:
    # Untouched until read into (fresh pages are not resident), and never touched where mapped.
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")


def _adopter(staged: StagedWeights, name: str) -> Callable[[torch.Tensor], None]:
    def adopt(mapped: torch.Tensor) -> None:
        staged.tensors[name] = mapped
        staged.mapped.add(name)

    return adopt


def fill_tensors(
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    staged: StagedWeights,
    swappable: Mapping[str, Callable[[torch.Tensor], None]],
    skip: Container[str] = (),
) -> None:
    """Fill one layer's materialized ``tensors`` (by name within the layer at ``prefix``) from ``staged``.

    A tensor with a setter in ``swappable`` takes the staged tensor as it is, where that is the same
    device, dtype and a contiguous layout (the loader serves a file's mapping on CPU); every other is
    copied in: on a GPU, from the host mapping into device memory. ``skip`` names are left alone.
    """
    for name, tensor in tensors.items():
        full = f"{prefix}.{name}" if prefix else name
        new = staged.get(full)
        if new is None or full in skip:
            continue
        setter = swappable.get(name)
        if setter is not None and new.device == tensor.device and new.dtype == tensor.dtype and new.is_contiguous():
            setter(new)
        else:
            tensor.copy_(new)


def held_bytes(tensors: Iterable[torch.Tensor], mapped: set[tuple[str, int]]) -> int:
    """The bytes a processed layer's ``tensors`` hold beside the served weights: each storage once, not
    counting the staged file mappings (``mapped``: :meth:`StagedWeights.mapped_storages`)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key not in mapped and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
