"""vLLM's save hook on every worker: the loaded state, saved through the save protocol."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from vllm.logger import init_logger

from ..checkpoint import remote_save
from ..checkpoint.carry import CarriedFiles
from ..checkpoint.save import (
    StagedRank,
    clean_after_publish,
    discard_rank,
    new_token,
    open_staged_tensors,
    publish_manifest,
    publish_rank,
    stage_rank,
)
from ..checkpoint.verify import verify_file_checksum
from ..format.errors import SaveRefused, ShardedStateError
from ..format.experts import ExpertPlacement
from ..format.manifest import Manifest, RankEntry
from ..format.names import default_pattern, validate_pattern
from ..planning.topology import RankInfo
from ..storage.local import OpenFile
from ..storage.location import is_remote
from ..storage.lock import SaveLock, acquire_save_lock, release_save_lock
from ..storage.staging_folders import StagingFolder, make_staging_folder
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
from .workers import FolderNotShared, Workers, check_folder_shared, is_agreed, raises_for_all

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")


def _live_state_if_unchanged(model: torch.nn.Module, state: LoadedState) -> dict[str, torch.Tensor]:
    """The live tensors, if they provably still are the loaded ones; else an error."""
    how = (
        f"Start the engine with {CAPTURE_DIR_ENV}=<dir> in its environment so that each worker "
        "captures its loaded state at start-up (examples/save_sharded_state.py does this), then save."
    )
    if state.quantization:
        raise ShardedStateError(
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
        raise ShardedStateError(
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
        raise ShardedStateError(
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
        except ShardedStateError as e:
            raise ShardedStateError(
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
    except ShardedStateError as refused:
        # No capture, and the live weights are not the loaded state: the source still is.
        try:
            live = reread_loaded_state(state)
        except SaveRefused:
            raise  # issue 34 (trust): the source no longer holds what is served; that is the reason, said whole
        except Exception as e:
            raise ShardedStateError(f"{refused} (Reading the source again failed too: {e}.)") from e
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
            raise ShardedStateError(f"Refusing to save: {path} has no recorded checksum to prove it unchanged. {how}")
        try:
            with OpenFile.open(path) as opened:
                if opened.size != f.size:
                    raise ShardedStateError(f"{path}: {opened.size} bytes, captured {f.size}")
                verify_file_checksum(opened, f.checksum)
        except (OSError, ShardedStateError) as e:
            raise ShardedStateError(f"Refusing to save: the captured state is gone ({e}). {how}") from e


def _loaded(model: torch.nn.Module, state: LoadedState | None) -> LoadedState:
    """The state recorded at load time, or the refusal that says why there is none."""
    if state is not None:
        return state
    failed = model.__dict__.get(RECORD_ERROR_ATTRIBUTE)
    if failed is not None:
        raise ShardedStateError(
            f"Refusing to save: recording the loaded state at start-up failed ({failed}), so the "
            f"state that reloads is unknown. Fix the cause (for {CAPTURE_DIR_ENV}: a writable "
            "directory with room for the model) and start the engine again."
        )
    raise ShardedStateError(
        "Refusing to save: this model was loaded before vllm_sharded_loader was active, so "
        "its loaded state is unknown. Check that the plugin is installed (VLLM_PLUGINS)."
    )


def _manifest(rank: RankInfo, state: LoadedState, pattern: str, outcomes: list[Any]) -> Manifest:
    """The manifest of a save, from every worker's (rank entry, geometry, tied names, expert placement)."""
    placements = {p for _, _, _, p in outcomes if p is not None}
    if len(placements) > 1:
        raise ShardedStateError(f"the ranks place their experts differently: {sorted(map(str, placements))}")
    return Manifest(
        tp_size=rank.tp_size,
        pp_size=rank.pp_size,
        dtype=state.dtype,
        pattern=pattern,
        source=state.source,
        ranks=tuple(sorted((entry for entry, _, _, _ in outcomes), key=lambda e: (e.pp_rank, e.dp_rank, e.tp_rank))),
        geometry={name: g for _, geometry, _, _ in outcomes for name, g in geometry.items()},
        tied=tuple(sorted({tuple(group) for _, _, tied, _ in outcomes for group in tied})),
        experts=next(iter(placements), None),
        dp_size=rank.dp_size,
        experts_over_dp=rank.experts_over_dp,
    )


