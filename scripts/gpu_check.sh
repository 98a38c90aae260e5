#!/usr/bin/env bash
# The one command for a lent GPU machine (one GPU, torch and safetensors; no vLLM), from the
# repository root, with the wheels of blake3, fastsafetensors and instanttensor for its Python in
# .whl/ (docs/performance.md says how to fetch them):
#
#   BENCH_COMMIT=<the commit of this tree> bash scripts/gpu_check.sh [OUT]
#
# OUT is where the logs and JSON go ($OUT, else ./gpu-out). The lent machine gets a copy of the
# tree without its git history: BENCH_COMMIT names the commit in the results (git rev-parse
# --short HEAD where the command is written).
#
# It runs the GPU-only tests (tests/test_gpu_staging.py: the real staging path and a resharded
# load onto CUDA parameters; tests/test_gpu_update_staging.py: a weight update's device memory),
# then benchmarks/gpu_bench.py on an 8 GB rank, cold and warm, each method's load the first of a
# fresh process (one repeat pass after it, reported apart), every eviction checked, within a time
# budget so that a lent machine's limit still leaves the figures written.
set -uo pipefail
out=${1:-${OUT:-./gpu-out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda)'
  nproc; free -g | head -2; uname -r
} 2>&1 | tee "$out/machine.txt"
# Cold reads mean nothing on a RAM-backed folder: keep the rank on a disk.
work=${GPU_BENCH_WORK:-/tmp/sharded-gpu-bench}
if [ "$(stat -f -c %T "$(dirname "$work")")" = tmpfs ]; then work=$PWD/.gpu-bench-work; fi
mkdir -p "$work"
df -h "$work" | tee -a "$out/machine.txt"
# The disk's own cold limit: 2 GB written, evicted, read back with O_DIRECT.
dd if=/dev/zero of="$work/dd.bin" bs=16M count=128 oflag=direct 2>&1 | tail -1 | tee -a "$out/machine.txt"
dd if="$work/dd.bin" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1 | tee -a "$out/machine.txt"
rm -f "$work/dd.bin"
status=0
timeout "${GPU_TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_staging.py tests/test_gpu_update_staging.py -rs 2>&1 \
  | tee "$out/gpu_tests.log" || status=1
# About 15 s a process cold and 8 s warm on an 8 GB rank: 14 processes a run with these settings.
timeout "${GPU_BENCH_TIMEOUT:-420}" python3 -m benchmarks.gpu_bench --gb "${GPU_BENCH_GB:-8}" --runs "${GPU_BENCH_RUNS:-2}" \
  --repeats "${GPU_BENCH_REPEATS:-1}" --threads "${GPU_BENCH_THREADS:-4,16}" --spans "${GPU_BENCH_SPANS:-16}" \
  --work "$work" --modes "${GPU_BENCH_MODES:-warm,cold}" --budget-s "${GPU_BENCH_BUDGET:-300}" \
  --json "$out/gpu_bench.json" 2>&1 | tee "$out/gpu_bench.log" || status=1
exit $status
