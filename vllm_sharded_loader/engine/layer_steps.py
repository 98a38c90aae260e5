"""One layer at a time through a weight update (:mod:`.reload`): the new weights staged on the host, each
layer materialized from them, post-processed, and either held for the commit or checked and let go.

An update must change nothing unless every rank can take all of it (issue 34), so every layer's
post-processing runs before the first served tensor changes. Holding every layer's processed
tensors until then costs a second copy of the rank's weights on its device, which a GPU serving
at ``gpu_memory_utilization=0.9`` does not have. So the processed layers are held only within a
budget (:func:`..checkpoint.update_staging.update_budget`); a layer past it is processed, checked and
let go, and processed again at the commit (the same bytes through the same code: only a fault that does not repeat can
fail there, and that is said as a partial update). The new weights themselves wait on the host,
mapped from the checkpoint's files where the reader can map them (page cache, not the device's
memory, nor the process's own), and each layer is materialized on the device only while it is
processed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from ..checkpoint.update_staging import StagedWeights, fill_tensors, held_bytes
from .processed import ProcessedLayer

if TYPE_CHECKING:
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo


def fill_layer(
    prefix: str,
    module: torch.nn.Module,
    info: LayerReloadingInfo,
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
    fill_tensors(prefix, tensors, staged, swappable, skip)


def layer_held_bytes(module: torch.nn.Module, mapped: set[tuple[str, int]]) -> int:
    """The bytes a processed layer holds beside the served weights (its own tensors, not file mappings)."""
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    return held_bytes(get_layer_tensors(module).values(), mapped)


def process_layer(prefix: str, module: torch.nn.Module, info: LayerReloadingInfo, done: ProcessedLayer) -> None:
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
