"""Saving and loading one rank of a sharded checkpoint, without any engine.

The vLLM layer (:mod:`.loader`, :mod:`.capture`) finds out which rank it is and which
tensors the model has, then calls :func:`write_rank`, :func:`write_manifest` and
:func:`load_rank`. Tests call them directly on real files and real tensors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import reader, safetensors_io
from .format import (
    MANIFEST_NAME,
    FileChecksum,
    FileEntry,
    Manifest,
    RankEntry,
    ShardedStateError,
    SourceModel,
    config_differences,
    default_pattern,
    parse_file_name,
    validate_pattern,
)
from .integrity import BlockVerifier
from .planning import Piece, TensorSpec, TensorView, check_tensor_sets, unique_tensor_names

VERIFY_MODES = ("size", "checksum")


@dataclass(frozen=True)
class RankInfo:
    """Which worker this is in the tensor- and pipeline-parallel grid."""

    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1

    def __str__(self) -> str:
        return f"pp_rank={self.pp_rank} tp_rank={self.tp_rank} (TP={self.tp_size}, PP={self.pp_size})"


@dataclass(frozen=True)
class LoadStats:
    """What :func:`load_rank` did, for the log line and for tests."""

    files: tuple[str, ...]
    tensors: int
    bytes_read: int
    seconds: float
    cast: tuple[str, ...]
    with_manifest: bool
    # (tp_size, pp_size) the checkpoint was saved at, when this load resharded it.
    resharded_from: tuple[int, int] | None = None
    checkpoint_bytes: int = 0
    threads: int = 1
    bytes_mapped: int = 0  # of bytes_read, served from file mappings instead of copied


# ----------------------------------------------------------------------- state


def saveable_state(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of a state dict that a checkpoint holds: non-empty, each memory once."""
    tensors = {name: t for name, t in state_dict.items() if t.numel()}
    views = []
    for name, t in tensors.items():
        start = t.data_ptr()
        views.append(
            TensorView(
                name=name,
                storage=(str(t.device), t.untyped_storage().data_ptr()),
                start=start,
                end=start + t.numel() * t.element_size(),
                contiguous=t.is_contiguous(),
            )
        )
    return {name: tensors[name] for name in unique_tensor_names(views)}


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Shape and safetensors dtype name of each tensor."""
    return {name: TensorSpec(tuple(t.shape), safetensors_io.dtype_name(t.dtype)) for name, t in tensors.items()}


# ------------------------------------------------------------------------ load


def read_manifest(directory: str) -> Manifest | None:
    """The checkpoint's manifest, or None for a checkpoint written by vLLM's own save."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    return Manifest.from_json(text, where=path)


def containment_root(directory: str) -> str:
    """The folder a checkpoint's files may resolve into.

    The checkpoint folder itself, except in a Hugging Face cache, where a snapshot's
    files are symlinks into the same repository's ``blobs`` folder.
    """
    real = os.path.realpath(directory)
    snapshots, repo = os.path.dirname(real), os.path.dirname(os.path.dirname(real))
    if os.path.basename(snapshots) == "snapshots" and os.path.isdir(os.path.join(repo, "blobs")):
        return repo
    return real


def part_path(directory: str, name: str) -> str:
    """The path of a part file, refusing one that resolves outside the checkpoint directory."""
    path = os.path.join(directory, name)
    real, root = os.path.realpath(path), containment_root(directory)
    if os.path.commonpath([real, root]) != root:
        raise ShardedStateError(
            f"{path} resolves to {real}, outside the checkpoint directory {root} (a symlink or path "
            "that escapes it); refusing to read it. Copy the real file into the checkpoint."
        )
    return path


def check_not_locked(directory: str) -> None:
    """Refuse a directory whose save is running or was interrupted."""
    from .saving import describe_lock, read_lock

    holder = read_lock(directory)
    if holder is not None:
        raise ShardedStateError(
            f"{directory} is being saved or its save was interrupted: {describe_lock(directory, holder)} "
            f"exists and the checkpoint may mix two saves. Wait for the save to finish, or save it again "
            "(with overwrite)."
        )


