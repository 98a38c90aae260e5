"""File names of a sharded checkpoint: vLLM's part patterns (one or more parts per rank), rendering
and parsing them, and the names a save stages under. Pure: no I/O."""

from __future__ import annotations

import itertools
import re
import string
from collections.abc import Iterable

from .errors import CheckpointCorrupt, InvalidOption

MANIFEST_NAME = "sharded_state.json"
# Held from a save's start until its manifest is published; a loader refuses a folder with it, no manifest.
LOCK_NAME = ".sharded_state.lock"

TP_ONLY_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
PP_AND_TP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
DP_AND_TP_PATTERN = "model-dp-{dp_rank}-rank-{rank}-part-{part}.safetensors"
PP_DP_AND_TP_PATTERN = "model-pp-{pp_rank}-dp-{dp_rank}-tp-{tp_rank}-part-{part}.safetensors"
DEFAULT_PATTERNS = (TP_ONLY_PATTERN, PP_AND_TP_PATTERN, DP_AND_TP_PATTERN, PP_DP_AND_TP_PATTERN)
# Staged names ``.<final>.<token>.partial``, exactly TOKEN_DIGITS hex digits: never a user's ``.a.2024.partial``.
STAGED_SUFFIX = ".partial"
TOKEN_DIGITS = 12
_STAGED = re.compile(rf"\.(?P<final>.+)\.(?P<token>[0-9a-f]{{{TOKEN_DIGITS}}})" + re.escape(STAGED_SUFFIX) + r"\Z")
PATTERN_FIELDS = frozenset({"pp_rank", "dp_rank", "tp_rank", "rank", "part"})
MAX_PATTERN_LENGTH = 255  # a file name
MAX_NUMBER_DIGITS = 18  # no save renders longer rank or part numbers; int() refuses over 4300 digits


def default_pattern(pp_size: int, replicas: int = 1) -> str:
    """vLLM's default file pattern for a pipeline-parallel size; with ``{dp_rank}`` if replicas write files.

    >>> default_pattern(1)
    'model-rank-{rank}-part-{part}.safetensors'
    >>> default_pattern(1, replicas=2)
    'model-dp-{dp_rank}-rank-{rank}-part-{part}.safetensors'
    """
    if replicas > 1:
        return PP_DP_AND_TP_PATTERN if pp_size > 1 else DP_AND_TP_PATTERN
    return PP_AND_TP_PATTERN if pp_size > 1 else TP_ONLY_PATTERN


def pattern_fields(pattern: str) -> set[str]:
    """The format fields a pattern uses; escaped braces (``{{x}}``) are literal text."""
    try:
        return {f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None}
    except ValueError as e:
        raise InvalidOption(f"File pattern {pattern!r} is not a valid format string: {e}") from e


