"""The documentation: the site builds strictly, its generated pages are current, the README
stays short and self-contained, and every Python and shell snippet of the README and of
``docs/*.md`` runs.

Snippets are run as a reader would run them, each in its own process from the repository
root, in the order of the README and then of the site's navigation. A snippet that starts an
engine, in Python or as one ``vllm-sharded ...`` or ``python SCRIPT.py ...`` command, is forked
from the engine tests' fork server (vLLM imported once) and runs eager, as the engine tests do:
``LLM(...)`` defaults to ``enforce_eager=True`` there, and a save command gets ``--enforce-eager``. Paths written
``/path/to/NAME`` are one shared folder per test session: ``/path/to/hf-model`` is the tiny
Llama of ``examples/tiny_models.py``, and what one snippet saves (``/path/to/sharded``) the
next ones serve. A snippet identical to one that already passed is not run again.

The line after a snippet's closing fence may say how to test it:

- ``<!-- test: engine -->``: it starts a vLLM engine, or reads what one saved; it carries the
  ``engine`` marker of the engine tests;
- ``<!-- test: skip: REASON -->``: not run, for the reason given (a GPU, a bucket, a server
  that runs until stopped, a benchmark of many minutes).

Any other snippet must run without an engine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from docs import gen_docs
from examples.tiny_models import build_model, engine_environment
from tests.support import ROOT
from tests.support.engines import FAST, EngineRun, run_python
from tests.support.forkserver import EAGER_ENV

RUNNABLE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)")
ANNOTATION = re.compile(r"^\s*<!-- test: (?P<kind>engine|skip)(?P<rest>.*?)-->\s*$")
PLACEHOLDER = re.compile(r"/path/to/(?P<name>[\w.-]+)")
TP_SIZE = re.compile(r"(?:tensor_parallel_size[\"']?\s*[=:]\s*|--tensor-parallel-size\s+|-tp\s+)(\d+)")
SNIPPET_TIMEOUT = 900


@dataclass(frozen=True)
class Snippet:
    path: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str  # "python" or "bash"
    code: str
    kind: str  # "run", "engine" or "skip"
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def pages() -> list[Path]:
    """The README, then every page of the site in its navigation order, then any page not in it."""
    import yaml

    def walk(nav) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [p for value in nav.values() for p in walk(value)]
        return [p for item in nav for p in walk(item)]

    class Loader(yaml.SafeLoader):  # mkdocs.yml's own tags (``!relative``) do not matter here
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    ordered = [ROOT / "docs" / name for name in walk(config["nav"])]
    rest = sorted(p for p in (ROOT / "docs").rglob("*.md") if p not in ordered)
    return [ROOT / "README.md", *ordered, *rest]


def snippets_of(path: Path) -> list[Snippet]:
    """The fenced code blocks of a markdown file in Python or shell, with their annotation."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        lang = RUNNABLE.get(start.group("lang"))
        if lang:
            indent = len(start.group("indent"))
            code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            note = ANNOTATION.match(lines[end + 1]) if end + 1 < len(lines) else None
            kind, reason = ("run", "") if note is None else (note.group("kind"), note.group("rest").strip(" :"))
            found.append(Snippet(str(path.relative_to(ROOT)), i + 1, lang, code, kind, reason))
        i = end + 1
    return found


SNIPPETS = [s for page in pages() for s in snippets_of(page)]


def snippet_params() -> list:
    params = []
    for s in SNIPPETS:
        marks = []
        if s.kind == "engine":
            marks.append(pytest.mark.engine)
        elif s.kind == "skip":
            marks.append(pytest.mark.skip(reason=f"not run: {s.reason}"))
        params.append(pytest.param(s, marks=marks, id=str(s)))
    return params


# ---------------------------------------------------------------------------- the site