def _save_to_objects(
    model: torch.nn.Module,
    state: LoadedState | None,
    workers: Workers,
    url: str,
    pattern: str,
    max_size: int | None,
    overwrite: bool,
) -> None:
    """The save hook into object storage: :mod:`..checkpoint.remote_save`'s steps across workers.

    Each worker stages its parts locally (its capture, if one was taken at start-up, is
    already staged) and uploads them; the first publishes the manifest once all have
    succeeded. Any failure before that deletes every upload and the lock.
    """
    rank = workers.rank
    token = new_token()
    begun = False
    staged: StagedRank | None = None
    scratch: StagingFolder | None = None  # a staging folder made here, when there is no capture to use
    carried = CarriedFiles(url, token)

    def check_and_lock() -> str:
        validate_pattern(pattern, rank.tp_size, rank.pp_size, rank.replicas)
        remote_save.begin(url, token, overwrite)
        return token

    def stage_and_upload() -> tuple[RankEntry, dict[str, Any], list[list[str]], ExpertPlacement | None]:
        nonlocal staged, scratch
        loaded = _loaded(model, state)
        capture = loaded.capture
        if capture is not None and capture.temporary and not loaded.updates:
            staged = capture  # staged at start-up, never published: upload it as it is
        else:
            if capture is not None and capture.temporary:
                staging = capture.directory
            else:
                # Not into a checkpoint an earlier save published here: that folder is not this save's.
                scratch = make_staging_folder()
                staging = scratch.path
            staged = _stage_for_save(model, loaded, staging, rank, pattern, max_size, token)
        if (staged.pattern, staged.max_size) != (pattern, max_size):
            staged = stage_rank(staged.directory, open_staged_tensors(staged), rank, pattern, max_size, token)
        entry = remote_save.upload_rank(url, staged, token)
        return entry, loaded.geometry, loaded.tied, loaded.rank and loaded.rank.experts

    outcomes: list[Any] = []
    try:
        # Every worker records its uploads under the lock's token: the cleanup and the next save find them all.
        token = carried.token = workers.run(check_and_lock, only_first=True)[0]
        begun = True
        outcomes = workers.run(stage_and_upload)
        manifest = _manifest(rank, _loaded(model, state), pattern, outcomes)
        workers.run(lambda: _stage_non_weight_files(state, carried), only_first=True)
        replaced = workers.run(lambda: remote_save.publish(url, manifest, token, carried), only_first=True)[0]
    except ShardedStateError as e:
        carried.restore()
        if staged is not None and staged is not (state and state.capture):
            discard_rank(staged)
        if begun and workers.first:
            remote_save.abandon(url, [entry for entry, _, _, _ in outcomes], token)
        raise ShardedStateError(
            f"Saving the sharded state to {url} failed: {e}. Nothing was published: this save's uploads and "
            "lock were deleted."
        ) from e
    finally:
        if scratch is not None:
            scratch.remove()
    try:
        workers.run(lambda: remote_save.clean_after_publish(url, manifest, token, replaced), only_first=True)
    except ShardedStateError as e:
        raise ShardedStateError(
            f"Saving the sharded state to {url}: the new checkpoint is published and complete, but removing the "
            f"old save's objects failed: {e}. Save again to clean up."
        ) from e
    if state is not None:
        capture = state.capture
        if capture is not None and (capture is staged or capture.temporary or state.updates):
            discard_rank(capture)
            state.capture = None  # uploaded, or stale: nothing local to rewrite from
        # Else a capture that an earlier local save published stays: its content is checked before each use.
        state.updates = 0
    if workers.first:
        logger.info("sharded_state: saved %d ranks, %.1f MB, to %s", len(outcomes), manifest.nbytes / 1e6, url)


def _stage_non_weight_files(state: LoadedState | None, carried: CarriedFiles) -> None:
    """Stage the served model's config, tokenizer and other non-weight files for a save, so that a
    checkpoint saved by the hook alone (a server's ``/collective_rpc``, ``LLM``'s engine) serves by
    itself. They are the served model's, so they replace what the output holds (the save
    script's copies of the same files, or a previous checkpoint's), but only just before the
    manifest (:mod:`..checkpoint.carry`)."""
    source = state.model_dir if state is not None else None
    if source is None:
        logger.warning(
            "sharded_state: the served model is not a local folder; copy its config and tokenizer files to %s",
            carried.output,
        )
        return
    if not is_remote(carried.output) and os.path.samefile(source, carried.output):
        return
    changed = carried.stage(source)
    logger.info("sharded_state: %d non-weight files of %s (config, tokenizer, ...) to replace", len(changed), source)


