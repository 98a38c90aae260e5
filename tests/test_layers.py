"""The package layout is its architecture: layers import only downwards, only the engine layer
imports vLLM, planning does no I/O, no module imports itself back through another, and none
grows past 500 lines (issue 33: a module that needs more is two).

Read from the source (``ast``), nothing imported, so a function-level import counts as much
as a module-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "vllm_sharded_loader"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
# Lowest first: a layer may import its own modules and those of the layers before it.
LAYERS = ("format", "planning", "storage", "checkpoint", "engine", "tools")
# What pure planning may import besides the format layer: no I/O, no torch.
PLANNING_STDLIB = {"__future__", "collections", "dataclasses", "math", "re", "typing", "itertools", "functools"}
IO_CALLS = {"open", "print", "input"}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def imports(module: str) -> list[str]:
    """Absolute names of everything ``module`` imports (a submodule when ``from pkg import submodule``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                candidate = f"{origin}.{alias.name}"
                names.append(candidate if candidate in MODULES else origin)
    return names


def layer(module: str) -> int | None:
    """The layer of a module of the package (None for the package's own ``__init__``)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 else None


def test_every_module_is_in_a_layer():
    for module in MODULES:
        parts = module.split(".")
        assert len(parts) == 1 or parts[1] in LAYERS, f"{module} is outside the layers {LAYERS}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_layers_import_only_downwards(module):
    own = layer(module)
    if own is None:
        return  # the package root: register() reaches the engine layer lazily
    for name in imports(module):
        if name.startswith(PACKAGE + "."):
            assert layer(name) is not None and layer(name) <= own, (
                f"{module} ({LAYERS[own]}) imports {name} ({LAYERS[layer(name)]}), a higher layer"
            )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_engine_layer_imports_vllm(module):
    if layer(module) == LAYERS.index("engine"):
        return
    for name in imports(module):
        assert name.split(".")[0] != "vllm", f"{module} imports {name}; only {PACKAGE}.engine may import vLLM"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) == LAYERS.index("planning")))
def test_planning_does_no_io(module):
    for name in imports(module):
        top = name.split(".")[0]
        assert top == PACKAGE or top in PLANNING_STDLIB, f"{module} imports {name}: planning is pure"
        if top == PACKAGE:
            assert layer(name) in (LAYERS.index("format"), LAYERS.index("planning")), name
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in IO_CALLS, f"{module} calls {node.func.id}(): planning does no I/O"


def test_no_import_cycles():
    graph = {m: sorted({n for n in imports(m) if n in MODULES and n != m}) for m in MODULES}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for name in graph[module]:
            if state.get(name) == "open":
                cycle = [*path[path.index(name) :], name]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if name not in state:
                visit(name, [*path, name])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])


MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not long, f"split these modules (at most {MAX_MODULE_LINES} lines each): {long}"


def test_the_checks_catch_a_violation(tmp_path, monkeypatch):
    """The checks above can fail: a planning module that imports torch and the engine is caught."""
    bad = tmp_path / PACKAGE / "planning" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("import os\nfrom ..engine import loader\nfrom vllm import LLM\n")
    monkeypatch.setitem(MODULES, f"{PACKAGE}.planning.bad", bad)
    with pytest.raises(AssertionError, match="a higher layer"):
        test_layers_import_only_downwards(f"{PACKAGE}.planning.bad")
    with pytest.raises(AssertionError, match=r"only vllm_sharded_loader\.engine may import vLLM"):
        test_only_the_engine_layer_imports_vllm(f"{PACKAGE}.planning.bad")
    with pytest.raises(AssertionError, match="planning is pure"):
        test_planning_does_no_io(f"{PACKAGE}.planning.bad")
    cyclic = tmp_path / PACKAGE / "format" / "cyclic.py"
    cyclic.parent.mkdir()
    cyclic.write_text("from . import cyclic_too\n")
    (tmp_path / PACKAGE / "format" / "cyclic_too.py").write_text("from . import cyclic\n")
    monkeypatch.setitem(MODULES, f"{PACKAGE}.format.cyclic", cyclic)
    monkeypatch.setitem(MODULES, f"{PACKAGE}.format.cyclic_too", cyclic.with_name("cyclic_too.py"))
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycles()
