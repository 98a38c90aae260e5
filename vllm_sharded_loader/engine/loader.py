"""The ``sharded_state`` model loader: the thin vLLM layer over :mod:`..checkpoint`."""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader import sharded_state_loader as builtin_sharded_state
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ..checkpoint import saveable_state
from ..checkpoint.group import check_same_checkpoint, share_load_outcome
from ..checkpoint.legacy import holds_sharded_checkpoint
from ..checkpoint.state import tied_groups
from ..format.errors import CheckpointNotFound
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..storage.location import Store
from .compile_cache import restore_startup_artifacts
from .identity import is_drafter, model_rank
from .model_reader import ModelReader, ReadInto
from .reload import InPlaceUpdate, remember_served_from
from .workers import model_groups

if TYPE_CHECKING:
    from vllm.config import ModelConfig
    from vllm.config.load import LoadConfig

# Under the "vllm" logger, so that vLLM's logging configuration shows our lines.
logger = init_logger(f"vllm.plugins.{__name__}")


def _register_saved_biases(model: torch.nn.Module, manifest: Manifest | None) -> None:
    """Register the biases a model makes only when its own ``load_weights`` meets them (Transformers
    backend's ``lm_head`` bias, Phi), if the checkpoint holds them: this loader bypasses ``load_weights``."""
    if manifest is None:
        return
    saved = {name for entry in manifest.ranks for name in entry.tensors}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if f"{name}.bias" in saved and hasattr(module, "_register_bias") and getattr(module, "bias", 0) is None:
            with torch.device(weight.device if isinstance(weight, torch.Tensor) else "cpu"):  # beside its weight
                module._register_bias()


class ShardedStateLoader(BaseModelLoader):
    """Loads each worker's own files of a sharded checkpoint straight into its parameters.

    Registered as the ``sharded_state`` load format, in place of vLLM's loader of the same name.
    Reads checkpoints saved by this package (with ``sharded_state.json``) and by vLLM's own save (no
    manifest), and refuses, saying what to do, anything that would load wrong weights: another
    topology or model, missing, unexpected or reshaped tensors, missing or resized files.

    ``model_loader_extra_config`` accepts:

    - ``verify``: ``"size"`` (default: manifest complete, every file present at its recorded size,
      headers consistent with it) or ``"checksum"`` (also the checksum of every byte read);
    - ``pattern``: the file name pattern of a checkpoint saved with a custom one, as vLLM's loader;
    - ``threads``: reader threads per worker (default one per core, 4 to 8);
    - ``huge_pages``: ask for transparent huge pages on the parameters (default off);
    - ``mmap``: on vLLM's CPU platform, serve CPU parameters stored in their own dtype from a private
      copy-on-write mapping of the file (default on); ``false`` copies every byte; ``"auto"`` copies
      the weights vLLM's CPU post-processing repacks and maps the rest.

    Rank 0 shows a progress bar unless ``use_tqdm_on_load`` is off.
    """

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.reader = ModelReader.from_load_config(load_config)

    # vLLM's save hook calls `ShardedStateLoader.save_model`; the plugin points that name here.
    @staticmethod
    def save_model(model: torch.nn.Module, path: str, pattern: str | None = None, max_size: int | None = None) -> None:
        """Write this worker's loaded state to ``path`` (see :mod:`.capture`)."""
        from .save_hook import save_rank_from_hook

        save_rank_from_hook(model, path, pattern, max_size)

    def _locate(self, model_config: ModelConfig) -> tuple[Store, str | None]:
        """The checkpoint's store, and its Hub repository id if it comes from the Hub."""
        # For remote URLs vLLM pulls config and tokenizer locally (model) and keeps the URL (model_weights).
        return self.reader.locate(model_config.model_weights or model_config.model, model_config.revision)

    def load_model(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """vLLM's ``load_model``, with the objects older than it frozen out of its ``gc.collect`` calls.

        Each full collection walks every object of the process, though only the load's can be its
        garbage; they are unfrozen after. Where something has frozen objects already, nothing changes.
        """
        if gc.get_freeze_count():
            return super().load_model(*args, **kwargs)
        gc.freeze()
        try:
            return super().load_model(*args, **kwargs)
        finally:
            gc.unfreeze()

    def download_model(self, model_config: ModelConfig) -> None:
        # Which parts a rank needs is known only in the worker (load_weights).
        self._locate(model_config)

    def _load_drafter(self, model: torch.nn.Module, model_config: ModelConfig, directory: str) -> None:
        """Load a speculative drafter from its Hugging Face folder with vLLM's default loader: vLLM
        gives the drafter the target's load format, but its folder holds its original weights."""
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        logger.info(
            "sharded_state: the speculative drafter %s holds no sharded checkpoint; loading its weights with "
            "vLLM's default loader",
            directory,
        )
        config = replace(self.load_config, load_format="auto", model_loader_extra_config={})
        try:
            DefaultModelLoader(config).load_weights(model, model_config)
        except Exception as e:
            raise CheckpointNotFound(
                f"The speculative drafter {directory} holds no sharded checkpoint ({MANIFEST_NAME} or part "
                f"files), and vLLM's default loader could not load its weights either ({type(e).__name__}: {e}). "
                "Point speculative_config['model'] at the drafter's Hugging Face folder (its *.safetensors), "
                "or at a sharded checkpoint of the drafter saved with examples/save_sharded_state.py."
            ) from e

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        store, repo_id = self._locate(model_config)
        if is_drafter(model_config) and not holds_sharded_checkpoint(store, self.reader.pattern):
            # The target is the sharded checkpoint; its drafter comes from its own folder.
            self._load_drafter(model, model_config, store.where)
            return
        rank = model_rank(model)
        workers = model_groups(rank)
        try:
            manifest, failed = store.read_manifest(), None
        except Exception as e:  # said to the other workers first, so that none waits for this one
            manifest, failed = None, e
        check_same_checkpoint(workers, rank, store.where, manifest, failed)
        if failed is not None:
            raise failed
        try:
            self._read(model, model_config, (store, repo_id), manifest)
        except Exception as e:  # said to the other workers, so that the leader's log names it
            share_load_outcome(workers, rank, e)
            raise
        share_load_outcome(workers, rank, None)
        # Before vLLM compiles (its profiling run comes after the load): a fresh node starts warm.
        hub_fetch = None if repo_id is None else (repo_id, self.load_config.download_dir)
        restore_startup_artifacts(model, store, manifest, rank, hub_fetch)

    def _read(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        located: tuple[Store, str | None],
        manifest: Manifest | None,
    ) -> None:
        """This worker's checked read of its rank's files into ``model``."""
        _register_saved_biases(model, manifest)
        state_dict = model.state_dict()
        targets = saveable_state(state_dict)
        remember_served_from(model, model_config)
        into = ReadInto(targets, tied_groups(state_dict, targets), self.reader.adoptable(model, state_dict))
        self.reader.read(model, model_config, located, manifest, into)

    def get_all_weights(self, model_config: ModelConfig, model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
        """vLLM's in-place ``reload_weights`` entry point.

        The returned iterable yields nothing: iterated inside the model's ``load_weights``, it reads
        this rank's files straight into the layers and post-processes each (:class:`.reload.InPlaceUpdate`).
        """
        return InPlaceUpdate(self.reader, model, model_config).for_reload_weights()


# The rest of vLLM's class's public surface (its patterns and helpers), taken from it so that code
# written for it behaves the same.
for _name, _value in vars(builtin_sharded_state.ShardedStateLoader).items():
    if not _name.startswith("__") and _name not in vars(ShardedStateLoader):
        setattr(ShardedStateLoader, _name, _value)
