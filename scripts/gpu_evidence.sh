#!/usr/bin/env bash
# The whole GPU evidence of BENCHMARKS.md (RL loop on the GPU, Engine, Mismatch) in four device calls of
# under 10 minutes each, on the lent H200 with vLLM 0.26 staged (../shared/device/README.md, kit built with
# WITH_SMOLLM2=1; carry `.whl` for math-verify). Each part writes small reports under $OUT (at most 8 files
# come back per call) and prints the tables.
#
#   bash scripts/gpu_evidence.sh loop      # the GPU loop check (scripts/gpu_loop_check.py): the SmolLM2 recipe
#                                          #         under every pairing, 20 steps, and fault injections
#   bash scripts/gpu_evidence.sh engine    # ~6 min: 8B-shape TPOT / publish / shared views (w8a16, w8a8)
#   bash scripts/gpu_evidence.sh engine2   # ~5 min: vllm_compat version checks on the staged vLLM, KV x20
#                                          #         (CUDA graphs), layer bitwise (eager), SmolLM2
#                                          #         engine vs FP8 trainer with shared base + embeddings
#   bash scripts/gpu_evidence.sh mismatch  # ~3 min: `epirl mismatch` table, 128 prompts x 4 samples
set -o pipefail
part=${1:?usage: gpu_evidence.sh loop|engine|engine2|mismatch}
source scripts/device_env.sh

engine_section() {  # name, timeout, then gpu_engine.py arguments; each in its own process
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -P scripts/gpu_engine.py --tag "$name" "$@" > "/tmp/engine_$name.log" 2>&1
  echo "[$name] exit $?"
  grep -E "^\[" "/tmp/engine_$name.log" | grep -v "^\[W" | cut -c1-240
  grep -E "Error" "/tmp/engine_$name.log" | tail -n 3 || true  # none found is the good case
}

case "$part" in
  loop)
    python3 -P scripts/gpu_loop_check.py
    ;;
  engine)
    engine_section main 280 --precisions w8a16 --sections publish,tpot,shared --skip-smollm2
    engine_section w8a8 260 --precisions w8a8 --sections publish,tpot --skip-smollm2
    ;;
  engine2)
    # The vLLM boundary's version checks on the staged vLLM (0.26: the manual KV path and its symbols).
    timeout 60 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_vllm_compat.py 2>&1 | tail -n 4
    engine_section kv 200 --precisions w8a16 --sections kv --skip-smollm2
    engine_section layer 300 --precisions w8a16 --sections layer --eager  # + the SmolLM2 section
    ;;
  mismatch)
    timeout 500 python3 -P scripts/gpu_mismatch.py --eager --out "$OUT/mismatch" > /tmp/mismatch.log 2>&1
    echo "mismatch exit $?"
    grep -E "^\||^note|^20|Error" /tmp/mismatch.log | tail -n 20
    ;;
  *)
    echo "unknown part: $part (loop | engine | engine2 | mismatch)"; exit 2 ;;
esac
