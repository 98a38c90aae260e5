"""The on-disk format: file names, the manifest schema, and the source-model identity.

A sharded checkpoint is a directory of safetensors files, one or more *parts* per
(pp_rank, tp_rank) worker, named exactly as vLLM names them, plus `sharded_state.json`,
the manifest, written last. Everything here is pure: no I/O beyond ``json`` text.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from typing import Any

MANIFEST_NAME = "sharded_state.json"
HASH_NAME = "blake3"
# Present from the start of a save until its manifest is published; also the lock
# that makes saves into one directory exclusive. A loader refuses a directory that has it.
LOCK_NAME = ".sharded_state.lock"
FORMAT_NAME = "vllm-sharded-state"
FORMAT_VERSION = 1

TP_ONLY_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
PP_AND_TP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
PATTERN_FIELDS = frozenset({"pp_rank", "tp_rank", "rank", "part"})

# Config keys that say nothing about the weights: they differ between the source
# directory and the saved one (paths), between transformers versions, or with
# --dtype, which we allow to differ (the loader casts).
VOLATILE_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"})


class ShardedStateError(ValueError):
    """A sharded checkpoint cannot be saved or loaded as asked.

    The message names the file or tensor, what was expected, what was found, and
    what to do. A ``ValueError`` so that vLLM reports it like its own loader errors.
    """


# --------------------------------------------------------------------------- names


def default_pattern(pp_size: int) -> str:
    """vLLM's default file pattern for a pipeline-parallel size.

    >>> default_pattern(1)
    'model-rank-{rank}-part-{part}.safetensors'
    """
    return PP_AND_TP_PATTERN if pp_size > 1 else TP_ONLY_PATTERN


def pattern_fields(pattern: str) -> set[str]:
    """The format fields a pattern uses; escaped braces (``{{x}}``) are literal text."""
    try:
        return {f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None}
    except ValueError as e:
        raise ShardedStateError(f"File pattern {pattern!r} is not a valid format string: {e}") from e


def validate_pattern(pattern: str, tp_size: int, pp_size: int) -> None:
    """Check a file pattern as vLLM does, plus that it names a plain file.

    Every active parallel dimension needs its rank field, otherwise ranks would write
    the same file and silently overwrite each other.
    """
    fields = pattern_fields(pattern)
    unsupported = fields - PATTERN_FIELDS
    if unsupported or "" in fields:
        raise ShardedStateError(
            f"File pattern {pattern!r} uses unsupported placeholder(s) {sorted(unsupported)}; "
            "supported fields are pp_rank, tp_rank, rank and part."
        )
    if "/" in pattern or "\\" in pattern or pattern.startswith("."):
        raise ShardedStateError(
            f"File pattern {pattern!r} must name a plain file inside the checkpoint directory "
            "(no path separators, no leading dot)."
        )
    if "part" not in fields:
        raise ShardedStateError(
            f"File pattern {pattern!r} has no {{part}} field; parts of one rank would overwrite "
            f"each other. Use {default_pattern(pp_size)!r}."
        )
    has_tp = "tp_rank" in fields or "rank" in fields
    if pp_size > 1:
        if "pp_rank" not in fields:
            raise ShardedStateError(
                f"File pattern {pattern!r} does not embed the pipeline parallel rank; with "
                f"pipeline parallelism every stage would write the same file. Use {PP_AND_TP_PATTERN!r}."
            )
    elif "pp_rank" in fields:
        raise ShardedStateError(
            f"File pattern {pattern!r} requires pipeline parallelism, but the pipeline "
            f"parallel size is 1. Use {TP_ONLY_PATTERN!r}."
        )
    if tp_size > 1 and not has_tp:
        raise ShardedStateError(
            f"File pattern {pattern!r} does not embed the tensor parallel rank; TP workers "
            "would overwrite each other's shards."
        )


def render_file_name(pattern: str, *, tp_rank: int, pp_rank: int, part: int) -> str:
    """The file name of one part of one rank (``rank`` is an alias of ``tp_rank``).

    >>> render_file_name(TP_ONLY_PATTERN, tp_rank=1, pp_rank=0, part=0)
    'model-rank-1-part-0.safetensors'
    """
    return pattern.format(pp_rank=pp_rank, tp_rank=tp_rank, rank=tp_rank, part=part)


def file_name_regex(pattern: str) -> re.Pattern[str]:
    """A regex matching every name the pattern can render, with a group per field.

    A field used twice (``{rank}`` and ``{tp_rank}`` are one value) must match the
    same number both times.
    """
    out: list[str] = []
    seen: set[str] = set()
    for literal, name, _, _ in string.Formatter().parse(pattern):
        out.append(re.escape(literal))
        if name is None:
            continue
        group = "tp_rank" if name == "rank" else name
        out.append(f"(?P={group})" if group in seen else f"(?P<{group}>[0-9]+)")
        seen.add(group)
    return re.compile("".join(out) + r"\Z")


def parse_file_name(pattern: str, name: str) -> dict[str, int] | None:
    """The (tp_rank, pp_rank, part) a file name was rendered from, or None.

    >>> parse_file_name(TP_ONLY_PATTERN, "model-rank-3-part-0.safetensors")
    {'tp_rank': 3, 'part': 0}
    """
    match = file_name_regex(pattern).match(name)
    return None if match is None else {k: int(v) for k, v in match.groupdict().items()}


# ------------------------------------------------------------------ source identity


def normalize_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a HF config that identifies the weights, as canonical JSON data."""
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    # Round-trip through JSON so tuples, numpy scalars and nested configs compare
    # the same way after a save and a reload.
    return json.loads(json.dumps(kept, sort_keys=True, default=str))


