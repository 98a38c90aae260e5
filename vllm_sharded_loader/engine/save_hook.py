"""vLLM's save hook on every worker: the loaded state, saved through the save protocol."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch
from vllm.logger import init_logger

from ..checkpoint.carry import CarriedFiles
from ..checkpoint.protocol import FolderNotShared, SaveJob, refusal, run_save
from ..checkpoint.state import manifest_ties
from ..checkpoint.verify import verify_file_checksum
from ..format.errors import SaveFailedAfterPublish, SaveRefused, ShardedStateError
from ..format.manifest import Manifest
from ..format.names import default_pattern, validate_pattern
from ..planning.topology import RankInfo
from ..storage.local import OpenFile
from ..storage.location import Store, open_store
from ..storage.staged import StagedRank, discard_rank, open_staged_tensors, stage_rank
from .capture import (
    CAPTURE_DIR_ENV,
    LOADED_STATE_ATTRIBUTE,
    OVERWRITE_ENV,
    RECORD_ERROR_ATTRIBUTE,
    LoadedState,
    is_experts,
    owner_of,
    reread_loaded_state,
    written_tensors,
)
from .compile_cache import save_startup_artifacts
from .identity import current_rank, dtype_label
from .layer_geometry import UNQUANTIZED_METHODS
from .workers import Workers, raises_for_all

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
    # Post-processing may rewrite a weight in place, keeping its address (for CUDA graphs:
    # MoE block layouts, EPLB, replace_parameter(prefer_copy=True)): only layers whose
    # post-processing is known never to do so pass on an unchanged address.
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


def _stage_for_save(
    model: torch.nn.Module,
    state: LoadedState,
    path: str,
    rank: RankInfo,
    pattern: str,
    max_size: int | None,
    token: str,
) -> StagedRank:
    """Stage this rank's loaded state in ``path``: the capture itself if it fits, else a rewrite."""
    capture = state.capture
    if state.updates:
        # The capture, and the loaded state, are what the engine served before the
        # updates: only the live weights are current.
        try:
            live = _live_state_if_unchanged(model, state)
        except SaveRefused as e:
            raise SaveRefused(
                f"Refusing to save: the weights were updated {state.updates} time(s) after loading (through "
                "the model's load_weights), so the state captured at start-up is stale, and the live one cannot "
                f"be proven to reload ({e}). Write the updated weights out in the Hugging Face format, start an "
                f"engine from them with {CAPTURE_DIR_ENV}=<dir>, and save that engine."
            ) from e
        return stage_rank(path, written_tensors(rank, state, live), rank, pattern, max_size, token)
    if capture is not None and not capture.temporary:
        # Published by an earlier save: its files now belong to a checkpoint that another
        # save may have replaced since, even under the same names. Only their content,
        # checked against the checksums taken as they were written, proves them ours.
        _check_capture_content(capture)
        return stage_rank(path, open_staged_tensors(capture), rank, pattern, max_size, token)
    if capture is not None:
        in_place = os.path.isdir(path) and os.path.samefile(capture.directory, path)
        if in_place and (capture.pattern, capture.max_size) == (pattern, max_size):
            return capture
        return stage_rank(path, open_staged_tensors(capture), rank, pattern, max_size, token)
    try:
        live = _live_state_if_unchanged(model, state)
    except SaveRefused as refused:
        # No capture, and the live weights are not the loaded state: the source still is.
        try:
            live = reread_loaded_state(state)
        except SaveRefused:
            raise  # issue 34 (trust): the source no longer holds what is served; that is the reason, said whole
        except Exception as e:
            raise SaveRefused(f"{refused} (Reading the source again failed too: {e}.)") from e
        logger.info("sharded_state: %s re-read its loaded state from %s to save it", rank, state.source.architecture)
    return stage_rank(path, written_tensors(rank, state, live), rank, pattern, max_size, token)


def _check_capture_content(capture: StagedRank) -> None:
    """Refuse to save from a published capture whose files no longer hold what was captured."""
    how = (
        f"Another save has replaced the checkpoint this engine saved at start-up; restart the engine (with "
        f"{CAPTURE_DIR_ENV}) to save what it serves."
    )
    for path, f in zip(capture.paths(), capture.entry.files, strict=True):
        if f.checksum is None:
            raise SaveRefused(f"Refusing to save: {path} has no recorded checksum to prove it unchanged. {how}")
        try:
            with OpenFile.open(path) as opened:
                if opened.size != f.size:
                    raise SaveRefused(f"{path}: {opened.size} bytes, captured {f.size}")
                verify_file_checksum(opened, f.checksum)
        except (OSError, ShardedStateError) as e:
            raise SaveRefused(f"Refusing to save: the captured state is gone ({e}). {how}") from e


