"""Weight updates in a running engine: a sharded checkpoint read in place, through vLLM's reload machinery.

vLLM's layerwise reload puts each layer back in its loaded layout on the meta device, keeps its served
("kernel") tensors aside, and copies the post-processed new weights into them, so every reference to
them (CUDA graphs, kernel handles) stays valid. :class:`InPlaceUpdate` drives it as a two-phase commit
across the workers (:func:`..checkpoint.update.run_update`): **read** (the start-up read, every check
included, into host memory), **process** (each layer post-processed into new memory, held within a
budget, else checked, let go and processed again at the commit), **commit** (copied into the served
tensors). A refusal on any rank before the commit puts every rank back as served, and is not counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterator
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from ..checkpoint.group import checkpoint_digest, wait_for_replicas
from ..checkpoint.state import saveable_state, shared_parameters, storage_key, tied_groups
from ..checkpoint.update import LayerSnapshot, run_update
from ..checkpoint.update_staging import (
    BUDGET_ENV,
    StagedWeights,
    fill_tensors,
    held_bytes,
    return_freed_memory,
    update_budget,
)
from ..format.errors import ShardedStateError, Unsupported, WorkerLost
from ..storage.location import Store
from .capture import LOADED_STATE_ATTRIBUTE, READ_PROOF_ATTRIBUTE
from .identity import model_rank, ranks_on_host
from .model_reader import ModelReader, ReadInto
from .workers import model_groups, raises_for_all, replica_group

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

logger = init_logger(f"vllm.plugins.{__name__}")

# Where the config pointed at the last full load: vLLM's reload_weights repoints it, and a refused
# update must leave it as it was.
SERVED_FROM_ATTRIBUTE = "_vllm_sharded_served_from"
_ANSWERS_FOR = "_vllm_sharded_answers_for"
# Where a layer keeps the processed tensors its post-processing's handles point into.
_HANDLE_MEMORY = "_sharded_state_handle_memory"


def remember_served_from(model: torch.nn.Module, model_config: ModelConfig) -> None:
    """Record which checkpoint ``model_config`` names as the served one."""
    model.__dict__[SERVED_FROM_ATTRIBUTE] = (
        model_config.model,
        model_config.model_weights,
        model_config.revision,
    )


def _layerwise() -> Any:
    """vLLM's layerwise reload module, checked for the pieces used here."""
    from vllm.model_executor.model_loader.reload import layerwise

    needed = ("get_layerwise_info", "_layerwise_process", "_place_kernel_tensors", "_copy_and_restore_kernel_tensors")
    missing = [name for name in needed if not hasattr(layerwise, name)]
    if missing:
        raise Unsupported(
            f"This vLLM's layerwise reload machinery lacks {missing} (vllm_sharded_loader was written against "
            "vLLM 0.32): weight updates with sharded_state are not available; restart the engine instead."
        )
    return layerwise


def _layer_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    return get_layer_tensors(module)