def check_verify_mode(verify: str) -> str:
    if verify not in VERIFY_MODES:
        raise ShardedStateError(
            f"verify={verify!r} is not a verification mode; use 'size' (the default: manifest, file sizes "
            "and headers) or 'checksum' (also the checksum of every byte read)."
        )
    return verify


def _check_file_size(directory: str, f: FileEntry) -> None:
    path = part_path(directory, f.name)
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise ShardedStateError(
            f"{path}: listed in {MANIFEST_NAME} ({f.size} bytes) but missing. The checkpoint is "
            "incomplete: copy the missing file or save the checkpoint again."
        ) from None
    if size != f.size:
        raise ShardedStateError(
            f"{path}: {size} bytes on disk, but {MANIFEST_NAME} records {f.size}. The file is "
            f"{'truncated' if size < f.size else 'not the one that was saved'}: copy or save the checkpoint again."
        )


def check_topology(manifest: Manifest, rank: RankInfo, directory: str) -> None:
    """Refuse to serve a checkpoint at another TP/PP size than it was saved at."""
    if (manifest.tp_size, manifest.pp_size) != (rank.tp_size, rank.pp_size):
        raise ShardedStateError(
            f"{directory} was saved with tensor_parallel_size={manifest.tp_size} and "
            f"pipeline_parallel_size={manifest.pp_size}, but the engine runs "
            f"tensor_parallel_size={rank.tp_size} and pipeline_parallel_size={rank.pp_size}. "
            f"Serve it with --tensor-parallel-size {manifest.tp_size} --pipeline-parallel-size "
            f"{manifest.pp_size}, or save it again at the new sizes."
        )


def check_source(manifest: Manifest, serving: SourceModel, directory: str) -> None:
    """Refuse to load weights saved from another model than the one being served."""
    if manifest.source.architecture != serving.architecture or (manifest.source.config_sha256 != serving.config_sha256):
        diff = config_differences(manifest.source.config, serving.config)
        raise ShardedStateError(
            f"{directory}: the checkpoint was saved from a {manifest.source.architecture} with config "
            f"sha256 {manifest.source.config_sha256[:12]}, but the engine serves a "
            f"{serving.architecture} with config sha256 {serving.config_sha256[:12]}"
            + (f" (differences: {'; '.join(diff)})" if diff else "")
            + ". Serve it with the config.json saved beside it, or save the checkpoint again from this model."
        )


def _rank_files_without_manifest(directory: str, pattern: str, rank: RankInfo) -> list[str]:
    """This rank's files in a checkpoint written by vLLM's own save (no manifest).

    Files of ranks the engine does not have mean the checkpoint was saved at another
    topology; vLLM would load those "successfully" into narrowed parameters.
    """
    # A checkpoint saved under PP has files a TP-only pattern never matches.
    patterns = [pattern] if rank.pp_size > 1 else [pattern, default_pattern(2)]
    mine, foreign = [], []
    for name in sorted(os.listdir(directory)):
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
        raise ShardedStateError(
            f"{directory} holds files of ranks this engine does not have (for example "
            f"{foreign[0]!r}) while it runs tensor_parallel_size={rank.tp_size} and "
            f"pipeline_parallel_size={rank.pp_size}: the checkpoint was saved at another topology. "
            "Serve it at the sizes it was saved with, or save it again at the new sizes."
        )
    if not mine:
        raise ShardedStateError(
            f"{directory} has no file for {rank} matching {pattern!r} and no {MANIFEST_NAME}. "
            "Either this is not a sharded checkpoint (save one with examples/save_sharded_state.py), "
            "or it was saved at a smaller topology than the engine runs."
        )
    return mine