def _abandon_local_stage(state: LoadedState | None, staged: StagedRank | None) -> None:
    """After a failed local save, before its publish: remove what this save staged or placed.

    A start-up capture that was only staged stays for the next try. One already placed
    under final names is removed: no manifest lists those files, and a retry rewrites
    from the live weights or refuses.
    """
    if staged is None:
        return
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
        if not is_agreed(e) or raises_for_all():
            raise
        logger.error("sharded_state: %s (raised by the engine's last worker)", e)


def _save_rank(model: torch.nn.Module, path: str, pattern: str | None, max_size: int | None) -> None:
    """The save of :func:`save_rank_from_hook`, on this worker.

    The steps of :mod:`..checkpoint.save` across workers: the first worker takes the lock, every
    worker stages its parts, then swaps them in, and the first worker publishes the
    manifest. A failure before the swap removes what was staged and the lock, and
    leaves any previous checkpoint intact.
    """
    state: LoadedState | None = getattr(model, LOADED_STATE_ATTRIBUTE, None)
    rank = state.rank if state is not None and state.rank is not None else current_rank()
    if rank.dp_size > 1 and rank.replicas == 1:
        if any(is_experts(m) for m in model.modules()):
            _loaded(model, state)  # without a recorded state (and placement), that is the reason to give
            # Experts held alike by every replica would be written by the first alone, but
            # vLLM splits them across the replicas in every layout this version records.
            raise ShardedStateError(
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
    if is_remote(path):
        _save_to_objects(model, state, workers, path, pattern, max_size, overwrite)
        return
    path = os.path.abspath(path)
    token = new_token()
    made_folder = False
    lock: SaveLock | None = None
    staged: StagedRank | None = None
    carried = CarriedFiles(path, token)
    published = False

    def check_and_lock() -> SaveLock:
        nonlocal made_folder
        validate_pattern(pattern, rank.tp_size, rank.pp_size, rank.replicas)
        made_folder = not os.path.lexists(path)
        return acquire_save_lock(path, token, overwrite)

    def stage() -> tuple[RankEntry, dict[str, Any], list[list[str]], ExpertPlacement | None]:
        nonlocal staged
        loaded = _loaded(model, state)
        staged = _stage_for_save(model, loaded, path, rank, pattern, max_size, token)
        return staged.entry, loaded.geometry, loaded.tied, loaded.rank and loaded.rank.experts

    try:
        lock = workers.run(check_and_lock, only_first=True)[0]
        token = carried.token = lock.token  # every worker stages under the lock's token: a takeover finds them
        check_folder_shared(workers, path, token)
        outcomes = workers.run(stage)
        # Placed under fresh names: the published checkpoint's parts are untouched until the manifest.
        entries = workers.run(lambda: save_startup_artifacts(model, path, publish_rank(staged), rank))
        outcomes = [(entry, *rest) for entry, (_, *rest) in zip(entries, outcomes, strict=True)]
        manifest = _manifest(rank, _loaded(model, state), pattern, outcomes)
        workers.run(lambda: _stage_non_weight_files(state, carried), only_first=True)
        workers.run(lambda: publish_manifest(path, manifest, lock, carried), only_first=True)
        published = True
        carried.finish()
        if staged is not None:
            staged.placed.clear()  # published: no longer this save's to remove
        workers.run(lambda: clean_after_publish(path, manifest, lock), only_first=True)
    except ShardedStateError as e:
        if not published:
            carried.restore()
            _abandon_local_stage(state, staged)
            if isinstance(e, FolderNotShared) and state is not None and state.drop_capture is not None:
                # Staged at start-up in that folder, for a save there that can never succeed.
                state.drop_capture()
            if lock is not None and workers.first:
                release_save_lock(lock)
                if made_folder:
                    with contextlib.suppress(OSError):  # only if nothing else was put there meanwhile
                        os.rmdir(path)
        raise ShardedStateError(
            f"Saving the sharded state to {path} failed: {e}. "
            + (
                "Nothing was published; any previous checkpoint there is intact."
                if not published
                else "The new checkpoint is published and complete; removing the old save's files failed: "
                "save again to clean up."
            )
        ) from e
    if state.capture is not None and state.capture is not staged:
        discard_rank(state.capture)  # a capture staged elsewhere, now rewritten and published
    # Published: its files now belong to the checkpoint, which a later save may replace.
    # The next save rewrites from them only once their content is proven the capture's.
    state.capture = staged
    state.updates = 0  # what was just published is what is served now
    if workers.first:
        logger.info("sharded_state: saved %d ranks, %.1f MB, to %s", len(entries), manifest.nbytes / 1e6, path)
