"""Where a saved state comes from: the state captured right after loading.

vLLM's save hook runs on a model that has already been post-processed
(``process_weights_after_loading``): on CPU every linear weight has been repacked
for oneDNN and ``layer.weight`` emptied; quantization methods rename, reshape or
drop parameters. Only the state as it stands right after ``load_weights`` always
reloads, because that is exactly what the loader fills in again. So:

* The plugin wraps vLLM's ``process_weights_after_loading``. Just before it runs,
  each worker records the loaded state's signature (names, shapes, dtypes, memory
  addresses) on the model, which costs nothing measurable.
* When a save is asked for at start-up (``SHARDED_STATE_CAPTURE_DIR`` set, as
  ``examples/save_sharded_state.py`` does), the worker also writes its loaded state
  to that directory then, straight from parameter memory: no second in-memory copy.
* The save hook then publishes: if the capture is already where and how it was
  asked, it only writes the manifest; otherwise it rewrites the captured files
  (memory-mapped, so memory stays bounded) at the asked place and size cap.
* Without a capture, the hook writes the live state only if it is provably the
  loaded one (every tensor at the same address, shape and dtype, no quantization,
  every layer's post-processing one that never rewrites a weight in place);
  otherwise it refuses with an error saying how to capture, and writes nothing.
* Weights updated after loading (RL loops: ``collective_rpc``, vLLM's weight-transfer
  engines and ``reload_weights`` all go through the model's ``load_weights``) make the
  capture stale: the model's ``load_weights`` is wrapped to count updates, and a save
  after one writes the live weights under the same proof, or refuses.
* Recording never breaks a load: any error in it, under any load format, is logged
  once and kept for the save hook to report.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
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
from ..checkpoint.state import saveable_state, tied_groups
from ..checkpoint.verify import verify_file_checksum
from ..format.errors import SaveRefused, ShardedStateError
from ..format.experts import ExpertPlacement
from ..format.manifest import Manifest, RankEntry
from ..format.names import default_pattern, validate_pattern
from ..format.source import SourceModel
from ..planning.topology import RankInfo
from ..storage.local import OpenFile
from ..storage.location import is_remote
from ..storage.lock import (
    SaveLock,
    acquire_save_lock,
    hold_owner_marker,
    read_lock,
    release_owner_marker,
    release_save_lock,
)
from ..storage.staging_folders import StagingFolder, make_staging_folder
from .follower import watch_leader
from .identity import current_rank, dtype_label, is_drafter, source_identity
from .layer_geometry import UNQUANTIZED_METHODS, model_rank, tensor_geometry
from .progress import ByteProgress

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")

CAPTURE_DIR_ENV = "SHARDED_STATE_CAPTURE_DIR"
CAPTURE_PATTERN_ENV = "SHARDED_STATE_CAPTURE_PATTERN"
CAPTURE_MAX_SIZE_ENV = "SHARDED_STATE_CAPTURE_MAX_SIZE"
OVERWRITE_ENV = "SHARDED_STATE_OVERWRITE"
# How long a save under data + expert parallelism waits for every replica to call it.
REPLICA_TIMEOUT_ENV = "SHARDED_STATE_REPLICA_TIMEOUT"
DEFAULT_REPLICA_TIMEOUT = 600.0
LOADED_STATE_ATTRIBUTE = "_vllm_sharded_loaded_state"
RECORD_ERROR_ATTRIBUTE = "_vllm_sharded_record_error"


@dataclass
class LoadedState:
    """What a worker's model held right after its weights were loaded."""

    signature: dict[str, tuple[int, tuple[int, ...], torch.dtype]]
    source: SourceModel
    dtype: str
    quantization: str | None
    # How each tensor is split across ranks, and names saved once for several (manifest fields).
    geometry: dict[str, Any] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    # The recording worker: its place in TP, PP and DP, and how it holds the routed experts.
    rank: RankInfo | None = None
    # The names a later data-parallel replica writes (its own experts; empty: it writes nothing).
    per_replica: frozenset[str] = frozenset()
    # The state written at start-up (staged, or published in place by a save).
    capture: StagedRank | None = field(default=None)
    # Calls of the model's load_weights since (weight updates): the capture is stale.
    updates: int = 0
    # The served model's local folder, whose non-weight files a save carries (None: not local).
    model_dir: str | None = None
    # The engine's configuration at load time: a save without a capture re-reads the source with it.
    vllm_config: Any = field(default=None, repr=False)
    model_config: Any = field(default=None, repr=False)
    # The sharded checkpoint a weight update replaced every tensor from (a save re-reads it).
    reloaded_from: str | None = None
    # Proof of what the served weights were read from (issue 34): the digest of the manifest of
    # the sharded checkpoint they were read from (at start-up, or by the last update), with every
    # file's block checksums; a save that re-reads that checkpoint first proves it unchanged.
    read_proof: str | None = None
    # The model's own weight files in its local folder, as loaded by another load format: each one's
    # identity (device, inode, size, mtime, ctime; the kernel changes ctime on every write), for a save
    # that reads them again (no checksums to prove their content by: see :func:`_weight_file_identities`).
    source_files: dict[str, tuple[int, ...]] | None = None
    # Removes the start-up capture and its owner marker (at exit at the latest); None once done.
    drop_capture: Callable[[], None] | None = field(default=None, repr=False)


