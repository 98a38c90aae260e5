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
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from vllm.logger import init_logger

from ..checkpoint.save_proof import (
    CAPTURE_DIR_ENV,
    check_source_files_unchanged,
    check_still_read_from,
    weight_file_identities,
)
from ..checkpoint.state import saveable_state, tied_groups
from ..format.errors import InvalidOption, ShardedStateError
from ..format.geometry import TensorGeometry
from ..format.manifest import Manifest
from ..format.names import default_pattern
from ..format.source import SourceModel
from ..planning.topology import RankInfo
from ..storage.local import make_output_folder
from ..storage.location import Store, open_store
from ..storage.lock import hold_owner_marker, release_owner_marker
from ..storage.progress import ByteProgress
from ..storage.reader import ReadOptions
from ..storage.staged import StagedRank, discard_rank, new_token, stage_rank
from .compile_cache import place_compile_cache
from .follower import watch_leader
from .identity import current_vllm_config, dtype_label, is_drafter, ranks_on_host, source_identity
from .layer_geometry import model_rank, tensor_geometry

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")

CAPTURE_PATTERN_ENV = "SHARDED_STATE_CAPTURE_PATTERN"
CAPTURE_MAX_SIZE_ENV = "SHARDED_STATE_CAPTURE_MAX_SIZE"
OVERWRITE_ENV = "SHARDED_STATE_OVERWRITE"

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
        raise InvalidOption(f"{CAPTURE_MAX_SIZE_ENV}={max_size!r} is not a number of bytes.") from None
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


def reread_loaded_state(state: LoadedState) -> dict[str, torch.Tensor]:
    """The state this worker loaded at start-up, read again from the source the engine loaded.

    For a save without a capture when the live weights are not the loaded state (CPU
    repacking, quantized layouts). From a sharded checkpoint in a folder or a bucket, without
    a model (:func:`_reread_streaming`: file mappings, no copy where the files can be mapped).
    Otherwise a fresh model of the same configuration is built on the CPU and given the same
    loader's ``load_weights``, without the post-processing, so it holds exactly what the engine
    held before it; that costs one more copy of this rank's weights in memory while the save runs.
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
        store = open_store(checkpoint)
        if store.exists():  # (a Hub id: checked after the read only)
            manifest = store.read_manifest()
            check_still_read_from(checkpoint, state.read_proof, manifest)
            if manifest is not None and state.rank is not None:
                return _reread_streaming(state, store, manifest)
        # Every byte read again is checked against the manifest's checksums: the content, not the path.
        load_config = copy.copy(load_config)
        load_config.model_loader_extra_config = {**(load_config.model_loader_extra_config or {}), "verify": "checksum"}
    else:
        check_source_files_unchanged(state.model_dir, state.source_files)
    loader = get_model_loader(load_config)
    with set_current_vllm_config(fresh), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = loader.create_model(vllm_config=fresh, model_config=model_config)
        loader.load_weights(model, model_config)
    if checkpoint is None:
        check_source_files_unchanged(state.model_dir, state.source_files)  # (a write during the read shows here)
    else:
        # The manifest the re-read used (a rewrite between our check and the read shows here).
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


def _reread_streaming(state: LoadedState, checkpoint: Store, manifest: Manifest) -> dict[str, torch.Tensor]:
    """This rank's loaded state read again from the sharded ``checkpoint`` it came from, without a model:
    the load's own checks and plan over what the load recorded (geometry, ties, rank), into host tensors
    that take the files' mappings where the reader can map them (a save then streams them to its files,
    with no copy of the rank's weights in memory). Every byte is checked against the manifest's checksums."""
    from ..checkpoint.load import load_rank
    from ..checkpoint.request import LoadRequest
    from ..checkpoint.update_staging import StagedWeights

    assert state.rank is not None
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (_, shape, dtype) in state.signature.items()}
    staged = StagedWeights(meta, [])
    request = LoadRequest(
        checkpoint,
        manifest,
        "checksum",
        serving=state.source,
        geometry={name: TensorGeometry.from_dict(g, name) for name, g in state.geometry.items()},
        tied=state.tied,
    )
    # ``manifest`` is the proven one (the caller checked it); load_rank reads it again after its reads
    # and refuses if it changed meanwhile (rank_files.check_not_replaced).
    load_rank(request, staged.targets(), state.rank, ReadOptions(ranks_on_host=ranks_on_host()), staged.adopt())
    logger.info(
        "sharded_state: %s re-read its loaded state from %s without a model: %d of %d tensors mapped from its files",
        state.rank,
        checkpoint.where,
        len(staged.mapped),
        len(staged.tensors),
    )
    return staged.tensors


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
        state.source_files = weight_file_identities(state.model_dir)
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
        make_output_folder(directory)
        owner = hold_owner_marker(directory, token)
        state.drop_capture = partial(_drop_capture, state, directory, token, owner)
        atexit.register(state.drop_capture)
        with ByteProgress(f"Saving sharded_state ({rank})", _show_progress()) as progress:
            state.capture = stage_rank(
                directory,
                written_tensors(rank, state, tensors),
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


def written_tensors(rank: RankInfo, state: LoadedState, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What this worker writes of its state: all of it in the first data-parallel replica;
    in a later one, which holds the same slices but for its experts, only those."""
    if rank.saved_dp_rank == 0:
        return tensors
    return {name: t for name, t in tensors.items() if name in state.per_replica}


def is_experts(module: torch.nn.Module) -> bool:
    return any(c.__name__ == "RoutedExperts" for c in type(module).__mro__)
