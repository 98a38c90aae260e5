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

1. **read**: the loader's start-up read (:meth:`.model_reader.ModelReader.read`,
   every check of a start-up load first) into host memory, mapped from the checkpoint's
   files where the reader can (:class:`..checkpoint.update_staging.StagedWeights`), never into a served
   tensor, before any layer is materialized;
2. **process**: layer by layer, the layer materialized on its device from those weights and
   post-processed as at start-up, into new memory; held for the commit while the held
   layers fit a budget (:func:`..checkpoint.update_staging.update_budget`), else checked and let go;
3. **commit**: the tensors vLLM leaves on the model (biases) and every layer's processed
   tensors copied into the served ones, layer by layer (a layer let go is processed again
   first), then the attention layers' own processing.

The workers agree after step 1 and again after step 2 (:func:`_agree`): the update is all
or nothing across every rank and every tensor. Anything that fails on any rank before the
commit (a checkpoint of another model, another dtype, a missing or corrupt file, a failed
post-processing) puts every rank's kernel tensors back untouched, and the module state
post-processing set (kernel handles, packed layouts) as it was: the engine serves, byte
for byte, what it served before, and the update is not counted (``LoadedState.updates``).

Memory beside the served weights: one layer's loaded and processed forms, plus the held
layers (the budget); on the host, the new weights, as file mappings (page cache) where the
checkpoint's files can be mapped, else read into host memory (object storage, resharding
that assembles a tensor from pieces).

