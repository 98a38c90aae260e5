"""``sharded_state.json``, the manifest: topology, files, tensors and source of a checkpoint, parsed
from untrusted text with every field checked (:meth:`Manifest.from_json`). Pure: no I/O."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .entries import (
    DIGEST_DIGITS,
    CarriedFile,
    FileChecksum,
    FileEntry,
    RankEntry,
    StartupArtifacts,
    TensorEntry,
    rank_to_dict,
)
from .errors import CheckpointCorrupt, CheckpointMismatch, InvalidOption
from .experts import ExpertPlacement, writing_replicas
from .geometry import TensorGeometry
from .names import (
    LOCK_NAME,
    MANIFEST_NAME,
    STARTUP_ARTIFACTS_PREFIX,
    check_carried_name,
    check_plain_file_name,
    is_staged_name,
    is_startup_artifacts_name,
    parse_file_name,
    validate_pattern,
)
from .signature import SIGNATURE_FIELD, Signature, signed_message
from .source import SourceModel
from .untrusted import MAX_BYTES, MAX_DIMS, JsonReader, is_int, is_shape, load_json

HASH_NAME = "blake3"
FORMAT_NAME = "vllm-sharded-state"
FORMAT_VERSION = 1

# Bounds checked before anything is allocated from a manifest: a hostile one must not make a
# loader build a billion-rank table, a file-sized buffer per thread, or names of any length.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_PARSE_EXPANSION = 12  # parsing may cost this many times the manifest's size in memory
MAX_RANKS = 1 << 16  # tp_size * pp_size
MAX_FILES_PER_RANK = 1 << 16
MAX_TENSORS_PER_RANK = 1 << 20
MAX_BLOCK_SIZE = 256 * 1024 * 1024  # each reader thread holds one block to verify it
MAX_CARRIED_FILES = 1 << 16
DIGEST_HEX = re.compile(r"[0-9a-f]{64}\Z")
CONTENT_DIGEST = re.compile(rf"[0-9a-f]{{{DIGEST_DIGITS}}}")


@dataclass(frozen=True)
class Manifest:
    """``sharded_state.json``: topology, files, tensors and source of a checkpoint."""

    tp_size: int
    pp_size: int
    dtype: str
    pattern: str
    source: SourceModel
    ranks: tuple[RankEntry, ...]
    format_version: int = FORMAT_VERSION
    # Each tensor's TensorGeometry as JSON, by name (parsed: :attr:`geometries`), and groups of
    # names saved once for several (tied embeddings).
    geometry: dict[str, Any] = field(default_factory=dict, compare=False)
    tied: tuple[tuple[str, ...], ...] = ()
    # The routed experts' placement under expert parallelism (None: without); the saving DP size.
    experts: ExpertPlacement | None = None
    dp_size: int = 1
    # Without expert parallelism under DP: experts cut across TP x DP, each replica writing its slices.
    experts_over_dp: bool = False
    # The non-weight files the save carried, by relative name; None: not recorded, not checked.
    carried_files: dict[str, CarriedFile] | None = None
    # Carried by the checkpoint this one replaced, not by this one: removed after the publish, recorded before.
    stale_files: tuple[str, ...] = ()
    # Who vouches for the carried code, and in a parsed manifest the message the signature signs.
    signature: Signature | None = field(default=None, compare=False)
    signed_message: bytes = field(default=b"", compare=False, repr=False)

    @property
    def expert_tp_size(self) -> int:
        """The TP size the stacked experts are cut at without expert parallelism (TP, or TP x DP)."""
        return self.tp_size * self.dp_size if self.experts_over_dp else self.tp_size

    @property
    def replicas(self) -> int:
        """How many data-parallel replicas wrote files (only the first, unless experts span replicas)."""
        return writing_replicas(self.experts, self.tp_size, self.dp_size, self.experts_over_dp)

    @cached_property
    def geometries(self) -> dict[str, TensorGeometry]:
        """:attr:`geometry` parsed and checked, once (:meth:`from_json` fills it as it validates)."""
        return {name: TensorGeometry.from_dict(g, name) for name, g in self.geometry.items()}

    def rank(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> RankEntry:
        """The entry of one worker; a :class:`ShardedStateError` if it is absent."""
        for entry in self.ranks:
            if (entry.tp_rank, entry.pp_rank, entry.dp_rank) == (tp_rank, pp_rank, dp_rank):
                return entry
        raise CheckpointCorrupt(
            f"{MANIFEST_NAME} has no entry for {rank_label(pp_rank, tp_rank, dp_rank)} "
            f"(it lists {len(self.ranks)} ranks for TP={self.tp_size} PP={self.pp_size}). "
            "The manifest is damaged: save the checkpoint again."
        )

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    def listed_files(self) -> set[str]:
        """Every file the manifest lists: each rank's parts and start-up artifacts."""
        parts = {f.name for entry in self.ranks for f in entry.files}
        return parts | {entry.startup.file for entry in self.ranks if entry.startup is not None}

    def to_json(self) -> str:
        """Serialize; the inverse of :meth:`from_json`."""
        data = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "dtype": self.dtype,
            "pattern": self.pattern,
            "source": {
                "architecture": self.source.architecture,
                "config_sha256": self.source.config_sha256,
                "config": self.source.config,
            },
            "ranks": [rank_to_dict(r) for r in self.ranks],
        }
        if self.geometry:
            data["geometry"] = self.geometry
        if self.tied:
            data["tied"] = [list(group) for group in self.tied]
        if self.experts is not None:
            data["expert_placement"] = self.experts.to_dict()
        if self.dp_size != 1:
            data["dp_size"] = self.dp_size
        if self.experts_over_dp:
            data["experts_over_dp"] = True
        if self.carried_files is not None:
            data["carried_files"] = {name: f.to_dict() for name, f in sorted(self.carried_files.items())}
        if self.stale_files:
            data["stale_files"] = list(self.stale_files)
        if self.signature is not None:
            data[SIGNATURE_FIELD] = self.signature.to_dict()
        return json.dumps(data, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate a manifest; every defect is a :class:`ShardedStateError`."""
        data = load_json(text, where, max_expansion=MAX_PARSE_EXPANSION)
        reader = JsonReader(where)
        obj = reader.mapping(data, "manifest")
        if obj.get("format") != FORMAT_NAME:
            raise CheckpointCorrupt(
                f"{where}: 'format' is {obj.get('format')!r}, expected {FORMAT_NAME!r}; "
                "this is not a vllm-sharded-loader manifest."
            )
        version = reader.integer(obj, "format_version")
        if version != FORMAT_VERSION:
            raise CheckpointMismatch(
                f"{where}: format_version {version} is not supported (this vllm-sharded-loader "
                f"reads version {FORMAT_VERSION}); upgrade the package or save the checkpoint again."
            )
        tp_size = reader.integer(obj, "tp_size", minimum=1)
        pp_size = reader.integer(obj, "pp_size", minimum=1)
        if tp_size * pp_size > MAX_RANKS:
            raise reader.fail(f"TP={tp_size} x PP={pp_size} is more than {MAX_RANKS} ranks")
        pattern = reader.string(obj, "pattern")
        src = reader.mapping(obj.get("source"), "source")
        source = SourceModel(
            architecture=reader.string(src, "architecture"),
            config_sha256=reader.string(src, "config_sha256"),
            config=reader.mapping(src.get("config", {}), "source.config"),
        )
        raw_ranks = reader.sequence(obj, "ranks")
        if len(raw_ranks) > MAX_RANKS:
            raise reader.fail(f"'ranks' lists {len(raw_ranks)} ranks, more than {MAX_RANKS}")
        ranks = tuple(_rank(reader, r) for r in raw_ranks)
        geometry = reader.mapping(obj.get("geometry", {}), "geometry")
        geometries = {name: TensorGeometry.from_dict(g, name, where) for name, g in geometry.items()}
        tied = obj.get("tied", [])
        if not isinstance(tied, list) or not all(
            isinstance(g, list) and all(isinstance(n, str) for n in g) for g in tied
        ):
            raise reader.fail("'tied' must be a list of lists of tensor names")
        experts = obj.get("expert_placement")
        manifest = cls(
            tp_size=tp_size,
            pp_size=pp_size,
            dtype=reader.string(obj, "dtype"),
            pattern=pattern,
            source=source,
            ranks=ranks,
            format_version=version,
            geometry=geometry,
            tied=tuple(tuple(g) for g in tied),
            experts=None if experts is None else ExpertPlacement.from_dict(experts, where),
            dp_size=reader.integer(obj, "dp_size", minimum=1, maximum=MAX_RANKS) if "dp_size" in obj else 1,
            experts_over_dp=reader.boolean(obj, "experts_over_dp") if "experts_over_dp" in obj else False,
            carried_files=_carried_files(reader, obj["carried_files"]) if "carried_files" in obj else None,
            stale_files=_stale_files(reader, obj.get("stale_files", [])),
            signature=Signature.from_dict(reader, obj[SIGNATURE_FIELD]) if SIGNATURE_FIELD in obj else None,
            signed_message=signed_message(obj) if SIGNATURE_FIELD in obj else b"",
        )
        manifest.__dict__["geometries"] = geometries  # the cached_property, parsed with messages naming `where`
        check_manifest_consistency(manifest, where)
        return manifest


def rank_label(pp_rank: int, tp_rank: int, dp_rank: int = 0) -> str:
    """``pp_rank=0 tp_rank=1``, with `` dp_rank=1`` for a later data-parallel replica's entry."""
    return f"pp_rank={pp_rank} tp_rank={tp_rank}" + (f" dp_rank={dp_rank}" if dp_rank else "")


def check_manifest_consistency(manifest: Manifest, where: str = MANIFEST_NAME) -> None:
    """Cross-field checks: every rank once, files unique and named for their rank, tensors
    point at listed files, the TP ranks of a stage list the same tensors, and a later replica's
    entry holds only what the first one's does."""
    replicas = manifest.replicas
    if manifest.experts_over_dp and (manifest.dp_size == 1 or manifest.experts is not None):
        raise CheckpointCorrupt(
            f"{where}: 'experts_over_dp' needs data parallelism without expert parallelism, but the manifest "
            f"records dp_size {manifest.dp_size} and expert placement {manifest.experts}. The manifest is damaged: "
            "save the checkpoint again."
        )
    if manifest.tp_size * manifest.pp_size * replicas > MAX_RANKS:
        raise CheckpointCorrupt(
            f"{where}: TP={manifest.tp_size} x PP={manifest.pp_size} x {replicas} replicas is more than "
            f"{MAX_RANKS} ranks. The manifest is damaged: save the checkpoint again."
        )
    try:
        validate_pattern(manifest.pattern, manifest.tp_size, manifest.pp_size, replicas)
    except InvalidOption as e:  # a bad option when saving; in a published manifest, damage
        raise CheckpointCorrupt(
            f"{where}: the file pattern does not fit the recorded topology (TP={manifest.tp_size} "
            f"PP={manifest.pp_size}, {replicas} writing replica(s)): {e} The manifest is damaged: save the "
            "checkpoint again."
        ) from e
    expected = {
        (pp, dp, tp) for pp in range(manifest.pp_size) for dp in range(replicas) for tp in range(manifest.tp_size)
    }
    seen: set[tuple[int, int, int]] = set()
    owners: dict[str, tuple[int, int, int]] = {}
    first: dict[tuple[int, int], set[str]] = {}
    for entry in manifest.ranks:
        key = (entry.pp_rank, entry.dp_rank, entry.tp_rank)
        if key not in expected or key in seen:
            raise CheckpointCorrupt(
                f"{where}: rank {rank_label(entry.pp_rank, entry.tp_rank, entry.dp_rank)} is "
                f"{'listed twice' if key in seen else 'outside the topology'} for "
                f"TP={manifest.tp_size} PP={manifest.pp_size}"
                + (f" and {replicas} data-parallel replicas" if replicas > 1 else "")
                + ". Save the checkpoint again."
            )
        seen.add(key)
        if entry.dp_rank == 0:
            first[(entry.pp_rank, entry.tp_rank)] = set(entry.tensors)
        _check_entry_files(manifest, entry, owners, where)
    if manifest.carried_files:
        # Carried records naming the checkpoint's own files: damage a reshard would refuse for ever.
        own = manifest.listed_files() | {MANIFEST_NAME, LOCK_NAME}
        wrong = sorted(n for n in manifest.carried_files if n in own or is_staged_name(n))
        if wrong:
            raise CheckpointCorrupt(
                f"{where}: 'carried_files' records {wrong[:3]}, the checkpoint's own files (its parts, start-up "
                "archives, manifest or lock), where a save records the non-weight files it carried beside its "
                "parts (config, tokenizer). The manifest is damaged: save the checkpoint again."
            )
    _check_ranks_complete(manifest, sorted(expected - seen), first, where)


def _check_entry_files(
    manifest: Manifest, entry: RankEntry, owners: dict[str, tuple[int, int, int]], where: str
) -> None:
    """One rank's files: unique across ranks (``owners``), named for their rank, holding its tensors."""
    key = (entry.pp_rank, entry.dp_rank, entry.tp_rank)
    rank = rank_label(entry.pp_rank, entry.tp_rank, entry.dp_rank)
    names = {f.name for f in entry.files}
    for f in entry.files:
        if f.name in owners:
            raise CheckpointCorrupt(f"{where}: file {f.name!r} is listed by two ranks {owners[f.name]} and {key}.")
        owners[f.name] = key
        # The name is the only record of the writer: swapped ranks would serve another rank's shards.
        parsed = parse_file_name(manifest.pattern, f.name)
        if parsed is None or any(
            parsed.get(k, v) != v
            for k, v in (("tp_rank", entry.tp_rank), ("pp_rank", entry.pp_rank), ("dp_rank", entry.dp_rank))
        ):
            raise CheckpointCorrupt(
                f"{where}: file {f.name!r} is listed by {rank}, but the pattern {manifest.pattern!r} does not "
                "name that rank's files so. The manifest is damaged: save the checkpoint again."
            )
    if entry.startup is not None:
        if entry.startup.file in owners:
            raise CheckpointCorrupt(
                f"{where}: the start-up artifacts {entry.startup.file!r} of {rank} are also listed by "
                f"{owners[entry.startup.file]}. The manifest is damaged: save the checkpoint again."
            )
        owners[entry.startup.file] = key
    for tensor_name, t in entry.tensors.items():
        if t.file not in names:
            raise CheckpointCorrupt(
                f"{where}: tensor {tensor_name!r} of {rank} points at {t.file!r}, which that rank does not list."
            )


def _check_ranks_complete(
    manifest: Manifest, missing: list[tuple[int, int, int]], first: dict[tuple[int, int], set[str]], where: str
) -> None:
    """No rank ``missing``, a stage's TP ranks listing the same tensors, later replicas only the first's."""
    replicas = manifest.replicas
    if missing:
        raise CheckpointCorrupt(
            f"{where}: ranks (pp_rank, dp_rank, tp_rank) {missing[:8]} are missing for TP={manifest.tp_size} "
            f"PP={manifest.pp_size}"
            + (f" and {replicas} data-parallel replicas" if replicas > 1 else "")
            + ". Save the checkpoint again."
        )
    for (pp_rank, tp_rank), names in first.items():
        # A tensor one TP rank lacks is damage a reshard (planning from tp_rank 0) would miss silently.
        if names != first[(pp_rank, 0)]:
            differ = sorted(names ^ first[(pp_rank, 0)])
            raise CheckpointCorrupt(
                f"{where}: {rank_label(pp_rank, tp_rank)} and {rank_label(pp_rank, 0)} list different tensors "
                f"({len(differ)}, such as {differ[:3]}), but every TP rank of a stage holds the same ones. The "
                "manifest is damaged: save the checkpoint again."
            )
    for entry in manifest.ranks:
        extra = sorted(set(entry.tensors) - first[(entry.pp_rank, entry.tp_rank)]) if entry.dp_rank else []
        if extra:
            raise CheckpointCorrupt(
                f"{where}: data-parallel replica {entry.dp_rank} (pp_rank={entry.pp_rank} tp_rank={entry.tp_rank}) "
                f"lists tensors replica 0 does not: {extra[:3]}. A later replica writes only its own experts. "
                "The manifest is damaged: save the checkpoint again."
            )


def _checksum(reader: JsonReader, obj: dict[str, Any], file_name: str) -> FileChecksum | None:
    if "checksum" not in obj:
        return None
    c = reader.mapping(obj["checksum"], f"checksum of {file_name!r}")
    blocks = reader.sequence(c, "blocks")
    if not all(isinstance(b, str) and DIGEST_HEX.match(b) for b in blocks):
        raise reader.fail(f"checksum blocks of {file_name!r} must be 64 hexadecimal digits each")
    block_size = reader.integer(c, "block_size", minimum=1)
    if block_size > MAX_BLOCK_SIZE:
        raise reader.fail(f"checksum block_size {block_size} of {file_name!r} is above {MAX_BLOCK_SIZE}")
    cells = max(1, -(-reader.integer(obj, "size") // block_size))
    if len(blocks) != cells:
        raise reader.fail(f"{file_name!r} has {len(blocks)} checksum blocks, but its size makes {cells}")
    return FileChecksum(reader.string(c, "algorithm"), block_size, tuple(blocks))


def _rank(reader: JsonReader, value: Any) -> RankEntry:
    obj = reader.mapping(value, "a rank entry")
    files = []
    raw_files, raw_tensors = reader.sequence(obj, "files"), reader.mapping(obj.get("tensors"), "tensors")
    if len(raw_files) > MAX_FILES_PER_RANK or len(raw_tensors) > MAX_TENSORS_PER_RANK:
        raise reader.fail(
            f"a rank lists {len(raw_files)} files and {len(raw_tensors)} tensors; at most "
            f"{MAX_FILES_PER_RANK} and {MAX_TENSORS_PER_RANK}"
        )
    for f in raw_files:
        f = reader.mapping(f, "a file entry")
        name = check_plain_file_name(reader.string(f, "name"), reader.where)
        size = reader.integer(f, "size")
        if size > MAX_BYTES:
            raise reader.fail(f"file {name!r} has size {size}, above {MAX_BYTES}")
        digest = None if f.get("digest") is None else reader.string(f, "digest")
        if digest is not None and not CONTENT_DIGEST.fullmatch(digest):
            raise reader.fail(f"'digest' of {name!r} must be {DIGEST_DIGITS} hexadecimal digits, found {digest[:40]!r}")
        files.append(FileEntry(name=name, size=size, checksum=_checksum(reader, f, name), digest=digest))
    tensors = {}
    for name, t in raw_tensors.items():
        t = reader.mapping(t, f"tensor {name!r}")
        shape = t.get("shape")
        if not is_shape(shape):
            raise reader.fail(
                f"tensor {name!r} has shape {shape!r}, expected a list of sizes "
                f"(at most {MAX_DIMS}, each up to {MAX_BYTES})"
            )
        offset = t.get("offset")
        if offset is not None and not (is_int(offset) and 0 <= offset <= MAX_BYTES):
            raise reader.fail(f"tensor {name!r} has offset {offset!r}, expected a byte position")
        tensors[name] = TensorEntry(
            file=reader.string(t, "file"), dtype=reader.string(t, "dtype"), shape=tuple(shape), offset=offset
        )
    return RankEntry(
        tp_rank=reader.integer(obj, "tp_rank"),
        pp_rank=reader.integer(obj, "pp_rank"),
        files=tuple(files),
        tensors=tensors,
        dp_rank=reader.integer(obj, "dp_rank") if "dp_rank" in obj else 0,
        startup=_startup(reader, obj["startup_artifacts"]) if "startup_artifacts" in obj else None,
    )


MAX_KEY_FIELDS = 64
MAX_KEY_LENGTH = 4096


def _startup(reader: JsonReader, value: Any) -> StartupArtifacts:
    obj = reader.mapping(value, "startup_artifacts")
    name = check_plain_file_name(reader.string(obj, "file"), reader.where)
    # A save removes the replaced manifest's files: any other name here would get deleted.
    if not is_startup_artifacts_name(name):
        raise reader.fail(f"startup_artifacts {name!r} is not named {STARTUP_ARTIFACTS_PREFIX}*.tar as saves name it")
    sha256 = reader.string(obj, "sha256")
    if not DIGEST_HEX.match(sha256):
        raise reader.fail(f"startup_artifacts {name!r}: 'sha256' must be 64 hexadecimal digits")
    key = reader.mapping(obj.get("key", {}), "startup_artifacts.key")
    if len(key) > MAX_KEY_FIELDS or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) + len(v) <= MAX_KEY_LENGTH for k, v in key.items()
    ):
        raise reader.fail(
            f"startup_artifacts {name!r}: 'key' must map at most {MAX_KEY_FIELDS} names to strings "
            f"(each under {MAX_KEY_LENGTH} characters)"
        )
    return StartupArtifacts(file=name, size=reader.integer(obj, "size"), sha256=sha256, key=dict(key))


def _carried_files(reader: JsonReader, value: Any) -> dict[str, CarriedFile]:
    obj = reader.mapping(value, "carried_files")
    if len(obj) > MAX_CARRIED_FILES:
        raise reader.fail(f"'carried_files' lists {len(obj)} files, more than {MAX_CARRIED_FILES}")
    carried = {}
    for name, f in obj.items():
        check_carried_name(name, reader.where)
        f = reader.mapping(f, f"carried file {name!r}")
        sha256 = reader.string(f, "sha256")
        if not DIGEST_HEX.match(sha256):
            raise reader.fail(f"carried file {name!r}: 'sha256' must be 64 hexadecimal digits, found {sha256!r}")
        size = f.get("size")
        if not (is_int(size) and 0 <= size <= MAX_BYTES):
            raise reader.fail(f"carried file {name!r}: 'size' must be a byte count, found {size!r}")
        carried[name] = CarriedFile(size=size, sha256=sha256)
    return carried


def _stale_files(reader: JsonReader, value: Any) -> tuple[str, ...]:
    if not (isinstance(value, list) and len(value) <= MAX_CARRIED_FILES and all(isinstance(n, str) for n in value)):
        raise reader.fail(f"'stale_files' must be a list of at most {MAX_CARRIED_FILES} file names")
    return tuple(check_carried_name(name, reader.where) for name in value)