class ProcessedLayer(LayerSnapshot):
    """One layer through an update: filled from the staged weights, post-processed into new memory,
    held for the commit or let go, and undone on a refusal."""

    def __init__(
        self, module: torch.nn.Module, info: LayerReloadingInfo, holds: bool, attention: bool, prefix: str = ""
    ) -> None:
        super().__init__(module)
        self.info, self.holds, self.attention, self.prefix = info, holds, attention, prefix
        self.held = not attention  # else processed at the commit

    def fill(self, staged: StagedWeights, swap: Callable[..., Any], skip: Container[str] = ()) -> None:
        """Materialize the layer in its loaded layout and fill it from ``staged``; tensors the loader
        would adopt (``swap``) take the staged mapping, ``skip`` names those copied at the commit only."""
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        materialize_layer(self.module, self.info)
        tensors = _layer_tensors(self.module)
        # Detached, as a state dict gives them: the loader counts each entry as one more holder of the memory.
        swappable = swap(self.module, {name: t.detach() for name, t in tensors.items()}) or {}
        fill_tensors(self.prefix, tensors, staged, swappable, skip)

    def held_bytes(self, mapped: set[tuple[str, int]]) -> int:
        """The bytes the processed layer holds beside the served weights."""
        return held_bytes(_layer_tensors(self.module).values(), mapped)

    def process(self) -> None:
        """vLLM's post-processing into new memory, with the kernel tensors held back so it copies nothing."""
        from vllm.model_executor.model_loader.reload import layerwise

        info = self.info
        kernel, non_persistent = info.kernel_tensors, info.kernel_non_persistent_buffers
        info.kernel_tensors = None  # vLLM's step copies into the kernel tensors only when it has them
        try:
            with _experts_processed_as_at_start_up(self.module):
                layerwise._layerwise_process(self.module, info)  # resets info
        finally:
            info.kernel_tensors, info.kernel_non_persistent_buffers = kernel, non_persistent
            info.load_numel_total = info.load_numel_total or 0  # still being reloaded (can_load)
        self.check_fits()
        self.note_handles()

    def let_go(self) -> None:
        """Undo the processing and put the layer back on the meta device, to be processed again at the commit."""
        from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

        on_host = any(t.device.type == "cpu" for t in _layer_tensors(self.module).values())
        self.undo()
        restore_layer_on_meta(self.module, self.info)
        self.held = False
        if on_host:
            # A held layer allocated after freed memory fragments glibc's heap; give it back.
            from ..storage import oscalls

            oscalls.release_free_heap()

    def keep_what_handles_point_at(self) -> None:
        """Keep the processed tensors while this update's handles may point into them."""
        if self.handles:
            self.module.__dict__[_HANDLE_MEMORY] = list(_layer_tensors(self.module).values())

    def check_fits(self) -> None:
        """Each processed tensor must fit its served one (``copy_`` would broadcast)."""
        params, buffers = self.info.kernel_tensors
        # vLLM's copy skips buffers gone from the layer or non-persistent.
        copied = {n: b for n, b in buffers.items() if n in self.module._buffers}
        copied = {n: b for n, b in copied.items() if n not in self.info.kernel_non_persistent_buffers}
        for name, served in [*params.items(), *copied.items()]:
            new = getattr(self.module, name, None)
            if not isinstance(new, torch.Tensor) or (new.shape, new.dtype) != (served.shape, served.dtype):
                got = "nothing" if not isinstance(new, torch.Tensor) else f"{list(new.shape)} {new.dtype}"
                raise ShardedStateError(
                    f"post-processing {self.prefix}.{name} gave {got}, the served tensor is {list(served.shape)} "
                    f"{served.dtype}"
                )


