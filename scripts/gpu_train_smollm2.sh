#!/usr/bin/env bash
# On the lent H200 with vLLM staged (../shared/device/README.md, kit built with WITH_SMOLLM2=1):
# the SmolLM2 arithmetic recipe with real vLLM on the GPU, for each engine/trainer pairing, then a table of
# seconds per phase. Usage: bash scripts/gpu_train_smollm2.sh [steps]
set -o pipefail
source scripts/device_env.sh
STEPS=${1:-6}
python3 -P -m epirl.model.smollm2 >/dev/null || { echo "SmolLM2 conversion failed"; exit 1; }
COMMON=(rl.steps=$STEPS output_dir=$OUT/runs tracking.wandb=disabled engine.gpu_memory_utilization=0.25
        engine.enforce_eager=true checkpoint.every=0 model.max_model_len=512)
run() {  # name, overrides...
  local name=$1; shift
  local t0=$(date +%s)
  python3 -P -m epirl.cli train recipes/smollm2_arith_cpu.yaml name=$name "${COMMON[@]}" "$@" \
    > "$OUT/$name.log" 2>&1 && echo "$name: ok in $(( $(date +%s) - t0 )) s" \
    || { echo "$name: FAILED (tail of log follows)"; tail -n 25 "$OUT/$name.log"; }
}
run bf16_engine_bf16_trainer engine.precision=bf16 trainer.base=bf16 rl.correction=tis engine.probe_tolerance=0.1
run w8a16_engine_fp8_trainer engine.precision=w8a16 trainer.base=fp8 rl.correction=none engine.probe_tolerance=0.05
run w8a8_engine_fp8_trainer engine.precision=w8a8 trainer.base=fp8 rl.correction=tis engine.probe_tolerance=0.3
for d in "$OUT"/runs/*/; do [ -f "$d/metrics.jsonl" ] && python3 -P scripts/summarize_run.py "$d"; done