def load_rank(
    directory: str,
    targets: Mapping[str, torch.Tensor],
    rank: RankInfo,
    *,
    manifest: Manifest | None,
    serving: SourceModel | None = None,
    pattern: str | None = None,
    verify: str = "size",
    tied: Sequence[Sequence[str]] = (),
    threads: int = reader.DEFAULT_THREADS,
    progress: Callable[[int, int], None] | None = None,
    huge_pages: bool = False,
    adopt: Mapping[str, Callable[[torch.Tensor], None]] | None = None,
) -> LoadStats:
    """Check a rank's saved files against the model, then read them into ``targets``.

    ``targets`` maps each tensor name to the tensor it loads into (the model's
    :func:`saveable_state`). Every check runs before the first byte is copied, so a
    refused checkpoint leaves the parameters untouched. With ``verify="checksum"``
    every byte read is also hashed and compared with the manifest; a mismatch raises
    before the load returns (the engine then does not start).

    A checkpoint saved at another TP/PP size is resharded (:func:`load_resharded`) if
    its manifest records the geometry; ``tied`` names groups of tensors the serving
    model shares (tied embeddings), so a tensor saved under one name serves the others.
    ``threads``, ``progress`` and ``huge_pages`` go to :func:`.reader.read_pieces`.
    ``adopt`` maps tensor names to callbacks that take a tensor over a private mapping
    of the file in place of the target (see :func:`.reader.read_pieces`); a
    same-topology load uses them, a resharding load reads every tensor.
    """
    started = time.perf_counter()
    where = f"{directory} ({rank})"
    check_verify_mode(verify)
    check_not_locked(directory)
    expected = tensor_specs(targets)
    checksums: dict[str, FileChecksum | None] = {}
    if manifest is None and verify == "checksum":
        raise ShardedStateError(
            f"{directory} has no {MANIFEST_NAME} (a checkpoint of vLLM's own save), so there are no "
            "checksums to verify; load it with verify='size' or save it again with vllm-sharded-loader."
        )
    if manifest is not None and (manifest.tp_size, manifest.pp_size) != (rank.tp_size, rank.pp_size):
        if not manifest.geometry:
            check_topology(manifest, rank, directory)  # raises: nothing to reshard with
        if serving is not None:
            check_source(manifest, serving, directory)
        return load_resharded(
            directory,
            manifest,
            targets,
            rank,
            verify=verify,
            tied=tied,
            started=started,
            threads=threads,
            progress=progress,
            huge_pages=huge_pages,
        )
    if manifest is not None:
        if serving is not None:
            check_source(manifest, serving, directory)
        entry = manifest.rank(rank.tp_rank, rank.pp_rank)
        for f in entry.files:
            _check_file_size(directory, f)
        saved = {name: TensorSpec(t.shape, t.dtype) for name, t in entry.tensors.items()}
        cast = check_tensor_sets(
            expected, saved, where, hint="The checkpoint was saved from a different model; save it again."
        )
        headers = [safetensors_io.read_header(part_path(directory, f.name)) for f in entry.files]
        for header in headers:
            _check_header_matches_manifest(header, entry)
        if verify == "checksum":
            for f, header in zip(entry.files, headers, strict=True):
                if f.checksum is None:
                    raise ShardedStateError(
                        f"{header.path}: {MANIFEST_NAME} records no checksum for it, so verify='checksum' "
                        "cannot check it; save the checkpoint again, or load with verify='size'."
                    )
                checksums[header.path] = f.checksum
    else:
        pattern = pattern or default_pattern(rank.pp_size)
        validate_pattern(pattern, rank.tp_size, rank.pp_size)
        names = _rank_files_without_manifest(directory, pattern, rank)
        headers = [safetensors_io.read_header(part_path(directory, n)) for n in names]
        saved = {}
        owner: dict[str, str] = {}
        for header in headers:
            for name, h in header.tensors.items():
                if name in owner:
                    raise ShardedStateError(
                        f"{where}: tensor {name!r} is stored in both {owner[name]} and {header.path}; "
                        "the directory mixes two saves. Remove the stale files or save it again."
                    )
                owner[name] = header.path
                saved[name] = TensorSpec(h.shape, h.dtype)
        cast = check_tensor_sets(
            expected,
            saved,
            where,
            hint="The checkpoint was written by vLLM's own save (no manifest); on CPU that save "
            "drops every linear weight. Save it again with examples/save_sharded_state.py.",
        )
    read = reader.read_files(
        headers, targets, checksums, adopt, threads=threads, progress=progress, huge_pages=huge_pages
    )
    return LoadStats(
        files=tuple(h.path for h in headers),
        tensors=len(targets),
        bytes_read=read.bytes_read,
        seconds=time.perf_counter() - started,
        cast=tuple(cast),
        with_manifest=manifest is not None,
        threads=read.threads,
        bytes_mapped=read.bytes_mapped,
    )