@contextlib.contextmanager
def _experts_processed_as_at_start_up(module: torch.nn.Module) -> Iterator[None]:
    """Run an unquantized experts layer's own post-processing on an update too.

    vLLM's ``UnquantizedFusedMoEMethod`` runs ``fused_experts.process_weights_after_loading`` on the first
    call only; on CPU that is the grouped-GEMM prepacking, so without it an update serves wrong tokens
    without an error.
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


class InPlaceUpdate:
    """One weight update of a running model from a sharded checkpoint.

    Built before vLLM takes the layers off the model, to record which parameters are tied. ``path``
    names the checkpoint (default: the one ``model_config`` points at); ``verify`` overrides the loader's.
    """

    def __init__(
        self,
        reader: ModelReader,
        model: torch.nn.Module,
        model_config: ModelConfig,
        path: str | None = None,
        verify: str | None = None,
    ) -> None:
        self.reader, self.model, self.model_config = reader, model, model_config
        self.path, self.verify = path, verify
        self.tied = shared_parameters(model)
        self.loaded_names: set[str] = set()
        self.done = False
        self.committed = False  # only then has anything served changed
        self.proof: str | None = None
        self.located: tuple[Store, str | None]  # set by read()
        self.staged: StagedWeights | None = None
        self.aside: dict[str, torch.Tensor] = {}  # served tensors left on the model
        self.layers: list[tuple[str, torch.nn.Module, Any]] = []  # (prefix, module, its reload info)
        self.processed: list[ProcessedLayer] = []

    def for_reload_weights(self) -> InPlaceUpdate:
        """This update, as the weights vLLM's ``reload_weights`` hands to the model's ``load_weights``.

        The model's ``load_weights`` is wrapped until then to report the names this update loaded, which
        vLLM checks against the model's parameters.
        """
        model = self.model
        current = model.__dict__.get("load_weights")
        while current is not None and hasattr(current, _ANSWERS_FOR):
            current = current.__wrapped__  # a wrapper left by an update that never ran
        method = current if current is not None else type(model).load_weights.__get__(model)
        update = self

        def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
            if weights is not update:
                return method(weights, *args, **kwargs)
            if current is None:
                model.__dict__.pop("load_weights", None)
            else:
                model.__dict__["load_weights"] = current
            # A refused update changed nothing and must not count (a later save would refuse).
            state = model.__dict__.get(LOADED_STATE_ATTRIBUTE)
            counted = None if state is None else state.updates
            try:
                returned = method(weights, *args, **kwargs)
                if not update.done:
                    iter(update)  # a model whose load_weights never iterated its weights
            finally:
                if state is not None and not update.committed:
                    state.updates = counted
            return set(returned or ()) | update.loaded_names

        setattr(load_weights, _ANSWERS_FOR, self)
        load_weights.__wrapped__ = current  # type: ignore[attr-defined]
        model.__dict__["load_weights"] = load_weights
        return self

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        # Iterated once by the model's load_weights, after vLLM put the layers in their loaded layout.
        if self.done:
            return iter(())
        self.done = True
        try:
            updated = self.run()
        except BaseException:
            self._restore_config()
            raise
        if updated:
            remember_served_from(self.model, self.model_config)
        else:
            self._restore_config()
        return iter(())

    def _restore_config(self) -> None:
        saved = self.model.__dict__.get(SERVED_FROM_ATTRIBUTE)
        if saved is not None:
            self.model_config.model, self.model_config.model_weights, self.model_config.revision = saved

    def run_layerwise(self) -> bool:
        """The whole update, with vLLM's layerwise reload set up and finished around it (see :meth:`run`)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        try:
            return self.run()
        finally:
            finalize_layerwise_reload(self.model, self.model_config)

    def run(self) -> bool:
        """Read, process, commit, agreed by every worker at each step; a refusal puts everything back.
        Only one worker raises it (:func:`.workers.raises_for_all`); the others return False."""
        layerwise = _layerwise()
        self.layers = [
            (prefix, module, info)
            for prefix, module in self.model.named_modules()
            if (info := layerwise.get_layerwise_info(module)).can_load()
        ]
        if not self.layers:
            raise ShardedStateError("The model's layers were not prepared for a reload (vLLM's layerwise reload).")
        rank = model_rank(self.model)
        try:
            wait_for_replicas(
                replica_group(rank), rank, "reload_weights (or update_weights)", "update", "No weights were changed."
            )
        except WorkerLost:
            self.roll_back()
            if raises_for_all():
                raise
            return False
        return run_update(self, model_groups(rank), rank, raises_for_all())

    def roll_back(self) -> None:
        """Put every layer's served tensors back and undo its post-processing."""
        self.staged = None
        layerwise = _layerwise()
        for done in reversed(self.processed):
            done.undo()
        for _, module, info in self.layers:
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(module, info)
            info.reset()
        return_freed_memory()

    def read(self) -> tuple[str, str]:
        """Step 1: the checkpoint read, every check included, into host memory."""
        config = self.model_config
        path = self.path if self.path is not None else config.model_weights or config.model
        # A missing path is refused before any memory is taken.
        self.located = self.reader.locate_update(path, config.revision)
        kernel = set()
        for _, _, info in self.layers:
            params, buffers = info.kernel_tensors or ({}, {})
            kernel |= {storage_key(t) for t in [*params.values(), *buffers.values()] if t.numel()}
        # vLLM restores each layer on its own: tie the names again.
        for names in self.tied:
            first = self.model.get_parameter(names[0])
            for name in names[1:]:
                prefix, _, leaf = name.rpartition(".")
                self.model.get_submodule(prefix).register_parameter(leaf, first)
        state_dict = self.model.state_dict()
        targets = saveable_state(state_dict)
        staged = self.staged = StagedWeights(targets, tied_groups(state_dict, targets))
        # Tensors vLLM leaves on the model are served ones, copied at the commit.
        self.aside = {name: t for name, t in targets.items() if storage_key(t) in kernel}
        # The read's proof is kept for the commit only; a refused update leaves the model's as it was.
        before = self.model.__dict__.get(READ_PROOF_ATTRIBUTE)
        manifest = self.located[0].read_manifest()
        into = ReadInto(staged.targets(), tied_groups(state_dict, targets), staged.adopt())
        try:
            self.reader.read(
                self.model, self.model_config, self.located, manifest, into, verify=self.verify, update=True
            )
        finally:
            read = self.model.__dict__.pop(READ_PROOF_ATTRIBUTE, None)
            if before is not None:
                self.model.__dict__[READ_PROOF_ATTRIBUTE] = before
        self.proof = None if read is None else read[1]
        self.loaded_names = {name for name, _ in self.model.named_parameters()}
        return self.located[0].where, checkpoint_digest(manifest)

    def process(self) -> None:
        """Step 2: each layer post-processed into new memory, held within the budget, else let go.
        Attention layers are processed at the commit, last, as at start-up."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        staged = self.staged
        assert staged is not None
        budget, held, again = update_budget(ranks_on_host()), 0, 0
        mapped = staged.mapped_storages()
        filled = staged.names()
        for prefix, module, info in self.layers:
            names = {f"{prefix}.{name}" if prefix else name for name in _layer_tensors(module)}
            holds = bool(names & filled) and info.kernel_tensors is not None
            done = ProcessedLayer(module, info, holds, attention=is_deferred_attention_layer(module), prefix=prefix)
            self.processed.append(done)
            if not holds or done.attention:
                continue
            self._fill(done)
            done.process()
            size = done.held_bytes(mapped)
            if held + size <= budget:
                held += size
            else:
                done.let_go()
                again += 1
        if again:
            logger.info(
                "sharded_state: %s holds %.1f MB of processed layers until the commit (budget %.1f MB, %s): "
                "%d layers past it were checked and let go, and are processed again at the commit",
                model_rank(self.model),
                held / 1e6,
                budget / 1e6,
                BUDGET_ENV,
                again,
            )

    def _fill(self, step: ProcessedLayer) -> None:
        assert self.staged is not None
        step.fill(self.staged, self.reader.adoptable, skip=self.aside)

    def commit(self) -> None:
        """Step 3: every rank agreed; from here on, what is served changes."""
        self.committed = True
        state = self.model.__dict__.get(LOADED_STATE_ATTRIBUTE)
        if state is not None:
            state.updates += 1  # while committing, what is served is neither old nor new
        try:
            self._commit()
        finally:
            self.staged = None
            return_freed_memory()
        if state is not None:
            # Every tensor is now this checkpoint's: a save re-reads it from there.
            state.served_from_checkpoint(self.located, self.proof)

    def _commit(self) -> None:
        """The new values into the served tensors, layer by layer."""
        layerwise = _layerwise()
        staged, done = self.staged, 0
        assert staged is not None
        try:
            for name, served in self.aside.items():
                served.copy_(staged.tensors[name])
            for step in sorted(self.processed, key=lambda step: step.attention):  # attention last, as at start-up
                if step.holds:
                    if not step.held:  # let go at step 2, or attention
                        self._fill(step)
                        if not step.attention:
                            step.process()
                    step.keep_what_handles_point_at()
                    layerwise._copy_and_restore_kernel_tensors(step.module, step.info)
                else:
                    layerwise._place_kernel_tensors(step.module, step.info)
                step.info.reset()
                if step.attention:
                    step.module.process_weights_after_loading(self.model_config.dtype)
                done += 1
        except BaseException as e:
            for _, module, info in self.layers:
                if info.can_load():
                    layerwise._place_kernel_tensors(module, info)
                    info.reset()
            raise ShardedStateError(
                f"The weight update was read, checked and post-processed on every rank, but copying it into the "
                f"served tensors failed after {done} of {len(self.layers)} layers ({type(e).__name__}: {e}): the "
                "served weights are partly updated. Update again, or restart the engine."
            ) from e