def capture_settings() -> tuple[str, str | None, int | None] | None:
    """(directory, pattern, max_size) asked through the environment, or None."""
    directory = os.environ.get(CAPTURE_DIR_ENV)
    if not directory:
        return None
    max_size = os.environ.get(CAPTURE_MAX_SIZE_ENV)
    try:
        size = int(max_size) if max_size else None
    except ValueError:
        raise ShardedStateError(f"{CAPTURE_MAX_SIZE_ENV}={max_size!r} is not a number of bytes.") from None
    return directory, os.environ.get(CAPTURE_PATTERN_ENV) or None, size


def _show_progress() -> bool:
    """vLLM's rule for load progress bars: rank 0 only, unless ``use_tqdm_on_load`` is off."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import enable_tqdm

    try:
        wanted = get_current_vllm_config().load_config.use_tqdm_on_load
    except Exception:  # outside an engine's config context: vLLM's default
        wanted = True
    return enable_tqdm(wanted)


def current_vllm_config() -> Any:
    """vLLM's config of the engine being built or run here, or None outside one."""
    from vllm.config import get_current_vllm_config

    try:
        return get_current_vllm_config()
    except Exception:  # loaded outside an engine's config context: no re-read
        return None


def served_from_checkpoint(state: LoadedState, checkpoint: str, proof: str | None = None) -> None:
    """After a weight update replaced every tensor from the sharded ``checkpoint`` (and post-processed
    them as at start-up): that checkpoint's state is the loaded state now. The start-up capture is
    stale and goes; a save re-reads this rank's state from ``checkpoint``, once proven to hold
    what was read (``proof``: :func:`manifest_proof` of the manifest the update read)."""
    if state.capture is not None and state.capture.temporary:
        discard_rank(state.capture)
    state.capture = None
    state.reloaded_from = checkpoint
    state.read_proof = proof
    state.updates = 0


# Set on the model by the sharded loader at start-up: (checkpoint, manifest_proof) it read.
READ_PROOF_ATTRIBUTE = "_vllm_sharded_read_proof"