def validate_pattern(pattern: str, tp_size: int, pp_size: int, replicas: int = 1) -> None:
    """Check a file pattern as vLLM does, plus that it names a plain file: every active parallel
    dimension (``replicas`` data-parallel ones write files) needs its rank field."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise InvalidOption(
            f"File pattern {pattern[:40]!r}... is {len(pattern)} characters; at most {MAX_PATTERN_LENGTH}."
        )
    try:
        parsed = list(string.Formatter().parse(pattern))
    except ValueError as e:
        raise InvalidOption(f"File pattern {pattern!r} is not a valid format string: {e}") from e
    if any(spec or conversion for _, name, spec, conversion in parsed if name is not None):
        # A spec ({rank:>999999999}) renders names of any length, or two ranks' names alike.
        raise InvalidOption(
            f"File pattern {pattern!r} uses a format spec or conversion; only plain fields such as "
            "{rank} and {part} are allowed."
        )
    for (_, first, _, _), (between, second, _, _) in itertools.pairwise(parsed):
        if first is not None and second is not None and (not between or between.isdigit()):
            # {rank}{part}: rank 1's part 10 and rank 11's part 0 are both ...110...
            raise InvalidOption(
                f"File pattern {pattern!r} puts {{{first}}} and {{{second}}} side by side, so their numbers run "
                "together and a file's name does not say which rank wrote it. Separate them with a character "
                f"that is not a digit, as in {default_pattern(pp_size)!r}."
            )
    fields = pattern_fields(pattern)
    unsupported = fields - PATTERN_FIELDS
    if unsupported or "" in fields:
        raise InvalidOption(
            f"File pattern {pattern!r} uses unsupported placeholder(s) {sorted(unsupported)}; "
            "supported fields are pp_rank, dp_rank, tp_rank, rank and part."
        )
    if "/" in pattern or "\\" in pattern or pattern.startswith("."):
        raise InvalidOption(
            f"File pattern {pattern!r} must name a plain file inside the checkpoint directory "
            "(no path separators, no leading dot)."
        )
    if "part" not in fields:
        raise InvalidOption(
            f"File pattern {pattern!r} has no {{part}} field; parts of one rank would overwrite "
            f"each other. Use {default_pattern(pp_size)!r}."
        )
    has_tp = "tp_rank" in fields or "rank" in fields
    if pp_size > 1:
        if "pp_rank" not in fields:
            raise InvalidOption(
                f"File pattern {pattern!r} does not embed the pipeline parallel rank; with "
                f"pipeline parallelism every stage would write the same file. Use {PP_AND_TP_PATTERN!r}."
            )
    elif "pp_rank" in fields:
        raise InvalidOption(
            f"File pattern {pattern!r} requires pipeline parallelism, but the pipeline "
            f"parallel size is 1. Use {TP_ONLY_PATTERN!r}."
        )
    if tp_size > 1 and not has_tp:
        raise InvalidOption(
            f"File pattern {pattern!r} does not embed the tensor parallel rank; TP workers "
            "would overwrite each other's shards."
        )
    if replicas > 1 and "dp_rank" not in fields:
        raise InvalidOption(
            f"File pattern {pattern!r} does not embed the data-parallel rank; under expert parallelism each of "
            f"the {replicas} replicas writes its own experts, and they would overwrite each other. Use "
            f"{default_pattern(pp_size, replicas)!r}."
        )
    if replicas == 1 and "dp_rank" in fields:
        raise InvalidOption(
            f"File pattern {pattern!r} embeds the data-parallel rank, but only one replica writes files (each "
            f"replica writes its own only for experts under expert parallelism). Use {default_pattern(pp_size)!r}."
        )


def render_file_name(pattern: str, *, tp_rank: int, pp_rank: int, part: int, dp_rank: int = 0) -> str:
    """The file name of one part of one rank (``rank`` is an alias of ``tp_rank``).

    >>> render_file_name(TP_ONLY_PATTERN, tp_rank=1, pp_rank=0, part=0)
    'model-rank-1-part-0.safetensors'
    """
    return pattern.format(pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank, rank=tp_rank, part=part)


def file_name_regex(pattern: str) -> re.Pattern[str]:
    """A regex matching every name the pattern can render, a group per field (``{rank}`` and
    ``{tp_rank}`` one group); a number over :data:`MAX_NUMBER_DIGITS` digits matches none."""
    out: list[str] = []
    seen: set[str] = set()
    for literal, name, _, _ in string.Formatter().parse(pattern):
        out.append(re.escape(literal))
        if name is None:
            continue
        group = "tp_rank" if name == "rank" else name
        out.append(f"(?P={group})" if group in seen else f"(?P<{group}>[0-9]{{1,{MAX_NUMBER_DIGITS}}})")
        seen.add(group)
    return re.compile("".join(out) + r"\Z")


def parse_file_name(pattern: str, name: str) -> dict[str, int] | None:
    """The (tp_rank, pp_rank, dp_rank, part) fields a file name was rendered from, or None.

    >>> parse_file_name(TP_ONLY_PATTERN, "model-rank-3-part-0.safetensors")
    {'tp_rank': 3, 'part': 0}
    """
    match = file_name_regex(pattern).match(name)
    return None if match is None else {k: int(v) for k, v in match.groupdict().items()}


def is_part_name(name: str, patterns: Iterable[str] = DEFAULT_PATTERNS) -> bool:
    """Whether ``name`` is a part file's name in one of ``patterns`` (by default vLLM's).

    >>> is_part_name("model-pp-1-tp-0-part-2.safetensors"), is_part_name("model.safetensors")
    (True, False)
    """
    return any(parse_file_name(p, name) is not None for p in patterns)


def file_rank(fields: dict[str, int]) -> tuple[int, int, int]:
    """The (tp_rank, pp_rank, dp_rank) of a parsed file name (fields a pattern lacks are 0)."""
    return fields.get("tp_rank", 0), fields.get("pp_rank", 0), fields.get("dp_rank", 0)


def check_plain_file_name(name: str, where: str) -> str:
    """Refuse names that could escape the checkpoint directory."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name or name.startswith("."):
        raise CheckpointCorrupt(
            f"{where}: file name {name!r} is not a plain file name inside the checkpoint directory; refusing it."
        )
    return name


