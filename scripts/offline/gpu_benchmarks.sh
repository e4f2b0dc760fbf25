#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md, run as named parts back to back on one GPU host, from the repo root:
#   bash scripts/offline/gpu_benchmarks.sh kernels trainer       # in the foreground, when it fits one command
#   bash scripts/offline/device_bg.sh start bench bash scripts/offline/gpu_benchmarks.sh tune kernels step engine
#   bash scripts/offline/device_bg.sh wait bench 570             # repeat while it prints "still running"
# Each part runs under its own time limit and writes $OUT/<part>.log; its table lines are printed here. A failed
# part does not stop the next. Parts:
#   kernels   every GPU kernel test (tests/kernels -m gpu), then bench_kernels.py (KERNEL_BENCH_ARGS, default
#             1/4/16/64 tokens + 4096-token trainer rows); after `tune`, with the table it wrote         ~6 min
#   tune      tune_w8a16.py: the W8A16 tile table, timed with LoRA, into $OUT/ws_configs.json (the parts
#             after it in the same job run with that table)                                           ~8 min
#   trainer   the trainer-side model's GPU tests and the PEFT round trip, then bench_trainer.py on the
#             Qwen3-8B and Qwen3.5-9B shapes                                                              ~5 min
#   step      bench_trainer.py on the Qwen3-8B shape: FP8 and bf16 trainer, 2 timed steps, kernel sum   ~5 min
#   fused     GPU tests of one call per fused layer, then bench_fused_slices.py (decode and training)  ~5 min
#   loop      gpu_loop_check.py: the SmolLM2 recipe under every engine/trainer pairing + fault injections ~9 min
#   bitkern   the invariant ops' GPU tests (batch invariance at real sizes, agreement with the references), then
#             bench_invariant.py: each kernel vs what the matched pairing runs instead (SDPA, cuBLAS, torch) ~3 min
#   bitwise   gpu_loop_check.py: the bitwise pairing for 40 steps (`mismatch/bitwise_frac` every step), under
#             FULL_AND_PIECEWISE (the default) and PIECEWISE CUDA graphs side by side                       ~6 min
#   bitspeed  the bitwise pairing's cost beside the matched one: engine TPOT at batch 1 / 32 (gpu_engine.py,
#             Qwen3-8B shape, one engine per process; bitwise under FULL_AND_PIECEWISE and PIECEWISE graphs)
#             and the trainer step (bench_trainer.py fp8 vs fp8-bitwise)                                 ~12 min
#   compare   `epirl compare` on the SmolLM2 recipe: bf16, w8a16, w8a8, w8a16-bitwise, w8a8-notis x 3 seeds x
#             40 steps (COMPARE_PAIRINGS), 8 runs beside each other on the GPU (COMPARE_RUNS_PER_GPU),
#             held-out test of each adapter; resumable: repeat the part (through device_bg.sh) until it
#             prints the summary table (the study's folder: runs/compare_smollm2_arith_cpu)        ~25 min
#   engine    gpu_engine.py: 8B-shape TPOT, publish and shared views, W8A16 and W8A8 engines            ~6 min
#   engine2   vLLM version checks (test_vllm_compat.py), KV release x20, layer bits (eager), SmolLM2
#             engine vs the FP8 trainer                                                                    ~5 min
#   mismatch  gpu_mismatch.py: the `epirl mismatch` table, 128 prompts x 4 samples                        ~3 min
#   publish   gpu_publish_check.py for w8a8 (vLLM's and epirl's fused serving kernels), bf16, w8a16     ~5 min
#   serving   bench_serving.py --vllm: TPOT and 32 tenants inside vLLM (kernels.serving_vllm_from passes
#             through: `never` lets the timed dispatch decide every batch size)                          ~13 min
#   tenants   multi-adapter kernel tests, then bench_serving_tenants.py --sweep                           ~8 min
# Engine, loop, bitwise, bitspeed, compare, mismatch, publish and serving parts need vLLM staged; loop, bitwise, compare and
# mismatch need math-verify's and pydantic's wheels in .whl/ (README.md in this folder).
set -o pipefail
source scripts/offline/device_env.sh
KERNEL_BENCH_ARGS=${KERNEL_BENCH_ARGS:-"--tokens 1 4 16 64 --train-tokens 4096"}
t0=$(date +%s)

part() {  # name, limit in s, command...: runs it, logs to $OUT/<name>.log, prints its table lines
  local name=$1 limit=$2; shift 2
  echo "== [$name] start at $(( $(date +%s) - t0 )) s"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== [$name] exit $rc at $(( $(date +%s) - t0 )) s"
  grep -E "^\||passed|failed|^#|^TPOT|^benchmark|Error" "$OUT/$name.log" | grep -v "^# \[" | cut -c1-220 | tail -n 60
}

engine_part() {  # name, limit in s, then gpu_engine.py arguments: each section set in its own process
  local name=$1 limit=$2; shift 2
  part "engine_$name" "$limit" python3 -P scripts/offline/gpu_engine.py --tag "$name" "$@"
}

