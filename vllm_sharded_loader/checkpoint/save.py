"""Saving a sharded checkpoint from one process, engine-free (tests, ``reshard``, ``convert``): the
save protocol (:mod:`.protocol`) over a group of one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..format.errors import InvalidOption
from ..format.experts import ExpertPlacement
from ..format.manifest import CarriedFile, Manifest, RankEntry
from ..format.names import default_pattern, validate_pattern
from ..format.source import SourceModel
from ..planning.topology import RankInfo
from ..storage.faults import declare, kill_point
from ..storage.location import Store, open_store, require_store
from ..storage.progress import ByteProgress
from ..storage.staged import StagedRank, stage_in_parallel, stage_rank
from .carry import check_carry_source
from .protocol import OneProcess, SaveJob, run_save

DEFAULT_MAX_SIZE = 5 * 1024**3

KILL_STAGED = declare("local.staged", "checkpoint/save.py: a rank's parts are staged under hidden names")


@dataclass(frozen=True)
class SaveOptions:
    """What a one-process save records and how it writes, beyond its ranks' dtype and source model.

    ``pattern`` and ``max_size`` name and cap the parts; ``overwrite`` lets it replace a checkpoint.
    ``geometry`` (JSON of :class:`~..format.geometry.TensorGeometry` by name) lets it be served at
    another TP/PP size; ``tied`` lists names saved once for several; ``experts`` places the routed
    experts (with several data-parallel replicas, each after the first gives only its experts).
    ``carry`` is the store of a model whose config and tokenizer go beside the parts, holding what
    ``carried_record`` says where given. ``progress`` counts the bytes staged.
    """

    pattern: str | None = None
    max_size: int | None = None
    overwrite: bool = False
    geometry: Mapping[str, dict] = field(default_factory=dict)
    tied: tuple[tuple[str, ...], ...] = ()
    experts: ExpertPlacement | None = None
    carry: Store | None = None
    carried_record: Mapping[str, CarriedFile] | None = None
    progress: ByteProgress | None = None

    def __post_init__(self) -> None:
        if self.carry is not None:
            require_store(self.carry, "SaveOptions.carry")


@dataclass(frozen=True)
class RankHooks:
    """What ``convert`` adds to a one-process save. ``parallel`` stages the ranks at once, one thread
    each (they are cut from shared source tensors, so they advance together). ``ended(rank, error)``
    is called when a rank's staging ends, so that one that stops leaves no other waiting.
    ``placed`` is :attr:`.protocol.SaveJob.placed`."""

    parallel: bool = False
    ended: Callable[[RankInfo, BaseException | None], None] | None = None
    placed: Callable[[Store, RankEntry], RankEntry] | None = None


def save_checkpoint(
    directory: str | Store,
    ranks: Mapping[RankInfo, Mapping[str, torch.Tensor]],
    *,
    dtype: str,
    source: SourceModel,
    options: SaveOptions = SaveOptions(),
    hooks: RankHooks = RankHooks(),
) -> Manifest:
    """Save every rank's tensors from one process into ``directory`` (a folder, URL or store), as
    ``options`` says, with ``convert``'s :class:`RankHooks`."""
    infos = sorted(ranks, key=lambda r: (r.pp_rank, r.dp_rank, r.tp_rank))
    replicas = infos[0].replicas
    if any(r.dp_rank >= replicas for r in infos):
        raise InvalidOption(
            "Only the first data-parallel replica writes a save, unless its experts are split across the "
            f"replicas (EP size = TP x DP, or experts_over_dp); ranks of replica {max(r.dp_rank for r in infos)} "
            "were given."
        )
    pattern = options.pattern or default_pattern(infos[0].pp_size, replicas)
    validate_pattern(pattern, infos[0].tp_size, infos[0].pp_size, replicas)  # before the lock: a refusal changes
    carry = options.carry
    check_carry_source(carry)  # nothing in the output, not even its mtime (as the save hook checks its pattern)
    ended = hooks.ended

    def stage_one(
        folder: str, token: str, info: RankInfo, progress: Callable[[int, int], None] | None, buffers: int | None = None
    ) -> StagedRank:
        """Stage one rank, then call ``ended`` however it ended."""
        try:
            staged = stage_rank(folder, ranks[info], info, pattern, options.max_size, token, progress, buffers)
        except BaseException as e:
            if ended is not None:
                ended(info, e)
            raise
        if ended is not None:
            ended(info, None)
        return staged

    def stage(store: Store) -> Iterator[tuple[StagedRank, None]]:
        folder = store.staging()  # (once: a store's staging folder is made on first use)
        if options.progress is not None:
            # One total, after the lock (a refused save draws no bar); lazy tensors give sizes only.
            options.progress(0, sum(t.numel() * t.element_size() for ts in ranks.values() for t in ts.values()))
        if hooks.parallel and len(infos) > 1:
            staged = stage_in_parallel(
                lambda info, progress, buffers: stage_one(folder, store.token, info, progress, buffers),
                infos,
                options.progress,
                lambda: kill_point(KILL_STAGED),
            )
            yield from ((s, None) for s in staged)
            return
        for info in infos:
            yield stage_one(folder, store.token, info, options.progress), None
            kill_point(KILL_STAGED)

    def manifest_of(entries: Sequence[tuple[RankEntry, None]]) -> Manifest:
        return Manifest(
            tp_size=infos[0].tp_size,
            pp_size=infos[0].pp_size,
            dtype=dtype,
            pattern=pattern,
            source=source,
            ranks=tuple(entry for entry, _ in entries),
            geometry=dict(options.geometry),
            tied=options.tied,
            experts=options.experts,
            dp_size=infos[0].dp_size,
            experts_over_dp=infos[0].experts_over_dp,
        )

    job = SaveJob(
        stage,
        manifest_of,
        carry=None if carry is None else lambda carried: carried.stage(carry, options.carried_record),
        placed=hooks.placed,
        overwrite=options.overwrite,
        pattern=pattern,
    )
    return run_save(open_store(directory), OneProcess(), job)[0]
