"""Checkpoints written by vLLM's own save (no manifest): found by file name, checked by header
(this rank's files only, no foreign rank's file, no tensor twice, exactly the model's tensors)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..format.errors import CheckpointCorrupt, CheckpointMismatch, CheckpointNotFound
from ..format.names import MANIFEST_NAME, default_pattern, is_part_name, parse_file_name, validate_pattern
from ..planning.tensors import TensorSpec, check_tensor_sets
from ..planning.topology import RankInfo
from ..storage.local import read_header
from ..storage.location import Store, StoredFile, hugging_face_model_here
from ..storage.reader import ReadOptions
from ..storage.tensor_files import read_files
from .rank_files import HeldAdoption
from .request import LoadRequest
from .state import tensor_specs
from .stats import LoadStats, whole_file_stats


def load_without_manifest(
    request: LoadRequest,
    targets: Mapping[str, torch.Tensor],
    rank: RankInfo,
    options: ReadOptions,
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None,
    started: float,
) -> LoadStats:
    """:func:`.load.load_rank` for a checkpoint of vLLM's own save."""
    store, pattern = request.store, request.pattern
    directory = store.where
    if request.verify == "checksum":
        raise CheckpointMismatch(
            f"{directory} has no {MANIFEST_NAME} (a checkpoint of vLLM's own save), so there are no "
            "checksums to verify; load it with verify='size' or save it again with vllm-sharded-loader."
        )
    where = f"{directory} ({rank})"
    pattern = pattern or default_pattern(rank.pp_size)
    validate_pattern(pattern, rank.tp_size, rank.pp_size)
    names = rank_files_without_manifest(store, pattern, rank)
    # One descriptor per file for header, reads and the final check: vLLM's save rewrites parts in place.
    files: list[StoredFile] = []
    try:
        for n in names:
            files.append(store.open_file(n, contained=True))
        headers = [read_header(f) for f in files]
        saved = {}
        owner: dict[str, str] = {}
        for header in headers:
            for name, h in header.tensors.items():
                if name in owner:
                    raise CheckpointCorrupt(
                        f"{where}: tensor {name!r} is stored in both {owner[name]} and {header.path}; "
                        "the directory mixes two saves. Remove the stale files or save it again."
                    )
                owner[name] = header.path
                saved[name] = TensorSpec(h.shape, h.dtype)
        cast = check_tensor_sets(
            tensor_specs(targets),
            saved,
            where,
            hint="The checkpoint was written by vLLM's own save (no manifest); on CPU that save "
            "drops every linear weight. Save it again with examples/save_sharded_state.py.",
        )
        held = HeldAdoption(adopt)
        read = read_files(headers, targets, None, held.callbacks(), files, options=options)
        for f in files:
            f.check_unchanged()
        held.hand_over()
    finally:
        for f in files:
            f.close()
    return whole_file_stats([h.path for h in headers], len(targets), read, started, cast, with_manifest=False)


def holds_sharded_checkpoint(store: Store, pattern: str | None = None) -> bool:
    """Whether ``store`` holds a sharded checkpoint: a manifest, or part files by ``pattern`` or a default one."""
    if not store.vllm_saves_here:  # served from object storage only with a manifest
        return store.read_manifest() is not None
    if store.exists_file(MANIFEST_NAME):
        return True
    patterns = {pattern or default_pattern(1), default_pattern(1), default_pattern(2)}
    try:
        names = store.list_names()
    except OSError:
        return False
    return any(is_part_name(name, patterns) for name in names)


def rank_files_without_manifest(store: Store, pattern: str, rank: RankInfo) -> list[str]:
    """This rank's files in a checkpoint of vLLM's own save, refusing files of ranks the engine lacks
    (vLLM would load another topology "successfully" into narrowed parameters)."""
    # A checkpoint saved under PP has files a TP-only pattern never matches.
    patterns = [pattern] if rank.pp_size > 1 else [pattern, default_pattern(2)]
    mine, foreign = [], []
    directory, names = store.where, store.list_names()
    for name in names:
        for p in patterns:
            fields = parse_file_name(p, name)
            if fields is None:
                continue
            tp, pp = fields.get("tp_rank", 0), fields.get("pp_rank", 0)
            if p == pattern and (tp, pp) == (rank.tp_rank, rank.pp_rank):
                mine.append(name)
            elif p != pattern or tp >= rank.tp_size or pp >= rank.pp_size:
                foreign.append(name)
            break
    if foreign:
        raise CheckpointMismatch(
            f"{directory} holds files of ranks this engine does not have (for example "
            f"{foreign[0]!r}) while it runs tensor_parallel_size={rank.tp_size} and "
            f"pipeline_parallel_size={rank.pp_size}: the checkpoint was saved at another topology. "
            "Serve it at the sizes it was saved with, or save it again at the new sizes."
        )
    if not mine:
        raise CheckpointNotFound(
            hugging_face_model_here(directory, names)
            or f"{directory} has no file for {rank} matching {pattern!r} and no {MANIFEST_NAME}. "
            "Either this is not a sharded checkpoint (save one with examples/save_sharded_state.py), "
            "or it was saved at a smaller topology than the engine runs."
        )
    return mine
