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
  loaded one (every tensor at the same address, shape and dtype, no quantization);
  otherwise it refuses with an error saying how to capture, and writes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from .checkpoint import (
    RankInfo,
    open_rank_tensors,
    remove_manifest,
    saveable_state,
    write_manifest,
    write_rank,
)
from .format import Manifest, RankEntry, ShardedStateError, SourceModel, default_pattern, validate_pattern
from .loader import current_rank, dtype_label, source_identity

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")

CAPTURE_DIR_ENV = "SHARDED_STATE_CAPTURE_DIR"
CAPTURE_PATTERN_ENV = "SHARDED_STATE_CAPTURE_PATTERN"
CAPTURE_MAX_SIZE_ENV = "SHARDED_STATE_CAPTURE_MAX_SIZE"
LOADED_STATE_ATTRIBUTE = "_vllm_sharded_loaded_state"


@dataclass(frozen=True)
class Capture:
    """A rank's loaded state, written to disk during start-up."""

    directory: str
    pattern: str
    max_size: int | None
    entry: RankEntry


@dataclass
class LoadedState:
    """What a worker's model held right after its weights were loaded."""

    signature: dict[str, tuple[int, tuple[int, ...], torch.dtype]]
    source: SourceModel
    dtype: str
    quantization: str | None
    capture: Capture | None = field(default=None)


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


def record_loaded_state(model: torch.nn.Module, model_config: Any) -> LoadedState:
    """Record (and, if asked, capture to disk) the state a worker has just loaded."""
    tensors = saveable_state(model.state_dict())
    state = LoadedState(
        signature={n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in tensors.items()},
        source=source_identity(model, model_config),
        dtype=dtype_label(model_config.dtype),
        quantization=getattr(model_config, "quantization", None),
    )
    settings = capture_settings()
    if settings is not None:
        directory, pattern, max_size = settings
        rank = current_rank()
        pattern = pattern or default_pattern(rank.pp_size)
        remove_manifest(directory)
        entry = write_rank(directory, tensors, rank, pattern, max_size)
        state.capture = Capture(directory, pattern, max_size, entry)
        logger.info("sharded_state: %s captured its loaded state (%.1f MB) in %s", rank, entry.nbytes / 1e6, directory)
    # Plain attribute, not a module or buffer: it must not show up in state_dict().
    model.__dict__[LOADED_STATE_ATTRIBUTE] = state
    return state


def wrap_process_weights_after_loading(original: Any) -> Any:
    """``process_weights_after_loading`` that records the loaded state first."""
    if getattr(original, "_records_loaded_state", False):
        return original

    def process_weights_after_loading(model: torch.nn.Module, model_config: Any, target_device: Any) -> Any:
        record_loaded_state(model, model_config)
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


def _write_rank_state(
    model: torch.nn.Module, state: LoadedState, path: str, rank: RankInfo, pattern: str, max_size: int | None
) -> RankEntry:
    capture = state.capture
    if capture is not None:
        in_place = os.path.isdir(path) and os.path.samefile(capture.directory, path)
        if in_place and (capture.pattern, capture.max_size) == (pattern, max_size):
            return capture.entry
        tensors = open_rank_tensors(capture.directory, capture.entry)
        entry = write_rank(path, tensors, rank, pattern, max_size)
        if in_place:
            state.capture = Capture(path, pattern, max_size, entry)
        return entry
    return write_rank(path, _live_state_if_unchanged(model, state), rank, pattern, max_size)


def _all_gather(obj: Any) -> tuple[list[Any], bool]:
    """Gather one object from every worker; also says whether this is the first worker."""
    from vllm.distributed import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return [obj], True
    gathered: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, obj, group=group.cpu_group)
    return gathered, group.rank_in_group == 0


def save_rank_from_hook(model: torch.nn.Module, path: str, pattern: str | None, max_size: int | None) -> None:
    """Body of vLLM's worker ``save_sharded_state`` hook; runs on every worker at once.

    Every worker writes its own parts, then all workers exchange their entries; the
    first one writes the manifest, last. If any worker failed, every worker raises
    and no manifest is written.
    """
    rank = current_rank()
    outcome: RankEntry | str
    state: LoadedState | None = getattr(model, LOADED_STATE_ATTRIBUTE, None)
    try:
        pattern = pattern or default_pattern(rank.pp_size)
        validate_pattern(pattern, rank.tp_size, rank.pp_size)
        if state is None:
            raise ShardedStateError(
                "Refusing to save: this model was loaded before vllm_sharded_loader was active, so "
                "its loaded state is unknown. Check that the plugin is installed (VLLM_PLUGINS)."
            )
        os.makedirs(path, exist_ok=True)
        # Unpublish an older checkpoint first: its manifest must never describe a mix.
        remove_manifest(path)
        outcome = _write_rank_state(model, state, path, rank, pattern, max_size)
    except Exception as e:  # every worker must reach the exchange, or the others hang
        outcome = f"{rank}: {e}"
    outcomes, first = _all_gather(outcome)
    errors = [o for o in outcomes if isinstance(o, str)]
    if errors:
        raise ShardedStateError(
            f"Saving the sharded state to {path} failed; no manifest was written. " + " | ".join(errors)
        )
    assert state is not None
    if first:
        manifest = Manifest(
            tp_size=rank.tp_size,
            pp_size=rank.pp_size,
            dtype=state.dtype,
            pattern=pattern,
            source=state.source,
            ranks=tuple(sorted(outcomes, key=lambda e: (e.pp_rank, e.tp_rank))),
        )
        write_manifest(path, manifest)
        logger.info("sharded_state: saved %d ranks, %.1f MB, to %s", len(outcomes), manifest.nbytes / 1e6, path)
