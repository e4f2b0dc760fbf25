#!/usr/bin/env bash
# Run on the GPU machine from the repo root: the kernels' gpu tests, then the benchmark.
# epirl is not pip-installed there: scripts/device_env.sh maps the package; pytest runs with -P so the
# checkout's own epirl/ folder (which lacks kernels/) is not first on sys.path.
set -o pipefail
source scripts/device_env.sh  # package tree for epirl.kernels/rewards/eval, carried wheels, $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -P -m pytest -q -m gpu tests/kernels -p no:cacheprovider --maxfail=30 2>&1 | tee "$OUT/gpu_tests.log"
python3 scripts/bench_kernels.py "$@" 2>&1 | tee "$OUT/bench.log"