run_part() {
  case "$1" in
    kernels)  part kernels_tests 420 python3 -P -m pytest -q -m gpu tests/kernels -p no:cacheprovider --maxfail=30
              # shellcheck disable=SC2086  # the bench arguments are a word list on purpose
              part kernels_bench 300 python3 -P scripts/bench_kernels.py $KERNEL_BENCH_ARGS \
                --json "$OUT/bench_kernels.json" ;;
    tune)     part tune 600 python3 -P scripts/tune_w8a16.py --out "$OUT/ws_configs.json" ;;
    trainer)  part trainer_tests 240 python3 -P -m pytest -q -rs tests/test_model_gpu.py \
                tests/test_model.py::test_peft_loads_the_adapter_and_computes_the_same_logprobs -p no:cacheprovider
              part trainer_bench 330 python3 -P scripts/bench_trainer.py --json "$OUT/bench_trainer.json" ;;
    step)     part step 400 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --steps 2 --kernel-sum \
                --kernel-table 25 --json "$OUT/bench_step.json" ;;
    fused)    part fused_tests 300 python3 -P -m pytest -q -m gpu tests/kernels/test_fused_slices_gpu.py \
                -p no:cacheprovider
              part fused_bench 300 python3 -P scripts/bench_fused_slices.py --json "$OUT/bench_fused_slices.json" ;;
    loop)     part loop 580 python3 -P scripts/gpu_loop_check.py ;;
    bitkern)  part bitkern 300 python3 -P -m pytest -q -rs -s -m gpu tests/kernels/test_invariant_gpu.py \
                tests/kernels/test_invariant_triton_rows_gpu.py tests/kernels/test_invariant_attention_triton_gpu.py \
                -p no:cacheprovider
              part bitbench 240 python3 -P scripts/bench_invariant.py --json "$OUT/bench_invariant.json" ;;
    bitwise)  # both graph modes of the bitwise engine, side by side
              part bitwise 580 python3 -P scripts/gpu_loop_check.py --pairings w8a16-bitwise --faults none --steps 40 \
                --output-dir /tmp/loop_bitwise &
              part bitwise_piecewise 580 python3 -P scripts/gpu_loop_check.py --pairings w8a16-bitwise --faults none \
                --steps 40 --output-dir /tmp/loop_bitwise_piecewise \
                engine.vllm_args.compilation_config.cudagraph_mode=PIECEWISE &
              wait ;;
    bitspeed) engine_part bitwise 300 --precisions w8a16-bitwise --sections tpot --skip-smollm2
              engine_part bitwise_piecewise 300 --precisions w8a16-bitwise --sections tpot --skip-smollm2 \
                --graphs PIECEWISE
              engine_part matched 300 --precisions w8a16 --sections tpot --skip-smollm2  # own process: one sleep-mode engine each
              part bitwise_step 240 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 fp8-bitwise \
                --steps 2 --json "$OUT/bench_step_bitwise.json" ;;
    compare)  python3 -P -m epirl.model.smollm2 > /dev/null
              # PYTHONSAFEPATH: the runs' own processes (python -m epirl.cli) must import the mapped package too
              part compare "${COMPARE_LIMIT:-3000}" env PYTHONSAFEPATH=1 python3 -m epirl.cli compare \
                recipes/smollm2_arith_cpu.yaml --pairings "${COMPARE_PAIRINGS:-bf16,w8a16,w8a8,w8a16-bitwise,w8a8-notis}" \
                --seeds 3 --steps 40 --runs-per-gpu "${COMPARE_RUNS_PER_GPU:-8}" output_dir=runs \
                tracking.wandb=disabled engine.gpu_memory_utilization=0.1 \
                engine.vllm_args.kv_cache_memory_bytes=2147483648
              cp runs/compare_smollm2_arith_cpu/summary.* runs/compare_smollm2_arith_cpu/curves.png "$OUT/" ;;
    engine)   engine_part main 280 --precisions w8a16 --sections publish,tpot,shared --skip-smollm2
              engine_part w8a8 260 --precisions w8a8 --sections publish,tpot --skip-smollm2 ;;
    engine2)  part vllm_compat 60 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_vllm_compat.py
              engine_part kv 200 --precisions w8a16 --sections kv --skip-smollm2
              engine_part layer 300 --precisions w8a16 --sections layer --eager ;;  # + the SmolLM2 section
    mismatch) part mismatch 500 python3 -P scripts/offline/gpu_mismatch.py --eager --out "$OUT/mismatch" ;;
    publish)  python3 -P -m epirl.model.smollm2 > /dev/null
              for pair in "w8a8 env" "w8a8 fused" "bf16 env" "w8a16 env"; do
                read -r precision kernels <<< "$pair"
                part "publish_${precision}_$kernels" 110 python3 -P scripts/offline/gpu_publish_check.py \
                  --precisions "$precision" --serving-kernels "$kernels"
              done ;;
    serving)  mkdir -p "$OUT/serving"  # its own folder: the child logs' names are fixed
              part serving 800 python3 -P scripts/bench_serving.py --vllm --budget 760 \
                --json "$OUT/serving/bench_serving_vllm.json" ;;
    tenants)  part tenants_tests 300 python3 -P -m pytest -q tests/kernels/test_w8a8_multi_lora_gpu.py \
                tests/kernels/test_w8a8_multi_lora_segmented_gpu.py tests/kernels/test_w8a8_multi_lora_sm90.py \
                -p no:cacheprovider
              part tenants_bench 300 python3 -P scripts/bench_serving_tenants.py --sweep \
                --json "$OUT/bench_tenants.json" ;;
    *) echo "unknown part: $1 (kernels tune trainer step fused loop bitwise bitspeed compare engine engine2 mismatch" \
            "publish serving tenants)"
       return 2 ;;
  esac
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for name in "$@"; do run_part "$name"; done
echo "== all parts done at $(( $(date +%s) - t0 )) s"
