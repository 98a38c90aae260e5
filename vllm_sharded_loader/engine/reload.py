"""Weight updates in a running engine: a sharded checkpoint read in place, through vLLM's reload machinery.

vLLM 0.32 reloads weights layer by layer (``model_executor/model_loader/reload``): every
layer is put back in the layout it had right after loading, on the meta device, while its
served ("kernel") tensors are kept aside; once a layer's weights are in, its
post-processing runs again (quantized repacking, MoE layouts, the CPU GEMM dispatch) and
the results are copied into the kernel tensors, so every reference to them (CUDA graphs,
kernels' handles) stays valid. vLLM drives that from the model's ``load_weights``, fed
Hugging Face weights that each layer's weight loader shards.

A sharded checkpoint already holds each rank's slice in the loaded layout, so
:class:`InPlaceUpdate` drives the same machinery itself, in three steps:

1. **materialize**: every layer's loaded layout in new memory (:func:`materialize_layer`);
   tied tensors share one;
2. **read**: the loader's start-up read (:meth:`.loader.ShardedStateLoader.read_checkpoint`,
   every check of a start-up load first) into that memory, never into a served tensor
   (the few tensors vLLM never takes off the model, such as biases, are read aside);
3. **process**: each layer's post-processing, as at start-up, into that new memory still;
4. **commit**: the tensors read aside and every layer's processed tensors copied into the
   served ones, then the attention layers' own processing.

The workers agree after step 2 and again after step 3 (:func:`_agree`): the update is all
or nothing across every rank and every tensor. Anything that fails on any rank before the
commit (a checkpoint of another model, another dtype, a missing or corrupt file, a failed
post-processing) puts every rank's kernel tensors back untouched, and the module state
post-processing set (kernel handles, packed layouts) as it was: the engine serves, byte
for byte, what it served before, and the update is not counted (``LoadedState.updates``).

On CPU the new weights are mapped from the checkpoint's files (the loader's ``mmap``), so
no second copy of the weights is made in memory; elsewhere the rank's new weights are held
once beside the served ones until the commit. Post-processed forms (packed copies) are
held for every layer until the commit, beside the served ones.

Two entry points: vLLM's ``reload_weights`` (through the loader's ``get_all_weights``,
see :meth:`InPlaceUpdate.for_reload_weights`) and the ``sharded_state`` weight-transfer
engine (:mod:`.weight_transfer`, see :meth:`InPlaceUpdate.run_layerwise`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from vllm.logger import init_logger

from ..checkpoint.state import saveable_state, storage_key, tied_groups
from ..format.errors import CheckpointNotFound, ShardedStateError, agreed_error
from ..storage import oscalls
from ..storage.location import open_store
from .capture import LOADED_STATE_ATTRIBUTE, READ_PROOF_ATTRIBUTE, served_from_checkpoint
from .layer_geometry import model_rank
from .processed import ProcessedLayer
from .workers import gather_over, raises_for_all

if TYPE_CHECKING:
    from vllm.config import ModelConfig

logger = init_logger(f"vllm.plugins.{__name__}")

# Where the model's config pointed when its weights were last loaded in full; vLLM's
# reload_weights repoints it at ``weights_path`` before asking the loader, and a refused
# update must leave it as it was.
SERVED_FROM_ATTRIBUTE = "_vllm_sharded_served_from"
_ANSWERS_FOR = "_vllm_sharded_answers_for"


def remember_served_from(model: torch.nn.Module, model_config: ModelConfig) -> None:
    """Record which checkpoint ``model_config`` names as the served one (see :data:`SERVED_FROM_ATTRIBUTE`)."""
    model.__dict__[SERVED_FROM_ATTRIBUTE] = (
        model_config.model,
        model_config.model_weights,
        model_config.revision,
    )


def _layerwise() -> Any:
    """vLLM's layerwise reload module, checked for the pieces this module drives."""
    from vllm.model_executor.model_loader.reload import layerwise

    needed = ("get_layerwise_info", "_layerwise_process", "_place_kernel_tensors", "_copy_and_restore_kernel_tensors")
    missing = [name for name in needed if not hasattr(layerwise, name)]
    if missing:
        raise ShardedStateError(
            f"This vLLM's layerwise reload machinery lacks {missing} (vllm_sharded_loader was written against "
            "vLLM 0.32): weight updates with sharded_state are not available; restart the engine instead."
        )
    return layerwise


