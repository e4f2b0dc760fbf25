#!/usr/bin/env bash
# Run on the GPU machine from the repo root: the kernels' gpu tests, then the benchmark.
# epirl is not pip-installed there, so build a throwaway package tree mapping epirl.kernels -> kernels/
# (and run pytest with -P so the checkout's own epirl/ folder, which lacks kernels, is not on sys.path first).
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl_kernels ]; then  # carried pytest wheels, in case the image lacks pytest
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_kernels/*.whl \
    && export PYTHONPATH=/tmp/site
fi
PKG=/tmp/epirl_pkg; rm -rf $PKG; mkdir -p $PKG/epirl
for f in "$ROOT"/epirl/*; do ln -s "$f" $PKG/epirl/; done
ln -s "$ROOT/kernels" $PKG/epirl/kernels
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -P -m pytest -q -m gpu tests/kernels -p no:cacheprovider --maxfail=30 2>&1 | tee "$OUT/gpu_tests.log"
python3 scripts/bench_kernels.py "$@" 2>&1 | tee "$OUT/bench.log"
