"""The examples in the package's docstrings are tests too: each module that has one runs its
examples through :mod:`doctest`, as ``pytest --doctest-modules`` would, in the fast tier's
workers. Only those modules are imported, so no vLLM is."""

from __future__ import annotations

import doctest
import importlib
import io
import re

import pytest

from tests.support import ROOT

PACKAGE = ROOT / "vllm_sharded_loader"
EXAMPLE = re.compile(r"^\s*>>> ", re.MULTILINE)
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in PACKAGE.rglob("*.py")
    if EXAMPLE.search(path.read_text(encoding="utf-8"))
)


def test_the_package_has_examples():
    assert len(MODULES) >= 10, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_module_run(name: str) -> None:
    module = importlib.import_module(name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(verbose=False)
    examples = 0
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=out.write)
        examples += len(test.examples)
    assert examples, f"{name} has '>>> ' lines but no example that doctest finds"
    assert runner.failures == 0, out.getvalue()
