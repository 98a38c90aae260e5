"""A Hugging Face checkpoint turned into vLLM's loaded state, without an engine: the vLLM side of ``convert``.

vLLM's own model class is built at TP=1 on the meta device (nothing allocated), inside a
one-process distributed world, so that every name, fusion (q/k/v, gate/up, stacked experts),
vocabulary padding and split geometry is vLLM's own (:func:`..layer_geometry.tensor_geometry`).
Then, before a byte of weights is read:

- a **dry run** feeds each source tensor, as a meta tensor of its shape and dtype, to the
  model's own ``load_weights``: what it returns is the parameters that tensor fills (the
  model's name mapping, ``stacked_params_mapping``, expert mapping). Source tensors and the
  parameters they fill fall into small *components* (one fused parameter and its sources);
- a parameter no source tensor fills, and that vLLM does not initialise to a known value
  itself (attention's default quantization scales), cannot be derived: it is refused by name.

A component is then made for real on the CPU, one at a time (:meth:`ConvertModel.make`): its
parameters allocated (floating ones filled with NaN), its source tensors mapped from their
files and given to the same ``load_weights``; a parameter left partly unfilled (NaN) is refused
by name. The result is exactly what vLLM's default loader holds at TP=1 before post-processing,
which is what ``vllm-sharded save`` captures; the target ranks' slices follow from the geometry.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..checkpoint.state import saveable_state, tied_groups
from ..checkpoint.write_coverage import WriteRecorder, canaries
from ..format.errors import ConvertRefused, ShardedStateError, listing
from ..format.geometry import TensorGeometry
from ..format.manifest import RankEntry
from ..format.source import SourceModel
from ..planning.components import fill_components
from ..planning.topology import RankInfo
from ..storage.hf_source import SourceFiles
from ..storage.location import Store
from ..storage.tensors import has_nan
from .compile_cache import save_startup_artifacts
from .convert_setup import DEFAULT_OPTIONS, ModelOptions, build_meta_model, engine_config
from .identity import dtype_label, source_identity
from .layer_geometry import tensor_geometry
from .meta_model import holding, walk_modules_once

# Under the "vllm" logger (vLLM's logging configuration shows our lines), without importing vLLM here.
logger = logging.getLogger(f"vllm.plugins.{__name__}")

# Buffers vLLM's attention layers register with a fixed value (set_default_quant_scales): 1.0
# unless the checkpoint holds KV-cache scales, which the dry run then shows.
DEFAULT_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")

SAVE_INSTEAD = "Make this checkpoint with `vllm-sharded save` (which loads the model in vLLM) instead."


class ConvertModel:
    """vLLM's model of a source checkpoint on the meta device, planned, made one component at a time."""

    def __init__(
        self,
        source: SourceFiles,
        options: ModelOptions = DEFAULT_OPTIONS,
        vllm_config: Any = None,
    ) -> None:
        self.source = source
        # Components' memory, written again rather than faulted in fresh (the model's layers repeat sizes),
        # shared with the source tensors read.
        self.pool = source.pool
        self.vllm_config = vllm_config or engine_config(source.directory, options, source.where)
        self.model_config = self.vllm_config.model_config
        self.model = build_meta_model(self.vllm_config)
        walk_modules_once(self.model)
        self._read_state()
        self.fills = self._dry_run()
        # A model may add parameters as it loads the tensors that need them (vLLM's Transformers
        # backend registers lm_head.bias when the checkpoint has one): its state as loaded.
        self._read_state()
        for name, targets in self.fills.items():
            foreign = sorted(targets - set(self.state))
            if foreign:
                raise ConvertRefused(
                    f"{source.where}: {name} fills {listing(foreign, 3)}, which is not in the model's state. "
                    f"{SAVE_INSTEAD}"
                )
        self.dtype = dtype_label(self.model_config.dtype)
        self.identity: SourceModel = source_identity(self.model, self.model_config)
        self.geometry: dict[str, TensorGeometry] = tensor_geometry(self.model, self.state, 1, 0)
        defaults = [n for n in self.state if n.rpartition(".")[2] in DEFAULT_SCALES]
        filled = {t for targets in self.fills.values() for t in targets}
        self.constants = self._initial_values([n for n in self.state if n not in filled and n not in defaults])
        defaults += list(self.constants)
        self._slots = self._tensor_slots()
        unfilled = [n for n in self.state if n not in filled and n not in defaults]
        if unfilled:
            raise ConvertRefused(
                f"{source.where}: vLLM's {type(self.model).__name__} has tensors that no tensor of the checkpoint "
                f"fills: {listing(unfilled, 5)}; their values come from running the model, not from its files "
                f"(or the config does not describe these weights).{source.stale_index()} {SAVE_INSTEAD}"
            )
        self.components = fill_components(self.fills, defaults)
        self.follow(list(self.state))

    # ----------------------------------------------------------------- planning

    def _read_state(self) -> None:
        state_dict = self.model.state_dict(keep_vars=True)
        self.state = saveable_state(state_dict)
        self.tied = tied_groups(state_dict, self.state)

    def _initial_values(self, unfilled: list[str]) -> dict[str, torch.Tensor]:
        """Tensors vLLM gives a fixed initial value, not filled from the checkpoint: a quantized
        attention layer's KV-cache scales and zero points, which its KV-cache method creates (-1:
        "not given") and post-processing replaces, made by that method's own ``create_weights``
        on the CPU, for attention layers none of whose tensors the checkpoint fills; and an
        encoder's integer ``position_ids`` buffer (``arange``)."""
        by_module: dict[str, list[str]] = {}
        for name in unfilled:
            by_module.setdefault(name.rpartition(".")[0], []).append(name)
        constants: dict[str, torch.Tensor] = {}
        for module_name, names in by_module.items():
            module = self.model.get_submodule(module_name)
            positions = module._buffers.get("position_ids")
            if f"{module_name}.position_ids" in names and positions is not None and not positions.is_floating_point():
                # BERT-style encoders register their position indices as a buffer, torch.arange
                # of the maximum length (as transformers' models do); no checkpoint holds them.
                shape = tuple(positions.shape)
                constants[f"{module_name}.position_ids"] = (
                    torch.arange(shape[-1], dtype=positions.dtype).expand(shape).clone()
                )
                continue
            method = getattr(module, "quant_method", None)
            create = getattr(method, "create_weights", None)
            own = [f"{module_name}.{p}" for p, _ in module.named_parameters(recurse=False)]
            if "Attention" not in type(module).__name__ or create is None or set(own) - set(names):
                continue
            try:
                with torch.device("cpu"):
                    create(module)
            except TypeError:  # a method that needs more than the layer: not a KV-cache method
                continue
            for name in names:
                value = getattr(module, name.rpartition(".")[2], None)
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    constants[name] = value.detach().clone()
        return constants

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

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> set[str]:
        from vllm.config import set_current_vllm_config

        try:
            with set_current_vllm_config(self.vllm_config):
                loaded = self.model.load_weights(iter(weights))
        except (ShardedStateError, OSError):
            raise  # reading a source tensor failed (the loader takes them as it goes): that error, as it is
        except Exception as e:  # vLLM's loader asserts on what it cannot place
            raise ConvertRefused(
                f"{self.source.where}: vLLM's {type(self.model).__name__}.load_weights cannot place {what}: "
                f"{type(e).__name__}: {e}. The config does not describe these weights, or loading them needs the "
                f"model running. {SAVE_INSTEAD}"
            ) from e
        if loaded is None:
            raise ConvertRefused(
                f"{self.source.where}: vLLM's {type(self.model).__name__}.load_weights does not say which "
                f"parameters it filled, so convert cannot follow it. {SAVE_INSTEAD}"
            )
        return {self._saved_name(n) for n in loaded}

    def _saved_name(self, name: str) -> str:
        if name in self.state:
            return name
        for group in self.tied:
            if name in group:
                return group[0]
        return name

    def _dry_run(self) -> dict[str, set[str]]:
        """Which model tensors each source tensor fills, from vLLM's load_weights on meta tensors;
        and (:attr:`covered`) which of them those loads write whole.

        vLLM's load device is the meta device meanwhile: a parameter a model registers while it
        loads (on ``load_config.device``) is made there too, allocating nothing."""
        load_config = self.vllm_config.load_config
        device, load_config.device = load_config.device, "meta"
        recorder = WriteRecorder({n: t for n, t in self.state.items() if t.is_floating_point()})
        try:
            with recorder:
                fills = {name: self._load([(name, self.source.meta(name))], name) for name in self.source.tensors}
        finally:
            load_config.device = device
        self.covered = recorder.covered(saveable_state(self.model.state_dict(keep_vars=True)))
        return fills

    # ----------------------------------------------------------------- making

    def _set(self, name: str, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` as state tensor ``name``, in every module that holds it (tied ones too).

        A parameter is replaced by one of its own class with its attributes (vLLM's weight
        loader, its dimensions), since a meta parameter's data cannot be set to a CPU tensor.
        """
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
        """The component holding ``name``, made on the CPU: each of its tensors as vLLM's TP=1 load holds it.

        The caller checks it (:meth:`check`), and frees it (:meth:`free`) after the ranks' last slices.
        """
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
                # Read as vLLM's loader takes them (the next while it copies one in): each source's memory
                # is held only until vLLM copied it in (a MoE layer's experts are hundreds of tensors).
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
        """Make components in the order ranks take these state tensors: what :meth:`after` and the
        source's read-ahead follow (the state's order until told)."""
        components = list({id(c): c for c in (self.components[n] for n in order if n in self.components)}.values())
        self._next = {id(c): components[i + 1] for i, c in enumerate(components[:-1])}

    def _unfilled(self, name: str, tensor: torch.Tensor) -> bool:
        if name in self.covered:  # (a constant is copied in whole before the load: no NaN at all)
            return bool(tensor.reshape(-1)[canaries(tensor.numel())].isnan().any())
        return has_nan(tensor)

    def after(self, name: str) -> str | None:
        """A tensor of the component after ``name``'s in the order ranks take them (None after the last)."""
        following = self._next.get(id(self.components[name]))
        return following.targets[0] if following else None

    def component_bytes(self, name: str) -> int:
        """The bytes :meth:`make` allocates for ``name``'s component (known before it is made)."""
        return sum(self.state[t].numel() * self.state[t].element_size() for t in self.components[name].targets)

    def free(self, name: str) -> None:
        """Put a component's tensors back on the meta device (their memory goes)."""
        for target in self.components[name].targets:
            spec = self.state[target]
            self._set(target, torch.empty(spec.shape, dtype=spec.dtype, device="meta"))

    def carry_startup_artifacts(self, target: Store, entry: RankEntry, rank: RankInfo) -> RankEntry:
        """``entry`` with vLLM's model-class inspection cache for this model written beside its
        parts, as an engine that compiled nothing (an eager ``save``) carries it, so that a fresh
        node prepared from the converted checkpoint (``prepare_node``) skips the inspection too.
        Nothing was compiled, so nothing else is carried; optional, as for a save."""
        return save_startup_artifacts(self.model, target, entry, rank, self.model_config)

    def close(self) -> None:
        self.source.close()


@contextlib.contextmanager
def converting(
    directory: str, where: str | None = None, options: ModelOptions = DEFAULT_OPTIONS
) -> Iterator[ConvertModel]:
    """A :class:`ConvertModel` of the Hugging Face model in ``directory`` (its weights at ``where``,
    default there too: see :class:`..storage.hf_source.SourceFiles`), its files closed after."""
    source = SourceFiles.open(directory, where)
    try:
        yield ConvertModel(source, options)
    finally:
        source.close()
