"""What a worker's model held right after loading (:class:`LoadedState`), and its save through the
save driver (:class:`LoadedSave`).

A save asked for at start-up (``SHARDED_STATE_CAPTURE_DIR``) captures the loaded state to disk straight
from parameter memory; the save hook then publishes the capture, or rewrites it memory-mapped. Without a
capture, only live weights provably the loaded ones are saved. Weight updates through ``load_weights``
are counted: they make the capture stale.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from ..format.errors import InvalidOption, SaveRefused, ShardedStateError
from ..format.geometry import TensorGeometry
from ..format.manifest import Manifest, RankEntry
from ..format.names import default_pattern, validate_pattern
from ..format.source import SourceModel
from ..planning.topology import RankInfo
from ..storage.local import OpenFile, make_output_folder
from ..storage.location import Store
from ..storage.lock import hold_owner_marker, release_owner_marker
from ..storage.progress import ByteProgress
from ..storage.reader import ReadOptions
from ..storage.staged import StagedRank, discard_rank, new_token, open_staged_tensors, stage_rank
from .carry import CarriedFiles
from .protocol import SaveJob
from .save_proof import CAPTURE_DIR_ENV
from .state import manifest_ties
from .verify import verify_file_checksum

# Under the "vllm" logger (vLLM's logging configuration shows our lines), without importing vLLM here.
logger = logging.getLogger(f"vllm.plugins.{__name__}")

CAPTURE_PATTERN_ENV = "SHARDED_STATE_CAPTURE_PATTERN"
CAPTURE_MAX_SIZE_ENV = "SHARDED_STATE_CAPTURE_MAX_SIZE"
OVERWRITE_ENV = "SHARDED_STATE_OVERWRITE"


@dataclass
class LoadedState:
    """What a worker's model held right after its weights were loaded."""

    signature: dict[str, tuple[int, tuple[int, ...], torch.dtype]]
    source: SourceModel
    dtype: str
    quantization: str | None
    geometry: dict[str, Any] = field(default_factory=dict)
    tied: list[list[str]] = field(default_factory=list)
    rank: RankInfo | None = None
    # The names a later data-parallel replica writes (its own experts).
    per_replica: frozenset[str] = frozenset()
    capture: StagedRank | None = field(default=None)
    # Calls of load_weights since loading: nonzero means the capture is stale.
    updates: int = 0
    # The served model's local folder, whose non-weight files a save carries.
    model_folder: Store | None = None
    vllm_config: Any = field(default=None, repr=False)
    model_config: Any = field(default=None, repr=False)
    # The sharded checkpoint a weight update replaced every tensor from.
    reloaded_from: str | None = None
    # The store (and Hub repository id, if any) the sharded loader or the last update read.
    read_from: tuple[Store, str | None] | None = None
    # Digest of the manifest the served weights were read from: a re-read first proves it unchanged.
    read_proof: str | None = None
    # Identities of the weight files another load format read (no checksums to prove them by).
    source_files: dict[str, tuple[int, ...]] | None = None
    drop_capture: Callable[[], None] | None = field(default=None, repr=False)

    def capture_to(
        self, directory: str, pattern: str | None, max_size: int | None, tensors: dict[str, torch.Tensor], bar: bool
    ) -> None:
        """Stage the loaded ``tensors`` in ``directory`` under temporary names, with an owner marker that
        keeps other saves off them; both go at exit unless a save published the capture."""
        assert self.rank is not None
        token = new_token()
        make_output_folder(directory)
        owner = hold_owner_marker(directory, token)
        self.drop_capture = partial(self._drop_capture, directory, token, owner)
        atexit.register(self.drop_capture)
        with ByteProgress(f"Saving sharded_state ({self.rank})", bar) as progress:
            pattern = pattern or default_pattern(self.rank.pp_size, self.rank.replicas)
            self.capture = stage_rank(directory, tensors, self.rank, pattern, max_size, token, progress=progress)
        logger.info(
            "vllm_sharded_loader: %s saved %.1f MB in %d files to %s in %.3f s (%.2f GB/s, fsynced, checksummed)",
            self.rank,
            progress.nbytes / 1e6,
            len(self.capture.entry.files),
            directory,
            progress.seconds,
            progress.rate,
        )

    def _drop_capture(self, directory: str, token: str, owner: int) -> None:
        """Remove an unpublished capture, then its marker (a killed worker leaves both to the next save)."""
        atexit.unregister(self.drop_capture)
        self.drop_capture = None
        if self.capture is not None and self.capture.temporary:
            discard_rank(self.capture)
            self.capture = None
        release_owner_marker(directory, token, owner)

    def count_updates(self, model: torch.nn.Module) -> None:
        """Count later calls of ``model``'s ``load_weights``, through which every weight update goes.

        Wraps the instance, not the class. Counted before the call: a failed update changes state too.
        """
        original = model.load_weights
        if getattr(original, "_counts_updates", False):
            original = original.__wrapped__

        def load_weights(*args: Any, **kwargs: Any) -> Any:
            self.updates += 1
            return original(*args, **kwargs)

        load_weights._counts_updates = True  # type: ignore[attr-defined]
        load_weights.__wrapped__ = original  # type: ignore[attr-defined]
        model.__dict__["load_weights"] = load_weights

    def served_from_checkpoint(self, located: tuple[Store, str | None], proof: str | None = None) -> None:
        """Make the checkpoint ``located`` (its store, and Hub repository id if any) the loaded state after
        an update replaced every tensor from it; ``proof`` is the digest of the manifest it read. The
        start-up capture is stale and goes."""
        if self.capture is not None and self.capture.temporary:
            discard_rank(self.capture)
        self.capture = None
        self.reloaded_from = located[1] or located[0].where
        self.read_from = located
        self.read_proof = proof
        self.updates = 0

    def written_tensors(self, rank: RankInfo, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """All of ``tensors`` in the first data-parallel replica; in a later one, only its experts."""
        if rank.saved_dp_rank == 0:
            return tensors
        return {name: t for name, t in tensors.items() if name in self.per_replica}

    def reread_from_checkpoint(
        self, checkpoint: Store, manifest: Manifest, ranks_on_host: int
    ) -> dict[str, torch.Tensor]:
        """This rank's loaded state re-read from ``checkpoint`` without a model, checksummed, into host
        tensors mapped from the files where possible (no second copy in memory)."""
        from .load import load_rank
        from .request import LoadRequest
        from .update_staging import StagedWeights

        assert self.rank is not None
        meta = {
            name: torch.empty(shape, dtype=dtype, device="meta") for name, (_, shape, dtype) in self.signature.items()
        }
        staged = StagedWeights(meta, [])
        request = LoadRequest(
            checkpoint,
            manifest,
            "checksum",
            serving=self.source,
            geometry={name: TensorGeometry.from_dict(g, name) for name, g in self.geometry.items()},
            tied=self.tied,
        )
        # load_rank refuses if the manifest changed during the reads.
        load_rank(request, staged.targets(), self.rank, ReadOptions(ranks_on_host=ranks_on_host), staged.adopt())
        logger.info(
            "sharded_state: %s re-read its loaded state from %s without a model: %d of %d tensors mapped from its "
            "files",
            self.rank,
            checkpoint.where,
            len(staged.mapped),
            len(staged.tensors),
        )
        return staged.tensors


def capture_settings() -> tuple[str, str | None, int | None] | None:
    """(directory, pattern, max_size) asked through the environment, or None."""
    directory = os.environ.get(CAPTURE_DIR_ENV)
    if not directory:
        return None
    max_size = os.environ.get(CAPTURE_MAX_SIZE_ENV)
    try:
        size = int(max_size) if max_size else None
    except ValueError:
        raise InvalidOption(f"{CAPTURE_MAX_SIZE_ENV}={max_size!r} is not a number of bytes.") from None
    return directory, os.environ.get(CAPTURE_PATTERN_ENV) or None, size


class ServedWeights(Protocol):
    """The served weights: ``live`` if provably the loaded ones (else :class:`SaveRefused`), or ``reread``."""

    def live(self) -> dict[str, torch.Tensor]: ...

    def reread(self) -> dict[str, torch.Tensor]: ...


@dataclass
class LoadedSave:
    """One worker's save of its loaded state (``state``; None: ``unknown`` says why) through the save driver."""

    state: LoadedState | None
    unknown: SaveRefused
    weights: ServedWeights
    rank: RankInfo
    pattern: str
    max_size: int | None
    overwrite: bool = False

    def loaded(self) -> LoadedState:
        """The state recorded at load time, or the refusal that says why there is none."""
        if self.state is None:
            raise self.unknown
        return self.state

    def job(self, placed: Callable[[Store, RankEntry], RankEntry] | None = None) -> SaveJob:
        """The save driver's job; ``placed``: what the engine records beside each placed rank."""
        return SaveJob(
            self.stage,
            self.manifest,
            check=lambda: validate_pattern(self.pattern, self.rank.tp_size, self.rank.pp_size, self.rank.replicas),
            carry=self.carry,
            discard=self.discard,
            placed=placed,
            overwrite=self.overwrite,
            pattern=self.pattern,
        )

    def stage(self, target: Store) -> list[tuple[StagedRank, Any]]:
        """This worker's parts, staged for ``target``, with what the manifest needs of them."""
        loaded = self.loaded()
        capture = loaded.capture
        if target.stages_in_place:
            staging = target.staging()  # parts are renamed into place: staged in the output folder
        elif capture is not None and capture.temporary:
            staging = capture.directory  # a capture never published: uploaded from where it is
        else:
            # Not into a checkpoint an earlier save published here: that folder is not this save's.
            staging = target.staging()
        staged = self._stage_state(loaded, staging, target.token)
        if (staged.pattern, staged.max_size) != (self.pattern, self.max_size):
            staged = self._restage(open_staged_tensors(staged), staged.directory, target.token)
        return [(staged, (loaded.geometry, loaded.tied, loaded.rank and loaded.rank.experts))]

    def _restage(self, tensors: dict[str, torch.Tensor], path: str, token: str) -> StagedRank:
        return stage_rank(path, tensors, self.rank, self.pattern, self.max_size, token)

    def _stage_state(self, state: LoadedState, path: str, token: str) -> StagedRank:
        """Stage this rank's loaded state in ``path``: the capture itself if it fits, else a rewrite."""
        capture = state.capture
        if state.updates:
            # Only the live weights are current after an update.
            try:
                live = self.weights.live()
            except SaveRefused as e:
                raise SaveRefused(
                    f"Refusing to save: the weights were updated {state.updates} time(s) after loading (through "
                    "the model's load_weights), so the state captured at start-up is stale, and the live one cannot "
                    f"be proven to reload ({e}). Write the updated weights out in the Hugging Face format, start an "
                    f"engine from them with {CAPTURE_DIR_ENV}=<dir>, and save that engine."
                ) from e
            return self._restage(state.written_tensors(self.rank, live), path, token)
        if capture is not None and not capture.temporary:
            # Published earlier: another save may have replaced these files under the same names,
            # so only their checksums prove them ours.
            check_capture_content(capture)
            return self._restage(open_staged_tensors(capture), path, token)
        if capture is not None:
            in_place = os.path.isdir(path) and os.path.samefile(capture.directory, path)
            if in_place and (capture.pattern, capture.max_size) == (self.pattern, self.max_size):
                return capture
            return self._restage(open_staged_tensors(capture), path, token)
        try:
            live = self.weights.live()
        except SaveRefused as refused:
            # No capture, and the live weights are not the loaded state: the source still is.
            try:
                live = self.weights.reread()
            except SaveRefused:
                raise  # the source no longer holds what is served; that is the reason, said whole
            except Exception as e:
                raise SaveRefused(f"{refused} (Reading the source again failed too: {e}.)") from e
            logger.info(
                "sharded_state: %s re-read its loaded state from %s to save it", self.rank, state.source.architecture
            )
        return self._restage(state.written_tensors(self.rank, live), path, token)

    def manifest(self, outcomes: list[Any]) -> Manifest:
        """The manifest from every worker's (rank entry, (geometry, tied names, expert placement))."""
        state = self.loaded()
        placements = {p for _, (_, _, p) in outcomes if p is not None}
        if len(placements) > 1:
            raise SaveRefused(f"the ranks place their experts differently: {sorted(map(str, placements))}")
        return Manifest(
            tp_size=self.rank.tp_size,
            pp_size=self.rank.pp_size,
            dtype=state.dtype,
            pattern=self.pattern,
            source=state.source,
            ranks=tuple(sorted((entry for entry, _ in outcomes), key=lambda e: (e.pp_rank, e.dp_rank, e.tp_rank))),
            geometry={name: g for _, (geometry, _, _) in outcomes for name, g in geometry.items()},
            tied=manifest_ties(group for _, (_, tied, _) in outcomes for group in tied),
            experts=next(iter(placements), None),
            dp_size=self.rank.dp_size,
            experts_over_dp=self.rank.experts_over_dp,
        )

    def carry(self, carried: CarriedFiles) -> None:
        """Stage the served model's non-weight files (config, tokenizer) so the checkpoint serves by itself;
        they replace the output's copies just before the manifest."""
        if self.state is None or self.state.model_folder is None:
            logger.warning(
                "sharded_state: the served model is not a local folder; copy its config and tokenizer files to %s",
                carried.output,
            )
            return
        source = self.state.model_folder
        if source.same_as(carried.store):
            return
        changed = carried.stage(source)
        logger.info(
            "sharded_state: %d non-weight files of %s (config, tokenizer, ...) to replace", len(changed), source.where
        )

    def discard(self, staged: StagedRank) -> None:
        """After a failed save, remove what this worker staged or placed.

        A capture only staged stays for the next try; one placed under final names goes (no manifest lists it).
        """
        if self.state is not None and staged is self.state.capture:
            if not staged.placed:
                return
            self.state.capture = None
        discard_rank(staged)

    def keep(self, staged: StagedRank, in_place: bool) -> None:
        """After a publish, keep what the next save can start from.

        Parts published in place become the capture (proven by checksum before reuse); after an upload,
        only a capture that an earlier local save published stays.
        """
        state = self.loaded()
        capture = state.capture
        if in_place:
            if capture is not None and capture is not staged:
                discard_rank(capture)  # a capture staged elsewhere, now rewritten and published
            state.capture = staged
        elif capture is not None and (capture is staged or capture.temporary or state.updates):
            discard_rank(capture)
            state.capture = None
        state.updates = 0  # what was just published is what is served now


def check_capture_content(capture: StagedRank) -> None:
    """Refuse to save from a published capture whose files no longer hold what was captured."""
    how = (
        f"Another save has replaced the checkpoint this engine saved at start-up; restart the engine (with "
        f"{CAPTURE_DIR_ENV}) to save what it serves."
    )
    for path, f in zip(capture.paths(), capture.entry.files, strict=True):
        if f.checksum is None:
            raise SaveRefused(f"Refusing to save: {path} has no recorded checksum to prove it unchanged. {how}")
        try:
            with OpenFile.open(path) as opened:
                if opened.size != f.size:
                    raise SaveRefused(f"{path}: {opened.size} bytes, captured {f.size}")
                verify_file_checksum(opened, f.checksum)
        except (OSError, ShardedStateError) as e:
            raise SaveRefused(f"Refusing to save: the captured state is gone ({e}). {how}") from e
