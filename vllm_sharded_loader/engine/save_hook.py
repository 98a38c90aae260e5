"""vLLM's save hook on every worker: the loaded state, saved through the save protocol."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from vllm.logger import init_logger

from ..checkpoint.group import Members, wait_for_replicas
from ..checkpoint.loaded_state import CAPTURE_DIR_ENV, OVERWRITE_ENV, LoadedSave, LoadedState
from ..checkpoint.protocol import FolderNotShared, refusal, run_save
from ..format.errors import SaveFailedAfterPublish, SaveRefused, ShardedStateError
from ..format.names import default_pattern
from ..storage.location import open_store
from .capture import LOADED_STATE_ATTRIBUTE, RECORD_ERROR_ATTRIBUTE, owner_of, reread_loaded_state
from .compile_cache import save_startup_artifacts
from .identity import current_rank, dtype_label, is_experts
from .layer_geometry import UNQUANTIZED_METHODS
from .workers import model_groups, raises_for_all, replica_group

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")


def _live_state_if_unchanged(model: torch.nn.Module, state: LoadedState) -> dict[str, torch.Tensor]:
    """The live tensors, if they provably still are the loaded ones; else an error."""
    how = (
        f"Start the engine with {CAPTURE_DIR_ENV}=<dir> in its environment so that each worker "
        "captures its loaded state at start-up (examples/save_sharded_state.py does this), then save."
    )
    if state.quantization:
        raise SaveRefused(
            f"Refusing to save: the model is quantized ({state.quantization}) and its post-processed "
            f"parameters are not a state that reloads. {how}"
        )
    # Post-processing may rewrite a weight in place, keeping its address (for CUDA graphs): only
    # layers known never to do so pass on an unchanged address.
    rewritten = sorted(
        {
            f"{type(module).__name__} ({method})"
            for name in state.signature
            if (module := owner_of(model, name)) is not None
            and (method := type(getattr(module, "quant_method", None)).__name__)
            not in (*UNQUANTIZED_METHODS, "NoneType")
        }
    )
    if rewritten:
        raise SaveRefused(
            f"Refusing to save the live state: post-processing of {', '.join(rewritten[:3])} may rewrite its "
            f"weights in place, so they may no longer be the state that reloads. {how}"
        )
    # The whole state dict, not saveable_state(): an emptied tensor must show as such.
    live = model.state_dict()
    changed = []
    for name, (address, shape, dtype) in state.signature.items():
        t = live.get(name)
        if t is None:
            changed.append(f"{name} (gone)")
        elif (t.data_ptr(), tuple(t.shape), t.dtype) != (address, shape, dtype):
            changed.append(
                f"{name} (loaded {list(shape)} {dtype_label(dtype)}, now {list(t.shape)} {dtype_label(t.dtype)})"
            )
    if changed:
        raise SaveRefused(
            f"Refusing to save an incomplete state: post-processing after loading replaced "
            f"{len(changed)} parameters (for example {'; '.join(changed[:3])}); on CPU vLLM repacks "
            f"every linear weight and empties layer.weight. {how}"
        )
    return {name: live[name] for name in state.signature}


def _unknown_state(model: torch.nn.Module) -> SaveRefused:
    """Why there is no state recorded at load time to save."""
    failed = model.__dict__.get(RECORD_ERROR_ATTRIBUTE)
    if failed is not None:
        return SaveRefused(
            f"Refusing to save: recording the loaded state at start-up failed ({failed}), so the "
            f"state that reloads is unknown. Fix the cause (for {CAPTURE_DIR_ENV}: a writable "
            "directory with room for the model) and start the engine again."
        )
    return SaveRefused(
        "Refusing to save: this model was loaded before vllm_sharded_loader was active, so "
        "its loaded state is unknown. Check that the plugin is installed (VLLM_PLUGINS)."
    )


@dataclass
class _EngineWeights:
    """The weights a worker serves (:class:`..checkpoint.loaded_state.ServedWeights`)."""

    model: torch.nn.Module
    state: LoadedState | None  # (None: never asked, the save refuses first)

    def live(self) -> dict[str, torch.Tensor]:
        assert self.state is not None
        return _live_state_if_unchanged(self.model, self.state)

    def reread(self) -> dict[str, torch.Tensor]:
        assert self.state is not None
        return reread_loaded_state(self.state)


def save_rank_from_hook(model: torch.nn.Module, path: str, pattern: str | None, max_size: int | None) -> None:
    """Body of vLLM's worker ``save_sharded_state`` hook, on every worker at once. A failure every
    worker knows alike is raised by one of them (:func:`raises_for_all`) so vLLM reads every answer."""
    try:
        _save_rank(model, path, pattern, max_size)
    except ShardedStateError as e:
        if not e.agreed or raises_for_all():
            raise
        logger.error("sharded_state: %s (raised by the engine's last worker)", e)


def _save_rank(model: torch.nn.Module, path: str, pattern: str | None, max_size: int | None) -> None:
    """This worker's part of :func:`..checkpoint.protocol.run_save` across the workers, staging its
    loaded state (its start-up capture, if it still holds)."""
    state: LoadedState | None = getattr(model, LOADED_STATE_ATTRIBUTE, None)
    rank = state.rank if state is not None and state.rank is not None else current_rank()
    if rank.dp_size > 1 and rank.replicas == 1:
        if any(is_experts(m) for m in model.modules()):
            if state is None:
                raise _unknown_state(model)  # without a recorded state (and placement), that is the reason to give
            # vLLM splits the experts across the replicas in every layout this version records.
            raise SaveRefused(
                f"Refusing to save: the model's experts are split across its {rank.dp_size} data-parallel replicas "
                "in a way this version does not record (with prefill context parallelism, or an expert-parallel "
                "size other than TP x DP). Save from an engine without data parallelism (data_parallel_size=1)."
            )
        if rank.dp_rank > 0:
            # Replicas hold the same slices: replica 0 writes them, once.
            logger.info("sharded_state: data-parallel replica %d leaves the save to replica 0", rank.dp_rank)
            return
    workers = Members(model_groups(rank), rank)
    wait_for_replicas(replica_group(rank), rank, "save_sharded_state", "save", "Nothing was written.")
    pattern = pattern or default_pattern(rank.pp_size, rank.replicas)
    overwrite = os.environ.get(OVERWRITE_ENV, "").lower() in ("1", "true", "yes")
    target = open_store(path)
    save = LoadedSave(state, _unknown_state(model), _EngineWeights(model, state), rank, pattern, max_size, overwrite)
    job = save.job(
        placed=lambda target, entry: save_startup_artifacts(
            model, target, entry, rank, getattr(state, "model_config", None)
        )
    )
    try:
        manifest, (staged,) = run_save(target, workers, job)
    except SaveFailedAfterPublish:
        raise
    except ShardedStateError as e:
        if isinstance(e, FolderNotShared) and state is not None and state.drop_capture is not None:
            state.drop_capture()  # staged at start-up in that folder, for a save there that can never succeed
        raise refusal(target, e) from e
    save.keep(staged, target.stages_in_place)
    if workers.first:
        nbytes = manifest.nbytes / 1e6
        logger.info("sharded_state: saved %d ranks, %.1f MB, to %s", len(manifest.ranks), nbytes, target.canonical())
