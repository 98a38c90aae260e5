"""Where a saved state comes from: the state recorded right after loading.

vLLM's save hook runs on a post-processed model (CPU weights repacked for oneDNN, quantized
parameters renamed, reshaped or dropped); only the state right after ``load_weights`` always
reloads. So the plugin wraps ``process_weights_after_loading``: each worker first records the loaded
state's signature on the model, and captures it to disk if asked (:mod:`..checkpoint.loaded_state`).
Recording never breaks a load: an error is logged once and kept for the save hook to report.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.logger import init_logger

from ..checkpoint.loaded_state import LoadedState, capture_settings
from ..checkpoint.save_proof import (
    check_source_files_unchanged,
    check_still_read_from,
    weight_file_identities,
)
from ..checkpoint.state import saveable_state, tied_groups
from ..format.errors import ShardedStateError
from ..storage.location import open_store
from .compile_cache import place_compile_cache
from .follower import watch_leader
from .identity import (
    current_vllm_config,
    dtype_label,
    is_drafter,
    is_experts,
    model_rank,
    ranks_on_host,
    source_identity,
)
from .layer_geometry import tensor_geometry

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")


LOADED_STATE_ATTRIBUTE = "_vllm_sharded_loaded_state"
RECORD_ERROR_ATTRIBUTE = "_vllm_sharded_record_error"


def _show_progress() -> bool:
    """vLLM's rule for load progress bars: rank 0 only, unless ``use_tqdm_on_load`` is off."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import enable_tqdm

    try:
        wanted = get_current_vllm_config().load_config.use_tqdm_on_load
    except Exception:  # outside an engine's config context: vLLM's default
        wanted = True
    return enable_tqdm(wanted)


# Set on the model by the sharded loader: ((store, Hub repository id), manifest_proof, manifest) it read.
READ_PROOF_ATTRIBUTE = "_vllm_sharded_read_proof"


def reread_loaded_state(state: LoadedState) -> dict[str, torch.Tensor]:
    """The state this worker loaded at start-up, read again from the source the engine loaded.

    For a save without a capture when the live weights are not the loaded state. From a sharded
    checkpoint, file mappings without a model; otherwise a fresh model built on the CPU and given the
    same loader's ``load_weights`` without post-processing, one more copy of the rank's weights.
    """
    import copy

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config, model_config = state.vllm_config, state.model_config
    if vllm_config is None or model_config is None:
        raise ShardedStateError("the engine's configuration at load time is unknown")
    # A configuration of its own: the fresh model's layers register themselves by name.
    fresh = copy.copy(vllm_config)
    fresh.compilation_config = copy.copy(vllm_config.compilation_config)
    fresh.compilation_config.static_forward_context = {}
    load_config = vllm_config.load_config
    checkpoint = None  # proven unchanged before and after the re-read
    model_dir = None if state.model_folder is None else state.model_folder.where
    if state.reloaded_from is not None:
        # Updated since start-up: the update's checkpoint, through our loader.
        load_config = copy.copy(load_config)
        load_config.load_format, load_config.model_loader_extra_config = "sharded_state", {}
        model_config = copy.copy(model_config)
        model_config.model_weights = state.reloaded_from
        checkpoint = state.reloaded_from
    elif load_config.load_format == "sharded_state":
        checkpoint = model_config.model_weights or model_config.model
    if checkpoint is not None:
        store, repo_id = state.read_from or (None, None)
        if store is not None and repo_id is None and store.exists():  # (a Hub id: checked after the read only)
            manifest = store.read_manifest()
            check_still_read_from(checkpoint, state.read_proof, manifest)
            if manifest is not None and state.rank is not None:
                return state.reread_from_checkpoint(store, manifest, ranks_on_host())
        # Every byte read again is checked against the manifest's checksums.
        load_config = copy.copy(load_config)
        load_config.model_loader_extra_config = {**(load_config.model_loader_extra_config or {}), "verify": "checksum"}
    else:
        check_source_files_unchanged(model_dir, state.source_files)
    loader = get_model_loader(load_config)
    with set_current_vllm_config(fresh), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = loader.create_model(vllm_config=fresh, model_config=model_config)
        loader.load_weights(model, model_config)
    if checkpoint is None:
        check_source_files_unchanged(model_dir, state.source_files)  # a write during the read
    else:
        # The manifest the re-read used: a rewrite between our check and the read shows here.
        check_still_read_from(
            checkpoint, state.read_proof, model.__dict__.get(READ_PROOF_ATTRIBUTE, (None, None, None))[2]
        )
    tensors = saveable_state(model.state_dict())
    loaded = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    expected = {name: (shape, dtype) for name, (_, shape, dtype) in state.signature.items()}
    if loaded != expected:
        differing = sorted(set(loaded.items()) ^ set(expected.items()))[:3]
        raise ShardedStateError(f"reading the source again gave another state (for example {differing})")
    return tensors


