"""Fetching a sharded checkpoint from the Hugging Face Hub, one rank's files at a time.

vLLM's built-in loader downloads every rank's files on every node. Here a worker first
fetches the small files (manifest, config, tokenizer), then only the part files its own
rank reads: its own parts at the saved topology, or the parts its planned reads touch
when it reshards. ``huggingface_hub`` does the fetching, so revision, cache directory,
token (``HF_TOKEN``) and ``HF_HUB_OFFLINE`` behave as everywhere else, and files already
in the cache are not fetched again.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME, default_pattern, render_file_name
from ..planning.experts import rank_experts_moved
from ..planning.manifest_plans import files_to_check, plan_manifest_reads
from ..planning.topology import RankInfo

# Everything but weights: manifest, config, generation config, tokenizer, chat template.
METADATA_PATTERNS = (MANIFEST_NAME, "*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")


def fetch(
    repo_id: str,
    patterns: Sequence[str],
    *,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> str:
    """Fetch the files of ``repo_id`` matching ``patterns`` into the cache; returns the snapshot folder."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=list(patterns))


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
    """The part files (or, without a manifest, globs) one serving rank reads.

    Its own parts at the saved topology; when it reshards, the parts its planned reads
    of the tensors ``needed`` touch; without a manifest, its parts by vLLM's naming.
    """
    if manifest is None:
        return rank_patterns(pattern or default_pattern(rank.pp_size), rank.tp_rank, rank.pp_rank)
    moved = rank_experts_moved(manifest, rank)
    if (manifest.tp_size, manifest.pp_size) == (rank.tp_size, rank.pp_size) and not moved:
        return [f.name for f in manifest.rank(rank.tp_rank, rank.pp_rank).files]
    plan = plan_manifest_reads(manifest, needed, rank, tied=tied)
    return files_to_check(plan, manifest)