Two entry points: vLLM's ``reload_weights`` (through the loader's ``get_all_weights``,
see :meth:`InPlaceUpdate.for_reload_weights`) and the ``sharded_state`` weight-transfer
engine (:mod:`.weight_transfer`, see :meth:`InPlaceUpdate.run_layerwise`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from ..checkpoint.state import saveable_state, storage_key, tied_groups
from ..checkpoint.update_staging import BUDGET_ENV, StagedWeights, return_freed_memory, update_budget
from ..format.errors import CheckpointNotFound, ShardedStateError, Unsupported, WorkerLost, agreed_error
from ..planning.topology import RankInfo
from ..storage.location import Store
from .capture import LOADED_STATE_ATTRIBUTE, READ_PROOF_ATTRIBUTE, served_from_checkpoint
from .identity import ranks_on_host
from .layer_geometry import model_rank
from .layer_steps import fill_layer, layer_held_bytes, let_go, process_layer
from .model_reader import ModelReader
from .processed import ProcessedLayer
from .workers import (
    checkpoint_digest,
    different_checkpoints,
    gather_over,
    model_groups,
    raises_for_all,
    wait_for_replicas,
)

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
        raise Unsupported(
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


def _agree(rank: RankInfo, error: str | None, held: tuple[str, str, str, str] | None = None) -> list[str]:
    """Every worker's error (None: read and checked), exchanged among the model's workers
    (:func:`.workers.model_groups`); with ``held`` (after the reads: this worker's rank, node, path
    and manifest digest), workers that read different checkpoints at one path (each node its own
    copy) are one more error."""
    outcomes = gather_over(model_groups(rank), [(error, held)], "this update")
    errors = [e for e, _ in outcomes if e is not None]
    views = [h for _, h in outcomes if h is not None]
    if not errors and views and (mismatch := different_checkpoints(views[0][2], views, "update again")):
        errors.append(mismatch)
    return errors


class InPlaceUpdate:
    """One weight update of a running model from a sharded checkpoint (see the module's docstring).

    Built before vLLM takes the layers off the model: it records which parameters are
    tied while they still are one object. ``path`` names the checkpoint (default: the
    one ``model_config`` points at, as vLLM's ``reload_weights`` sets it); ``verify``
    overrides the loader's setting.
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
        self.tied = _shared_parameters(model)
        self.loaded_names: set[str] = set()
        self.done = False
        # Whether the commit began (see :meth:`run`): only then has anything served changed.
        self.committed = False
        self.proof: str | None = None  # of the checkpoint read (see checkpoint/save_proof.py)
        self.digest = ""  # of the manifest read (workers.checkpoint_digest)
        # The new weights on the host, and the served tensors (vLLM leaves on the model) they update.
        self.staged: StagedWeights | None = None
        self.aside: dict[str, torch.Tensor] = {}

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
        """Read, process, commit (see the module's docstring); on a refusal, put everything back.

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
        try:
            wait_for_replicas(rank, "reload_weights (or update_weights)", "update", "No weights were changed.")
        except WorkerLost:
            self._put_back(layers)
            if raises_for_all():
                raise
            return False
        processed: list[ProcessedLayer] = []
        for step in ("read", "process"):
            failure: Exception | None = None
            try:
                if step == "read":
                    self._read(layers, rank)
                else:
                    self._process(layers, processed)  # fills processed as it goes: undone on a refusal
            except Exception as e:
                failure = e
            except BaseException:
                self._put_back(layers, processed)
                raise
            held = None
            if step == "read" and failure is None:
                held = (str(rank), socket.gethostname(), self.located[0].where, self.digest)
            try:
                errors = _agree(rank, None if failure is None else f"{rank}: {failure}", held)
            except BaseException:  # another worker died (WorkerLost): this one's layers must not stay empty
                self._put_back(layers, processed)
                raise
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
            self._commit(layers, processed)
        finally:
            self.staged = None  # the new weights' host copies and mappings
            return_freed_memory()
        if state is not None:
            # Every tensor now is this checkpoint's, as loaded: a save re-reads it from there.
            served_from_checkpoint(state, self.located[1] or self.located[0].where, self.proof)
        return True

    def _put_back(
        self, layers: list[tuple[str, torch.nn.Module, Any]], processed: list[ProcessedLayer] | None = None
    ) -> None:
        """Every layer's served tensors back on it, and what post-processing set on its modules undone."""
        self.staged = None
        layerwise = _layerwise()
        for done in reversed(processed or []):
            done.undo()
        for _, module, info in layers:
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(module, info)
            info.reset()
        return_freed_memory()  # the new weights read and processed so far

    def _located(self) -> tuple[Store, str | None]:
        """The checkpoint's store (and Hub id), refusing at once a local path that is no folder."""
        config = self.model_config
        path = self.path if self.path is not None else config.model_weights or config.model
        if not isinstance(path, str) or not path:  # reload_weights(weights_path=...) is passed on unchecked
            raise CheckpointNotFound(
                f"weights_path={path!r}: expected the folder, s3://, gs:// or az:// URL, or Hub id of a sharded "
                "checkpoint for the weight update, as a string."
            )
        if (os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)) and not os.path.isdir(path):
            raise CheckpointNotFound(
                f"{path}: no such checkpoint directory for the weight update. Save the update first "
                "(examples/save_sharded_state.py, or vLLM's save_sharded_state hook) and pass its folder."
            )
        return self.reader.locate(path, config.revision)

    def _read(self, layers: list[tuple[str, torch.nn.Module, Any]], rank: RankInfo) -> None:
        """Step 1: the checkpoint read, with every check of a start-up load, into host memory (mapped
        from its files where it can be), before any layer is materialized (see :mod:`.layer_steps`)."""
        located = self._located()  # before any memory is taken: a missing path is refused at once
        self.located = located
        kernel = set()
        for _, _, info in layers:
            params, buffers = info.kernel_tensors or ({}, {})
            kernel |= {storage_key(t) for t in [*params.values(), *buffers.values()] if t.numel()}
        # vLLM restores each layer on its own: names tied at load time get one tensor again.
        for names in self.tied:
            first = self.model.get_parameter(names[0])
            for name in names[1:]:
                prefix, _, leaf = name.rpartition(".")
                self.model.get_submodule(prefix).register_parameter(leaf, first)
        state_dict = self.model.state_dict()
        targets = saveable_state(state_dict)
        staged = self.staged = StagedWeights(targets, tied_groups(state_dict, targets))
        # Tensors vLLM leaves on the model (biases, expert maps) are served ones: copied at the commit.
        self.aside = {name: t for name, t in targets.items() if storage_key(t) in kernel}
        # The loader records what it read on the model (for the start-up capture's proof): an update
        # keeps it for its commit only, and leaves the model's as it was (a refused update leaves no trace).
        before = self.model.__dict__.get(READ_PROOF_ATTRIBUTE)
        manifest = located[0].read_manifest()
        # Compared across the workers (each node reads its own copy); alone, nothing to compare.
        if model_groups(rank):
            self.digest = checkpoint_digest(manifest)
        try:
            self.reader.read(
                self.model,
                self.model_config,
                located,
                manifest,
                staged.targets(),
                tied_groups(state_dict, targets),
                staged.adopt(),
                verify=self.verify,
                update=True,
            )
        finally:
            read = self.model.__dict__.pop(READ_PROOF_ATTRIBUTE, None)
            if before is not None:
                self.model.__dict__[READ_PROOF_ATTRIBUTE] = before
        self.proof = None if read is None else read[1]
        self.loaded_names = {name for name, _ in self.model.named_parameters()}

    def _process(self, layers: list[tuple[str, torch.nn.Module, Any]], processed: list[ProcessedLayer]) -> None:
        """Step 2: each layer materialized from ``staged`` and post-processed, as at start-up, into new
        memory (not yet served); held for the commit within the budget, else checked and let go.

        Attention layers are processed at the commit, as at start-up after every other layer, in
        their served tensors.
        """
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        staged = self.staged
        assert staged is not None
        budget, held, again = update_budget(ranks_on_host()), 0, 0
        mapped = staged.mapped_storages()
        filled = staged.names()
        for prefix, module, info in layers:
            names = {f"{prefix}.{name}" if prefix else name for name in get_layer_tensors(module)}
            holds = bool(names & filled) and info.kernel_tensors is not None
            done = ProcessedLayer(module, info, holds, attention=is_deferred_attention_layer(module), prefix=prefix)
            processed.append(done)
            if not holds or done.attention:
                continue
            self._fill(done)
            process_layer(prefix, module, info, done)
            size = layer_held_bytes(module, mapped)
            if held + size <= budget:
                held += size
            else:
                let_go(done)
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
        fill_layer(step.prefix, step.module, step.info, self.staged, self.reader.adoptable, skip=self.aside)

    def _commit(self, layers: list[tuple[str, torch.nn.Module, Any]], processed: list[ProcessedLayer]) -> None:
        """Step 3: every rank agreed; the new values go into the served tensors, layer by layer (a
        layer let go at step 2 is processed again first)."""
        layerwise = _layerwise()
        staged, done = self.staged, 0
        try:
            for name, served in self.aside.items():
                served.copy_(staged.tensors[name])
            for step in processed:
                if step.attention:
                    continue
                if step.holds:
                    if not step.held:
                        self._fill(step)
                        process_layer(step.prefix, step.module, step.info, step)
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
                    self._fill(step)
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
