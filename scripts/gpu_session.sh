#!/usr/bin/env bash
# Several device parts back to back in one background job (scripts/device_bg.sh), so a session spends its GPU
# minutes on work instead of on call boundaries and idle gaps:
#   bash scripts/device_bg.sh start s bash scripts/gpu_session.sh tune kernels engine serving
#   bash scripts/device_bg.sh wait s 570        # repeat while it prints "still running"; each part's log is in
#                                               # the returned tarball, its summary lines in bg_s.log
# Parts (each under its own time limit; a failed part does not stop the next):
#   kernels    GPU kernel tests, then bench_kernels.py at 1/4/16/64 + 4096 tokens (PDL on/off columns)  ~6 min
#              (after `tune` in the same job: with the table it just wrote, EPIRL_WS_CONFIGS, for the
#              parts after it too)
#   kernelsq   `kernels` in short: the W8A16 GPU tests (test_gpu_kernels.py, test_gpu_gluon.py; GPU_TEST_K=EXPR:
#              those -k selects), bench at 1/16/32 + 4096 tokens                                          ~7 min
#   tunebig    tune_w8a16.py: the many-token bucket with the TMA twins of the 128x256 tiles, then the 32-token
#              bucket, into $OUT/ws_configs.json (the parts after it use that table)                         ~6 min
#   bitsgu     ws_bits_report.py on the 4096 -> 24576 gate_up (every tile, pointer and TMA, twice at 4096 tokens): how
#              and how repeatably its TMA twins differ from the pointer kernel                                ~4 min
#   flush      bench_kernels.py --quick with EPIRL_L2_FLUSH=write (the old timer) for comparison          ~2 min
#   tune       tune_w8a16.py (LoRA-aware timing) -> $OUT/ws_configs.json + its log                         ~8 min
#   engine     matched W8A16 vs W8A8 engine TPOT at batch 1 / 32 (gpu_evidence.sh engine; needs vLLM)     ~6 min
#   mismatch   epirl mismatch with bf16, w8a8, w8a8@timed (epirl's serving kernels), w8a16, a random rank-16
#              adapter on every projection (SmolLM2 kit; carry .whl for math-verify)                       ~4 min
#   serving    bench_serving.py --vllm (TPOT + 32 tenants, both settings)                                ~9 min
#   servingall the same with EPIRL_SERVING_VLLM_FROM=never (the timed dispatch, vLLM's kernels among its
#              candidates, decides every batch size; it times every bucket at engine start)            ~13 min
#   tenants    multi-adapter kernel tests, then bench_serving_tenants.py (layer at 16-8192 tokens over
#              1/8/32 adapters vs vLLM's own LoRA kernels, --sweep of K2/shrink tiles; vLLM staged)   ~8 min
#   decode     the W8A16 decode-path GPU tests (split-K, PDL, lora_down, invariance), then bench_kernels.py at
#              1/4/16/64 tokens without trainer rows                                                      ~3 min
#   loopk      the GPU loop check on the W8A8 pairings (vLLM's LoRA kernels and engine.serving_kernels=auto) and its W8A8 fault
#              (epirl's serving kernels; the run that decides that default; carry .whl)               ~8 min
#   publish    gpu_publish_check.py for w8a8 (vLLM's kernels, epirl's fused), bf16, w8a16: each engine serves every
#              publish the loop makes (re-publish, publish while the KV cache is released, decode), β vs the trainer ~5 min
#   decodeprof profile_decode_lora.py: the W8A16 decode layer's kernels on a timeline, LoRA on/off, PDL on/off ~1 min
#   q35w8a16   gpu_main_recipe.sh q35w8a16, 3 steps (needs the triton 3.7.1 kit for fla)                 ~14 min
#   trainerprof profile_trainer_linear.py on the Qwen3-8B shapes at 1024 / 4096 tokens: kernels per step, and
#              wall vs kernel sum vs host enqueue time (does the host keep the GPU fed?)                  ~3 min
#   b32        bench_kernels.py at 32 tokens (the matched engine's batch-32 decode), no trainer rows        ~1 min
#   step       bench_trainer.py on the Qwen3-8B shape, FP8 and bf16 trainer, 2 timed steps, + one profiled step
#              (kernel time / wall time: GPU busy)                                                          ~5 min
#   tmaprobe   tma_chunk_probe.py: TMA vs pointer kernel, bitwise, NaN-poisoned, twice, per tile: gate_up (one
#              4096-deep chunk), q3_qkv with its 4 chunks and forced to one, dX                          ~1 min
#   tmavar     `tmaprobe` with TMA kernel variants beside it (TMA_VARIANTS, default x: only x through a descriptor;
#              sync: a barrier per k-step; flat / xflat: flattened chunk loop), bits and µs, trainer shapes too ~3 min
#   tunex      tune_w8a16.py --tma --flatten on the many-token bucket only, into $OUT/ws_configs.json (both TMA
#              twins of each TMA tile, and the chunked forwards' flattened-loop twins; the parts after it use
#              that table)                                                                                     ~5 min
#   stepgu     `step` with the TMA table plus TMA on the fused gate_up rows (each checked against the pointer
#              kernel on its first call: there it warns and falls back)                                   ~2 min
#   enginetpot matched W8A16 vs W8A8 engine TPOT at batch 1 / 32 with the same adapter, nothing else (needs vLLM) ~4 min
#   widen      the e4m3 -> bf16 widening (kernels/gemm/widen.py): its GPU tests (PTX vs conversion, bitwise: every
#              code, whole GEMMs), then `kernelsq`'s bench with EPIRL_WIDEN=cvt (the conversion instructions) for
#              the A/B against `kernelsq` (the default, PTX)                                              ~4 min
#   tunedec    tune_w8a16.py on the decode buckets (TUNE_BUCKETS, default 16 / 32 / 64) into $OUT/ws_configs.json,
#              then bench_kernels.py at 1 / 16 / 32 tokens with that table (the committed one stays in effect for
#              later parts)                                                                                ~2-5 min
#   ticket     bench_kernels.py at 1 / 16 / 32 tokens with the two-launch split-K (EPIRL_WS_TICKET=0), then with the
#              one-launch split-K of ws_splitk.py (the default)                                             ~2 min
#   hostlaunch host µs per call of each piece of the FP8 trainer linear (profile_host_launch.py), q3_o + gate_up ~2 min
#   gputrim    the W8A16 GPU tests a host-side change can break (one-launch, TMA table, backward, module, invariance)
#   gpufused   GPU tests of one call per fused layer (test_fused_slices_gpu.py)                            ~2 min
#   benchfused one call per fused layer vs one per slice: decode (1 / 16 tokens) and training (4096 / 8192)   ~3 min
#   stepfused  `step` with EPIRL_FUSED_SLICES=1 (q, k, v as one call: ONE_CALL_LAYERS)                  ~2 min
#   enginefused the matched engine's TPOT with EPIRL_FUSED_SLICES=1 beside the W8A8 engine's (vLLM staged; enginetpot:
#              the same without it), then its qkv / down layers against the kernel, bitwise (eager engine)  ~9 min
#   trainhf    trainer rows at 8192 tokens for the modules a Qwen3-8B step runs (q = o shape, k/v, gate/up, down) ~2 min
#   gpuall     every GPU test of the W8A16 kernels (test_gpu_kernels.py, test_gpu_gluon.py -m gpu)               ~4 min
#   step1t     `step` with the backward on the calling thread (autograd multithreading off)           ~4 min
#   desccache  the TMA descriptor cache (kernels/gemm/tma_desc_cache.py) off, then on: profile_host_launch.py q3_o rows,
#              then the Qwen3-8B step (FP8 off; FP8 + bf16 on)                                                ~5 min
#   stepq      `step` without the kernel table: FP8 and bf16 Qwen3-8B steps, 3 timed each                     ~2 min
#   hostdiag   profile_host_launch.py rows (GC off, forward / backward timed apart, backward thread) + a CPU trace ~2 min
#   train816   bench_kernels.py trainer rows at 8192 and 16384 tokens (kernel sums and walls, every shape)    ~3 min
#   stepgaps   the idle GPU gaps of one Qwen3-8B training step (fp8, bf16), pinned on host ops (profile_step_gaps.py) ~4 min
#   hostprof   cProfile of the FP8 trainer linear's host side (q3_o, 1024 tokens): Python, autograd, launches ~1 min
#   chunkprobe probe_k_chunking.py: the K chunking's program target (264 / 132 / 66) at decode (1 / 16 tokens) and in
#              training (8192 tokens, forward and forward + backward vs bf16) on the step's four module shapes, and
#              each fwd + bwd's kernels (CHUNK_TARGETS="132": only that target)                            ~1 min
#   enginebits the matched engine's TPOT at batch 1 / 32 (defaults), then its qkv / down layers against the kernel,
#              bitwise (eager engine); no W8A8 engine (enginefused runs both)                              ~6 min
#   downgroup  the decode GPU tests, then bench_kernels.py at 1 / 16 tokens (GROUP_SHAPES) with one sub-chunk per
#              `lora_down` program (EPIRL_WS_DOWN_GROUP=0) and with the default grouping (down_parts_per_program),
#              alternated twice                                                                               ~5 min
#   xaprobe    probe_k_chunking.py at the committed target with XA_CHUNK_MAX 512 / 256 (XA_MAXES): the LoRA
#              down-projection's sub-chunk depth at decode and in training (PROBE_SHAPES)                    ~2 min
#   tune8k     tune_w8a16.py --tma on the many-token bucket timed at 8192 tokens (TUNE_SHAPES: down, gate) into
#              $OUT/ws_configs_8k.json (not used by later parts): fwd and dX each beside cuBLAS bf16; TUNE_TMA_ALL=1:
#              TMA twins of every tile; BIG_TOKENS: the token counts timed                                  ~4 min
#   readfloor  bench_read_floor.py: the fastest any one kernel reads each layer's FP8 bytes once (programs x BLOCK
#              x warps swept; graph replays, L2 flushed) beside w8a16 at 1 token, + an empty kernel's node cost ~3 min
#   gluon      the Gluon forward's GPU tests (bitwise vs the pointer kernel; every table config; invariance across M),
#              then the Qwen3-8B step with it off (EPIRL_WS_GLUON=0) and on, alternated (GLUON_STEPS rounds, default 1) ~6 min
#              (bench_trainer imports pydantic, which a bare device lacks: carry `.whl/` holding its py3.12 wheels -
#              pip download pydantic --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl -
#              and device_env.sh installs them)
#   gluonprobe probe_gluon_fwd.py: the table's kernel, the pointer kernel and Gluon configs (GLUON_CONFIGS) at 4096 and
#              8192 tokens on the training shapes, bits and µs beside cuBLAS bf16 + LoRA                      ~2 min
#   racecount  race_count.py: RACE_CALLS calls (default 200) of each W8A16 kernel (pointer, TMA, Gluon, decode, dX) on
#              RACE_SHAPES, each bitwise against the pointer kernel: how often each races under this Triton  ~3 min
#   drain      the wgmma drain (kernels/gemm/wgmma_drain.py): race_count.py with it (4000 calls), bench_kernels.py with
#              EPIRL_WGMMA_DRAIN=0 / 1 (and under the Triton 3.9 at $HOME/t39 when there), the FP8 step with it off / on ~6 min
#   gluonqkv   probe_gluon_fwd.py on q3_qkv / q3_kv (rank 64; and rank 192, the fused qkv, at BM 128), then the FP8 step
#              with the committed table and without Gluon on the qkv and k/v entries (EPIRL_WS_CONFIGS, $OUT) ~5 min
#   tunedrain  tune_w8a16.py on the decode bucket(s) (TUNE_BUCKETS, default 16) under this Triton (3.6: with the wgmma
#              drain), then bench_kernels.py at 1 / 16 tokens with the committed and the tuned table, each under this
#              Triton and under the Triton 3.9 at $HOME/t39 when there                                        ~5 min
#   gluondx    probe_gluon_fwd.py --dx (the Gluon dX, codes widened in registers and in shared memory - "/s", A_SMEM -,
#              against the Triton dX kernels and cuBLAS, bitwise vs the pointer kernel), the same for the forward, the
#              Gluon / TMA-table GPU tests, race_count.py with the A_SMEM configs, one FP8 step               ~5 min
#   tunegluon  tune_w8a16.py --tma --gluon on the many-token bucket at 8192 tokens: each entry's best Triton config, then
#              the Gluon configs (forward and dX, codes widened in registers or shared memory) beside it; the
#              table with the winners in $OUT/ws_configs.json                                                  ~8 min
#   gluononly  tune_w8a16.py --gluon-only (each entry's Gluon configs against the table's own Triton entry), then the
#              FP8 + bf16 step with that table                                                              ~8 min
#   gluondxtable every W8A16 GPU test, race_count.py on the Gluon 256/64/4/16, the host profile of q3_o, the step ~8 min
#   traingdx   bench_kernels.py trainer rows at 4096 / 8192 / 16384 tokens on the Qwen shapes, then the step   ~6 min
#   ring       the Gluon LoRA ring (ws_gluon.LORA_RING): the Gluon GPU tests, probe_gluon_fwd.py (fwd and dX) at the
#              fused qkv's rank 192 - ring at 256-token tiles against the narrowed forward and the Triton dX - and at
#              rank 64 against the tiles path, the same with PERSISTENT ("/p": a program per SM over many tiles),
#              race_count.py with both                                                     ~3.5 min on an H100
#   ringtable  the step with the previous table (OLD_TABLE, default .whl/ws_configs_old.json: `git show
#              HEAD~:kernels/gemm/ws_configs_tma.json`) and with the committed one, the trainer rows at 4096 / 8192 /
#              16384 tokens, every W8A16 GPU test (needs ~8 min on its own), race_count.py on gate_up / down  ~12 min
#   tablecheck the targets on the committed table in one job: the FP8 + bf16 step with it and the FP8 step with the
#              previous one (OLD_TABLE, when that file exists), the decode rows at 1/4/16/64 tokens, the Gluon GPU
#              tests (carry .whl)                                                                            ~10 min
#   tablenow   `tablecheck` without the previous table and the Gluon tests: the step and the decode rows    ~5 min
#   trainrows  bench_kernels.py trainer rows at 4096 / 8192 / 16384 tokens on the Qwen shapes, with the table a part
#              before it wrote ($OUT/ws_configs.json: `gluononly`, `tunegluon`) if there is one, for the parts after it
#              too                                                                                           ~4 min
#   downprof   profile_trainer_linear.py on PROF_SHAPES (default q3_down q3_gate, the 1.0x target's misses) at 4096 / 8192
#              tokens: each kernel's µs of one fwd + bwd, FP8 beside bf16                                    ~3 min
#   clock      probe_clock.py: the W8A16 forward and cuBLAS bf16 run for seconds each at 8192 tokens (down, gate_up), the
#              SM clock and board power sampled: TFLOP/s per GHz (is the ceiling power or work per cycle?), then the
#              same on down with EPIRL_WIDEN=cvt (Triton's conversions instead of the PTX widening)          ~2 min
#   racecount39 `racecount` under the Triton 3.9 unpacked at $HOME/t39 (scripts/stage_triton.sh builds the archive; the
#              device call that carries it unpacks it there before starting the job)                      ~4 min
set -o pipefail
source scripts/device_env.sh
W8A16_GPU_TESTS="tests/kernels/test_gpu_kernels.py tests/kernels/test_gpu_gluon.py"  # every W8A16 GEMM GPU test
t0=$(date +%s)

