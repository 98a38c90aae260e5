"""``vllm-sharded convert``: a Hugging Face checkpoint written as per-rank sharded files, without an engine.

vLLM's model, built at TP=1 on the meta device, gives every tensor's name, fused layout and split.
Each component (a fused parameter and its source tensors) is made once, cut for every rank that
holds it and freed after its last slice, so memory holds a few components, never the model.
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
from ..storage.location import Store
from ..storage.oscalls import release_free_heap
from ..storage.progress import ByteProgress
from ..storage.staging_folders import staging_folder
from ..storage.tensors import torch_threads
from ..storage.writer import LazyTensor, write_order
from .offline import open_output

if TYPE_CHECKING:
    from ..checkpoint.meta_model import MetaModel
    from ..engine.convert import ConvertModel

# Bytes of components made and not yet freed: ranks that run ahead wait for the others.
DEFAULT_BUDGET = 128 * 1024**2
# Components made ahead of their ranks: keeps the maker busy while memory stays a few components.
AHEAD = 2


@dataclass
class _Made:
    tensors: dict[str, torch.Tensor]
    nbytes: int
    pending: int  # slices of its tensors not yet taken, over every rank


@dataclass
class ComponentCache:
    """Components made once and shared by the ranks' writer threads, freed after their last slice.

    One thread makes components (vLLM's loader on one model, never two at once), another checks
    them, while the ranks write; the next is made ahead if ``budget`` allows. A rank whose component
    does not fit waits, unless every other rank waits too: then components no waiting rank needs
    are freed and made again later (a source read twice rather than memory without bound). A
    failed make or check raises in the rank that takes the component.
    """

    model: MetaModel
    takes: dict[str, int]  # tensor -> how many ranks take a slice of it
    budget: int = DEFAULT_BUDGET
    made: dict[int, _Made] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)
    waiting: dict[int, int] = field(default_factory=dict)  # thread -> component it waits to make
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
        # Leave two cores per rank to its writer and checksums; extra OpenMP threads only spin.
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
            # glibc keeps these freed blocks fragmented across arenas unless handed back.
            release_free_heap()
        return tensor

    def _start(self, name: str, key: int) -> None:
        """Have the idle maker make ``name``'s component (the caller holds the lock)."""
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
            # Other ranks that can still take a slice (not waiting for an unmade component).
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
        """Start the next unmade component after ``name``'s, within :data:`AHEAD` and the budget."""
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
        """A rank takes nothing more; with ``failed``, every other rank stops at its next tensor."""
        with self.cond:
            self.running -= 1
            if failed is not None:
                self.failed = self.failed or failed
            self.cond.notify_all()

    def close(self) -> None:
        """Stop the helpers after their current component; nothing queued runs."""
        self.maker.shutdown(wait=True, cancel_futures=True)
        self.checker.shutdown(wait=True, cancel_futures=True)


@dataclass
class ConvertResult:
    manifest: Manifest
    source_bytes: int
    peak_component_bytes: int
    remade: int
    build_seconds: float  # vLLM's configuration and the meta model
    write_seconds: float  # reading, cutting and writing every rank


def plan_ranks(
    state: dict[str, torch.Tensor],
    geometry: dict[str, TensorGeometry],
    tied: list[list[str]],
    layers: int | None,
    tp_size: int,
    pp_size: int,
) -> dict[RankInfo, dict[str, tuple[str, ShardLayout]]]:
    """Every target rank's tensors: name -> (the state tensor it is cut from, the rank's layout).

    Refuses tensors whose split vLLM's layers do not describe at TP > 1, and sizes that do not divide.
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
    """``model``: the serving engine's ``LLM(...)`` arguments; ``revision`` of a Hub repo id; the save's
    ``max_size``, ``pattern``, ``overwrite``; ``budget``: bytes of components held at once."""

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

    Every check runs before a byte is written; the output is published by the save protocol,
    config and tokenizer carried.
    """
    if tp_size < 1 or pp_size < 1:
        raise InvalidOption(f"Sizes must be >= 1, got TP={tp_size} PP={pp_size}.")
    folder = resolve_source(source, options.revision)
    out = open_output(output, folder, "model")
    check_source_files(folder)
    # Refused now rather than after vLLM has built the model.
    out.refuse_before_save(options.overwrite)
    return _convert(folder, out, tp_size, pp_size, options, progress)


class _Ranks:
    """Every target rank's tensors as lazy takes from ``cache``; a rank is done after its last take
    (counted, not ordered) or when its writing ends."""

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
                # Components are made in the order the writer takes a rank's tensors.
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
        # All ranks are staged now: a source file changed meanwhile would mix old and new bytes.
        self.model.source.check_unchanged()
        info = self.by_position[(entry.tp_rank, entry.pp_rank, entry.dp_rank)]
        return self.model.carry_startup_artifacts(target, entry, info)


def _convert(
    folder: Store, output: Store, tp_size: int, pp_size: int, options: ConvertOptions, progress: ByteProgress | None
) -> ConvertResult:
    started = time.perf_counter()
    # Warm a cold source while vLLM builds the model.
    stop_reading_ahead = read_ahead(folder)
    with contextlib.ExitStack() as stack:
        stack.callback(stop_reading_ahead)
        from ..engine.convert import converting

        # vLLM needs the config and tokenizer locally; the weights are read where they are.
        directory = folder.local_copy(folder.non_weight_files(), stack.enter_context(staging_folder()))
        # The carry refuses a config.json changed after vLLM read it (weights made for another config).
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
            # Raise the failure itself, not a rank that only stopped for it.
            if cache.failed is None or isinstance(cache.failed, RankStopped):
                raise
            raise cache.failed from None
        written = time.perf_counter()
        return ConvertResult(manifest, model.source.nbytes, cache.peak, cache.remakes, built - started, written - built)
