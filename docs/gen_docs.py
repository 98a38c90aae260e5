"""Generated parts of the documentation: the CLI reference (from the argument parsers), the
model-family table (from ``benchmarks/results/model_matrix.json``) and the error types with
their messages (from the package's raise sites).

    python docs/gen_docs.py            # rewrite the generated blocks of the three pages
    python docs/gen_docs.py --check    # exit 1 if a committed page differs from what is generated

A generated block sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``; the
prose around it is written by hand. ``tests/test_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MATRIX_JSON = ROOT / "benchmarks" / "results" / "model_matrix.json"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


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
}
PAGES = [DOCS / "cli.md", DOCS / "model-families.md", DOCS / "troubleshooting.md"]


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