def record_loaded_state(model: torch.nn.Module, model_config: Any) -> LoadedState:
    """Record (and, if asked, capture to disk) the state a worker has just loaded."""
    state_dict = model.state_dict()
    tensors = saveable_state(state_dict)
    rank = model_rank(model)
    model_dir = str(getattr(model_config, "model", ""))
    state = LoadedState(
        signature={n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in tensors.items()},
        source=source_identity(model, model_config),
        dtype=dtype_label(model_config.dtype),
        quantization=getattr(model_config, "quantization", None),
        geometry={
            n: g.to_dict()
            for n, g in tensor_geometry(
                model, tensors, rank.tp_size, rank.tp_rank, rank.experts, rank.ep_rank, rank.expert_tp
            ).items()
        },
        tied=tied_groups(state_dict, tensors),
        rank=rank,
        per_replica=frozenset(_expert_tensors(model, tensors)) if rank.replicas > 1 else frozenset(),
        model_folder=open_store(model_dir) if os.path.isdir(model_dir) else None,
        read_from=(model.__dict__.get(READ_PROOF_ATTRIBUTE) or (None, None, None))[0],
        vllm_config=current_vllm_config(),
        model_config=model_config,
        read_proof=(model.__dict__.get(READ_PROOF_ATTRIBUTE) or (None, None, None))[1],
    )
    if READ_PROOF_ATTRIBUTE not in model.__dict__:  # loaded by another format, from its own files
        state.source_files = weight_file_identities(model_dir)
    # Data-parallel replicas hold the same slices: only the first captures, the others only their own
    # experts. A speculative drafter's capture would leave stray files in the served model's checkpoint.
    writes = rank.dp_rank == 0 or bool(state.per_replica)
    settings = capture_settings() if writes and not is_drafter(model_config) else None
    if settings is not None:
        state.capture_to(*settings, state.written_tensors(rank, tensors), _show_progress())
    # Plain attributes, not modules or buffers: they must not show up in state_dict().
    model.__dict__[LOADED_STATE_ATTRIBUTE] = state
    state.count_updates(model)
    return state


def wrap_process_weights_after_loading(original: Any) -> Any:
    """``process_weights_after_loading`` that records the loaded state first."""
    if getattr(original, "_records_loaded_state", False):
        return original

    def process_weights_after_loading(model: torch.nn.Module, model_config: Any, target_device: Any) -> Any:
        # Runs for every load format: a failed recording must leave the load untouched.
        config = current_vllm_config()
        if config is not None:
            watch_leader(config.parallel_config)  # a follower node ends with its leader, whatever it loaded
        try:
            model.__dict__.pop(RECORD_ERROR_ATTRIBUTE, None)
            record_loaded_state(model, model_config)
            place_compile_cache(model)
        except Exception as e:
            model.__dict__.pop(LOADED_STATE_ATTRIBUTE, None)
            model.__dict__[RECORD_ERROR_ATTRIBUTE] = f"{type(e).__name__}: {e}"
            logger.warning_once(
                "vllm_sharded_loader: recording the loaded state failed (%s: %s); the model loads and serves "
                "as usual, but save_sharded_state will refuse to save it.",
                type(e).__name__,
                e,
            )
        return original(model, model_config, target_device)

    process_weights_after_loading._records_loaded_state = True  # type: ignore[attr-defined]
    process_weights_after_loading.__wrapped__ = original  # type: ignore[attr-defined]
    return process_weights_after_loading


def owner_of(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return None


def _expert_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``tensors`` that routed-expert layers hold: each EP rank's own experts."""
    return [name for name in tensors if (module := owner_of(model, name)) is not None and is_experts(module)]
