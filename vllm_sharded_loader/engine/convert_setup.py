"""vLLM's configuration and model class for ``convert``, set up without an engine: the configuration at
TP=1 (:func:`engine_config`, with vLLM's model-class inspection run in this process), and the model
built on the meta device inside a one-process distributed world (:func:`build_meta_model`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..format.errors import ConvertRefused, ShardedStateError
from .meta_model import parameters_to_meta

# Under the "vllm" logger (vLLM's logging configuration shows our lines), without importing vLLM here.
logger = logging.getLogger(f"vllm.plugins.{__name__}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ModelOptions:
    """How vLLM builds the source's model: the ``LLM(...)`` arguments that decide its class and
    tensors (a pooling model is ``runner="pooling"``, with ``convert="embed"`` for a causal LM
    served as an embedding model, as ``vllm serve`` takes them)."""

    dtype: str = "auto"
    quantization: str | None = None
    trust_remote_code: bool = False
    runner: str = "auto"
    convert: str = "auto"


DEFAULT_OPTIONS = ModelOptions()


def engine_config(source: str, options: ModelOptions, where: str | None = None) -> Any:
    """vLLM's configuration of ``source`` at TP=1 (what its model class is built from); one that
    vLLM refuses (an architecture it does not serve, a config it cannot take) is a
    :class:`ShardedStateError` naming ``where`` (the source as the user named it)."""
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
    """Keep Ray unimported while vLLM builds the configuration: vLLM imports it only to ask whether
    this process runs inside a Ray job (for its runtime environment), which it cannot if Ray is not
    imported yet. Importing it, and its shutdown at exit, took 0.3 to 0.45 s of a 9 s convert
    here; a process that imported Ray already is asked as usual."""
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
    """Have vLLM inspect the source's model classes in this process (:func:`inspect_in_process`):
    its architectures, and the Transformers backend's, which serve an architecture vLLM has no
    class of its own for. A config this cannot read is left to vLLM, which says what is wrong."""
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
    """vLLM's inspection of each registered architecture's model class, run in this process, with
    its cache entry written as vLLM writes it; the names it could not inspect are returned.

    vLLM inspects a class it registered lazily in a new interpreter (so as not to initialise CUDA
    in its own) unless ``VLLM_CACHE_ROOT/modelinfos`` has an entry for it: about 16 s of a 34 s
    convert on a fresh node here. Convert builds the class in its own process anyway, on no
    accelerator, so vLLM's ``_run_in_subprocess`` is replaced for these calls only, then put back.
    Only a shortcut: a class this cannot inspect, vLLM inspects its own way when it needs it."""
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
                # A model class that computes values from tensors as it is built (BLOOM's ALiBi slopes,
                # .tolist()) cannot be built on the meta device: built on the CPU instead, its
                # parameters then put on the meta device. vLLM makes them with torch.empty, whose pages
                # nothing touches: memory stays about what the meta build takes.
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
    """The refusal of a model whose layers vLLM does not build here: most often a quantized layer whose
    kernel this machine lacks (vLLM picks each layer's kernel as it makes the layer, even on the meta
    device, although convert runs none)."""
    import vllm

    reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return ConvertRefused(
        f"{where}: vLLM {vllm.__version__} cannot build this model's layers on this machine "
        f"({type(error).__name__}: {reason}). vLLM chooses a quantized layer's kernel as it builds the layer, "
        "even for convert, which runs none. Nothing was written: convert on a machine whose vLLM builds this "
        "model (one that can serve it), or make the checkpoint with `vllm-sharded save` there."
    )
