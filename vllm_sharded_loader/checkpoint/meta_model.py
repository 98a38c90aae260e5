"""The meta model convert runs vLLM's loaders on: built on the meta device, its state tensors made on
the CPU one component at a time (:class:`MetaModel`).

A component's parameters are allocated filled with NaN, and its source tensors given to the model's
``load_weights``; a parameter left partly NaN is refused by name. The result is what vLLM's default
loader holds at TP=1 before post-processing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..format.errors import ConvertRefused, listing
from ..planning.components import Component
from ..storage.hf_source import SourceFiles
from ..storage.tensors import has_nan
from .state import saveable_state, tied_groups
from .write_coverage import canaries

# Buffers vLLM's attention layers register with a fixed value (set_default_quant_scales): 1.0
# unless the checkpoint holds KV-cache scales, which the dry run then shows.
DEFAULT_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")

SAVE_INSTEAD = "Make this checkpoint with `vllm-sharded save` (which loads the model in vLLM) instead."


@dataclass(frozen=True)
class ModelOptions:
    """The ``LLM(...)`` arguments that decide the source model's class and tensors, as ``vllm serve`` takes them."""

    dtype: str = "auto"
    quantization: str | None = None
    trust_remote_code: bool = False
    runner: str = "auto"
    convert: str = "auto"


DEFAULT_OPTIONS = ModelOptions()


def parameters_to_meta(model: torch.nn.Module) -> None:
    """Move to the meta device the parameters a model class makes on the CPU even under
    ``torch.device("meta")`` (vLLM's Transformers backend's norms), keeping their class, attributes
    and ties: the dry run's meta tensors cannot be copied into CPU ones."""
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is None or param.device.type == "meta":
                continue
            if id(param) not in moved:
                moved[id(param)] = holding(param, torch.empty_like(param, device="meta"))
            module._parameters[attr] = moved[id(param)]


