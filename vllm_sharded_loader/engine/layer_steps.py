"""One layer at a time through a weight update (:mod:`.reload`): the new weights staged on the host, each
layer materialized from them, post-processed, and either held for the commit or checked and let go.

An update must change nothing unless every rank can take all of it (issue 34), so every layer's
post-processing runs before the first served tensor changes. Holding every layer's processed
tensors until then costs a second copy of the rank's weights on its device, which a GPU serving
at ``gpu_memory_utilization=0.9`` does not have. So the processed layers are held only within a
budget (:func:`update_budget`); a layer past it is processed, checked and let go, and processed
again at the commit (the same bytes through the same code: only a fault that does not repeat can
fail there, and that is said as a partial update). The new weights themselves wait on the host,
mapped from the checkpoint's files where the reader can map them (page cache, not the device's
memory, nor the process's own), and each layer is materialized on the device only while it is
processed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Container, Iterator, Mapping
from typing import Any

import torch

from ..checkpoint.state import storage_key
from ..format.errors import ShardedStateError
from .processed import ProcessedLayer

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
            raise ShardedStateError(f"{BUDGET_ENV}={text!r} is not a number of bytes (or 'auto').")
        return budget
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.mem_get_info()[0] // 2
    return _host_available() // (2 * max(ranks_on_host, 1))


def _host_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


def fill_layer(
    prefix: str,
    module: torch.nn.Module,
    info: Any,
    staged: StagedWeights,
    swap: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], Mapping[str, Callable[[torch.Tensor], None]] | None],
    skip: Container[str] = (),
) -> None:
    """Materialize one reloaded layer in its loaded layout on its device and fill it from ``staged``.

    A tensor the loader would serve from its file's mapping at start-up (``swap``: the loader's
    ``adoptable``, CPU only) takes the staged mapping as it is; every other is copied in. ``skip``
    names served tensors left on the layer (copied at the commit only).
    """
    from vllm.model_executor.model_loader.reload.meta import materialize_layer
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    materialize_layer(module, info)
    tensors = get_layer_tensors(module)
    # Detached, as a state dict gives them: the loader counts each entry as one more holder of the memory.
    swappable = swap(module, {name: t.detach() for name, t in tensors.items()}) or {}
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


def held_bytes(module: torch.nn.Module, mapped: set[tuple[str, int]]) -> int:
    """The bytes a processed layer holds beside the served weights (its own tensors, not file mappings)."""
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    seen: set[tuple[str, int]] = set()
    total = 0
    for t in get_layer_tensors(module).values():
        key = storage_key(t)
        if key not in mapped and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def process_layer(prefix: str, module: torch.nn.Module, info: Any, done: ProcessedLayer) -> None:
    """The layer's post-processing, as at start-up, into its new memory: vLLM's ``_layerwise_process``
    with the layer's kernel tensors held back so that it copies nothing; then checked to fit them."""
    from vllm.model_executor.model_loader.reload import layerwise

    kernel, non_persistent = info.kernel_tensors, info.kernel_non_persistent_buffers
    info.kernel_tensors = None  # vLLM's step copies into the kernel tensors only when it has them
    try:
        with _experts_processed_as_at_start_up(module):
            layerwise._layerwise_process(module, info)  # resets info
    finally:
        info.kernel_tensors, info.kernel_non_persistent_buffers = kernel, non_persistent
        info.load_numel_total = info.load_numel_total or 0  # still being reloaded (can_load)
    done.check_fits(prefix)
    done.note_handles()


def let_go(done: ProcessedLayer) -> None:
    """A processed layer past the budget, checked: undo what its processing set, and put it back on the
    meta device in its loaded layout (its new memory freed), to be processed again at the commit."""
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    on_host = any(t.device.type == "cpu" for t in get_layer_tensors(done.module).values())
    done.undo()
    restore_layer_on_meta(done.module, done.info)
    done.held = False
    if on_host:
        # glibc keeps freed memory for reuse, but a held layer allocated after it fragments the heap:
        # without this the extra peak grew by up to three layers past the budget (measured).
        from ..storage import oscalls

        oscalls.release_free_heap()


@contextlib.contextmanager
def _experts_processed_as_at_start_up(module: torch.nn.Module) -> Iterator[None]:
    """Post-process an unquantized routed-experts layer during an update as at start-up.

    vLLM 0.32's ``UnquantizedFusedMoEMethod`` runs its experts' own post-processing
    (``fused_experts.process_weights_after_loading``) on the first call only: on a weight
    update it skips it. On CPU that step is the prepacking into the grouped-GEMM layout, so
    an update would copy unpacked weights into the packed kernel tensors and serve wrong
    tokens without an error (vLLM's own ``reload_weights`` does so too). Here the step runs
    after the method's own, on the layer's new weights, before their copy into the kernel
    tensors. Other methods rebuild their kernel, and this step with it, on every call.
    """
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    method = getattr(module, "quant_method", None)
    experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    if (
        type(method).__name__ != "UnquantizedFusedMoEMethod"
        or experts is None
        or type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading
    ):
        yield
        return
    original = method.process_weights_after_loading

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        original(layer)
        experts.process_weights_after_loading(layer)

    method.process_weights_after_loading = process_weights_after_loading
    try:
        yield
    finally:
        del method.process_weights_after_loading  # the class's again
