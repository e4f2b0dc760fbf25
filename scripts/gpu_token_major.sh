#!/usr/bin/env bash
# Issue 12's next device call (one H200, no vLLM needed, ~7 min): may the token-major W8A16 kernel
# (TOKEN_MAJOR in kernels/gemm/weight_stationary.py) join the tile table, and what does it buy the trainer?
#   1. scripts/ws_bits_report.py on three shapes, twice: every pointer / TMA / token-major config vs the
#      weight-stationary reference config, forward with LoRA + bias and dX, 257 and 4096 tokens (bits must be equal;
#      a second pass catches nondeterministic mismatches like the TMA kernel's);
#   2. scripts/tune_w8a16.py --xw on every shape (then, timing only, --tma --xw on two shapes), buckets <= 256 and many tokens: pointer and token-major
#      candidates, each bitwise-checked, the fastest kept -> $OUT/ws_xw.json (+ _log.json);
#   3. the GPU kernel tests with that table (EPIRL_WS_CONFIGS): rows bitwise across M and across every table
#      config, split-K vs single pass, engine call == trainer module, the no-dequantized-weight allocation test;
#   4. scripts/bench_kernels.py with that table: decode sizes and Fp8LoRALinear fwd+bwd vs bf16 at 4096 tokens.
# Commit $OUT/ws_xw.json as kernels/gemm/ws_configs.json only if 1-3 are clean.
#   bash scripts/gpu_token_major.sh
set -o pipefail
source scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -P -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t0=$(date +%s)
for pass in 1 2; do
  for shape in "4096 6144" "12288 4096" "4096 24576"; do
    timeout 120 python3 -P scripts/ws_bits_report.py --shape $shape --tokens 257 4096 > "$OUT/bits_${pass}_${shape// /x}.log" 2>&1
    echo "bits pass $pass K N = $shape: rc $? $(grep -c '| True |' "$OUT/bits_${pass}_${shape// /x}.log") equal," \
         "$(grep -c '| False |' "$OUT/bits_${pass}_${shape// /x}.log") differ"
    grep '| False |' "$OUT/bits_${pass}_${shape// /x}.log" | cut -c1-120 | head -n 6
  done
done
echo "[bits done at $(( $(date +%s) - t0 )) s]"
timeout 300 python3 -P scripts/tune_w8a16.py --xw --buckets 256 1000000000 --out "$OUT/ws_xw.json" > "$OUT/tune_xw.log" 2>&1
echo "tune rc $? at $(( $(date +%s) - t0 )) s"; grep -E '^\||BITS' "$OUT/tune_xw.log"
# timing only (TMA entries are refused by the table loader): what TMA loads add to each kernel kind
timeout 150 python3 -P scripts/tune_w8a16.py --tma --xw --shapes q3_qkv q3_down --buckets 1000000000 \
    --out /tmp/ws_all.json > "$OUT/tune_all.log" 2>&1
echo "tune (all kinds) rc $?"; grep -E '^\|' "$OUT/tune_all.log"
export EPIRL_WS_CONFIGS=$OUT/ws_xw.json
timeout 200 python3 -P -m pytest -q -m gpu tests/kernels/test_gpu_kernels.py -p no:cacheprovider 2>&1 | tail -n 6
echo "[tests done at $(( $(date +%s) - t0 )) s]"
timeout 240 python3 -P scripts/bench_kernels.py --tokens 1 16 256 --train-tokens 4096 > "$OUT/bench_xw.log" 2>&1
echo "bench rc $?"; grep -E '^\|' "$OUT/bench_xw.log" | tail -n 40
