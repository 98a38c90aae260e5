"""A Hugging Face checkpoint turned into vLLM's loaded state, without an engine: the vLLM side of ``convert``.

vLLM's own model class is built at TP=1 on the meta device, so that every name, fusion and split
geometry is vLLM's own. Before a byte of weights is read, a **dry run** feeds each source tensor as
a meta tensor to the model's ``load_weights``, which says which parameters it fills; these group
into small *components*, made for real one at a time (:mod:`..checkpoint.meta_model`). A parameter
no source tensor fills and vLLM does not initialise itself is refused by name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..checkpoint.meta_model import (
    DEFAULT_OPTIONS,
    DEFAULT_SCALES,
    SAVE_INSTEAD,
    MetaModel,
    ModelOptions,
    parameters_to_meta,
    walk_modules_once,
)
from ..checkpoint.state import saveable_state
from ..checkpoint.write_coverage import WriteRecorder
from ..format.errors import ConvertRefused, ShardedStateError, listing
from ..format.geometry import TensorGeometry
from ..format.manifest import RankEntry
from ..format.source import SourceModel
from ..planning.components import fill_components
from ..planning.topology import RankInfo
from ..storage.hf_source import SourceFiles
from ..storage.location import Store
from .compile_cache import save_startup_artifacts
from .identity import dtype_label, source_identity
from .layer_geometry import tensor_geometry

# Under the "vllm" logger, without importing vLLM here.
logger = logging.getLogger(f"vllm.plugins.{__name__}")


class ConvertModel(MetaModel):
    """vLLM's model of a source checkpoint on the meta device, planned, made one component at a time."""

    def __init__(
        self,
        source: SourceFiles,
        options: ModelOptions = DEFAULT_OPTIONS,
        vllm_config: Any = None,
    ) -> None:
        self.source = source
        # Reused memory rather than fresh pages (the layers repeat sizes), shared with the source reads.
        self.pool = source.pool
        self.vllm_config = vllm_config or engine_config(source.directory, options, source.where)
        self.model_config = self.vllm_config.model_config
        self.model = build_meta_model(self.vllm_config)
        walk_modules_once(self.model)
        self._read_state()
        self.fills = self._dry_run()
        # A model may add parameters as it loads (the Transformers backend's lm_head.bias): read again.
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

    def _initial_values(self, unfilled: list[str]) -> dict[str, torch.Tensor]:
        """Tensors vLLM gives a fixed initial value rather than the checkpoint's: quantized attention's
        KV-cache scales (made by its method's ``create_weights``) and an encoder's ``position_ids``."""
        by_module: dict[str, list[str]] = {}
        for name in unfilled:
            by_module.setdefault(name.rpartition(".")[0], []).append(name)
        constants: dict[str, torch.Tensor] = {}
        for module_name, names in by_module.items():
            module = self.model.get_submodule(module_name)
            positions = module._buffers.get("position_ids")
            if f"{module_name}.position_ids" in names and positions is not None and not positions.is_floating_point():
                # BERT-style position indices: torch.arange of the maximum length, in no checkpoint.
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

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> set[str]:
        from vllm.config import set_current_vllm_config

        try:
            with set_current_vllm_config(self.vllm_config):
                loaded = self.model.load_weights(iter(weights))
        except (ShardedStateError, OSError):
            raise  # reading a source tensor failed: that error, as it is
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

    def _dry_run(self) -> dict[str, set[str]]:
        """Which model tensors each source tensor fills, from ``load_weights`` on meta tensors, and
        (:attr:`covered`) which it writes whole. The load device is meta meanwhile, so a parameter
        registered while loading allocates nothing."""
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

    def carry_startup_artifacts(self, target: Store, entry: RankEntry, rank: RankInfo) -> RankEntry:
        """``entry`` with vLLM's model-class inspection cache written beside its parts, so that a
        node prepared from the converted checkpoint skips the inspection too."""
        return save_startup_artifacts(self.model, target, entry, rank, self.model_config)

    def close(self) -> None:
        self.source.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config(source: str, options: ModelOptions, where: str | None = None) -> Any:
    """vLLM's configuration of ``source`` at TP=1; one vLLM refuses is a :class:`ConvertRefused`
    naming ``where`` (the source as the user named it)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=source,
        dtype=options.dtype,
        quantization=options.quantization,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        enforce_eager=True,
        trust_remote_code=options.trust_remote_code,
        runner=options.runner,
        convert=options.convert,
        load_format="dummy",
    )
    try:
        _inspect_here(source)
        with _ray_not_imported():
            return args.create_engine_config()
    except Exception as e:  # vLLM's own checks, many of them pydantic validation errors
        import vllm

        errors = e.errors() if callable(getattr(e, "errors", None)) else []  # pydantic's, one per field
        reason = errors[0].get("msg", str(e)) if errors else str(e)
        raise ConvertRefused(
            f"{where or source}: vLLM {vllm.__version__} cannot serve this model as configured, so there is nothing "
            f"to convert it for: {reason}"
        ) from e


@contextlib.contextmanager
def _ray_not_imported() -> Iterator[None]:
    """Keep Ray unimported while vLLM builds the configuration (it imports Ray only to ask whether this
    process runs in a Ray job, which it cannot be if Ray is not imported); its import and shutdown cost."""
    if "ray" in sys.modules:
        yield
        return
    sys.modules["ray"] = None  # type: ignore[assignment]  # ``import ray`` raises ImportError
    try:
        yield
    finally:
        if "ray" in sys.modules and sys.modules["ray"] is None:
            del sys.modules["ray"]


def _inspect_here(source: str) -> None:
    """Have vLLM inspect the source's model classes (and the Transformers backend's) in this process;
    a config this cannot read is left to vLLM."""
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        with open(os.path.join(source, "config.json")) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return
    if any(a not in ModelRegistry.models for a in architectures):
        architectures += [a for a in ModelRegistry.models if a.startswith("Transformers")]
    inspect_in_process(architectures)


def inspect_in_process(architectures: list[str]) -> list[str]:
    """vLLM's inspection of each architecture's model class, run in this process with its cache entry
    written as vLLM writes it; returns the names it could not inspect.

    vLLM inspects a lazily registered class in a new interpreter (not to initialise CUDA in its own);
    convert builds the class here anyway, on no accelerator, so ``_run_in_subprocess`` is replaced for
    these calls only. A class this cannot inspect, vLLM inspects its own way later."""
    from vllm.model_executor.models import registry

    models = registry.ModelRegistry.models
    in_subprocess = getattr(registry, "_run_in_subprocess", None)
    if in_subprocess is None:
        return list(architectures)  # vLLM's inspection has moved: it runs as vLLM runs it
    failed = []
    registry._run_in_subprocess = lambda inspect: inspect()
    try:
        for name in dict.fromkeys(architectures):
            try:
                models[name].inspect_model_cls()
            except Exception:  # not registered, or its module does not import here
                failed.append(name)
    finally:
        registry._run_in_subprocess = in_subprocess
    return failed


# Whether this process's model-parallel groups are convert's own world of one process.
_OWN_GROUPS: list[bool] = []


def build_meta_model(vllm_config: Any) -> torch.nn.Module:
    """vLLM's model class for ``vllm_config``, at TP=1, every parameter on the meta device."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config):
        if _OWN_GROUPS and vllm_config.model_config.is_moe and parallel_state._EP is None:
            # vLLM makes an expert-parallel group only for a MoE model: ours, made for a dense model, again.
            parallel_state.destroy_model_parallel()
        if not parallel_state.model_parallel_is_initialized():
            # A world of one process on the loopback: vLLM's layers ask it for their TP rank and size.
            os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
            _OWN_GROUPS[:] = [True]
        where = vllm_config.model_config.model
        try:
            try:
                with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
                    model = initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
            except NotImplementedError as e:
                if "meta tensor" not in str(e):
                    raise
                # A class that computes values from tensors as it is built (BLOOM's ALiBi slopes) is built
                # on the CPU, then moved to meta; torch.empty pages nothing touches cost no memory.
                logger.info("%s cannot be built on the meta device (%s): built on the CPU", where, e)
                vllm_config.compilation_config.static_forward_context.clear()  # the layers the failed build named
                with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
                    model = initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        except ShardedStateError:
            raise
        except Exception as e:
            raise _cannot_build(where, e) from e
    parameters_to_meta(model)
    return model


def _cannot_build(where: str, error: Exception) -> ConvertRefused:
    """The refusal of a model whose layers vLLM does not build here (most often a quantized kernel this
    machine lacks, chosen even on the meta device)."""
    import vllm

    reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return ConvertRefused(
        f"{where}: vLLM {vllm.__version__} cannot build this model's layers on this machine "
        f"({type(error).__name__}: {reason}). vLLM chooses a quantized layer's kernel as it builds the layer, "
        "even for convert, which runs none. Nothing was written: convert on a machine whose vLLM builds this "
        "model (one that can serve it), or make the checkpoint with `vllm-sharded save` there."
    )


@contextlib.contextmanager
def converting(
    directory: str, where: str | None = None, options: ModelOptions = DEFAULT_OPTIONS
) -> Iterator[ConvertModel]:
    """A :class:`ConvertModel` of the Hugging Face model in ``directory`` (weights at ``where``, default
    there too), its files closed after."""
    source = SourceFiles.open(directory, where)
    try:
        yield ConvertModel(source, options)
    finally:
        source.close()