def test_the_site_builds_strictly(tmp_path):
    """``mkdocs build --strict``: a broken link, a missing page or a bad API reference fails."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for page in ("index.html", "guarantees/index.html", "performance/index.html", "api/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    for chart in ("load_bench.png", "issue15_scaling.png"):
        assert (tmp_path / "site" / "results" / chart).exists(), chart
    assert "load_rank" in (tmp_path / "site" / "api" / "index.html").read_text()


def test_generated_pages_are_current():
    """The CLI reference and the model-family table equal what ``docs/gen_docs.py`` makes from the
    argument parsers and ``benchmarks/results/model_matrix.json``."""
    stale = gen_docs.stale_pages()
    assert not stale, f"run `python docs/gen_docs.py`: {[str(p.relative_to(ROOT)) for p in stale]} are out of date"


def test_the_cli_reference_names_every_option():
    """Belt and braces over the generated tables: every option of every command is on the page."""
    import argparse

    text = (ROOT / "docs" / "cli.md").read_text()
    for name, sub in gen_docs._subcommands().items():
        assert f"## {name}" in text, name
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                for option in action.option_strings:
                    assert f"`{option}`" in text, (name, option)
    for option in ("--output", "-o", "--max-file-size", "--file-pattern", "--overwrite"):
        assert f"`{option}`" in text, option


def test_the_readme_is_short_and_self_contained():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "../" not in text, "the README refers to a file outside the repository"
    for link in re.findall(r"\]\(([^)#]+)", text):
        if not link.startswith(("http://", "https://")):
            assert (ROOT / link).exists(), f"README links to a missing file: {link}"
    assert "mkdocs serve" in text
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in text


def test_every_snippet_is_annotated_sensibly():
    """A skipped snippet says why; every runnable kind is one the runner knows."""
    assert SNIPPETS, "no snippets found"
    for s in SNIPPETS:
        assert s.kind in ("run", "engine", "skip"), s
        if s.kind == "skip":
            assert len(s.reason) > 10, f"{s}: a skipped snippet must say why"


def test_benchmark_commands_name_real_scripts_and_flags():
    """The re-run commands are not run (benchmarks take many minutes), but each names a script
    that exists (``python -m benchmarks.NAME``) and only flags that script defines."""
    commands = [s for s in SNIPPETS if re.search(r"benchmarks[/.]", s.code)]
    assert commands
    for s in commands:
        code = s.code.replace("\\\n", " ")
        for match in re.finditer(
            r"(?:benchmarks/|-m benchmarks\.)(?P<script>\w+)(?:\.py)?(?![\w/.])(?P<args>[^\n#]*)", code
        ):
            script = ROOT / "benchmarks" / f"{match.group('script')}.py"
            assert script.exists(), f"{s}: {script} does not exist"
            source = script.read_text()
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", match.group("args")):
                assert f'"{flag}"' in source, f"{s}: {match.group('script')} has no flag {flag}"


# ---------------------------------------------------------------------------- the snippets


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """The folder that ``/path/to/NAME`` stands for, for the whole session."""
    return tmp_path_factory.mktemp("docs-snippets")


_passed: dict[tuple[str, str], str] = {}


def _prepare(code: str, workspace: Path) -> str:
    if "/path/to/hf-model" in code and not (workspace / "hf-model").exists():
        build_model(str(workspace / "hf-model"))
    return PLACEHOLDER.sub(lambda m: str(workspace / m.group("name")), code)


def _tp(code: str) -> int:
    return max([int(n) for n in TP_SIZE.findall(code)] or [1])


def _path() -> dict[str, str]:
    """The venv's commands first (``vllm-sharded``, ``python``), as after ``. .venv/bin/activate``."""
    return {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}


def _environment(code: str) -> dict[str, str]:
    # The engine core in-process and the checkout on the path, as the engine tests run them.
    return {**os.environ, **engine_environment(_tp(code)), **FAST, **_path()}


def _console_script_module(name: str) -> str:
    """The module of the installed console script NAME (``pyproject.toml``'s ``[project.scripts]``):
    ``python -m`` on it runs the script's function, which its ``__main__`` block calls."""
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name=name)
    source = Path(importlib.util.find_spec(entry.module).origin).read_text()
    assert f"{entry.attr}()" in source.rsplit('if __name__ == "__main__":', 1)[-1], entry
    return entry.module


def _one_python_command(code: str) -> list[str] | None:
    """A shell snippet that is one ``vllm-sharded ...`` or ``python SCRIPT.py ...`` command, as the
    arguments ``python`` takes to run it; None for any other shell code, which bash runs."""
    joined = code.replace("\\\n", " ").strip()
    if not joined or any(c in joined for c in "\n;&|<>$`()*?"):
        return None
    words = shlex.split(joined)
    cli = _console_script_module("vllm-sharded")
    if words[0] == "vllm-sharded":
        args = ["-m", cli, *words[1:]]
    elif words[0] == "python" and len(words) > 1 and words[1].endswith(".py"):
        args = words[1:]
    else:
        return None
    # A save command passes every engine flag to LLM(...), enforce_eager=False too: one that says
    # nothing of compilation runs eager, as a Python snippet's LLM(...) does here.
    saves = args[:3] == ["-m", cli, "save"] or args[0].endswith("save_sharded_state.py")
    if saves and not any(w.startswith(("--enforce-eager", "--compilation-config", "-O")) for w in args):
        args.append("--enforce-eager")
    return args


@pytest.mark.parametrize("snippet", snippet_params())
def test_snippet_runs(snippet: Snippet, workspace: Path):
    key = (snippet.lang, snippet.code)
    if key in _passed:
        return  # the same snippet already ran and passed (the README's, repeated on a page)
    code = _prepare(snippet.code, workspace)
    if snippet.lang == "python":
        script = workspace / f"snippet-{Path(snippet.path).stem}-{snippet.line}.py"
        script.write_text(code)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", code]
    forked = [str(script)] if snippet.lang == "python" else _one_python_command(code)
    if snippet.kind == "engine" and forked:
        # Through the engine tests' runner (its fork server: vLLM imported once), eager as the engine
        # tests run (compiling the same tiny model in each snippet took ~40 s and tests vLLM, not us).
        out = run_python(forked, _tp(code), env={**_path(), EAGER_ENV: "1"}, timeout=SNIPPET_TIMEOUT)
    else:
        out = subprocess.run(
            command,
            cwd=ROOT,
            env=_environment(code),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=SNIPPET_TIMEOUT,
        )
    output = out.output if isinstance(out, EngineRun) else out.stdout
    (workspace / f"snippet-{Path(snippet.path).stem}-{snippet.line}.log").write_text(output)
    tail = "\n".join(output.splitlines()[-60:])
    assert out.returncode == 0, f"{snippet} failed (exit {out.returncode}):\n{code}\n--- output ---\n{tail}"
    _passed[key] = str(snippet)
