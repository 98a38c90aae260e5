"""A weight update's memory, outside the model: the new weights staged on the host, the bytes of
processed layers held until the commit, and the memory given back afterwards. No vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Iterable, Mapping

import torch

from ..format.errors import InvalidOption
from ..storage.oscalls import available_memory
from .state import storage_key

# Bytes of processed layers a worker's update may hold until its commit: a number, or "auto".
BUDGET_ENV = "SHARDED_STATE_UPDATE_BUDGET"


def update_budget(ranks_on_host: int = 1) -> int:
    """Bytes of processed layers held until the commit (:data:`BUDGET_ENV`); ``auto``: half the GPU's
    free memory, or half the host's available memory split among its ranks."""
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
    """Give the memory an update freed back (the C heap's to the system, CUDA's cache to the device)."""
    from ..storage import oscalls

    oscalls.release_free_heap()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class StagedWeights:
    """A rank's new weights on the host by state-dict name, mapped from their files where possible."""

    def __init__(self, targets: Mapping[str, torch.Tensor], tied: list[list[str]]) -> None:
        self.tensors = {name: _host_like(t) for name, t in targets.items()}
        self.mapped: set[str] = set()
        # Tied names -> the kept name.
        self.also = {other: names[0] for names in tied for other in names[1:] if names[0] in self.tensors}

    def targets(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def adopt(self) -> dict[str, Callable[[torch.Tensor], None]]:
        return {name: _adopter(self, name) for name in self.tensors}

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(self.also.get(name, name))

    def names(self) -> set[str]:
        return {*self.tensors, *self.also}

    def mapped_storages(self) -> set[tuple[str, int]]:
        return {storage_key(self.tensors[name]) for name in self.mapped}


def _host_like(t: torch.Tensor) -> torch.Tensor:
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
    """Fill one layer's ``tensors`` (at ``prefix``) from ``staged``, but ``skip``: swapped in through
    ``swappable`` where device, dtype and layout allow, else copied."""
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
    """The bytes a processed layer's ``tensors`` hold: each storage once, but the staged mappings."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key not in mapped and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