part() {  # name, limit in s, command...: runs it, logs to $OUT/<name>.log, prints its table lines
  local name=$1 limit=$2; shift 2
  echo "== [$name] start at $(( $(date +%s) - t0 )) s"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== [$name] exit $rc at $(( $(date +%s) - t0 )) s"
  grep -E "^\||passed|failed|^#|^TPOT|^benchmark|Error|W8A16 TMA kernel|W8A16 Gluon" "$OUT/$name.log" | grep -v "^# \[" | cut -c1-220 | tail -n 60
}

for name in "$@"; do
  case "$name" in
    kernels)  # after `tune` in the same job: tests and bench with the freshly tuned table
              [ -f "$OUT/ws_configs.json" ] && export EPIRL_WS_CONFIGS=$OUT/ws_configs.json
              part kernels 480 bash scripts/gpu_kernels.sh --tokens 1 4 16 64 --train-tokens 4096 ;;
    kernelsq) [ -f "$OUT/ws_configs.json" ] && export EPIRL_WS_CONFIGS=$OUT/ws_configs.json
              part kernelsq 480 bash -c "python3 -P -m pytest -q -m gpu $W8A16_GPU_TESTS \
                ${GPU_TEST_K:+-k \"$GPU_TEST_K\"} -p no:cacheprovider --durations=8 2>&1 | tee $OUT/gpu_tests.log; python3 -P scripts/bench_kernels.py \
                --tokens 1 16 32 --train-tokens 4096 --json $OUT/bench_kernels.json" ;;
    tunebig)  part tunebig 420 bash -c "python3 -P scripts/tune_w8a16.py --tma --buckets 1000000000 \
                --out $OUT/ws_configs.json && EPIRL_WS_CONFIGS=$OUT/ws_configs.json python3 -P scripts/tune_w8a16.py \
                --buckets 32 --out $OUT/ws_configs.json" ;;
    bitsgu)   part bitsgu 300 bash -c "python3 -P scripts/ws_bits_report.py --shape 4096 24576 --tokens 257 4096; \
                python3 -P scripts/ws_bits_report.py --shape 4096 24576 --tokens 4096" ;;
    flush)    part flush 200 env EPIRL_L2_FLUSH=write python3 -P scripts/bench_kernels.py --quick --tokens 1 16 \
                --train-tokens 4096 --json "$OUT/bench_write_flush.json" ;;
    tune)     part tune 600 python3 -P scripts/tune_w8a16.py --out "$OUT/ws_configs.json" ;;
    engine)   part engine 600 bash scripts/gpu_evidence.sh engine ;;
    mismatch) part mismatch 400 python3 -P scripts/gpu_mismatch.py --quick --eager --random-adapter 0.02 \
                --engines bf16,w8a8,w8a8@timed,w8a16 --out "$OUT/mismatch" ;;
    serving)  part serving 560 python3 -P scripts/bench_serving.py --vllm ;;
    servingall) mkdir -p "$OUT/servingall"  # its own folder: the child logs' names are fixed
                part servingall 800 env EPIRL_SERVING_VLLM_FROM=never python3 -P scripts/bench_serving.py --vllm \
                  --budget 760 --json "$OUT/servingall/bench_serving_vllm.json" ;;
    tenants)  part tenants 540 bash -c "python3 -P -m pytest -q tests/kernels/test_w8a8_multi_lora_gpu.py \
                tests/kernels/test_w8a8_multi_lora_segmented_gpu.py tests/kernels/test_w8a8_multi_lora_sm90.py; python3 -P scripts/bench_serving_tenants.py --sweep \
                --json $OUT/bench_tenants.json" ;;
    decode)   part decode 300 bash -c "python3 -P -m pytest -q -m gpu tests/kernels/test_gpu_kernels.py -p no:cacheprovider \
                -k 'pdl or lora_down or split_k or bitwise'; python3 -P scripts/bench_kernels.py --tokens 1 4 16 64 \
                --train-tokens --json $OUT/bench_decode.json" ;;
    loopk)    part loopk 560 python3 -P scripts/gpu_loop_check.py --pairings w8a8,w8a8-off --faults skip-w8a8 ;;
    publish)  part publish 400 bash -c 'python3 -P -m epirl.model.smollm2 > /dev/null; for pk in "w8a8 env" \
                "w8a8 fused" "bf16 env" "w8a16 env"; do set -- $pk; timeout 110 python3 -P scripts/gpu_publish_check.py \
                --precisions $1 --serving-kernels $2; done' ;;
    decodeprof) part decodeprof 200 python3 -P scripts/profile_decode_lora.py ;;
    trainerprof) part trainerprof 300 python3 -P scripts/profile_trainer_linear.py --shapes q3_qkv q3_o q3_gate_up \
                q3_down --tokens 1024 4096 --steps 3 ;;
    b32)      part b32 150 python3 -P scripts/bench_kernels.py --tokens 32 --train-tokens --json "$OUT/bench_b32.json" ;;
    step)     part step 400 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --steps 2 --kernel-sum --kernel-table 25 \
                --json "$OUT/bench_step.json" ;;
    step1t)   part step1t 400 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --steps 2 --kernel-sum \
                --backward-thread caller --json "$OUT/bench_step1t.json" ;;
    tmaprobe) part tmaprobe 200 python3 -P scripts/tma_chunk_probe.py --tokens 4096 ;;
    tmavar)   part tmavar 330 python3 -P scripts/tma_chunk_probe.py --tokens 4096 --variants ${TMA_VARIANTS:-x} ;;
    tunex)    part tunex 540 python3 -P scripts/tune_w8a16.py --tma --flatten --buckets 1000000000 \
                --out $OUT/ws_configs.json ;;
    stepgu)   python3 -P - "$OUT/ws_configs_gu.json" <<'PY'
