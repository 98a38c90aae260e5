"""Shared fixtures (small models built in process, a staging folder per test) and the test tiers.

Every test gets exactly one tier marker (``tests/support/tiers.py``), so that
``scripts/test.sh --fast`` (``-m "not engine"``) runs everything that starts no engine:

- ``engine``: the modules in ``ENGINE_MODULES``, and any test marked ``@pytest.mark.engine``;
- ``servers``: a test using one of ``SERVER_FIXTURES`` (they start S3/Azure/GCS emulators);
- ``unit``: the rest.

A test that starts an engine or an emulator without its tier fails (``tiers.require``).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.cloud_servers import Azurite, FakeGCS
from examples.s3_server import SeaweedS3
from tests.support import engines, shm, tiers
from tests.support.engines import DefaultOutputs
from tests.support.hub import HUB_CACHE_MARK

# Modules whose every test starts vLLM.
ENGINE_MODULES = frozenset(
    {"test_engine", "test_families", "test_nodes", "test_ray", "test_update_families", "test_weight_updates"}
)
# Fixtures that start object-store emulators (SeaweedFS, Azurite, fake-gcs-server).
SERVER_FIXTURES = frozenset({"seaweed", "s3", "store"})
# vLLM's shared-memory segments there when the session began (tests/support/shm.py).
SHM_BEFORE = pytest.StashKey[set[str]]()
# Why scripts ran in fresh processes (tests/support/engines.py: fresh_processes), as pytest-xdist's
# workers report it at their end, summed in the controller.
FRESH_OUTPUT = "vsl_fresh_processes"
WORKERS_FRESH: Counter[str] = Counter()


def tier_of(item: pytest.Item) -> str:
    if item.get_closest_marker(tiers.ENGINE) or item.module.__name__.rpartition(".")[2] in ENGINE_MODULES:
        return tiers.ENGINE
    if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
        return tiers.SERVERS
    return tiers.UNIT


def pytest_configure(config: pytest.Config) -> None:
    # The session's own Hub cache (tests/support/hub.py), never the user's: an engine test that
    # serves a repository from it runs in a child of the fork server, which shares this setting
    # (``HF_*`` is read when huggingface_hub is imported; an engine with another one starts fresh).
    # pytest-xdist's workers inherit the controller's.
    if not os.environ.get(HUB_CACHE_MARK):
        os.environ[HUB_CACHE_MARK] = tempfile.mkdtemp(prefix="vsl-hub-cache-")
        atexit.register(shutil.rmtree, os.environ[HUB_CACHE_MARK], True)
    os.environ["HF_HUB_CACHE"] = os.environ[HUB_CACHE_MARK]
    # Torch writes its default compile cache folder into the environment the first time it is asked
    # for it (building a model does). Set from the start, with the value torch would write, it is
    # the same for the fork servers and for every script after them, whichever test asks first.
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # A run started in the background of a script (``cmd &``, nohup) inherits SIGINT ignored, and so
    # would every process it starts: Python then raises no KeyboardInterrupt, and the Ctrl-C tests'
    # saves would run to their end. Their processes get Python's own handler, as from a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    if not hasattr(config, "workerinput"):  # the controller, not a pytest-xdist worker
        config.stash[SHM_BEFORE] = shm.segments()
    # The emulators refuse to start in a unit test (tiers.require): a test that needs one is marked servers.
    for server in (SeaweedS3, Azurite, FakeGCS):
        if not getattr(server.start, "tier_checked", False):
            server.start = _checked(server.start, server.__name__)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its tally goes to the controller
        workeroutput[FRESH_OUTPUT] = engines.fresh_processes()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """A pytest-xdist worker's tally of fresh processes, added to the controller's (printed below)."""
    WORKERS_FRESH.update(getattr(node, "workeroutput", {}).get(FRESH_OUTPUT, {}))


def pytest_unconfigure(config: pytest.Config) -> None:
    before = config.stash.get(SHM_BEFORE, None)
    if before is not None:
        removed = shm.remove_left(before)
        if removed:
            print(f"\nremoved {len(removed)} shared-memory segments left by killed engines (tests/support/shm.py)")
    if not hasattr(config, "workeroutput"):
        for reason, count in (WORKERS_FRESH + Counter(engines.fresh_processes())).items():
            print(f"\n{count} scripts ran in fresh processes, not forked (tests/support/engines.py), {reason}")


def _checked(start, name: str):
    @functools.wraps(start)
    def start_in_tier(self):
        tiers.require(tiers.SERVERS, f"an emulator ({name})")
        return start(self)

    start_in_tier.tier_checked = True
    return start_in_tier


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item)
        for other in tiers.TIERS:
            if other != tier and item.get_closest_marker(other):
                raise pytest.UsageError(f"{item.nodeid} is marked {other} but belongs to the {tier} tier")
        if not item.get_closest_marker(tier):
            item.add_marker(tier)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    tiers.enter(tier_of(item))
    try:
        return (yield)
    finally:
        tiers.enter(None)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    """The small HF models of every kind in examples/tiny_models.py, built once."""
    from examples.tiny_models import MODEL_KINDS, build_model

    root = tmp_path_factory.mktemp("models")
    return {kind: build_model(str(root / kind), kind) for kind in MODEL_KINDS}


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> Iterator[SeaweedS3]:
    """One SeaweedFS S3 server for the session (a start and a stop cost seconds each): each module
    that uses it makes a bucket of its own and points its clients at it for its own duration."""
    with SeaweedS3(str(tmp_path_factory.mktemp("seaweed"))) as server:
        yield server


@pytest.fixture(scope="session")
def default_outputs(models) -> DefaultOutputs:
    """vLLM's default loader's greedy outputs of ``models``, one engine per model and topology for the session."""
    return DefaultOutputs(models)


@pytest.fixture(autouse=True)
def environment_kept() -> Iterator[None]:
    """What a test's libraries write into ``os.environ`` is undone after it. vLLM's CPU platform, as
    it builds a configuration in the test's process (a convert run in process), sets ``LD_PRELOAD``
    and ``TORCHINDUCTOR_*`` for the processes it will start: left there, every later script of the
    session differs from the fork server's import-time environment and runs in a fresh process,
    a vLLM import each (about 10 s). A module's or the session's fixtures set theirs before this."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def staging_dir(tmp_path_factory, monkeypatch) -> Iterator[Path]:
    """Every test's saves into object storage stage under a folder of its own (``SHARDED_STATE_STAGING_DIR``,
    inherited by the engines and save processes it starts). A staging folder still there after
    the test was left by a process that survived, or by a killed one that no later save
    removed: the test fails."""
    from vllm_sharded_loader.storage.staging_folders import STAGING_ENV

    base = tmp_path_factory.mktemp("staging")
    monkeypatch.setenv(STAGING_ENV, str(base))
    yield base
    left = sorted(p.name for p in base.iterdir())
    assert not left, f"staging folders left behind in {base}: {left}"
