"""The meta model convert runs vLLM's loaders on.

A model built on the meta device allocates nothing; :func:`parameters_to_meta` puts there
what a model class makes on the CPU anyway, :func:`holding` swaps a parameter's tensor, and
:func:`walk_modules_once` keeps vLLM's loaders from walking the module tree per call. Which
elements the loaders write is recorded by :mod:`..checkpoint.write_coverage`.
"""

from __future__ import annotations

import torch


def parameters_to_meta(model: torch.nn.Module) -> None:
    """Put on the meta device the parameters a model class makes on the CPU even inside
    ``torch.device("meta")``: vLLM's Transformers backend (the model class of architectures vLLM
    has no own implementation of) makes the norms it puts in place of the model's own there. The
    dry run fills meta tensors into every parameter, which a CPU one refuses ("Cannot copy out of
    meta tensor"). Each keeps its class and attributes (vLLM's weight loader); one held by several
    modules (tied) stays one."""
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is None or param.device.type == "meta":
                continue
            if id(param) not in moved:
                moved[id(param)] = holding(param, torch.empty_like(param, device="meta"))
            module._parameters[attr] = moved[id(param)]


def holding(param: torch.nn.Parameter, tensor: torch.Tensor) -> torch.nn.Parameter:
    """A parameter of ``param``'s class and attributes (vLLM's weight loader, its dimensions) holding
    ``tensor``: a parameter's data cannot move between the meta device and the CPU in place."""
    held = torch.nn.Parameter._make_subclass(type(param), tensor, False)
    held.__dict__.update(param.__dict__)
    return held


def walk_modules_once(model: torch.nn.Module) -> None:
    """Each call of vLLM's ``load_weights`` walks every module of the model (``AutoWeightsLoader``
    looks for tied embeddings), and convert calls it once per source tensor and once per
    component: quadratic in the layers (36 of 44 s before the first write, for 155 layers). The
    modules of this meta model never change during a conversion (only their tensors do), so each
    module that loads weights answers a whole-tree ``named_modules`` from one walk."""
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
