#!/usr/bin/env bash
# Run on the GPU machine from the repo root: the trainer-side model's gpu tests, then bench_trainer.py.
# epirl is not pip-installed there: scripts/device_env.sh maps the package; pytest and python run with -P so
# the checkout's epirl/ folder (which lacks kernels/) is not first on sys.path.
# Budget: tests ~1-2 min, benchmark ~3-4 min (Qwen3.5 without flash-linear-attention takes the torch fallback).
set -o pipefail
source scripts/device_env.sh  # package tree for epirl.kernels/rewards/eval, carried wheels, $OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers, importlib.util as u; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', u.find_spec('peft') is not None, 'fla', u.find_spec('fla') is not None)"
timeout 240 python3 -P -m pytest -q -rs tests/test_model_gpu.py \
  tests/test_model.py::test_peft_loads_the_adapter_and_computes_the_same_logprobs -p no:cacheprovider -s 2>&1 \
  | tee "$OUT/gpu_trainer_tests.log" | grep -v "^\[transformers\]"
timeout 330 python3 -P scripts/bench_trainer.py --json "$OUT/bench_trainer.json" "$@" 2>&1 \
  | tee "$OUT/bench_trainer.log" | grep -v "^\[transformers\]"