def _loaded(model: torch.nn.Module, state: LoadedState | None) -> LoadedState:
    """The state recorded at load time, or the refusal that says why there is none."""
    if state is not None:
        return state
    failed = model.__dict__.get(RECORD_ERROR_ATTRIBUTE)
    if failed is not None:
        raise SaveRefused(
            f"Refusing to save: recording the loaded state at start-up failed ({failed}), so the "
            f"state that reloads is unknown. Fix the cause (for {CAPTURE_DIR_ENV}: a writable "
            "directory with room for the model) and start the engine again."
        )
    raise SaveRefused(
        "Refusing to save: this model was loaded before vllm_sharded_loader was active, so "
        "its loaded state is unknown. Check that the plugin is installed (VLLM_PLUGINS)."
    )


def _manifest(rank: RankInfo, state: LoadedState, pattern: str, outcomes: list[Any]) -> Manifest:
    """The manifest of a save, from every worker's (rank entry, (geometry, tied names, expert placement))."""
    placements = {p for _, (_, _, p) in outcomes if p is not None}
    if len(placements) > 1:
        raise SaveRefused(f"the ranks place their experts differently: {sorted(map(str, placements))}")
    return Manifest(
        tp_size=rank.tp_size,
        pp_size=rank.pp_size,
        dtype=state.dtype,
        pattern=pattern,
        source=state.source,
        ranks=tuple(sorted((entry for entry, _ in outcomes), key=lambda e: (e.pp_rank, e.dp_rank, e.tp_rank))),
        geometry={name: g for _, (geometry, _, _) in outcomes for name, g in geometry.items()},
        tied=manifest_ties(group for _, (_, tied, _) in outcomes for group in tied),
        experts=next(iter(placements), None),
        dp_size=rank.dp_size,
        experts_over_dp=rank.experts_over_dp,
    )


def _stage_non_weight_files(state: LoadedState | None, carried: CarriedFiles) -> None:
    """Stage the served model's config, tokenizer and other non-weight files for a save, so that a
    checkpoint saved by the hook alone (a server's ``/collective_rpc``, ``LLM``'s engine) serves by
    itself. They are the served model's, so they replace what the output holds (the save
    script's copies of the same files, or a previous checkpoint's), but only just before the
    manifest (:mod:`..checkpoint.carry`)."""
    if state is None or state.model_dir is None:
        logger.warning(
            "sharded_state: the served model is not a local folder; copy its config and tokenizer files to %s",
            carried.output,
        )
        return
    source = open_store(state.model_dir)
    if source.same_as(carried.store):
        return
    changed = carried.stage(source)
    logger.info(
        "sharded_state: %d non-weight files of %s (config, tokenizer, ...) to replace", len(changed), source.where
    )


def _discard(state: LoadedState | None, staged: StagedRank) -> None:
    """After a failed save, before its publish: remove what this worker staged or placed.

    A start-up capture that was only staged stays for the next try. One already placed
    under final names is removed: no manifest lists those files, and a retry rewrites
    from the live weights or refuses.
    """
    if state is not None and staged is state.capture:
        if not staged.placed:
            return
        state.capture = None
    discard_rank(staged)


def save_rank_from_hook(model: torch.nn.Module, path: str, pattern: str | None, max_size: int | None) -> None:
    """Body of vLLM's worker ``save_sharded_state`` hook; runs on every worker at once.

    A failure that every worker knows alike is raised by one of them (:func:`raises_for_all`)
    and logged by the others, so that vLLM reads every worker's answer to this call.
    """
    try:
        _save_rank(model, path, pattern, max_size)
    except ShardedStateError as e:
        if not e.agreed or raises_for_all():
            raise
        logger.error("sharded_state: %s (raised by the engine's last worker)", e)


