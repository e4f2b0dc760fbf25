#!/usr/bin/env bash
# Scale-out evidence (BENCHMARKS.md "Scale-out"): one recipe at 1 GPU and at N GPUs (default 2) with the same
# seed and the same global batch, then the table of scripts/offline/scaleout_table.py: step time split, samples/s,
# speed-up, gradient all-reduce seconds and their share of the step, checksums equal every step, and whether
# both runs trained on the same batches. On a host with 2 GPUs (or 4 / 8 with NPROC=4/8), vLLM 0.26 staged
# (its kit built with the SmolLM2 weights; math-verify wheels carried in .whl/). One part per command (each under
# 10 minutes):
#
#   bash scripts/offline/gpu_scaleout.sh smollm2  # ~5 min: SmolLM2 recipe (matched W8A16 engine,
#                                                 #   trainer.base=shared, 64 prompts x 8 samples per step,
#                                                 #   6 steps) at 1 GPU then NPROC GPUs
#   bash scripts/offline/gpu_scaleout.sh qwen1    # ~6 min: Qwen3-8B shape, random weights, `--benchmark` (1 GPU)
#   bash scripts/offline/gpu_scaleout.sh qwen2    # ~6 min: the same at NPROC GPUs, then the Qwen table (both
#                                                 #   parts' runs live under $HOME/scaleout: same machine)
#
# The Qwen parts need `model.load_format: dummy` and `epirl train --benchmark`; a checkout without them prints
# "skipped" and exits 0. Knobs: NPROC (2), STEPS (6 SmolLM2 / 3 Qwen), PROMPTS (64 SmolLM2 / the recipe's
# 16 Qwen), SEEDING (SmolLM2: prompt, both runs sample the same completions and do the same work; Qwen: step,
# its synthetic prompts carry no stream position and --force-max-tokens makes the work equal anyway).
# The first step of each run is warm-up and left out of the means (--skip 1).
set -o pipefail
part=${1:?usage: gpu_scaleout.sh smollm2|qwen1|qwen2}
NPROC=${NPROC:-2}
source scripts/offline/device_env.sh
export COLUMNS=250 PYTHONSAFEPATH=1  # torchrun's workers run `python -m epirl` from the repo root: no -P there
RUNS=$HOME/scaleout; mkdir -p "$RUNS"
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader

run_job() {  # name, ranks, limit_s, recipe, then `epirl train` overrides and options
  local name=$1 ranks=$2 limit=$3 recipe=$4; shift 4
  local log=$RUNS/$name.log t0; t0=$(date +%s)
  rm -rf "${RUNS:?}/$name" "${RUNS:?}/$name-benchmark"
  local args=("$recipe" output_dir="$RUNS" name="$name" "$@")  # overrides before options (argparse)
  if [ "$ranks" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 -P -m epirl train "${args[@]}" > "$log" 2>&1
  else
    timeout "$limit" python3 -P -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
      -m epirl train "${args[@]}" > "$log" 2>&1
  fi
  local rc=$?
  local started; started=$(grep -o 'started in [0-9.]* s' "$log" | head -1)
  echo "[$name] $ranks rank(s): exit $rc after $(( $(date +%s) - t0 )) s ($started)"
  if [ $rc -ne 0 ]; then
    grep -v -E 'it/s|s/it|^\s*$' "$log" | grep -E "Error|error:|Traceback|differs|File \"/tmp/epirl" \
      | cut -c1-300 | tail -n 14
  fi
  grep -v -E 'it/s|s/it|^\s*$' "$log" | cut -c1-300 | tail -n 150 > "$OUT/$name.log"
  return $rc
}

table() {  # label_1,label_N then run folders
  local labels=$1; shift
  python3 -P scripts/offline/scaleout_table.py "$@" --labels "$labels" --skip 1 | tee -a "$OUT/scaleout.md"
  for run in "$@"; do cp "$run/metrics.jsonl" "$OUT/$(basename "$run").metrics.jsonl" 2>/dev/null; done
}

needs_dummy() {
  if ! python3 -P -m epirl train --help | grep -q -- "--benchmark" \
      || ! python3 -P -m epirl train --help-config | grep -q "load_format"; then
    echo "[$part] skipped: this checkout has no model.load_format=dummy / epirl train --benchmark"
    exit 0
  fi
}

case "$part" in
  smollm2)
    python3 -P -m epirl.model.smollm2 >/dev/null || { echo "SmolLM2 conversion failed"; exit 1; }
    ARGS=(recipes/smollm2_arith_cpu.yaml rl.steps=${STEPS:-6} rl.prompts_per_step=${PROMPTS:-64}
          rl.sample_seeding=${SEEDING:-prompt} engine.precision=w8a16 trainer.base=shared rl.correction=none
          engine.gpu_memory_utilization=0.25 engine.enforce_eager=true
          model.max_model_len=512 checkpoint.every=0 tracking.wandb=disabled)
    run_job smollm2_1gpu 1 200 "${ARGS[@]}" && run_job "smollm2_${NPROC}gpu" "$NPROC" 220 "${ARGS[@]}" \
      && table "1 GPU,$NPROC GPUs" "$RUNS/smollm2_1gpu" "$RUNS/smollm2_${NPROC}gpu"
    ;;
  qwen1|qwen2)
    needs_dummy
    ranks=1; [ "$part" = qwen2 ] && ranks=$NPROC
    ARGS=(recipes/qwen3_8b_dapo.yaml model.load_format=dummy tracking.wandb=disabled
          rl.sample_seeding=${SEEDING:-step} ${PROMPTS:+rl.prompts_per_step=$PROMPTS}
          --benchmark "${STEPS:-3}" --prompt-tokens 256 --force-max-tokens)
    run_job "qwen3_8b_${ranks}gpu" "$ranks" 560 "${ARGS[@]}" || exit 1
    one=$RUNS/qwen3_8b_1gpu-benchmark; many=$RUNS/qwen3_8b_${NPROC}gpu-benchmark
    if [ -s "$one/metrics.jsonl" ] && [ -s "$many/metrics.jsonl" ]; then
      table "1 GPU,$NPROC GPUs" "$one" "$many"
    else
      table "$ranks GPU(s)" "$RUNS/qwen3_8b_${ranks}gpu-benchmark"
    fi
    ;;
  *)
    echo "unknown part: $part (smollm2 | qwen1 | qwen2)"; exit 2 ;;
esac