def holding(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.nn.Parameter:
    """A parameter of ``param``'s class and attributes holding ``tensor`` (data cannot change device in place)."""
    held = torch.nn.Parameter._make_subclass(type(param), tensor, False)
    held.__dict__.update(param.__dict__)
    return held


def walk_modules_once(model: torch.nn.Module) -> None:
    """Answer each loading module's whole-tree ``named_modules`` from one walk.

    vLLM's ``load_weights`` walks every module per call, and convert calls it per component:
    quadratic in the layers. The modules never change during a conversion, only their tensors."""
    for module in model.modules():
        if hasattr(module, "load_weights"):
            walk = module.named_modules
            walked: dict[tuple[str, bool], list[tuple[str, torch.nn.Module]]] = {}

            def named_modules(memo=None, prefix="", remove_duplicate=True, _walk=walk, _walked=walked):
                if memo is not None:  # a parent's walk passing through: torch's own
                    return _walk(memo, prefix, remove_duplicate)
                key = (prefix, remove_duplicate)
                if key not in _walked:
                    _walked[key] = list(_walk(None, prefix, remove_duplicate))
                return iter(_walked[key])

            module.named_modules = named_modules  # type: ignore[method-assign]


class MetaModel:
    """A model on the meta device whose state tensors are made one component at a time, and freed after."""

    model: torch.nn.Module
    source: SourceFiles
    pool: Any  # the memory components are made in
    state: dict[str, torch.Tensor]
    tied: list[list[str]]
    components: dict[str, Component]
    constants: dict[str, torch.Tensor]
    covered: set[str]
    _slots: dict[str, list[tuple[torch.nn.Module, str, bool]]]
    _next: dict[int, Component]

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> set[str]:
        """The model's loader given ``weights``: the state names it filled."""
        raise NotImplementedError

    def _read_state(self) -> None:
        state_dict = self.model.state_dict(keep_vars=True)
        self.state = saveable_state(state_dict)
        self.tied = tied_groups(state_dict, self.state)

    def _tensor_slots(self) -> dict[str, list[tuple[torch.nn.Module, str, bool]]]:
        """Every (module, attribute, is_parameter) holding each state tensor (tied ones held twice)."""
        by_id: dict[int, list[tuple[torch.nn.Module, str, bool]]] = {}
        for _, module in self.model.named_modules(remove_duplicate=False):
            for attr, p in module._parameters.items():
                if p is not None:
                    by_id.setdefault(id(p), []).append((module, attr, True))
            for attr, b in module._buffers.items():
                if b is not None:
                    by_id.setdefault(id(b), []).append((module, attr, False))
        slots = {}
        for name in self.state:
            module_name, _, attr = name.rpartition(".")
            module = self.model.get_submodule(module_name)
            held = module._parameters.get(attr)
            held = held if held is not None else module._buffers.get(attr)
            slots[name] = by_id[id(held)]
        return slots

    def _saved_name(self, name: str) -> str:
        if name in self.state:
            return name
        for group in self.tied:
            if name in group:
                return group[0]
        return name

    # ----------------------------------------------------------------- making

    def _set(self, name: str, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` as state tensor ``name`` in every module that holds it (tied ones too)."""
        slots = self._slots[name]
        module, attr, is_parameter = slots[0]
        held: torch.Tensor = tensor
        if is_parameter:
            old = module._parameters[attr]
            assert old is not None
            held = holding(old, tensor)
        for module, attr, is_parameter in slots:
            (module._parameters if is_parameter else module._buffers)[attr] = held

    def _current(self, name: str) -> torch.Tensor:
        module, attr, is_parameter = self._slots[name][0]
        return (module._parameters if is_parameter else module._buffers)[attr]

    def make(self, name: str) -> dict[str, torch.Tensor]:
        """The component holding ``name``, made on the CPU as vLLM's TP=1 load holds it."""
        component = self.components[name]
        with torch.no_grad():
            for target in component.targets:
                spec = self.state[target]  # the shape and dtype vLLM built it with
                tensor = self.pool.empty(tuple(spec.shape), spec.dtype)
                if target in self.constants:
                    tensor.copy_(self.constants[target])
                elif target in self.covered:
                    tensor.view(-1)[canaries(tensor.numel())] = float("nan")  # the dry run writes it whole
                elif tensor.is_floating_point():
                    tensor.fill_(float("nan"))  # what stays NaN was not filled
                self._set(target, tensor)
                attr = self._slots[target][0][1]
                if attr in DEFAULT_SCALES:
                    tensor.fill_(1.0)  # vLLM's set_default_quant_scales
            self.source.prefetch(component.sources + getattr(self._next.get(id(component)), "sources", []))
            if component.sources:
                # One source at a time: a MoE layer's experts are hundreds of tensors.
                weights = self.source.read_each(component.sources)
                self._load(weights, listing(component.sources, 3))
            return {t: self._current(t).detach() for t in component.targets}

    def check(self, name: str, made: dict[str, torch.Tensor]) -> None:
        """Refuse (and free) ``name``'s component if vLLM's loader left part of it unfilled (still NaN)."""
        partial = [t for t, v in made.items() if v.is_floating_point() and self._unfilled(t, v)]
        if not partial:
            return
        self.free(name)
        component = self.components[name].sources
        # NaN is how an unfilled element shows: a source tensor holding NaN values itself hides it.
        with_nan = [
            s for s in component if self.source.tensors[s].dtype.is_floating_point and has_nan(self.source.read(s))
        ]
        if with_nan:
            files = listing(sorted({self.source.tensors[s].file for s in with_nan}), 3)
            raise ConvertRefused(
                f"{self.source.where}: {listing(with_nan, 3)} (in {files}) holds NaN values, so convert cannot tell "
                f"whether vLLM's loader filled all of {listing(partial, 3)}. Check the source model's weights; "
                f"{SAVE_INSTEAD}"
            )
        raise ConvertRefused(
            f"{self.source.where}: vLLM's loader left part of {listing(partial, 3)} unfilled from "
            f"{listing(component, 5)}: the checkpoint lacks weights the model has.{self.source.stale_index()} "
            f"{SAVE_INSTEAD}"
        )

    def follow(self, order: list[str]) -> None:
        """Make components in the order ranks take these state tensors."""
        components = list({id(c): c for c in (self.components[n] for n in order if n in self.components)}.values())
        self._next = {id(c): components[i + 1] for i, c in enumerate(components[:-1])}

    def _unfilled(self, name: str, tensor: torch.Tensor) -> bool:
        if name in self.covered:  # (a constant is copied in whole before the load: no NaN at all)
            return bool(tensor.reshape(-1)[canaries(tensor.numel())].isnan().any())
        return has_nan(tensor)

    def after(self, name: str) -> str | None:
        """A tensor of the component after ``name``'s (None after the last)."""
        following = self._next.get(id(self.components[name]))
        return following.targets[0] if following else None

    def component_of(self, name: str) -> int:
        """What tells ``name``'s component apart from the others."""
        return id(self.components[name])

    def component_bytes(self, name: str) -> int:
        """The bytes :meth:`make` allocates for ``name``'s component."""
        return sum(self.state[t].numel() * self.state[t].element_size() for t in self.components[name].targets)

    def free(self, name: str) -> None:
        """Put a component's tensors back on the meta device."""
        for target in self.components[name].targets:
            spec = self.state[target]
            self._set(target, torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
