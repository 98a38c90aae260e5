"""``vllm-sharded convert``: a Hugging Face checkpoint written as per-rank sharded files, without an engine.

vLLM's model class is built at TP=1 on the meta device (:mod:`..engine.convert`), which gives
every tensor's name, fused layout and split geometry as vLLM's own layers define them. Each
target rank's tensor is then the rank's slice of the TP=1 tensor by vLLM's sharding rule
(:func:`..planning.layout.shard_layout`, the rule resharding loads use), its pipeline stage's
tensors by vLLM's layer split (:func:`..planning.pipeline.stage_split`). Written by the save
protocol (:func:`..checkpoint.save.save_checkpoint`), every rank at once: a component (one
fused parameter and the source tensors it is made of) is made once, from one read of its
source bytes, cut for every rank that holds it, and freed when every rank has taken its slice.
Memory holds a few components, never the model.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..checkpoint.carry import record_of
from ..checkpoint.meta_model import DEFAULT_OPTIONS, SAVE_INSTEAD, ModelOptions
from ..checkpoint.rank_cut import rank_parts
from ..checkpoint.save import DEFAULT_MAX_SIZE, RankHooks, SaveOptions, save_checkpoint
from ..checkpoint.state import manifest_ties
from ..format.errors import ConvertRefused, InvalidOption, RankStopped, listing
from ..format.geometry import OPAQUE, TensorGeometry
from ..format.manifest import Manifest, RankEntry
from ..planning.layout import ShardLayout, shard_layout
from ..planning.pipeline import config_layers, stage_split
from ..planning.topology import RankInfo
from ..storage.hf_source import check_source_files, read_ahead, resolve_source
from ..storage.location import Store, open_store
from ..storage.oscalls import release_free_heap
from ..storage.progress import ByteProgress
from ..storage.staging_folders import staging_folder
from ..storage.tensors import torch_threads
from ..storage.writer import LazyTensor, write_order
from .offline import check_output_apart

if TYPE_CHECKING:
    from ..checkpoint.meta_model import MetaModel
    from ..engine.convert import ConvertModel

# Components made and not yet freed, in bytes: ranks that run ahead wait for the others. With
# vLLM imported (about 0.8 GiB resident here, the writers' buffers included), more would take the
# peak past the largest tensor plus 1 GiB; a budget of 1 GiB gave 1.26 GiB on the 14 GB model of
# benchmarks/convert_bench.py --large, and no convert was faster for it.
DEFAULT_BUDGET = 128 * 1024**2
# Components made ahead of the ranks that will take them: enough to keep the maker busy while
# one is checked and the ranks write another, few enough that memory stays a few components.
AHEAD = 2


@dataclass
class _Made:
    tensors: dict[str, torch.Tensor]
    nbytes: int
    pending: int  # slices of its tensors not yet taken, over every rank


@dataclass
class ComponentCache:
    """Components made once and shared by the ranks' writer threads, freed after their last slice.

    ``model`` makes them (:class:`..checkpoint.meta_model.MetaModel`). One thread of its own makes
    every component (``make`` is vLLM's loader on one model, so never two at once) and another
    checks each one made (``check`` refuses one left partly unfilled), while the ranks cut and write
    the ones checked: once a component is made, or taken by a rank, the one after it (``after``) is
    made ahead if the budget allows, so making, checking and writing overlap.

    Components made and not yet freed stay within ``budget`` bytes (``component_bytes`` gives a
    component's bytes before it is made): a rank whose component does not fit waits for slower
    ranks to free theirs, unless every other working rank waits too; then components no waiting
    rank needs next are freed (and made again later if a rank still needs them: a source read
    twice rather than memory without bound). Only a component larger than the budget on its own
    is made over it. A component whose making or check failed raises its error in the rank that
    takes it.
    """

    model: MetaModel
    takes: dict[str, int]  # tensor -> how many ranks take a slice of it
    budget: int = DEFAULT_BUDGET
    made: dict[int, _Made] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)
    waiting: dict[int, int] = field(default_factory=dict)  # thread -> component it waits to make
    # Ranks written at once and not finished: every rank, each staged in a thread of its own.
    running: int = 1
    failed: BaseException | None = None
    remakes: int = 0
    peak: int = 0
    ahead: int = 0  # components made ahead of the rank that took them

    def __post_init__(self) -> None:
        self.cond = threading.Condition()
        self.making: int | None = None  # the component the maker is making
        self.checking: dict[int, int] = {}  # components made, being checked -> their bytes
        self.untaken: set[int] = set()  # components made (or being checked) that no rank took yet
        self.errors: dict[int, BaseException] = {}
        self.maker = ThreadPoolExecutor(1, thread_name_prefix="convert-make")
        self.checker = ThreadPoolExecutor(1, thread_name_prefix="convert-check")
        # The helpers' torch operations get the cores the ranks' writers and checksums leave
        # (two threads each): on a few cores, an OpenMP team per operation only spins on theirs.
        self.threads = max(1, len(os.sched_getaffinity(0)) - 2 * self.running)
        for name, count in self.takes.items():
            key = self.model.component_of(name)
            self.pending[key] = self.pending.get(key, 0) + count

    def _bytes(self) -> int:
        return sum(m.nbytes for m in self.made.values()) + sum(self.checking.values())

    def take(self, name: str) -> torch.Tensor:
        """The TP=1 tensor ``name`` (made with its component if no rank made it yet) for one rank's slice."""
        me = threading.get_ident()
        with self.cond:
            try:
                tensor, freed = self._take(name, me)
            except BaseException as e:
                # Every other rank stops at its next tensor: the save then discards them all.
                self.failed = self.failed or e
                self.cond.notify_all()
                raise
        if freed:
            # glibc keeps freed blocks of the sizes that recur here, fragmented across the
            # threads' arenas: handed back, memory stays at a few components.
            release_free_heap()
        return tensor

    def _start(self, name: str, key: int) -> None:
        """Have the maker make ``name``'s component (the caller holds the lock; the maker is idle)."""
        self.making = key
        self.maker.submit(self._make, name, key)

    def _make(self, name: str, key: int) -> None:
        try:
            with torch_threads(self.threads):
                tensors = self.model.make(name)
        except BaseException as e:
            with self.cond:
                self.errors[key], self.making = e, None
                self.cond.notify_all()
            return
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self.cond:
            self.checking[key], self.making = nbytes, None
            self.untaken.add(key)
            self.peak = max(self.peak, self._bytes())
            self._make_ahead(name)  # the next one is made while this one is checked
            self.cond.notify_all()
        self.checker.submit(self._check, name, key, tensors)

    def _check(self, name: str, key: int, tensors: dict[str, torch.Tensor]) -> None:
        try:
            with torch_threads(self.threads):
                self.model.check(name, tensors)
        except BaseException as e:
            with self.cond:
                self.errors[key] = e
                del self.checking[key]
                self.cond.notify_all()
            return
        with self.cond:
            self.made[key] = _Made(tensors, self.checking.pop(key), self.pending[key])
            self.cond.notify_all()

    def _take(self, name: str, me: int) -> tuple[torch.Tensor, bool]:
        key = self.model.component_of(name)
        while key not in self.made:
            if key in self.errors:
                raise self.errors[key]  # this rank's own component failed: its error, not a "stopped"
            if self.failed is not None:
                raise RankStopped(f"stopped: another rank's conversion failed ({self.failed})")
            # Ranks that can still take a slice: those not waiting for a component nobody made yet.
            others = self.running - 1 - sum(1 for k in self.waiting.values() if k not in self.made)
            fits = self._bytes() + self.model.component_bytes(name) <= self.budget
            if self.making is None and key not in self.checking and (fits or not self.made or others <= 0):
                if not fits:
                    self._evict(key)
                self._start(name, key)
            self.waiting[me] = key
            self.cond.wait()
            self.waiting.pop(me, None)
        made = self.made[key]
        tensor = made.tensors[name]
        self.untaken.discard(key)
        self._make_ahead(name)
        made.pending -= 1
        self.pending[key] -= 1
        if made.pending:
            return tensor, False
        del self.made[key]
        self.model.free(name)
        self.cond.notify_all()
        return tensor, True

    def _make_ahead(self, name: str) -> None:
        """Start making the first component after ``name``'s not yet made, if it is at most :data:`AHEAD`
        components on, no more than :data:`AHEAD` made ones wait for their first rank, the maker is
        idle and the budget has room for it."""
        if self.making is not None or len(self.untaken) >= AHEAD:
            return
        following = self.model.after(name)
        for _ in range(AHEAD):
            if following is None:
                return
            key = self.model.component_of(following)
            if key not in self.made and key not in self.checking:
                break
            following = self.model.after(following)
        else:
            return
        if key in self.errors or not self.pending.get(key):
            return
        if self._bytes() + self.model.component_bytes(following) <= self.budget:
            self.ahead += 1
            self._start(following, key)

    def _evict(self, keep: int) -> None:
        wanted = set(self.waiting.values()) | {keep}
        for key in [k for k in self.made if k not in wanted]:
            made = self.made.pop(key)
            self.untaken.discard(key)  # made again when a rank needs it, and counted ahead then
            self.model.free(next(iter(made.tensors)))
            self.remakes += 1

    def rank_done(self, failed: BaseException | None = None) -> None:
        """A rank takes nothing more: it took its last slice, or its writing ended early with
        ``failed`` (then every other rank stops at its next tensor, not waiting for this one's takes)."""
        with self.cond:
            self.running -= 1
            if failed is not None:
                self.failed = self.failed or failed
            self.cond.notify_all()

    def close(self) -> None:
        """Stop the helpers: after the component each is making or checking, if any; nothing queued."""
        self.maker.shutdown(wait=True, cancel_futures=True)
        self.checker.shutdown(wait=True, cancel_futures=True)


@dataclass
class ConvertResult:
    manifest: Manifest
    source_bytes: int
    peak_component_bytes: int
    remade: int
    build_seconds: float  # vLLM's configuration and model on the meta device, the dry run
    write_seconds: float  # reading, cutting and writing every rank, published


def plan_ranks(
    state: dict[str, torch.Tensor],
    geometry: dict[str, TensorGeometry],
    tied: list[list[str]],
    layers: int | None,
    tp_size: int,
    pp_size: int,
) -> dict[RankInfo, dict[str, tuple[str, ShardLayout]]]:
    """Every target rank's tensors: name -> (the state tensor it is cut from, the rank's layout).

    Refuses, naming them, tensors whose split vLLM's layer classes do not describe at a TP size
    above 1, and sizes vLLM itself refuses (heads or rows that do not divide).
    """
    alias = {n: group[0] for group in tied for n in group[1:]}
    order = {name: i for i, name in enumerate(state)}
    if pp_size > 1 and not isinstance(layers, int):
        raise ConvertRefused(f"Cannot split into {pp_size} pipeline stages: the config has no num_hidden_layers.")
    opaque = [n for n, g in geometry.items() if g.kind == OPAQUE]
    if tp_size > 1 and opaque:
        shown = listing([f"{n} ({geometry[n].layer_class})" for n in opaque], 5)
        raise ConvertRefused(
            f"Cannot convert to TP={tp_size}: vLLM's layers do not describe how {shown} split across ranks "
            "(a layer this version does not know). Convert at TP=1, or make the checkpoint with "
            "`vllm-sharded save` at the target size."
        )
    ranks: dict[RankInfo, dict[str, tuple[str, ShardLayout]]] = {}
    for pp_rank in range(pp_size):
        names = list(state) if pp_size == 1 else stage_split(list(state), tied, layers or 0, pp_size, pp_rank)
        names.sort(key=lambda n: order.get(alias.get(n, n), len(order)))
        for tp_rank in range(tp_size):
            info = RankInfo(tp_rank, tp_size, pp_rank, pp_size)
            ranks[info] = {
                n: (alias.get(n, n), shard_layout(geometry[alias.get(n, n)], tp_size, tp_rank, n)) for n in names
            }
    return ranks


@dataclass(frozen=True)
class ConvertOptions:
    """How ``convert`` builds the source's model (``model``: vLLM's ``LLM(...)`` arguments of the engine
    that will serve it), which ``revision`` of a Hub repo id, how it writes (a save's ``max_size``,
    ``pattern``, ``overwrite``), and the bytes of components made and not yet freed (``budget``)."""

    model: ModelOptions = DEFAULT_OPTIONS
    revision: str | None = None
    max_size: int | None = DEFAULT_MAX_SIZE
    pattern: str | None = None
    overwrite: bool = False
    budget: int = DEFAULT_BUDGET


def convert_checkpoint(
    source: str,
    output: str,
    tp_size: int,
    pp_size: int = 1,
    options: ConvertOptions = ConvertOptions(),
    progress: ByteProgress | None = None,
) -> ConvertResult:
    """Write ``source``'s weights as a sharded checkpoint for ``tp_size`` x ``pp_size`` into ``output``
    (``options``: :class:`ConvertOptions`; ``progress`` counts the bytes written).

    Every check (the source's files and headers, that vLLM's loader places every tensor,
    that every rank's split exists) runs before a byte is written; the output is published
    by the save protocol (lock, staged parts, manifest last), config and tokenizer carried.
    """
    if tp_size < 1 or pp_size < 1:
        raise InvalidOption(f"Sizes must be >= 1, got TP={tp_size} PP={pp_size}.")
    folder = resolve_source(source, options.revision)
    out = open_store(output)
    check_output_apart(out, folder, "model")
    check_source_files(folder)
    # Said now, as the save's lock would say it once vLLM has built the model (tens of seconds from here).
    out.refuse_before_save(options.overwrite)
    # (Nothing is written into OUT before the save protocol's lock, which makes the output's folders
    # and, on a failure, removes those it made.)
    return _convert(folder, out, tp_size, pp_size, options, progress)


class _Ranks:
    """Every target rank's tensors (``plans``), each made when the writer takes it from its component in
    ``cache``; a rank is done once it took every tensor of its plan, or when its writing ended (a full
    disk): counted, so that it does not depend on the order the writer takes them in."""

    def __init__(self, model: ConvertModel, cache: ComponentCache, plans: dict[RankInfo, dict[str, Any]]) -> None:
        self.model, self.cache, self.plans = model, cache, plans
        self.left = {info: len(plan) for info, plan in plans.items()}
        self.done: set[RankInfo] = set()
        self.by_position = {(info.tp_rank, info.pp_rank, info.dp_rank): info for info in plans}

    def tensors(self) -> dict[RankInfo, dict[str, LazyTensor]]:
        ranks = {}
        for info, plan in self.plans.items():
            ranks[info] = {n: self._lazy(state_name, layout, info) for n, (state_name, layout) in plan.items()}
            if len(ranks) == 1:
                # Components are made in the order the writer takes a rank's tensors (a size cap cuts
                # them into files, which can reorder them a little); the files keep the plan's order,
                # as a save's do.
                order = write_order(list(plan.values()), self._nbytes)
                self.model.follow([state_name for state_name, _ in order])
        return ranks

    def _nbytes(self, item: tuple[str, ShardLayout]) -> int:
        return math.prod(item[1].shape) * self.model.state[item[0]].dtype.itemsize

    def _lazy(self, state_name: str, layout: ShardLayout, info: RankInfo) -> LazyTensor:
        meta = self.model.state[state_name]

        def produce() -> tuple[torch.Tensor, ...]:
            tensor = self.cache.take(state_name)
            self.left[info] -= 1
            if not self.left[info]:
                self.finish(info)
            if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != meta.dtype:
                # The header already written says otherwise: the save fails, nothing is published.
                raise ConvertRefused(
                    f"{state_name}: vLLM's loader made {list(tensor.shape)} {tensor.dtype}, but the model "
                    f"declares {list(meta.shape)} {meta.dtype}. {SAVE_INSTEAD}"
                )
            return rank_parts(tensor, layout, self.model.pool)

        return LazyTensor(tuple(layout.shape), meta.dtype, produce)

    def finish(self, info: RankInfo, error: BaseException | None = None) -> None:
        if info not in self.done:
            self.done.add(info)
            self.cache.rank_done(error)

    def placed(self, target: Store, entry: RankEntry) -> RankEntry:
        # Every rank is written (the save places after staging them all): a source file written
        # meanwhile could have given some tensors its old bytes and some its new ones.
        self.model.source.check_unchanged()
        info = self.by_position[(entry.tp_rank, entry.pp_rank, entry.dp_rank)]
        return self.model.carry_startup_artifacts(target, entry, info)


def _convert(
    folder: Store, output: Store, tp_size: int, pp_size: int, options: ConvertOptions, progress: ByteProgress | None
) -> ConvertResult:
    started = time.perf_counter()
    # A cold source is read while vLLM is imported and configured and its model built (seconds of
    # one core's work), not while the ranks wait for it; the components' own read-ahead takes over.
    stop_reading_ahead = read_ahead(folder)
    with contextlib.ExitStack() as stack:
        stack.callback(stop_reading_ahead)
        from ..engine.convert import converting

        # vLLM reads the config (and tokenizer) from a local folder: those few files are fetched from a
        # bucket; the weights are read where they are, each byte once.
        directory = folder.local_copy(folder.non_weight_files(), stack.enter_context(staging_folder()))
        # The manifest records the config the weights are made for, and the checkpoint carries config.json:
        # one written meanwhile (between vLLM's read and the carry's copy) would be carried beside weights
        # made for the other, a checkpoint that verifies and that loads refuse. The carry refuses it.
        config = record_of(directory.where, "config.json")
        model = stack.enter_context(converting(directory.where, folder.where, options.model))
        built = time.perf_counter()
        stop_reading_ahead()
        layers = config_layers(model.identity.config)
        if layers is None:
            layers = getattr(model.model_config.hf_text_config, "num_hidden_layers", None)
        plans = plan_ranks(model.state, model.geometry, model.tied, layers, tp_size, pp_size)
        takes: dict[str, int] = {}
        for plan in plans.values():
            for state_name, _ in plan.values():
                takes[state_name] = takes.get(state_name, 0) + 1
        # (every rank is staged in a thread of its own, wherever it goes)
        cache = ComponentCache(model, takes, options.budget, running=len(plans))
        stack.callback(cache.close)
        ranks = _Ranks(model, cache, plans)
        try:
            saved = SaveOptions(
                pattern=options.pattern,
                max_size=options.max_size,
                overwrite=options.overwrite,
                geometry={n: model.geometry[s].to_dict() for plan in plans.values() for n, (s, _) in plan.items()},
                tied=manifest_ties(model.tied),
                carry=directory,
                carried_record=config,
                progress=progress,
            )
            manifest = save_checkpoint(
                output,
                ranks.tensors(),
                dtype=model.dtype,
                source=model.identity,
                options=saved,
                hooks=RankHooks(parallel=True, ended=ranks.finish, placed=ranks.placed),
            )
        except RankStopped:
            # The save reports the first rank's error; a rank that only stopped for another's failure
            # would hide the failure itself (its type and what to do).
            if cache.failed is None or isinstance(cache.failed, RankStopped):
                raise
            raise cache.failed from None
        written = time.perf_counter()
        return ConvertResult(manifest, model.source.nbytes, cache.peak, cache.remakes, built - started, written - built)