def manifest_proof(manifest: Manifest | None) -> str | None:
    """The digest of a manifest whose every file has block checksums, or None (nothing to prove content by).

    Equal digests and a read with ``verify="checksum"`` prove the bytes read again are the
    bytes read then: the manifest names each file's size and the BLAKE3 digest of each block.
    """
    import hashlib

    if manifest is None or any(f.checksum is None for entry in manifest.ranks for f in entry.files):
        return None
    return hashlib.sha256(manifest.to_json().encode()).hexdigest()


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def _weight_file_identities(folder: str | None) -> dict[str, tuple[int, ...]] | None:
    """Each weight file's identity in a local model folder (what vLLM's default loader reads), or None."""
    if folder is None or not os.path.isdir(folder):
        return None
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(_WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(folder, name))
            found[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return found


def _check_source_files_unchanged(state: LoadedState) -> None:
    """Refuse to save from the model's own files if any was replaced or written since it was loaded."""
    if state.source_files is None:
        return
    now = _weight_file_identities(state.model_dir)
    if now != state.source_files:
        changed = sorted(
            n for n in (now or {}).keys() | state.source_files.keys() if (now or {}).get(n) != state.source_files.get(n)
        )
        raise SaveRefused(
            f"Refusing to save: {state.model_dir} was written after the served weights were loaded from it "
            f"({', '.join(changed[:3])} changed): reading it again would not give what is served. Start an engine "
            f"with {CAPTURE_DIR_ENV}=<dir> so that its start-up capture is saved, or save before the folder changes."
        )


def _check_still_read_from(checkpoint: str, proof: str | None, manifest: Manifest | None) -> None:
    """Refuse to save from ``checkpoint`` unless its manifest is still the one the served weights were read with."""
    how = (
        "Save right after the update, before anything writes to that folder again (or update from a folder "
        "that is never rewritten, such as one per step), or start an engine with "
        f"{CAPTURE_DIR_ENV}=<dir> so that its start-up capture is saved."
    )
    if proof is None:
        raise SaveRefused(
            f"Refusing to save: the served weights were read from {checkpoint}, whose manifest records no checksum "
            f"for every file, so reading it again cannot be proven to give what is served. {how}"
        )
    now = manifest_proof(manifest)
    if now != proof:
        raise SaveRefused(
            f"Refusing to save: {checkpoint} was rewritten after the served weights were read from it (its "
            f"{'manifest is gone' if manifest is None else 'manifest differs'}): it no longer holds what is "
            f"served, and a save would publish other weights under this engine's name. {how}"
        )


def _reread_loaded_state(state: LoadedState) -> dict[str, torch.Tensor]:
    """The state this worker loaded at start-up, read again from the source the engine loaded.

    For a save without a capture when the live weights are not the loaded state (CPU
    repacking, quantized layouts) and no update came since: a fresh model of the same
    configuration is built on the CPU and given the same loader's ``load_weights``, without
    the post-processing, so it holds exactly what the engine held before it. Costs one more
    copy of this rank's weights in memory while the save runs.
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
    checkpoint = None  # the sharded checkpoint re-read, proven unchanged before and after (issue 34)
    if state.reloaded_from is not None:
        # Updated since start-up: the checkpoint of the update, through our loader (vLLM's registry).
        load_config = copy.copy(load_config)
        load_config.load_format, load_config.model_loader_extra_config = "sharded_state", {}
        model_config = copy.copy(model_config)
        model_config.model_weights = state.reloaded_from
        checkpoint = state.reloaded_from
    elif load_config.load_format == "sharded_state":
        checkpoint = model_config.model_weights or model_config.model
    if checkpoint is not None:
        from ..storage.location import read_manifest

        if os.path.isdir(checkpoint) or is_remote(checkpoint):  # (a Hub id: checked after the read only)
            _check_still_read_from(checkpoint, state.read_proof, read_manifest(checkpoint))
        # Every byte read again is checked against the manifest's checksums: the content, not the path.
        load_config = copy.copy(load_config)
        load_config.model_loader_extra_config = {**(load_config.model_loader_extra_config or {}), "verify": "checksum"}
    else:
        _check_source_files_unchanged(state)
    loader = get_model_loader(load_config)
    with set_current_vllm_config(fresh), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = loader.create_model(vllm_config=fresh, model_config=model_config)
        loader.load_weights(model, model_config)
    if checkpoint is None:
        _check_source_files_unchanged(state)  # (a write during the read shows here)
    else:
        # The manifest the re-read used (a rewrite between our check and the read shows here).
        _check_still_read_from(
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
        model_dir=model_config.model if os.path.isdir(str(getattr(model_config, "model", ""))) else None,
        vllm_config=current_vllm_config(),
        model_config=model_config,
        read_proof=(model.__dict__.get(READ_PROOF_ATTRIBUTE) or (None, None, None))[1],
    )
    if READ_PROOF_ATTRIBUTE not in model.__dict__:  # loaded by another format, from its own files
        state.source_files = _weight_file_identities(state.model_dir)
    # Data-parallel replicas hold the same slices: only the first captures them, the others
    # only their own experts, if placed across replicas (see the save hook). A speculative
    # drafter loads too, with its own config: the capture (and the save) are the served
    # model's, and a drafter's staged files would be left in the checkpoint.
    writes = rank.dp_rank == 0 or bool(state.per_replica)
    settings = capture_settings() if writes and not is_drafter(model_config) else None
    if settings is not None:
        directory, pattern, max_size = settings
        # Staged under temporary names: nothing is published until the save hook runs. The
        # marker tells saves into the same folder that these files are a live engine's.
        token = new_token()
        os.makedirs(directory, exist_ok=True)
        owner = hold_owner_marker(directory, token)
        state.drop_capture = partial(_drop_capture, state, directory, token, owner)
        atexit.register(state.drop_capture)
        with ByteProgress(f"Saving sharded_state ({rank})", _show_progress()) as progress:
            state.capture = stage_rank(
                directory,
                _written(rank, state, tensors),
                rank,
                pattern or default_pattern(rank.pp_size, rank.replicas),
                max_size,
                token,
                progress=progress,
            )
        logger.info(
            "vllm_sharded_loader: %s saved %.1f MB in %d files to %s in %.3f s (%.2f GB/s, fsynced, checksummed)",
            rank,
            progress.nbytes / 1e6,
            len(state.capture.entry.files),
            directory,
            progress.seconds,
            progress.rate,
        )
    # Plain attributes, not modules or buffers: they must not show up in state_dict().
    model.__dict__[LOADED_STATE_ATTRIBUTE] = state
    _count_updates(model, state)
    return state


def _drop_capture(state: LoadedState, directory: str, token: str, owner: int) -> None:
    """At the worker's exit (or once a save shows the folder unusable): a start-up capture that
    no save published goes, then its marker.

    A worker killed outright leaves both; the next save into the folder removes them.
    """
    atexit.unregister(state.drop_capture)
    state.drop_capture = None
    if state.capture is not None and state.capture.temporary:
        discard_rank(state.capture)
        state.capture = None
    release_owner_marker(directory, token, owner)


def _count_updates(model: torch.nn.Module, state: LoadedState) -> None:
    """Count later calls of the model's ``load_weights``: each may change what is served.

    vLLM's in-place ``reload_weights``, its weight-transfer engines (NCCL, IPC) and RL
    loops calling ``collective_rpc`` update weights through this method. Wrapping the
    instance (not the class) touches only this model. Counted before the call: an update
    that fails halfway leaves the state changed too.
    """
    original = model.load_weights
    if getattr(original, "_counts_updates", False):
        original = original.__wrapped__

    def load_weights(*args: Any, **kwargs: Any) -> Any:
        state.updates += 1
        return original(*args, **kwargs)

    load_weights._counts_updates = True  # type: ignore[attr-defined]
    load_weights.__wrapped__ = original  # type: ignore[attr-defined]
    model.__dict__["load_weights"] = load_weights


def wrap_process_weights_after_loading(original: Any) -> Any:
    """``process_weights_after_loading`` that records the loaded state first."""
    if getattr(original, "_records_loaded_state", False):
        return original

    def process_weights_after_loading(model: torch.nn.Module, model_config: Any, target_device: Any) -> Any:
        # This runs for every load format once the plugin is installed: whatever goes
        # wrong in the recording must leave the load itself untouched.
        config = current_vllm_config()
        if config is not None:
            watch_leader(config.parallel_config)  # a follower node ends with its leader, whatever it loaded
        try:
            model.__dict__.pop(RECORD_ERROR_ATTRIBUTE, None)
            record_loaded_state(model, model_config)
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


# ------------------------------------------------------------------------ save hook


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
            if (module := _owner(model, name)) is not None
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


def _owner(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return None


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
        return stage_rank(path, _written(rank, state, live), rank, pattern, max_size, token)
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
            live = _reread_loaded_state(state)
        except SaveRefused:
            raise  # the source no longer holds what is served: that is the reason, said whole
        except Exception as e:
            raise ShardedStateError(f"{refused} (Reading the source again failed too: {e}.)") from e
        logger.info("sharded_state: %s re-read its loaded state from %s to save it", rank, state.source.architecture)
    return stage_rank(path, _written(rank, state, live), rank, pattern, max_size, token)


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


def _expert_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``tensors`` that routed-expert layers hold: each EP rank's own experts."""
    return [name for name in tensors if (module := _owner(model, name)) is not None and _is_experts(module)]


def _written(rank: RankInfo, state: LoadedState, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What this worker writes of its state: all of it in the first data-parallel replica;
    in a later one, which holds the same slices but for its experts, only those."""
    if rank.saved_dp_rank == 0:
        return tensors
    return {name: t for name, t in tensors.items() if name in state.per_replica}


def gather_over(groups: list[Any], outcomes: list[Any], what: str) -> list[Any]:
    """Every worker's ``outcomes`` (picklable), gathered over vLLM's ``groups`` (their CPU groups) in turn.

    A worker that died resets its connections: the exchange fails at once (gloo), raised
    here as our error naming ``what`` stopped, so that the caller's cleanup runs.
    """
    for group in groups:
        gathered: list[Any] = [None] * group.world_size
        try:
            torch.distributed.all_gather_object(gathered, outcomes, group=group.cpu_group)
        except RuntimeError as e:
            raise ShardedStateError(f"another worker of {what} stopped answering (did it die? see its log): {e}") from e
        outcomes = [o for part in gathered for o in part]
    return outcomes


class AgreedFailure(ShardedStateError):
    """A failure every worker of the exchange knows alike (they gathered it): one of them reports it."""


def raises_for_all() -> bool:
    """Whether this worker is the one that raises an agreed failure for all: the last of the engine's workers.

    vLLM 0.32's multiprocessing executor reads the workers' answers in rank order and stops
    at the first failure: the answers of the workers after it stay queued and are taken
    for the answers to the next call (a second save, or ``/pause``, then fails with this
    call's error). Failing on the last worker alone keeps every answer read.
    """
    from vllm.distributed import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return tp.rank_in_group == tp.world_size - 1 and pp.rank_in_group == pp.world_size - 1


def _is_agreed(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, AgreedFailure):
            return True
        error = error.__cause__
    return False


class _Workers:
    """Steps that every worker of one save runs together, failing together.

    The exchange spans this replica's tensor- and pipeline-parallel workers (its TP group,
    then its PP group), and the data-parallel replicas only when each writes its own
    experts. Never vLLM's world group otherwise: with data parallelism it also spans
    replicas that may never reach the save, and they would hang it. When the replicas
    take part, :meth:`wait_for_replicas` bounds the wait for them.
    """

    def __init__(self, rank: RankInfo) -> None:
        from vllm.distributed import get_pp_group, get_tp_group
        from vllm.distributed.parallel_state import get_dp_group

        self.rank = rank
        groups = [get_tp_group(), get_pp_group()] + ([get_dp_group()] if rank.replicas > 1 else [])
        self.groups = [g for g in groups if g.world_size > 1]
        self.first = rank.tp_rank == 0 and rank.pp_rank == 0 and rank.dp_rank == 0

    def wait_for_replicas(self) -> None:
        """Wait, at most ``SHARDED_STATE_REPLICA_TIMEOUT`` seconds, until every data-parallel replica
        has called the save; raise naming the ones that did not (each writes its own experts)."""
        if self.rank.replicas == 1:
            return
        from vllm.distributed.parallel_state import get_dp_group

        seconds = float(os.environ.get(REPLICA_TIMEOUT_ENV) or DEFAULT_REPLICA_TIMEOUT)
        try:
            # Gloo's monitored barrier: every rank that arrived raises once the timeout passes.
            torch.distributed.monitored_barrier(
                group=get_dp_group().cpu_group, timeout=timedelta(seconds=seconds), wait_all_ranks=True
            )
        except RuntimeError as e:
            raise ShardedStateError(
                f"Refusing to save: under expert parallelism each of the {self.rank.dp_size} data-parallel replicas "
                f"writes its own experts, and not all of them called save_sharded_state within {seconds:g} s "
                f"({REPLICA_TIMEOUT_ENV}; {e}). Call it on every replica: in each data-parallel process of an "
                "offline engine (vLLM's serve reaches them all through collective_rpc). Nothing was written."
            ) from e

    def run(self, step: Any, only_first: bool = False) -> list[Any]:
        """Run ``step`` here (or only on the first worker), exchange results, raise if any failed.

        Every worker reaches the exchange even when its step fails, or the others would hang.
        """
        try:
            outcome: tuple[bool, Any] = (True, step() if self.first or not only_first else None)
        except Exception as e:
            outcome = (False, f"{self.rank}: {e}")
        try:
            outcomes = gather_over(self.groups, [outcome], "this save")
        except ShardedStateError as e:
            # This worker's own cleanup (the lock, what it staged) runs on this error.
            raise ShardedStateError(f"{e}" + ("" if outcome[0] else f" | {outcome[1]}")) from e
        errors = [value for ok, value in outcomes if not ok]
        if errors:
            raise AgreedFailure(" | ".join(errors))
        return [value for _, value in outcomes]


class FolderNotShared(AgreedFailure):
    """A local save's folder is not the same folder for every worker (each node has its own)."""


def _check_folder_shared(workers: _Workers, path: str, token: str) -> None:
    """Refuse a local save unless every worker sees the folder the first one locked.

    The lock file that the first worker just took, with this save's token, is the marker:
    a worker that does not find it there sees another folder under the same path (another
    node's disk), where its parts would be written out of the manifest's reach.
    Decided from the file system, not from host names, so that two nodes sharing a file
    system save, and two containers on one host that do not are refused.
    """
    seen = workers.run(lambda: (socket.gethostname(), str(workers.rank), (read_lock(path) or {}).get("token") == token))
    blind = [f"{rank} on {host}" for host, rank, sees in seen if not sees]
    if not blind:
        return
    holder = next(f"{rank} on {host}" for host, rank, sees in seen if sees)
    raise FolderNotShared(
        f"Refusing to save to {path}: the workers do not share that folder. {holder} locked it for this save, "
        f"but {'; '.join(blind)} cannot see that lock there: each of these nodes has its own {path}, and a "
        "checkpoint written there would lack the other nodes' parts. Save to object storage (s3://, gs://, "
        "az://) or to a folder that every node mounts (a shared file system), then copy the checkpoint to "
        "where it is served. Nothing was written"
    )


def _is_experts(module: torch.nn.Module) -> bool:
    return any(c.__name__ == "RoutedExperts" for c in type(module).__mro__)


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
    workers: _Workers,
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
        if not _is_agreed(e) or raises_for_all():
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
        if any(_is_experts(m) for m in model.modules()):
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
    workers = _Workers(rank)
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
        _check_folder_shared(workers, path, token)
        outcomes = workers.run(stage)
        # Placed under fresh names: the published checkpoint's parts are untouched until the manifest.
        entries = workers.run(lambda: publish_rank(staged))
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