def _shared_parameters(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one parameter object (tied embeddings), as served now."""
    by_object: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(param), []).append(name)
    return [names for names in by_object.values() if len(names) > 1]


def _groups() -> list[Any]:
    """The model-parallel groups of this worker (TP, then PP) that span more than one worker."""
    from vllm.distributed import get_pp_group, get_tp_group

    return [g for g in (get_tp_group(), get_pp_group()) if g.world_size > 1]


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


def _agree(error: str | None) -> list[str]:
    """Every worker's error (None: read and checked), exchanged among the model's workers."""
    return [e for e in gather_over(_groups(), [error], "this update") if e is not None]


class CheckpointReader(Protocol):
    """What an update needs of the loader (:class:`.loader.ShardedStateLoader`), which imports this module."""

    def locate(self, directory: str, revision: str | None = None) -> tuple[str, str | None]: ...

    def adoptable(
        self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
    ) -> dict[str, Callable[[torch.Tensor], None]] | None: ...

    def read_checkpoint(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        located: tuple[str, str | None],
        targets: Mapping[str, torch.Tensor],
        tied: list[list[str]],
        adopt: Mapping[str, Callable[[torch.Tensor], None]] | None,
        *,
        verify: str | None = None,
        update: bool = False,
    ) -> Any: ...


class InPlaceUpdate:
    """One weight update of a running model from a sharded checkpoint (see the module's docstring).

    Built before vLLM takes the layers off the model: it records which parameters are
    tied while they still are one object. ``path`` names the checkpoint (default: the
    one ``model_config`` points at, as vLLM's ``reload_weights`` sets it); ``verify``
    overrides the loader's setting.
    """

    def __init__(
        self,
        loader: CheckpointReader,
        model: torch.nn.Module,
        model_config: ModelConfig,
        path: str | None = None,
        verify: str | None = None,
    ) -> None:
        self.loader, self.model, self.model_config = loader, model, model_config
        self.path, self.verify = path, verify
        self.tied = _shared_parameters(model)
        self.loaded_names: set[str] = set()
        self.done = False
        # Whether the commit began (see :meth:`run`): only then has anything served changed.
        self.committed = False
        self.proof: str | None = None  # of the checkpoint read (see capture.manifest_proof)

    # ------------------------------------------------------------------ entry points

    def for_reload_weights(self) -> InPlaceUpdate:
        """This update, as the weights vLLM's ``reload_weights`` hands to the model's ``load_weights``.

        vLLM compares what ``load_weights`` reports loaded with the model's parameters and
        warns about the rest; the model's own method sees no weights here (they go
        straight into the layers). So until it is called with this update, the model's
        ``load_weights`` is wrapped (on the instance) to add the names this update loaded.
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
            # The capture's wrapper (inside ``method``) counts every call as an update; a
            # refused one changed nothing, so it must not count (a later save would refuse).
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
        # Iterated by the model's load_weights inside vLLM's reload_weights, once vLLM has
        # put the layers in their loaded layout (initialize_layerwise_reload); once.
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
            # After a refusal every layer is back already; this restores vLLM's own flags.
            finalize_layerwise_reload(self.model, self.model_config)

    # ------------------------------------------------------------------ the update

    def run(self) -> bool:
        """Materialize, read, process, commit (see the module's docstring); on a refusal, put everything back.

        Every worker reads and checks its own files, then all agree before any processes,
        and every worker post-processes into new memory, then all agree again before any
        copies into a served tensor: a file that only one rank finds corrupt, or a
        post-processing that fails on one rank only, must leave every rank as served, not
        some updated and some not. A refusal is raised by one worker only, the last one
        (see :func:`.workers.raises_for_all`); the others put their layers back and return False.
        """
        layerwise = _layerwise()
        layers = [
            (prefix, module, info)
            for prefix, module in self.model.named_modules()
            if (info := layerwise.get_layerwise_info(module)).can_load()
        ]
        if not layers:
            raise ShardedStateError("The model's layers were not prepared for a reload (vLLM's layerwise reload).")
        rank = model_rank(self.model)
        processed: list[ProcessedLayer] = []
        for step in ("read", "process"):
            failure: Exception | None = None
            try:
                if step == "read":
                    filled, aside = self._read(layers)
                else:
                    self._process(layers, filled, processed)  # fills processed as it goes: undone on a refusal
            except Exception as e:
                failure = e
            except BaseException:
                self._put_back(layers, processed)
                raise
            errors = _agree(None if failure is None else f"{rank}: {failure}")
            if errors:
                self._put_back(layers, processed)
                if len(errors) == 1 and failure is not None and raises_for_all():
                    raise failure
                if raises_for_all():
                    kind = type(failure) if isinstance(failure, ShardedStateError) else ShardedStateError
                    raise agreed_error(kind, " | ".join(errors) + " (no rank's weights were changed)", failure)
                logger.warning("sharded_state: %s put its weights back: another rank refused the update", rank)
                return False
        # Every rank read, checked and post-processed everything: from here on, what is served changes.
        self.committed = True
        state = self.model.__dict__.get(LOADED_STATE_ATTRIBUTE)
        if state is not None:
            state.updates += 1  # until committed, what is served is neither the old state nor the new
        try:
            self._commit(layers, aside, processed)
        finally:
            # The previous packings just freed: to the system, not kept by the allocator (see release_free_heap).
            oscalls.release_free_heap()
        if state is not None:
            # Every tensor now is this checkpoint's, as loaded: a save re-reads it from there.
            served_from_checkpoint(state, self.located[1] or self.located[0], self.proof)
        return True

    @staticmethod
    def _put_back(
        layers: list[tuple[str, torch.nn.Module, Any]], processed: list[ProcessedLayer] | None = None
    ) -> None:
        """Every layer's served tensors back on it, and what post-processing set on its modules undone."""
        layerwise = _layerwise()
        for done in reversed(processed or []):
            done.undo()
        for _, module, info in layers:
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(module, info)
            info.reset()

    def _located(self) -> tuple[str, str | None]:
        """The checkpoint's folder (and Hub id), refusing at once a local path that does not exist."""
        config = self.model_config
        path = self.path if self.path is not None else config.model_weights or config.model
        if open_store(path).exists():
            return path, None
        if os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path):
            raise CheckpointNotFound(
                f"{path}: no such checkpoint directory for the weight update. Save the update first "
                "(examples/save_sharded_state.py, or vLLM's save_sharded_state hook) and pass its folder."
            )
        return self.loader.locate(path, config.revision)

    def _read(
        self, layers: list[tuple[str, torch.nn.Module, Any]]
    ) -> tuple[set[str], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Steps 1 and 2; returns the state-dict names that now hold new values, and the served
        tensors read aside (name -> (served, new)), copied only at the commit."""
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        located = self._located()  # before any memory is taken: a missing path is refused at once
        self.located = located
        kernel = set()
        for _, module, info in layers:
            params, buffers = info.kernel_tensors or ({}, {})
            kernel |= {storage_key(t) for t in [*params.values(), *buffers.values()] if t.numel()}
            materialize_layer(module, info)
        # vLLM restores each layer on its own: names tied at load time get one tensor again.
        for names in self.tied:
            first = self.model.get_parameter(names[0])
            for name in names[1:]:
                prefix, _, leaf = name.rpartition(".")
                self.model.get_submodule(prefix).register_parameter(leaf, first)
        state_dict = self.model.state_dict()
        targets = saveable_state(state_dict)
        memory = {storage_key(t) for t in targets.values()}
        filled = {name for name, t in state_dict.items() if t.numel() and storage_key(t) in memory}
        # Tensors vLLM leaves on the model (biases, expert maps) are served ones: read aside.
        aside = {name: t for name, t in targets.items() if storage_key(t) in kernel}
        targets = {name: torch.empty_like(t) if name in aside else t for name, t in targets.items()}
        adopt = self.loader.adoptable(self.model, state_dict)
        if adopt is not None:
            adopt = {name: setter for name, setter in adopt.items() if name not in aside}
        # The loader records what it read on the model (for the start-up capture's proof): an update
        # keeps it for its commit only, and leaves the model's as it was (a refused update leaves no trace).
        before = self.model.__dict__.get(READ_PROOF_ATTRIBUTE)
        try:
            self.loader.read_checkpoint(
                self.model,
                self.model_config,
                located,
                targets,
                tied_groups(state_dict, targets),
                adopt,
                verify=self.verify,
                update=True,
            )
        finally:
            read = self.model.__dict__.pop(READ_PROOF_ATTRIBUTE, None)
            if before is not None:
                self.model.__dict__[READ_PROOF_ATTRIBUTE] = before
        self.proof = None if read is None else read[1]
        self.loaded_names = {name for name, _ in self.model.named_parameters()}
        return filled, {name: (served, targets[name]) for name, served in aside.items()}

    def _process(
        self, layers: list[tuple[str, torch.nn.Module, Any]], filled: set[str], processed: list[ProcessedLayer]
    ) -> None:
        """Step 3: each layer's post-processing, as at start-up, into the new memory (not yet served).

        vLLM's ``_layerwise_process`` runs it, with the layer's kernel tensors held back so
        that it copies nothing; each processed tensor is checked to fit the served one it
        is copied into at the commit. Attention layers are processed at the commit, as at
        start-up after every other layer, in their served tensors.
        """
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        layerwise = _layerwise()
        for prefix, module, info in layers:
            names = {f"{prefix}.{name}" if prefix else name for name in get_layer_tensors(module)}
            holds = bool(names & filled) and info.kernel_tensors is not None
            done = ProcessedLayer(module, info, holds, attention=is_deferred_attention_layer(module))
            processed.append(done)
            if not holds or done.attention:
                continue
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

    def _commit(
        self,
        layers: list[tuple[str, torch.nn.Module, Any]],
        aside: dict[str, tuple[torch.Tensor, torch.Tensor]],
        processed: list[ProcessedLayer],
    ) -> None:
        """Step 4: every rank agreed; the new values go into the served tensors."""
        layerwise = _layerwise()
        done = 0
        try:
            for served, new in aside.values():
                served.copy_(new)
            for step in processed:
                if step.attention:
                    continue
                if step.holds:
                    step.keep_what_handles_point_at()
                    layerwise._copy_and_restore_kernel_tensors(step.module, step.info)
                else:
                    layerwise._place_kernel_tensors(step.module, step.info)
                step.info.reset()
                done += 1
            for step in processed:
                if not step.attention:
                    continue
                if step.holds:
                    layerwise._copy_and_restore_kernel_tensors(step.module, step.info)
                else:
                    layerwise._place_kernel_tensors(step.module, step.info)
                step.info.reset()
                step.module.process_weights_after_loading(self.model_config.dtype)
                done += 1
        except BaseException as e:
            for _, module, info in layers:
                if info.can_load():
                    layerwise._place_kernel_tensors(module, info)
                    info.reset()
            raise ShardedStateError(
                f"The weight update was read, checked and post-processed on every rank, but copying it into the "
                f"served tensors failed after {done} of {len(layers)} layers ({type(e).__name__}: {e}): the served "
                "weights are partly updated. Update again, or restart the engine."
            ) from e
