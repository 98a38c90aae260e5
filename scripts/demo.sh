#!/usr/bin/env bash
# The main job: build a small model in process, save it sharded at TP=2, serve it back
# with --load-format sharded_state, and compare with vLLM's default loader.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${VENV:-.venv}/bin/activate"
python examples/demo.py "$@"