def config_sha256(config: dict[str, Any]) -> str:
    """Hash of :func:`normalize_config` of a HF config dict."""
    text = json.dumps(normalize_config(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def config_differences(saved: dict[str, Any], serving: dict[str, Any], limit: int = 8) -> list[str]:
    """Human-readable ``key: saved -> serving`` lines for differing config keys."""
    a, b = normalize_config(saved), normalize_config(serving)
    lines = [
        f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


# ------------------------------------------------------------------------ manifest


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of one rank lives: its part file, dtype, shape and byte offset.

    ``offset`` is the absolute position of its first byte in the file (None in manifests
    that did not record it); with it a resharding reader plans reads without headers.
    """

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int | None = None


@dataclass(frozen=True)
class FileChecksum:
    """Digests of consecutive ``block_size`` blocks of one file (the last may be short)."""

    algorithm: str
    block_size: int
    blocks: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"algorithm": self.algorithm, "block_size": self.block_size, "blocks": list(self.blocks)}


@dataclass(frozen=True)
class FileEntry:
    """One part file, its exact byte size and, if recorded, its block checksums."""

    name: str
    size: int
    checksum: FileChecksum | None = None


@dataclass(frozen=True)
class RankEntry:
    """What one (pp_rank, tp_rank) worker wrote."""

    tp_rank: int
    pp_rank: int
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorEntry]

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class SourceModel:
    """Identity of the model the checkpoint was saved from."""

    architecture: str
    config_sha256: str
    config: dict[str, Any] = field(default_factory=dict, compare=False)


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
    # How each tensor is split across TP ranks (JSON of resharding.TensorGeometry, by
    # name, the same for every rank), and groups of names saved once for several
    # (tied embeddings). Parsed only when a load reshards.
    geometry: dict[str, Any] = field(default_factory=dict, compare=False)
    tied: tuple[tuple[str, ...], ...] = ()

    def rank(self, tp_rank: int, pp_rank: int) -> RankEntry:
        """The entry of one worker; a :class:`ShardedStateError` if it is absent."""
        for entry in self.ranks:
            if entry.tp_rank == tp_rank and entry.pp_rank == pp_rank:
                return entry
        raise ShardedStateError(
            f"{MANIFEST_NAME} has no entry for pp_rank={pp_rank} tp_rank={tp_rank} "
            f"(it lists {len(self.ranks)} ranks for TP={self.tp_size} PP={self.pp_size}). "
            "The manifest is damaged: save the checkpoint again."
        )

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

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
        return json.dumps(data, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate a manifest; every defect is a :class:`ShardedStateError`."""
        data = load_json(text, where)
        reader = _Reader(where)
        obj = reader.mapping(data, "manifest")
        if obj.get("format") != FORMAT_NAME:
            raise ShardedStateError(
                f"{where}: 'format' is {obj.get('format')!r}, expected {FORMAT_NAME!r}; "
                "this is not a vllm-sharded-loader manifest."
            )
        version = reader.integer(obj, "format_version")
        if version != FORMAT_VERSION:
            raise ShardedStateError(
                f"{where}: format_version {version} is not supported (this vllm-sharded-loader "
                f"reads version {FORMAT_VERSION}); upgrade the package or save the checkpoint again."
            )
        tp_size = reader.integer(obj, "tp_size", minimum=1)
        pp_size = reader.integer(obj, "pp_size", minimum=1)
        pattern = reader.string(obj, "pattern")
        validate_pattern(pattern, tp_size, pp_size)
        src = reader.mapping(obj.get("source"), "source")
        source = SourceModel(
            architecture=reader.string(src, "architecture"),
            config_sha256=reader.string(src, "config_sha256"),
            config=reader.mapping(src.get("config", {}), "source.config"),
        )
        ranks = tuple(reader.rank(r) for r in reader.sequence(obj, "ranks"))
        geometry = reader.mapping(obj.get("geometry", {}), "geometry")
        tied = obj.get("tied", [])
        if not isinstance(tied, list) or not all(
            isinstance(g, list) and all(isinstance(n, str) for n in g) for g in tied
        ):
            raise reader.fail("'tied' must be a list of lists of tensor names")
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
        )
        check_manifest_consistency(manifest, where)
        return manifest


def rank_to_dict(entry: RankEntry) -> dict[str, Any]:
    """JSON data of one rank's entry (also the per-rank fragment written at save)."""
    return {
        "tp_rank": entry.tp_rank,
        "pp_rank": entry.pp_rank,
        "files": [file_to_dict(f) for f in entry.files],
        "tensors": {
            name: {"file": t.file, "dtype": t.dtype, "shape": list(t.shape)}
            | ({} if t.offset is None else {"offset": t.offset})
            for name, t in entry.tensors.items()
        },
    }


def file_to_dict(f: FileEntry) -> dict[str, Any]:
    data: dict[str, Any] = {"name": f.name, "size": f.size}
    if f.checksum is not None:
        data["checksum"] = f.checksum.to_dict()
    return data


def check_manifest_consistency(manifest: Manifest, where: str = MANIFEST_NAME) -> None:
    """Cross-field checks: every rank once, files unique, tensors point at listed files."""
    expected = {(pp, tp) for pp in range(manifest.pp_size) for tp in range(manifest.tp_size)}
    seen: set[tuple[int, int]] = set()
    owners: dict[str, tuple[int, int]] = {}
    for entry in manifest.ranks:
        key = (entry.pp_rank, entry.tp_rank)
        if key not in expected or key in seen:
            raise ShardedStateError(
                f"{where}: rank pp_rank={entry.pp_rank} tp_rank={entry.tp_rank} is "
                f"{'listed twice' if key in seen else 'outside the topology'} for "
                f"TP={manifest.tp_size} PP={manifest.pp_size}. Save the checkpoint again."
            )
        seen.add(key)
        names = {f.name for f in entry.files}
        for f in entry.files:
            if f.name in owners:
                raise ShardedStateError(f"{where}: file {f.name!r} is listed by two ranks {owners[f.name]} and {key}.")
            owners[f.name] = key
        for tensor_name, t in entry.tensors.items():
            if t.file not in names:
                raise ShardedStateError(
                    f"{where}: tensor {tensor_name!r} of pp_rank={entry.pp_rank} "
                    f"tp_rank={entry.tp_rank} points at {t.file!r}, which that rank does not list."
                )
    missing = sorted(expected - seen)
    if missing:
        raise ShardedStateError(
            f"{where}: ranks (pp_rank, tp_rank) {missing} are missing for TP={manifest.tp_size} "
            f"PP={manifest.pp_size}. Save the checkpoint again."
        )


def check_plain_file_name(name: str, where: str) -> str:
    """Refuse names that could escape the checkpoint directory."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name or name.startswith("."):
        raise ShardedStateError(
            f"{where}: file name {name!r} is not a plain file name inside the checkpoint directory; refusing it."
        )
    return name


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def load_json(text: str | bytes, where: str) -> Any:
    """Parse untrusted JSON; duplicate keys (which json would silently merge) are an error."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise ShardedStateError(f"{where} is not valid JSON ({e}). Save the checkpoint again.") from e


class _Reader:
    """Typed accessors for untrusted JSON data, raising :class:`ShardedStateError`."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str) -> ShardedStateError:
        return ShardedStateError(f"{self.where}: {what}. Save the checkpoint again.")

    def mapping(self, value: Any, what: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} must be an object, found {type(value).__name__}")
        return value

    def sequence(self, obj: dict[str, Any], key: str) -> list[Any]:
        value = obj.get(key)
        if not isinstance(value, list):
            raise self.fail(f"{key!r} must be a list, found {type(value).__name__}")
        return value

    def integer(self, obj: dict[str, Any], key: str, minimum: int = 0) -> int:
        value = obj.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(f"{key!r} must be an integer >= {minimum}, found {value!r}")
        return value

    def string(self, obj: dict[str, Any], key: str) -> str:
        value = obj.get(key)
        if not isinstance(value, str):
            raise self.fail(f"{key!r} must be a string, found {value!r}")
        return value

    def checksum(self, obj: dict[str, Any], file_name: str) -> FileChecksum | None:
        if "checksum" not in obj:
            return None
        c = self.mapping(obj["checksum"], f"checksum of {file_name!r}")
        blocks = self.sequence(c, "blocks")
        if not all(isinstance(b, str) for b in blocks):
            raise self.fail(f"checksum blocks of {file_name!r} must be strings")
        return FileChecksum(self.string(c, "algorithm"), self.integer(c, "block_size", minimum=1), tuple(blocks))

    def rank(self, value: Any) -> RankEntry:
        obj = self.mapping(value, "a rank entry")
        files = []
        for f in self.sequence(obj, "files"):
            f = self.mapping(f, "a file entry")
            name = check_plain_file_name(self.string(f, "name"), self.where)
            files.append(FileEntry(name=name, size=self.integer(f, "size"), checksum=self.checksum(f, name)))
        tensors = {}
        for name, t in self.mapping(obj.get("tensors"), "tensors").items():
            t = self.mapping(t, f"tensor {name!r}")
            shape = t.get("shape")
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
            ):
                raise self.fail(f"tensor {name!r} has shape {shape!r}, expected a list of sizes")
            offset = t.get("offset")
            if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int) or offset < 0):
                raise self.fail(f"tensor {name!r} has offset {offset!r}, expected a byte position")
            tensors[name] = TensorEntry(
                file=self.string(t, "file"), dtype=self.string(t, "dtype"), shape=tuple(shape), offset=offset
            )
        return RankEntry(
            tp_rank=self.integer(obj, "tp_rank"),
            pp_rank=self.integer(obj, "pp_rank"),
            files=tuple(files),
            tensors=tensors,
        )
