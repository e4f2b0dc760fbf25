#!/usr/bin/env bash
# On the lent H200 with vLLM staged (../shared/device/README.md, kit built with WITH_SMOLLM2=1):
# the SmolLM2 arithmetic recipe with real vLLM on the GPU for each engine/trainer pairing, each followed by
# its table (reward curve, engine-trainer KL, probe, seconds per phase).
# Usage: bash scripts/gpu_train_smollm2.sh [steps] [pairing ...]
#   pairings: bf16 w8a16 w8a8 (default: all three; w8a8 = vLLM's LoRA kernels, engine.serving_kernels=off), w8a8k (w8a8 with engine.serving_kernels=auto, the default: epirl's
#   serving kernels, timed dispatch). The KV cache is released around training (on vLLM
#   0.26-0.27 by the manual unmap; export EPIRL_KV_RELEASE_MANUAL=0 to keep it resident). Each run's table
#   with its console output (and, when it failed, the end of its train.log without progress bars) is kept as
#   $OUT/train_<pairing>.md, with the number of console lines up to step 1; runs live in /tmp/runs.
set -o pipefail
source scripts/device_env.sh
STEPS=${1:-6}; shift || true
PAIRINGS=("${@:-bf16 w8a16 w8a8}"); PAIRINGS=(${PAIRINGS[@]})
python3 -P -m epirl.model.smollm2 >/dev/null || { echo "SmolLM2 conversion failed"; exit 1; }
COMMON=(rl.steps=$STEPS output_dir=/tmp/runs tracking.wandb=disabled engine.gpu_memory_utilization=0.25
        engine.enforce_eager=true checkpoint.every=0 model.max_model_len=512)
declare -A OVERRIDES=(
  [bf16]="engine.precision=bf16 trainer.base=bf16 rl.correction=tis"
  [w8a16]="engine.precision=w8a16 trainer.base=fp8 rl.correction=none"
  [w8a8]="engine.precision=w8a8 trainer.base=fp8 rl.correction=tis engine.serving_kernels=off"
  [w8a8k]="engine.precision=w8a8 trainer.base=fp8 rl.correction=tis engine.serving_kernels=auto"
)
for pairing in "${PAIRINGS[@]}"; do
  name=${pairing}_engine; console=/tmp/$name.console; t0=$(date +%s)
  report=$OUT/train_$pairing.md
  rm -rf /tmp/runs/$name /tmp/runs/$name.failed
  # The console is quiet (plan, step lines, summary); everything else is in the run's train.log
  # (/tmp/runs/<name>.failed/train.log when the run failed before its first step).
  if timeout 420 python3 -P -m epirl.cli train recipes/smollm2_arith_cpu.yaml \
      name=$name "${COMMON[@]}" ${OVERRIDES[$pairing]} > $console 2>&1; then
    log=/tmp/runs/$name/train.log
    echo "$name: ok in $(( $(date +%s) - t0 )) s ($(grep -o 'started in [0-9.]* s' $log | head -1)," \
         "$(grep -n -m1 '^step 1/' $console | cut -d: -f1) console lines up to step 1)" | tee $report
    { echo '```'; cat $console; echo '```'; } >> $report
  else
    log=/tmp/runs/$name/train.log; [ -f $log ] || log=/tmp/runs/$name.failed/train.log
    echo "$name: FAILED after $(( $(date +%s) - t0 )) s" | tee $report
    cat $console | tail -n 12
    { echo '```'; grep -v -E 'it/s|s/it|^\s*$' $log | cut -c1-300 | tail -n 300; echo '```'; } >> $report
  fi
  grep -E "KV|kv_cache|checksum" $log | cut -c1-240 | head -n 4
  if [ -s "/tmp/runs/$name/metrics.jsonl" ]; then
    python3 -P scripts/summarize_run.py "/tmp/runs/$name" > /tmp/$name.md; cat /tmp/$name.md >> $report
    sed -n 2p /tmp/$name.md; tail -n 4 /tmp/$name.md  # header, last steps, phase means
  fi
done