import json, sys
table = json.load(open("kernels/gemm/ws_configs_tma.json"))
for op, shape in (("fwd", "24576x4096"), ("dx", "4096x24576")):
    table[op][shape]["1000000000"]["tma"] = True
json.dump(table, open(sys.argv[1], "w"), indent=1)
PY
              part stepgu 400 env EPIRL_WS_CONFIGS="$OUT/ws_configs_gu.json" python3 -P \
                scripts/bench_trainer.py --shapes qwen3-8b --steps 2 --kernel-sum --json "$OUT/bench_stepgu.json" ;;
    enginetpot) part enginetpot 480 bash -c "[ -f ~/vllm-env.sh ] && source ~/vllm-env.sh; timeout 230 python3 -P scripts/gpu_engine.py --tag main --precisions w8a16 \
                --sections tpot --skip-smollm2; timeout 230 python3 -P scripts/gpu_engine.py --tag w8a8 --precisions w8a8 \
                --sections tpot --skip-smollm2" ;;
    widen)    part widen 420 bash -c "python3 -P -m pytest -q -m gpu tests/kernels/test_widen.py -p no:cacheprovider; \
                EPIRL_WIDEN=cvt python3 -P scripts/bench_kernels.py --tokens 1 16 32 --train-tokens 4096 \
                --json $OUT/bench_kernels_cvt.json" ;;
    tunedec)  part tunedec 540 bash -c "python3 -P scripts/tune_w8a16.py --buckets ${TUNE_BUCKETS:-16 32 64} --out $OUT/ws_configs.json \
                && EPIRL_WS_CONFIGS=$OUT/ws_configs.json python3 -P scripts/bench_kernels.py --tokens 1 16 32 \
                --train-tokens --json $OUT/bench_tunedec.json" ;;
    ticket)   part ticket 200 bash -c "EPIRL_WS_TICKET=0 python3 -P scripts/bench_kernels.py --tokens 1 16 32 --train-tokens \
                --json $OUT/bench_2launch.json; python3 -P scripts/bench_kernels.py --tokens 1 16 32 --train-tokens \
                --json $OUT/bench_ticket.json" ;;
    hostlaunch) part hostlaunch 240 bash -c "python3 -P scripts/profile_host_launch.py --shape q3_o --calls ${HOST_CALLS:-40} \
                --cprofile; python3 -P scripts/profile_host_launch.py --shape q3_gate_up --calls ${HOST_CALLS:-40}" ;;
    gputrim)  part gputrim 300 python3 -P -m pytest -q -m gpu tests/kernels/test_gpu_kernels.py -p no:cacheprovider \
                -k "one_launch or tma_table or backward or module or invariance or allocates or lora_down" ;;
    benchfused) part benchfused 300 python3 -P scripts/bench_fused_slices.py --json "$OUT/bench_fused_slices.json" ;;
    stepfused) part stepfused 400 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --steps 2 --kernel-sum \
                --kernel-table 25 --fused-slices on --json "$OUT/bench_stepfused.json" ;;
    gpufused) part gpufused 300 python3 -P -m pytest -q -m gpu tests/kernels/test_fused_slices_gpu.py -p no:cacheprovider ;;
    enginefused) part enginefused 600 bash -c "[ -f ~/vllm-env.sh ] && source ~/vllm-env.sh; export EPIRL_FUSED_SLICES=1; \
                timeout 230 python3 -P scripts/gpu_engine.py --tag fused --precisions w8a16 --sections tpot --skip-smollm2; \
                timeout 230 python3 -P scripts/gpu_engine.py --tag w8a8 --precisions w8a8 --sections tpot --skip-smollm2; \
                timeout 150 python3 -P scripts/gpu_engine.py --tag fusedbits --precisions w8a16 --sections layer --eager \
                --skip-smollm2" ;;
    trainhf)  part trainhf 240 python3 -P scripts/bench_kernels.py --tokens 1 --train-tokens 8192 \
                --shapes q3_o q3_kv q3_gate q3_down --json $OUT/bench_trainhf.json ;;
    gpuall)   part gpuall 420 python3 -P -m pytest -q -m gpu $W8A16_GPU_TESTS -p no:cacheprovider ;;
    desccache) part desccache 480 bash -c "EPIRL_TMA_DESC_CACHE=0 python3 -P scripts/profile_host_launch.py --shape q3_o \
                --calls 40; python3 -P scripts/profile_host_launch.py --shape q3_o --calls 40; EPIRL_TMA_DESC_CACHE=0 \
                python3 -P scripts/bench_trainer.py --shapes qwen3-8b --steps 2 --kernel-sum --bases fp8; \
                python3 -P scripts/bench_trainer.py --shapes qwen3-8b --steps 2 --kernel-sum" ;;
    stepq)    part stepq 240 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --steps 3 --kernel-sum \
                --json "$OUT/bench_stepq.json" ;;
    hostdiag) part hostdiag 200 python3 -P scripts/profile_host_launch.py --shape q3_o --trace --cprofile-step ;;
    train816) part train816 300 python3 -P scripts/bench_kernels.py --tokens 1 --train-tokens 8192 16384 \
                --json $OUT/bench_train816.json ;;
    stepgaps) part stepgaps 300 python3 -P scripts/profile_step_gaps.py --shape qwen3-8b ;;
    hostprof) part hostprof 120 python3 -P scripts/profile_trainer_linear.py --shapes q3_o --tokens 1024 --steps 1 \
                --host-profile ;;
    chunkprobe) part chunkprobe 420 python3 -P scripts/probe_k_chunking.py ${CHUNK_TARGETS:+--targets $CHUNK_TARGETS} \
                --kernels --json $OUT/probe_k_chunking.json ;;
    downgroup) part downgroup 540 bash -c "python3 -P -m pytest -q -m gpu tests/kernels/test_gpu_kernels.py \
                -p no:cacheprovider -k 'one_launch or split_k_with_pdl or lora_down or decode_path or invariance'; \
                for g in 0 1 0 1; do EPIRL_WS_DOWN_GROUP=\$g python3 -P scripts/bench_kernels.py --tokens 1 16 \
                --train-tokens --shapes ${GROUP_SHAPES:-q3_qkv q3_o q3_gate_up q3_down} --json $OUT/bench_group\$g.json; done" ;;
    gluon)    part gluontests 300 python3 -P -m pytest -q -m gpu $W8A16_GPU_TESTS -p no:cacheprovider \
                -k "gluon or every_table_config or tma_table or module_forward"
              for round in $(seq ${GLUON_STEPS:-1}); do for g in 0 1; do
                EPIRL_WS_GLUON=$g part step_gluon$g 400 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --steps 2 \
                  --kernel-sum --kernel-table 25 --json "$OUT/bench_step_gluon$g.json"; done; done ;;
    gluonprobe) for t in 8192 4096; do part gluonprobe$t 240 python3 -P scripts/probe_gluon_fwd.py --tokens $t \
                --shapes q3_qkv q3_o q3_gate q3_down q35_attn_qkv --configs ${GLUON_CONFIGS:-256/64/4 256/64/3}; done ;;
    racecount) part racecount 540 python3 -P scripts/race_count.py --calls ${RACE_CALLS:-200} \
                --shapes ${RACE_SHAPES:-q3_qkv q3_o q3_down q3_gate} ;;
    drain)    part racedrain 300 python3 -P scripts/race_count.py --calls ${RACE_CALLS:-4000} \
                --shapes ${RACE_SHAPES:-q3_down q3_qkv q3_gate}
              for d in 0 1; do EPIRL_WGMMA_DRAIN=$d part benchdrain$d 300 python3 -P scripts/bench_kernels.py \
                --tokens 1 16 4096 8192 --train-tokens 8192 --shapes q3_qkv q3_o q3_gate_up q3_down \
                --json $OUT/bench_drain$d.json; done
              [ -d $HOME/t39 ] && part benchdrain39 300 env PYTHONPATH=$HOME/t39${PYTHONPATH:+:$PYTHONPATH} \
                python3 -P scripts/bench_kernels.py --tokens 1 16 4096 8192 --train-tokens 8192 \
                --shapes q3_qkv q3_o q3_gate_up q3_down --json $OUT/bench_drain39.json
              for d in 0 1; do EPIRL_WGMMA_DRAIN=$d part stepdrain$d 400 python3 -P scripts/bench_trainer.py \
                --shapes qwen3-8b --bases fp8 --steps 2 --kernel-sum --json "$OUT/bench_step_drain$d.json"; done ;;
    gluonqkv) part gq64 240 python3 -P scripts/probe_gluon_fwd.py --tokens 8192 --shapes q3_qkv q3_kv \
                --configs 256/64/4/16 128/64/4/16
              part gq192 240 python3 -P scripts/probe_gluon_fwd.py --tokens 8192 --shapes q3_qkv --rank 192 \
                --configs 128/64/4/16 128/64/4/8
              # the committed table without the qkv and k/v entries' Gluon forward (committed on 2026-12-04)
              python3 -P -c "import json, sys; from epirl.kernels.gemm.configs import TMA_TABLE_PATH as p