def check_carried_name(name: str, where: str) -> str:
    """Refuse a carried file's name unless it is a relative path of plain parts (``1_Pooling/config.json``).

    >>> check_carried_name("1_Pooling/config.json", "sharded_state.json")
    '1_Pooling/config.json'
    """
    parts = name.split("/")
    if len(name) > 4096 or "\\" in name or "\x00" in name or any(p in ("", ".", "..") for p in parts):
        raise CheckpointCorrupt(
            f"{where}: carried file name {name!r} is not a relative path inside the checkpoint directory "
            "(absolute, empty, or with a '.' or '..' part); refusing it."
        )
    return name


def staged_name(final_name: str, token: str) -> str:
    """The hidden name a save writes ``final_name`` under until it publishes it.

    >>> staged_name("model-rank-0-part-0.safetensors", "ab12")
    '.model-rank-0-part-0.safetensors.ab12.partial'
    """
    return f".{final_name}.{token}{STAGED_SUFFIX}"


def staged_token(name: str) -> str | None:
    """The token of the save that staged a file of this name, or None for any other name."""
    match = _STAGED.match(name)
    return None if match is None else match.group("token")


def is_staged_name(name: str) -> bool:
    return staged_token(name) is not None


def fresh_part_names(
    pattern: str, count: int, taken: Iterable[str], *, tp_rank: int, pp_rank: int, dp_rank: int = 0
) -> list[str]:
    """Names for a rank's ``count`` new parts that collide with none of ``taken`` (the old checkpoint
    loads until the new manifest is published): from part 0 if free, else past this rank's highest.

    >>> fresh_part_names(TP_ONLY_PATTERN, 2, [], tp_rank=0, pp_rank=0)
    ['model-rank-0-part-0.safetensors', 'model-rank-0-part-1.safetensors']
    >>> old = ["model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    >>> fresh_part_names(TP_ONLY_PATTERN, 2, old, tp_rank=0, pp_rank=0)
    ['model-rank-0-part-1.safetensors', 'model-rank-0-part-2.safetensors']
    >>> fresh_part_names(TP_ONLY_PATTERN, 1, ["model-rank-0-part-1.safetensors"], tp_rank=0, pp_rank=0)
    ['model-rank-0-part-0.safetensors']
    """
    taken = set(taken)

    def names(first: int) -> list[str]:
        return [
            render_file_name(pattern, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, part=first + i)
            for i in range(count)
        ]

    if not taken.intersection(names(0)):
        return names(0)
    mine = (tp_rank, pp_rank, dp_rank)
    highest = -1
    for name in taken:
        fields = parse_file_name(pattern, name)
        if fields is not None and file_rank(fields) == mine:
            highest = max(highest, fields["part"])
    return names(highest + 1)


STARTUP_ARTIFACTS_PREFIX = "startup-artifacts-"


def startup_artifacts_name(tp_rank: int, pp_rank: int, dp_rank: int = 0) -> str:
    """The name of one rank's start-up (compile) artifacts (a save adds its :func:`token_name`)."""
    return f"{STARTUP_ARTIFACTS_PREFIX}pp{pp_rank}-tp{tp_rank}" + (f"-dp{dp_rank}" if dp_rank else "") + ".tar"


def token_name(name: str, token: str) -> str:
    """``name`` with a save's token before its extension: a name no published file has.

    >>> token_name("startup-artifacts-pp0-tp1.tar", "ab12")
    'startup-artifacts-pp0-tp1-ab12.tar'
    """
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}-{token}.{suffix}" if dot else f"{name}-{token}"


def is_startup_artifacts_name(name: str) -> bool:
    """Whether a checkpoint's file is one rank's start-up artifacts."""
    return name.startswith(STARTUP_ARTIFACTS_PREFIX) and name.endswith(".tar")