# Bytes of temporaries a resharding load holds at once to join rows (see ReshardSource.read).
GATHER_BYTES = 256 * 1024 * 1024


@dataclass
class _ReadBatch:
    """One :func:`.reader.read_pieces` call of a resharding load, and the row joins after it."""

    pieces: list[Piece] = field(default_factory=list)
    targets: list[reader.Target] = field(default_factory=list)
    copies: list[tuple[torch.Tensor, Any, torch.Tensor]] = field(default_factory=list)
    gathered: int = 0

    def add(self, target: reader.Target) -> int:
        self.targets.append(target)
        return len(self.targets) - 1


def _gathers(read: Any, target: torch.Tensor) -> bool:
    """Whether a planned read is contiguous in the file but strided (several rows) in the target."""
    # The planner pairs source and destination runs one to one; rows that follow each
    # other in the file (stride == length) are one contiguous range.
    return read.dest.count > 1 and read.source.stride == read.source.length and target.is_contiguous()


class ReshardSource:
    """A checkpoint opened for planned reads at another topology (see :mod:`.resharding`).

    Indexes the manifest's tensors with their geometry, plans a serving rank's reads, and
    fills tensors from those plans. Each file is checked (size, header against the
    manifest) the first time a plan touches it; with ``verify="checksum"`` every
    checksum block a read touches is verified as it is read.
    """

    def __init__(self, directory: str, manifest: Manifest, verify: str = "size") -> None:
        from .resharding import SavedRank, SavedTensor, TensorGeometry

        self.directory, self.manifest, self.verify = directory, manifest, check_verify_mode(verify)
        self.saved, self.dtypes, self.owners = [], {}, {}
        self.checked: dict[str, str] = {}  # file name -> path, once checked
        for entry in manifest.ranks:
            tensors = {}
            for name, t in entry.tensors.items():
                if t.offset is None:
                    raise ShardedStateError(
                        f"{directory}: {MANIFEST_NAME} records no byte offset for {name!r}, so the checkpoint cannot "
                        f"be resharded; serve it at TP={manifest.tp_size} PP={manifest.pp_size} or save it again."
                    )
                g = manifest.geometry.get(name)
                geometry = None if g is None else TensorGeometry.from_dict(g, name)
                itemsize = safetensors_io.torch_dtype(t.dtype, name).itemsize
                tensors[name] = SavedTensor(t.file, t.offset, itemsize, tuple(t.shape), geometry)
                self.dtypes[name] = t.dtype
            for f in entry.files:
                self.owners[f.name] = (f, entry)
            self.saved.append(SavedRank(entry.tp_rank, entry.pp_rank, tensors))

    def plan(self, needed: Sequence[str], rank: RankInfo, tied: Sequence[Sequence[str]] = ()) -> Any:
        """The :class:`~.resharding.ReadPlan` giving ``rank`` the tensors ``needed``."""
        from .resharding import plan_reads

        return plan_reads(
            self.saved,
            self.manifest.tp_size,
            list(needed),
            tp_size=rank.tp_size,
            tp_rank=rank.tp_rank,
            pp_rank=rank.pp_rank,
            tied=[*self.manifest.tied, *tied],
        )

    def stored_dtype(self, tensor_plan: Any) -> torch.dtype:
        return safetensors_io.torch_dtype(self.dtypes[tensor_plan.source_name], tensor_plan.name)

    def check_file(self, name: str) -> str:
        """Check a saved file the first time a plan touches it (size, header against the manifest); its path."""
        if name not in self.checked:
            f, entry = self.owners[name]
            _check_file_size(self.directory, f)
            header = safetensors_io.read_header(part_path(self.directory, name))
            _check_header_matches_manifest(header, entry)
            if self.verify == "checksum" and f.checksum is None:
                raise ShardedStateError(f"{header.path}: {MANIFEST_NAME} records no checksum for it.")
            self.checked[name] = header.path
        return self.checked[name]

    def read(
        self,
        plans: Mapping[str, Any],
        targets: Mapping[str, torch.Tensor],
        *,
        threads: int = reader.DEFAULT_THREADS,
        progress: Callable[[int, int], None] | None = None,
        huge_pages: bool = False,
    ) -> reader.ReadStats:
        """Fill ``targets`` from their :class:`~.resharding.TensorPlan` (cast if the saved dtype differs).

        With ``verify="checksum"`` every checksum block the plans touch is read whole and
        verified; blocks they do not touch are not read.
        """
        files = sorted({r.file for p in plans.values() for r in p.reads})
        index = {name: i for i, name in enumerate(files)}
        paths = [self.check_file(name) for name in files]
        checksums = {index[n]: self.owners[n][0].checksum for n in files} if self.verify == "checksum" else {}
        batch = _ReadBatch()
        batches = [batch]
        for name, tensor_plan in plans.items():
            stored, target = self.stored_dtype(tensor_plan), targets[name]
            size = stored.itemsize
            zero_runs = [run for zeros in tensor_plan.zero_fills for run in zeros.runs()]
            dest = batch.add(reader.Target(target, stored, zero_runs))
            for r in tensor_plan.reads:
                file = index[r.file]
                if not _gathers(r, target):
                    for (src, src_end), (dst, _) in zip(r.source.runs(), r.dest.runs(), strict=True):
                        batch.pieces.append(Piece(file, src, src_end - src, dest, dst * size, size))
                    continue
                # Contiguous bytes in the file that land as strided rows (a dim-1 split being
                # joined): one read into a temporary, one strided copy, instead of a read per
                # row. Temporaries are bounded per batch.
                if batch.gathered and batch.gathered + r.source.total > GATHER_BYTES:
                    batch = _ReadBatch()
                    batches.append(batch)
                    dest = batch.add(reader.Target(target, stored))
                temp = torch.empty(r.source.total // size, dtype=stored)
                at = batch.add(reader.Target(temp, stored))
                batch.pieces.append(Piece(file, r.source.offset, r.source.total, at, 0, size))
                batch.copies.append((temp, r.dest, target))
                batch.gathered += r.source.total
        total, spans, huge = 0, 0, False
        for batch in batches:
            stats = reader.read_pieces(
                paths,
                batch.pieces,
                batch.targets,
                checksums=checksums,
                verify="touched",
                threads=threads,
                progress=progress,
                huge_pages=huge_pages,
            )
            for temp, dest_runs, target in batch.copies:
                rows = target.view(-1).as_strided(
                    (dest_runs.count, dest_runs.length), (dest_runs.stride, 1), dest_runs.offset
                )
                rows.copy_(temp.view(dest_runs.count, dest_runs.length))
            batch.copies.clear()
            total, spans, huge = total + stats.bytes_read, spans + stats.spans, huge or stats.huge_pages
        return reader.ReadStats(total, spans, threads, huge)

    def fill(self, tensor_plan: Any, target: torch.Tensor) -> None:
        """Read one planned tensor into ``target`` (cast if its dtype differs from the saved one)."""
        self.read({tensor_plan.name: tensor_plan}, {tensor_plan.name: target})

    def close(self) -> None:
        self.checked.clear()

    def __enter__(self) -> ReshardSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_resharded(
    directory: str,
    manifest: Manifest,
    targets: Mapping[str, torch.Tensor],
    rank: RankInfo,
    *,
    verify: str = "size",
    tied: Sequence[Sequence[str]] = (),
    started: float | None = None,
    threads: int = reader.DEFAULT_THREADS,
    progress: Callable[[int, int], None] | None = None,
    huge_pages: bool = False,
) -> LoadStats:
    """Fill a rank's tensors from a checkpoint saved at another TP/PP size.

    Plans exactly the byte ranges this rank keeps, checks the files it touches, then
    reads those ranges straight into the parameters: a rank never reads bytes it does
    not keep. Every planned shape is checked against the model before any read.
    """
    started = time.perf_counter() if started is None else started
    with ReshardSource(directory, manifest, verify) as source:
        plan = source.plan(list(targets), rank, tied)
        wrong = [
            f"{n} planned {list(p.shape)} but the model expects {list(targets[n].shape)}"
            for n, p in plan.tensors.items()
            if tuple(p.shape) != tuple(targets[n].shape)
        ]
        if wrong:
            raise ShardedStateError(
                f"{directory} ({rank}, resharded from TP={manifest.tp_size} PP={manifest.pp_size}): shape "
                f"mismatch: {'; '.join(wrong[:5])}. Save the checkpoint again."
            )
        for name in plan.files:
            source.check_file(name)  # every check before the first byte lands in a parameter
        read = source.read(plan.tensors, targets, threads=threads, progress=progress, huge_pages=huge_pages)
        cast = [n for n, p in plan.tensors.items() if targets[n].dtype != source.stored_dtype(p)]
    return LoadStats(
        files=tuple(os.path.join(directory, n) for n in plan.files),
        tensors=len(plan.tensors),
        bytes_read=plan.bytes_read,
        seconds=time.perf_counter() - started,
        cast=tuple(cast),
        with_manifest=True,
        resharded_from=(manifest.tp_size, manifest.pp_size),
        checkpoint_bytes=manifest.nbytes,
        threads=read.threads,
    )


def _check_header_matches_manifest(header: safetensors_io.Header, entry: RankEntry) -> None:
    name = os.path.basename(header.path)
    listed = {t: e for t, e in entry.tensors.items() if e.file == name}
    if set(listed) != set(header.tensors):
        extra = sorted(set(header.tensors) - set(listed))
        absent = sorted(set(listed) - set(header.tensors))
        raise ShardedStateError(
            f"{header.path}: holds tensors {extra[:5]} not in {MANIFEST_NAME} and lacks {absent[:5]} "
            "that it lists; the file is not the one that was saved. Copy or save the checkpoint again."
        )
    for tensor_name, e in listed.items():
        h = header.tensors[tensor_name]
        if (h.dtype, h.shape) != (e.dtype, tuple(e.shape)):
            raise ShardedStateError(
                f"{header.path}: tensor {tensor_name!r} is {h.dtype}{list(h.shape)} in the file but "
                f"{e.dtype}{list(e.shape)} in {MANIFEST_NAME}; copy or save the checkpoint again."
            )


# ---------------------------------------------------------------------- offline


def verify_file_checksum(path: str, checksum: FileChecksum) -> None:
    """Stream a whole file through its block checksums; raises on the first bad block."""
    verifier = BlockVerifier(path, checksum)
    buffer = bytearray(safetensors_io.CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            verifier.update(view[:n])
    verifier.finish()


def verify_checkpoint(directory: str, checksums: bool = True) -> list[str]:
    """Every problem of a checkpoint on disk, one line each naming the file; empty when sound.

    Checks what a load checks for every rank (lock, manifest, file presence, sizes,
    symlinks, headers against the manifest) and, with ``checksums``, every byte.
    Also reports parts the manifest does not list (left by an older save).
    """
    problems: list[str] = []
    try:
        check_not_locked(directory)
    except ShardedStateError as e:
        problems.append(str(e))
    try:
        manifest = read_manifest(directory)
    except ShardedStateError as e:
        return [*problems, str(e)]
    if manifest is None:
        return [
            *problems,
            f"{os.path.join(directory, MANIFEST_NAME)}: missing; the checkpoint is incomplete "
            f"or was written by vLLM's own save, and cannot be verified.",
        ]
    listed = set()
    for entry in manifest.ranks:
        for f in entry.files:
            listed.add(f.name)
            try:
                _check_file_size(directory, f)
                header = safetensors_io.read_header(part_path(directory, f.name))
                _check_header_matches_manifest(header, entry)
                if checksums:
                    if f.checksum is None:
                        raise ShardedStateError(f"{header.path}: {MANIFEST_NAME} records no checksum for it.")
                    verify_file_checksum(header.path, f.checksum)
            except ShardedStateError as e:
                problems.append(str(e))
    for name in sorted(os.listdir(directory)):
        if name not in listed and parse_file_name(manifest.pattern, name) is not None:
            problems.append(
                f"{os.path.join(directory, name)}: a part that {MANIFEST_NAME} does not list (left by an older "
                "save?); our loader ignores it but vLLM's own loader would read it. Remove it."
            )
    return problems