t = json.loads(p.read_text())
for key in ('6144x4096', '1024x4096'):
    t['fwd'][key]['1000000000'].pop('gluon', None)
json.dump(t, open(sys.argv[1], 'w'), indent=1)" $OUT/table_no_gluon_qkv.json
              part step_committed 400 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 --steps 2 \
                --kernel-sum --kernel-table 25 --json "$OUT/bench_step_committed.json"
              EPIRL_WS_CONFIGS=$OUT/table_no_gluon_qkv.json part step_no_gluon_qkv 400 python3 -P \
                scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 --steps 2 --kernel-sum --kernel-table 25 \
                --json "$OUT/bench_step_no_gluon_qkv.json" ;;
    tunedrain) part tunedrain 300 python3 -P scripts/tune_w8a16.py --buckets ${TUNE_BUCKETS:-16} --out $OUT/ws_configs.json
              for tbl in committed tuned; do
                [ $tbl = tuned ] && export EPIRL_WS_CONFIGS=$OUT/ws_configs.json
                part dec_${tbl}_36 150 python3 -P scripts/bench_kernels.py --tokens 1 16 --train-tokens \
                  --json $OUT/dec_${tbl}_36.json
                [ -d $HOME/t39 ] && PYTHONPATH=$HOME/t39:$PYTHONPATH part dec_${tbl}_39 150 python3 -P \
                  scripts/bench_kernels.py --tokens 1 16 --train-tokens --json $OUT/dec_${tbl}_39.json
              done; unset EPIRL_WS_CONFIGS ;;
    gluondx)  part gdx 200 python3 -P scripts/probe_gluon_fwd.py --dx --tokens 8192 \
                --shapes ${PROBE_SHAPES:-q3_o q3_down q3_gate q3_qkv q3_kv} \
                --configs ${GLUON_CONFIGS:-128/64/4/16 128/64/4/16/s 256/64/3/16/s}
              part gfwds 200 python3 -P scripts/probe_gluon_fwd.py --tokens 8192 \
                --shapes ${PROBE_SHAPES:-q3_o q3_down q3_gate q3_qkv q3_kv} --configs 256/64/4/16 128/64/4/16/s 256/64/3/16/s
              part gdxtests 200 python3 -P -m pytest -q -m gpu $W8A16_GPU_TESTS -p no:cacheprovider \
                -k "gluon or tma_table"
              part gdxrace 200 python3 -P scripts/race_count.py --calls ${RACE_CALLS:-300} --shapes q3_o q3_down \
                --gluon 128/64/4/16/s 256/64/3/16/s
              part stepgdx 150 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 --steps 2 --kernel-sum \
                --kernel-table 12 --json "$OUT/bench_step_gdx.json" ;;
    gluononly) part gluononly 400 python3 -P scripts/tune_w8a16.py --gluon-only --big-tokens ${BIG_TOKENS:-8192} \
                ${TUNE_SHAPES:+--shapes $TUNE_SHAPES} --out $OUT/ws_configs.json
              part stepgonly 150 env EPIRL_WS_CONFIGS=$OUT/ws_configs.json python3 -P scripts/bench_trainer.py \
                --shapes qwen3-8b --bases fp8 bf16 --steps 2 --kernel-sum --kernel-table 12 --json "$OUT/bench_step_gonly.json" ;;
    gluondxtable) part gdxall 300 python3 -P -m pytest -q -m gpu $W8A16_GPU_TESTS -p no:cacheprovider
              part gdxrace2 120 python3 -P scripts/race_count.py --calls ${RACE_CALLS:-300} --shapes q3_o q3_down \
                --gluon 256/64/4/16
              part hostgluon 200 python3 -P scripts/profile_host_launch.py --shape q3_o --tokens 8192 --calls 20
              part stepgdxt 150 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 bf16 --steps 2 \
                --kernel-sum --kernel-table 12 --json "$OUT/bench_step_gdxt.json" ;;
    traingdx) part traingdx 240 python3 -P scripts/bench_kernels.py --tokens 8192 --train-tokens 4096 8192 16384 \
                --shapes q3_qkv q3_o q3_gate q3_down q3_kv q35_attn_qkv q35_gdn_qkvz --json "$OUT/bench_kernels_gdx.json"
              part stepgdx2 110 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 bf16 --steps 2 \
                --kernel-sum --json "$OUT/bench_step_gdx2.json" ;;
    ring)     part ringtests 300 python3 -P -m pytest -q -m gpu $W8A16_GPU_TESTS -p no:cacheprovider \
                -k "gluon"
              for dx in "" --dx; do
                part ring192$dx 200 python3 -P scripts/probe_gluon_fwd.py $dx --tokens 8192 --shapes q3_qkv --rank 192 \
                  --configs 256/64/4/16/r 256/64/4/16/r/p 128/64/4/16
                part ring64$dx 300 python3 -P scripts/probe_gluon_fwd.py $dx --tokens 8192 \
                  --shapes ${RING_SHAPES:-q3_qkv q3_o q3_down q3_gate_up} --configs 256/64/4/16 256/64/4/16/r 256/64/4/16/r/p
              done
              part ringrace 200 python3 -P scripts/race_count.py --calls ${RACE_CALLS:-200} --shapes q3_qkv q3_o \
                --gluon 256/64/4/16/r 256/64/4/16/r/p ;;
    tablecheck|tablenow) [ "$name" = tablecheck ] && [ -f "${OLD_TABLE:-.whl/ws_configs_old.json}" ] && part stepold 120 \
                env EPIRL_WS_CONFIGS=${OLD_TABLE:-.whl/ws_configs_old.json} python3 -P \
                scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 --steps 2 --kernel-sum --json "$OUT/bench_step_old.json"
              part stepnew 150 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 bf16 --steps 2 \
                --kernel-sum --kernel-table 12 --json "$OUT/bench_step_new.json"
              part decoderows 150 python3 -P scripts/bench_kernels.py --tokens 1 4 16 64 --train-tokens \
                --json $OUT/bench_decode.json
              [ "$name" = tablecheck ] && part gluontests 240 python3 -P -m pytest -q -m gpu tests/kernels/test_gpu_gluon.py \
                -p no:cacheprovider ;;
    clock)    part clock 200 python3 -P scripts/probe_clock.py
              part clockcvt 120 env EPIRL_WIDEN=cvt python3 -P scripts/probe_clock.py --shapes q3_down ;;
    downprof) part downprof 240 python3 -P scripts/profile_trainer_linear.py --shapes ${PROF_SHAPES:-q3_down q3_gate} \
                --tokens 4096 8192 --steps 3 ;;
    trainrows) [ -f "$OUT/ws_configs.json" ] && export EPIRL_WS_CONFIGS=$OUT/ws_configs.json
              part trainrows 240 python3 -P scripts/bench_kernels.py --tokens 8192 --train-tokens 4096 8192 16384 \
                --shapes q3_qkv q3_o q3_gate q3_down q3_kv q35_attn_qkv q35_gdn_qkvz --json "$OUT/bench_kernels_rows.json" ;;
    ringtable) part steptold 120 env EPIRL_WS_CONFIGS=${OLD_TABLE:-.whl/ws_configs_old.json} python3 -P scripts/bench_trainer.py \
                --shapes qwen3-8b --bases fp8 --steps 2 --kernel-sum --json "$OUT/bench_step_oldtable.json"
              part steptnew 150 python3 -P scripts/bench_trainer.py --shapes qwen3-8b --bases fp8 bf16 --steps 2 \
                --kernel-sum --kernel-table 12 --json "$OUT/bench_step_ringtable.json"
              part trainring 240 python3 -P scripts/bench_kernels.py --tokens 8192 --train-tokens 4096 8192 16384 \
                --shapes q3_qkv q3_o q3_gate q3_down q3_kv q35_attn_qkv q35_gdn_qkvz --json "$OUT/bench_kernels_ring.json"
              part ringall 540 python3 -P -m pytest -q -m gpu $W8A16_GPU_TESTS -p no:cacheprovider
              part ringrace2 120 python3 -P scripts/race_count.py --calls ${RACE_CALLS:-100} --shapes q3_gate_up q3_down \
                --gluon 256/64/4/16/r 256/64/4/16/r/p ;;
    tunegluon) part tunegluon 540 python3 -P scripts/tune_w8a16.py --tma --gluon --buckets 1000000000 \
                --big-tokens ${BIG_TOKENS:-8192} ${TUNE_SHAPES:+--shapes $TUNE_SHAPES} --out $OUT/ws_configs.json ;;
    racecount39) part racecount39 540 env PYTHONPATH=$HOME/t39${PYTHONPATH:+:$PYTHONPATH} \
                python3 -P scripts/race_count.py --calls ${RACE_CALLS:-200} \
                --shapes ${RACE_SHAPES:-q3_qkv q3_o q3_down q3_gate} ;;
    xaprobe)  part xaprobe 420 python3 -P scripts/probe_k_chunking.py --targets 132 --xa-chunk-max ${XA_MAXES:-512 256} \
                --shapes ${PROBE_SHAPES:-q3_qkv q3_o q3_down q3_gate} --json $OUT/probe_xa_chunk.json ;;
    tune8k)   part tune8k 480 python3 -P scripts/tune_w8a16.py --tma ${TUNE_TMA_ALL:+--tma-all} --buckets 1000000000 \
                --big-tokens ${BIG_TOKENS:-8192} \
                --shapes ${TUNE_SHAPES:-q3_down q35_gdn_qkvz} --out $OUT/ws_configs_8k.json ;;
    enginebits) part enginebits 420 bash -c "[ -f ~/vllm-env.sh ] && source ~/vllm-env.sh; \
                timeout 230 python3 -P scripts/gpu_engine.py --tag main --precisions w8a16 --sections tpot --skip-smollm2; \
                timeout 150 python3 -P scripts/gpu_engine.py --tag bits --precisions w8a16 --sections layer --eager \
                --skip-smollm2" ;;
    readfloor) part readfloor 240 python3 -P scripts/bench_read_floor.py --json $OUT/read_floor.json ;;
    q35w8a16) part q35w8a16 1200 env STEPS=3 TIMEOUT=1150 bash scripts/gpu_main_recipe.sh q35w8a16 ;;
    *) echo "unknown part: $name (kernels flush tune engine mismatch serving servingall tenants decode loopk publish decodeprof q35w8a16 trainerprof b32 step hostprof kernelsq tunebig bitsgu tmaprobe tmavar tunex stepgu enginetpot widen tunedec ticket hostlaunch stepgaps gputrim train816 hostdiag step1t gpuall trainhf stepfused gpufused enginefused benchfused chunkprobe enginebits readfloor ring ringtable gluononly gluondxtable traingdx trainrows tablecheck tablenow downprof clock)" ;;
  esac
done
echo "== all parts done at $(( $(date +%s) - t0 )) s"
