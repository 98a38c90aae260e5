"""Fetching a sharded checkpoint from the Hugging Face Hub, one rank's files at a time: the small
files first, then only the parts its rank reads. ``huggingface_hub`` fetches, so revision, cache,
``HF_TOKEN`` and ``HF_HUB_OFFLINE`` behave as everywhere else."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ..format.errors import CheckpointCorrupt, InvalidOption
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME, default_pattern, render_file_name
from ..planning.experts import rank_experts_moved
from ..planning.manifest_plans import files_to_check, plan_manifest_reads
from ..planning.topology import RankInfo
from .folder import LocalStore
from .local import escapes

# Everything but weights: manifest, config, generation config, tokenizer, chat template.
METADATA_PATTERNS = (MANIFEST_NAME, "*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")


def fetch(
    repo_id: str,
    patterns: Sequence[str],
    *,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> LocalStore:
    """Fetch the files of ``repo_id`` matching ``patterns`` into the cache; returns the snapshot folder,
    checked to be the repository's own, every file in it resolving into the repository's folder."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    revision = revision if revision is not None else constants.DEFAULT_REVISION
    # The revision is joined to the cache's refs/ folder: "../" or "/" would read any file (a FIFO hangs).
    if os.path.isabs(revision) or ".." in revision.split("/"):
        raise InvalidOption(
            f"{repo_id}: revision {revision!r} names a path, not a branch, tag or commit of the Hub; "
            "give a branch or tag name or a commit hash."
        )
    cache = str(cache_dir or constants.HF_HUB_CACHE)
    storage = os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type="model"))
    ref = os.path.join(storage, "refs", revision)
    if os.path.lexists(ref) and not stat.S_ISREG(os.lstat(ref).st_mode):
        raise CheckpointCorrupt(
            f"{ref}: not a regular file, where the Hub cache keeps the commit of {revision!r} (a file huggingface_hub "
            f"writes); refusing to open it. Delete it and fetch {repo_id} again."
        )
    snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=list(patterns))
    check_snapshot(repo_id, storage, snapshot)
    return LocalStore(snapshot)


def fetch_more(repo_id: str, snapshot: LocalStore, patterns: Sequence[str], cache_dir: str | None = None) -> LocalStore:
    """Fetch more files of ``snapshot`` (from :func:`fetch`) into it, by its commit: a push may have
    moved the branch or tag that named it."""
    revision = os.path.basename(os.path.normpath(snapshot.where))
    fetched = fetch(repo_id, patterns, revision=revision, cache_dir=cache_dir)
    if not fetched.same_as(snapshot):
        raise CheckpointCorrupt(
            f"{repo_id}: the files of {snapshot.where} were fetched into {fetched.where}, another folder; refusing "
            "to read them. Delete the repository's folder in the Hub cache and load again."
        )
    return fetched


def check_snapshot(repo_id: str, storage: str, snapshot: str) -> None:
    """Refuse a snapshot outside ``storage``'s ``snapshots/``, or holding a link out of it and its blobs:
    a hand-edited ``refs/`` file or link would otherwise have us read another model's weights, or any file."""
    real = os.path.realpath(snapshot)
    # (Resolved: the cache, the repository's folder or its snapshots/ may be links to another disk.)
    snapshots = os.path.realpath(os.path.join(storage, "snapshots"))
    if os.path.dirname(real) != snapshots:
        raise CheckpointCorrupt(
            f"{snapshot}: resolves to {real}, not a snapshot of {repo_id} in the Hub cache ({snapshots}); its "
            f"refs/ file or snapshot link was edited. Refusing to read it: delete {storage} and fetch it again."
        )
    for folder, dirs, files in os.walk(snapshot):
        for name in sorted(dirs + files):
            path = os.path.join(folder, name)
            error = escapes(path, os.path.realpath(path), snapshot)
            if error is not None:
                raise error


def rank_patterns(pattern: str, tp_rank: int, pp_rank: int) -> list[str]:
    """Glob of one rank's parts for a checkpoint without manifest (vLLM's own save).

    >>> rank_patterns("model-rank-{rank}-part-{part}.safetensors", 1, 0)
    ['model-rank-1-part-*.safetensors']
    """
    return [render_file_name(pattern, tp_rank=tp_rank, pp_rank=pp_rank, part="*")]  # type: ignore[arg-type]


def rank_fetch_patterns(
    manifest: Manifest | None,
    rank: RankInfo,
    needed: Sequence[str] = (),
    tied: Sequence[Sequence[str]] = (),
    pattern: str | None = None,
) -> list[str]:
    """The part files (or, without a manifest, globs) one serving rank reads of the tensors ``needed``."""
    if manifest is None:
        return rank_patterns(pattern or default_pattern(rank.pp_size), rank.tp_rank, rank.pp_rank)
    moved = rank_experts_moved(manifest, rank)
    if (manifest.tp_size, manifest.pp_size) == (rank.tp_size, rank.pp_size) and not moved:
        return [f.name for f in manifest.rank(rank.tp_rank, rank.pp_rank).files]
    plan = plan_manifest_reads(manifest, needed, rank, tied=tied)
    return files_to_check(plan, manifest)
