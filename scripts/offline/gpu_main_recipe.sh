#!/usr/bin/env bash
# The main recipe as written (16 prompts x 8 samples, <= 2048-token responses, rank-64 LoRA, W8A8 + TIS,
# trainer.base=shared, gpu_memory_utilization 0.55, CUDA graphs, KV release, publish every step) on one
# H200 in benchmark mode: `epirl train RECIPE --benchmark 3` with the real architecture and random weights
# (model.load_format=dummy, configs from recipes/configs/), synthetic 256-token prompts, seeded-coin rewards,
# every response forced to 2048 tokens. One part per command (each < 10 min):
#
# Part        model        engine, correction            trainer.base        time (STEPS=2)
#   q35       Qwen3.5-9B   W8A8 + TIS                    shared              ~9 min (~7)
#   q3        Qwen3-8B     W8A8 + TIS                    shared              ~6 min
#   q3w8a16   Qwen3-8B     matched W8A16, none           shared              ~7 min
#   q3bitwise Qwen3-8B     matched W8A16 + engine.bitwise shared              ~7 min (KL 0, bitwise 1.0 every step)
#   bf16      Qwen3-8B     W8A8 + TIS                    bf16 (own copy)     ~5 min
#   q35bf16   Qwen3.5-9B   W8A8 + TIS                    bf16                ~8.5 min (~6.5)
#   q35w8a16  Qwen3.5-9B   matched W8A16, none           shared              ~9.5 min (use STEPS=2)
#   bash scripts/offline/gpu_main_recipe.sh q3
#   bash scripts/offline/gpu_main_recipe.sh q3bitwise engine.vllm_args.compilation_config.cudagraph_mode=PIECEWISE
# (key=value arguments after the part override the recipe).
#
# Qwen3.5 on the fla kit does not fit 3 steps in 10 minutes from a cold machine (engine + trainer start
# 366 s, step 1 188 s): run it in the background, one start and then waits back to back
# (TIMEOUT raises the 570 s limit on the train command):
#   bash scripts/offline/device_bg.sh start q35 env STEPS=3 TIMEOUT=1500 \
#     bash scripts/offline/gpu_main_recipe.sh q35
#   bash scripts/offline/device_bg.sh wait q35 580      # again while it prints "still running".
# Needs vLLM 0.26 staged (`source ~/vllm-env.sh` sets VLLM_USE_FLASHINFER_SAMPLER=0) and math-verify carried as
# wheels in .whl/ (the loop imports the grader even though benchmark rewards are a coin). Qwen3.5 runs with
# language_model_only (automatic for its config) and vLLM's Triton GDN prefill (FlashInfer is not shipped
# there). The trainer's gated-DeltaNet layers use flash-linear-attention when it imports and passes a
# forward+backward check on the device, else transformers' torch fallback; benchmark.json and the table say
# which ran. fla 0.6's Hopper backward needs Triton >= 3.7.1 (the image has 3.6): when triton_kit.sh's kit is
# staged ($HOME/env-triton37.sh exists) it is sourced after the vLLM environment, so `q35` measures the fla
# path; the header line says which triton/fla are active. Each part prints the per-step table + the
# plan-vs-measured line and leaves $OUT/main_<part>.json (the full benchmark.json) and $OUT/main_<part>.log
# (the log's tail).
set -o pipefail
part=${1:?usage: gpu_main_recipe.sh q35|q3|q3w8a16|q3bitwise|bf16|q35bf16|q35w8a16}
STEPS=${STEPS:-3}
source scripts/offline/device_env.sh
# after device_env.sh (which sources ~/vllm-env.sh): the kit's PYTHONPATH entry must come first to shadow triton 3.6
[ -f "$HOME/env-triton37.sh" ] && source "$HOME/env-triton37.sh"
export COLUMNS=250  # rich wraps log lines at 80 columns when stderr is not a terminal

COMMON=(model.load_format=dummy output_dir=/tmp/runs tracking.wandb=disabled)
Q35=(recipes/qwen35_9b_dapo.yaml engine.vllm_args.gdn_prefill_backend=triton)
Q3=(recipes/qwen3_8b_dapo.yaml)
case "$part" in
  q35)      args=("${Q35[@]}") ;;
  q3)       args=("${Q3[@]}") ;;
  q3w8a16)  args=("${Q3[@]}" engine.precision=w8a16 rl.correction=none) ;;
  q3bitwise) args=("${Q3[@]}" engine.precision=w8a16 rl.correction=none engine.bitwise=true model.dtype=bfloat16) ;;
  bf16)     args=("${Q3[@]}" trainer.base=bf16) ;;
  q35bf16)  args=("${Q35[@]}" trainer.base=bf16) ;;
  q35w8a16) args=("${Q35[@]}" engine.precision=w8a16 rl.correction=none) ;;
  *) echo "unknown part: $part (q35 | q3 | q3w8a16 | q3bitwise | bf16 | q35bf16 | q35w8a16)"; exit 2 ;;
esac

log=/tmp/main_$part.log; json=$OUT/main_$part.json; t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -P -c "import importlib.util as u, importlib.metadata as m, triton
fla = m.version('flash-linear-attention') if u.find_spec('fla') else 'not installed'
print(f'[$part] triton {triton.__version__} ({triton.__file__.rsplit(\"/\", 2)[0]}), fla {fla}')" 2>&1 | tail -n 1
timeout "${TIMEOUT:-570}" python3 -P -m epirl.cli train "${args[@]}" "${COMMON[@]}" "${@:2}" name=main_$part \
    --benchmark "$STEPS" --prompt-tokens 256 --force-max-tokens --benchmark-out "$json" > "$log" 2>&1
rc=$?
echo "[$part] exit $rc after $(( $(date +%s) - t0 )) s (engine: $(grep -o 'started in [0-9.]* s' "$log" | head -1))"
grep -E "RANDOM WEIGHTS|memory plan|linear attention|flash-linear|released KV" "$log" | cut -c1-300 | head -n 6
grep -E "^benchmark:|^\||^pre-flight" "$log"
if [ $rc -ne 0 ]; then
  grep -v '^\[rank0\]:\s*[~^]*$' "$log" | grep -E "Error|error:|Traceback|File \"/tmp/epirl" | tail -n 12
  [ -s "$json" ] && python3 -P -c "import json, sys; from epirl.rl.benchmark import format_table; \
print(format_table(json.load(open(sys.argv[1]))))" "$json"  # the steps measured before it stopped
fi
grep -v -E 'it/s|s/it|^\s*$' "$log" | cut -c1-300 | tail -n 200 > "$OUT/main_$part.log"
exit $rc