def _save_rank(model: torch.nn.Module, path: str, pattern: str | None, max_size: int | None) -> None:
    """The save of :func:`save_rank_from_hook`, on this worker: :func:`..checkpoint.protocol.run_save`
    across the workers (:class:`.workers.Workers`), each staging its loaded state (its capture,
    if one was taken at start-up and still holds)."""
    state: LoadedState | None = getattr(model, LOADED_STATE_ATTRIBUTE, None)
    rank = state.rank if state is not None and state.rank is not None else current_rank()
    if rank.dp_size > 1 and rank.replicas == 1:
        if any(is_experts(m) for m in model.modules()):
            _loaded(model, state)  # without a recorded state (and placement), that is the reason to give
            # Experts held alike by every replica would be written by the first alone, but
            # vLLM splits them across the replicas in every layout this version records.
            raise SaveRefused(
                f"Refusing to save: the model's experts are split across its {rank.dp_size} data-parallel replicas "
                "in a way this version does not record (with prefill context parallelism, or an expert-parallel "
                "size other than TP x DP). Save from an engine without data parallelism (data_parallel_size=1)."
            )
        if rank.dp_rank > 0:
            # Replicas hold the same slices: replica 0 writes them, once.
            logger.info("sharded_state: data-parallel replica %d leaves the save to replica 0", rank.dp_rank)
            return
    workers = Workers(rank)
    workers.wait_for_replicas()
    pattern = pattern or default_pattern(rank.pp_size, rank.replicas)
    overwrite = os.environ.get(OVERWRITE_ENV, "").lower() in ("1", "true", "yes")
    target = open_store(path)

    def stage(target: Store) -> list[tuple[StagedRank, Any]]:
        loaded = _loaded(model, state)
        capture = loaded.capture
        if target.stages_in_place:
            staging = target.staging()  # parts are renamed into place: staged in the output folder
        elif capture is not None and capture.temporary:
            staging = capture.directory  # a capture never published: uploaded from where it is
        else:
            # Not into a checkpoint an earlier save published here: that folder is not this save's.
            staging = target.staging()
        staged = _stage_for_save(model, loaded, staging, rank, pattern, max_size, target.token)
        if (staged.pattern, staged.max_size) != (pattern, max_size):
            staged = stage_rank(staged.directory, open_staged_tensors(staged), rank, pattern, max_size, target.token)
        return [(staged, (loaded.geometry, loaded.tied, loaded.rank and loaded.rank.experts))]

    job = SaveJob(
        stage,
        lambda outcomes: _manifest(rank, _loaded(model, state), pattern, outcomes),
        check=lambda: validate_pattern(pattern, rank.tp_size, rank.pp_size, rank.replicas),
        carry=lambda carried: _stage_non_weight_files(state, carried),
        discard=partial(_discard, state),
        # Each rank's start-up artifacts go beside its parts (optional: never fail the save).
        placed=lambda target, entry: save_startup_artifacts(
            model, target, entry, rank, getattr(state, "model_config", None)
        ),
        overwrite=overwrite,
        pattern=pattern,
    )
    try:
        manifest, (staged,) = run_save(target, workers, job)
    except SaveFailedAfterPublish:
        raise
    except ShardedStateError as e:
        if isinstance(e, FolderNotShared) and state is not None and state.drop_capture is not None:
            state.drop_capture()  # staged at start-up in that folder, for a save there that can never succeed
        raise refusal(target, e) from e
    _keep_capture(_loaded(model, state), staged, target.stages_in_place)
    if workers.first:
        nbytes = manifest.nbytes / 1e6
        logger.info("sharded_state: saved %d ranks, %.1f MB, to %s", len(manifest.ranks), nbytes, target.canonical())


def _keep_capture(state: LoadedState, staged: StagedRank, in_place: bool) -> None:
    """After a publish: what this worker keeps of its start-up capture for the next save.

    Parts published in place are the capture now: their files belong to the checkpoint, which
    a later save may replace, so the next save rewrites from them only once their content is
    proven the capture's. After an upload, a capture that was uploaded, never published, or is
    stale goes; one that an earlier local save published stays.
    """
    capture = state.capture
    if in_place:
        if capture is not None and capture is not staged:
            discard_rank(capture)  # a capture staged elsewhere, now rewritten and published
        state.capture = staged
    elif capture is not None and (capture is staged or capture.temporary or state.updates):
        discard_rank(capture)
        state.capture = None
    state.updates = 0  # what was just published is what is served now
