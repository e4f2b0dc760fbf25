"""Tune the weight-stationary W8A16 GEMM's tile table (kernels/w8a16/ws_configs_tma.json) on the GPU.

For each Qwen3-8B / Qwen3.5-9B projection shape, op ("fwd": y = x·Wᵀ; "dx": dX = dY·W, codes read
transposed) and M bucket, times every candidate config (CUDA-graph replays, L2 flushed, a bucket's candidates
interleaved round by round: `gpu_timing.graph_us_interleaved`) at the bucket's representative token counts and keeps the fastest (sum over those counts).
Candidates differ only in tiling (BN, BM, BK, warps, stages, split-K or not), never in the K chunking, so
every entry of the table gives the same bits (tests/kernels/test_gpu_kernels.py checks it). Also prints
the cost of the chunked K loop itself at 4096 tokens (same kernel with one chunk; not batch invariant
with split-K, diagnostic only). Every candidate's output is checked bitwise against the first candidate's (a TMA
twin's on two calls).
Each candidate is timed on the call the engine and the trainer make, with a rank-64 LoRA: the forward computes
its down-projection (on the GPU at decode sizes a separate launch, with the base GEMM as its PDL dependent, split-K
or single pass as `split` says, also with LoRA; without PDL fused into split-K), dX gets
gb = g·B as xa with Aᵀ as its B (`--no-lora`: the base GEMM alone).
`--tma` adds TMA-load twins of the candidates (x and the codes through descriptors; buckets >= 256;
`kernels/w8a16/ws_tma.py`; of the tiles `configs.TMA_TUNER_TILES`, of all with `--tma-all`; a twin that gives other
bits than the first candidate is excluded), and it prints cuBLAS bf16 (+ the same LoRA as separate matmuls) on the
same shape beside the many-token bucket. `--gluon` times the Gluon kernel's configs
(`GLUON_CANDIDATES`, forward and dX: one tile a program or PERSISTENT, LoRA tiles or through the ring) beside
each many-token entry's best and sets its "gluon" to the fastest that beats it (same bits), or drops it; without it an entry keeps its
"gluon". `--shapes`/`--buckets` tune a subset and merge it into the table (`--start`: the table to start from, by
default the committed one).
Usage: python scripts/tune_w8a16.py [--out PATH] [--start PATH] [--quick] [--tma [--tma-all]] [--gluon] [--no-lora]
       [--shapes q3_qkv ...] [--buckets 256 ...] [--big-tokens 4096 8192]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, graph_us, make_layer  # noqa: E402

from epirl.kernels.w8a16.configs import TMA_TUNER_TILES, k_chunking, load_table, tile_of  # noqa: E402
from epirl.kernels.w8a16.weight_stationary import _ws_single_kernel, weight_stationary_gemm  # noqa: E402
from epirl.kernels.gpu_timing import graph_us_interleaved  # noqa: E402


def cfg(bn, bm, bk, warps, stages, split):
    return dict(BN=bn, BM=bm, BK=bk, num_warps=warps, num_stages=stages, split=split)


BIG = 1_000_000_000
# bucket bound -> (representative token counts, candidate configs)
FWD_BUCKETS = {
    16: ([1, 16], [cfg(64, 16, 128, 4, 4, True), cfg(64, 16, 256, 4, 3, True), cfg(128, 16, 128, 4, 4, True),
                   cfg(128, 16, 128, 8, 4, True), cfg(64, 16, 128, 4, 6, True), cfg(64, 16, 128, 4, 4, False),
                   # more bytes in flight per SM (the fastest plain read of a decode layer's bytes keeps ~64 KB in
                   # flight per SM, scripts/bench_read_floor.py): 96 KB pipelines, still two CTAs an SM
                   cfg(64, 16, 256, 4, 4, True), cfg(64, 16, 128, 4, 8, True), cfg(128, 16, 256, 8, 3, True)]),
    # the matched engine's batch 32 (BM 32 reads each weight tile once for the whole batch, as BM 64 does, with
    # half the wgmma width)
    32: ([32], [cfg(64, 32, 128, 4, 4, True), cfg(128, 32, 128, 8, 3, True), cfg(64, 32, 256, 4, 3, True),
                cfg(64, 64, 128, 4, 4, True), cfg(128, 64, 128, 8, 3, True), cfg(64, 32, 128, 4, 4, False),
                cfg(64, 32, 256, 4, 4, True), cfg(64, 32, 128, 4, 6, True)]),
    64: ([64], [cfg(64, 64, 128, 4, 4, True), cfg(128, 64, 128, 8, 3, True), cfg(64, 64, 128, 4, 4, False),
                cfg(64, 32, 128, 4, 4, True)]),
    256: ([256], [cfg(64, 64, 128, 4, 4, False), cfg(128, 64, 128, 4, 3, False), cfg(128, 128, 64, 8, 4, False),
                  cfg(64, 128, 128, 4, 3, False)]),
    # (16-warp tiles, 256/128/64/16/3 and 128/256/64/16/3, never won on the H200: capped at 128
    # registers a thread, they spill 72-78)
    BIG: ([4096], [cfg(128, 128, 64, 8, 4, False), cfg(128, 256, 64, 8, 3, False), cfg(128, 256, 64, 8, 4, False),
                   cfg(256, 128, 64, 8, 3, False), cfg(128, 128, 128, 8, 3, False), cfg(128, 256, 128, 8, 2, False),
                   # BK 32: a third less spilled (304 vs 472 B of stack at sm_90a, triton 3.9) for 27 % more loop
                   # instructions per k (137 per 32-deep trip vs 216 per 64)
                   cfg(128, 256, 32, 8, 4, False)]),
}
DX_BUCKETS = {256: FWD_BUCKETS[256], BIG: FWD_BUCKETS[BIG]}
# `--gluon`: the warp-specialized Gluon kernel's configs timed beside the many-token bucket's best Triton config
# (kernels/w8a16/ws_gluon.py; LORA_RING: the LoRA ranks through the k-step
# ring, which lets the fused qkv's rank 192 keep 256-token tiles - timed here at rank 64, one ring step)
# PERSISTENT: a program per SM over many tiles, the LoRA through the ring (codes widened in shared memory lost to the
# register form by 1-8 %: kernels/README.md, What we tried)
GLUON_CANDIDATES = [dict(BM=256, BK=64, num_stages=4, GROUP_N=16), dict(BM=128, BK=64, num_stages=4, GROUP_N=16),
                    dict(BM=256, BK=64, num_stages=4, GROUP_N=16, LORA_RING=True),
                    dict(BM=256, BK=64, num_stages=4, GROUP_N=16, LORA_RING=True, PERSISTENT=True),
                    dict(BM=128, BK=64, num_stages=4, GROUP_N=16, LORA_RING=True, PERSISTENT=True)]
EXTRA_SHAPES = [("q3_kv_slice", 4096, 1024)]  # the engine calls k and v of the fused qkv per slice


def time_config(op, x, codes, scale, c, lora):
    w = codes if op == "fwd" else codes.t()
    return graph_us(lambda: weight_stationary_gemm(x, w, torch.bfloat16, w_scale=scale, config=c, op=op, **lora))


def lora_args(op, x, a, b) -> dict:
    """The LoRA part of the real call (none without a, b): forward x·Aᵀ then ·Bᵀ; dX gb·A with gb = x·B."""
    if a is None:
        return {}
    if op == "fwd":
        return dict(lora_a=a, lora_b=b, lora_scale=2.0)
    return dict(xa=(x @ b).to(x.dtype), lora_b=a.t(), lora_scale=2.0)


def one_chunk_us(x, w, scale, c):
    """The single-pass kernel with the whole K in one chunk (one accumulator): the chunking's cost."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
    tiles = -(-M // c["BM"]) * -(-N // c["BN"])
    k_all = -(-K // 256) * 256

    def run():
        _ws_single_kernel[(tiles,)](x, w, y, scale, y, y, y, M, N, K, 0, k_all, 1, 1.0, x.stride(0), x.stride(1),
                                    w.stride(0), w.stride(1), y.stride(0), y.stride(1), 0, 0, 0, 0,
                                    HAS_W_SCALE=True, HAS_LORA=False, HAS_BIAS=False, DOT_F32=False, BN=c["BN"],
                                    BM=c["BM"], BK=c["BK"], BR=16, GROUP_N=8, EVEN_K=k_all == K,
                                    EVEN_N=N % c["BN"] == 0, num_warps=c["num_warps"], num_stages=c["num_stages"])
    return graph_us(run)


def with_twins(cands, tma=False):
    """The pointer-load candidates plus, with tma, the TMA twin (same tile, x and the codes through descriptors;
    `kernels/w8a16/ws_tma.py`) of the tiles worth timing (`configs.TMA_TUNER_TILES`; of every tile with tma="all")."""
    twins = [dict(c, tma=True) for c in cands if tile_of(c) in TMA_TUNER_TILES or tma == "all"] if tma else []
    return cands + twins


def describe(c):
    tile = "/".join(str(c[k]) for k in ("BN", "BM", "BK", "num_warps", "num_stages"))
    return tile + (" split" if c["split"] else "") + (" tma" if c.get("tma") else "")


def compiled_kernels() -> dict:
    """Every compiled GEMM kernel so far (id -> CompiledKernel): registers and spills of a new compile are
    printed beside the candidate that caused it (a spilling accumulator explains a slow tile)."""
    from epirl.kernels.w8a16.ws_tma import _ws_tma_kernel
    found = {}
    for fn in (_ws_single_kernel, _ws_tma_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for k in (cache[0].values() if isinstance(cache, tuple) else []):
                found[id(k)] = k
    return found


def report_new_compiles(before: dict, what: str, log: list) -> None:
    for key, k in compiled_kernels().items():
        if key in before:
            continue
        regs, spills = getattr(k, "n_regs", None), getattr(k, "n_spills", None)
        shared = getattr(getattr(k, "metadata", None), "shared", None)
        print(f"#   compiled {getattr(k, 'name', '?')} for {what}: {regs} regs, {spills} spills, {shared} B smem",
              flush=True)
        log.append(dict(compiled=what, kernel=getattr(k, "name", "?"), n_regs=regs, n_spills=spills, shared=shared))


def time_candidates(name, op, codes, scale, x, cands, log, entry, lora=None):
    """Times every candidate at x (with `lora`, see lora_args); each must give the first one's bits (the table's
    contract). The candidates that run are timed together (`graph_us_interleaved`): timed one after another, drift
    between them decided close calls."""
    lora = lora or {}
    w = codes if op == "fwd" else codes.t()
    runs, first = [], None
    for c in cands:
        before = compiled_kernels()
        call = functools.partial(weight_stationary_gemm, x, w, torch.bfloat16, w_scale=scale, config=c, op=op, **lora)
        try:
            y = call()
            report_new_compiles(before, f"{op} {describe(c)}", log)
        except Exception as err:  # e.g. out of shared memory: not a candidate here
            print(f"# {name} {op} {describe(c)}: {type(err).__name__}: {str(err)[:160]}", flush=True)
            continue
        if c.get("tma"):  # the TMA kernel's miscompiles were races: its bits must hold on a second call too
            y = y if torch.equal(y, call()) else torch.full_like(y, float("nan"))
        first = y if first is None else first
        if not torch.equal(y, first):  # never a table entry; loud, but the other candidates still run
            print(f"# BITS DIFFER: {name} {op} {describe(c)} vs {describe(runs[0][0])}: excluded", flush=True)
            log.append(dict(entry, config=c, bits_differ=True))
            continue
        runs.append((c, call))
    timed = list(zip(graph_us_interleaved([call for _, call in runs]), [c for c, _ in runs]))
    log.extend(dict(entry, config=c, us=us) for us, c in timed)
    return timed


def gluon_runs(op, x, codes, lora, g) -> bool:
    """Whether the Gluon kernel runs this call in config g as it is (`ws_gluon.fitting_config`: a CUDA call on a
    Triton with Gluon's Hopper API, TMA-aligned operands, the ring and LoRA tiles in shared memory)."""
    if not x.is_cuda:
        return False
    try:
        from epirl.kernels.w8a16 import ws_gluon
    except (ImportError, AttributeError):
        return False
    from epirl.kernels.w8a16.weight_stationary import _epilogue_rows, lora_down, whole_k
    N, K = codes.shape
    if op == "fwd":
        w, (k_chunk, n_chunks), n_out = codes, k_chunking(N, K), N
        xa = lora_down(x, lora["lora_a"], N) if lora else None
    else:
        w, (k_chunk, n_chunks), n_out = codes.t(), whole_k(N), K
        xa = lora.get("xa")
    y = torch.empty(x.shape[0], n_out, device=x.device, dtype=torch.bfloat16)
    br = _epilogue_rows(xa.shape[1]) if xa is not None else 16
    return ws_gluon.fitting_config(x, w, y, xa, lora.get("lora_b"), k_chunk, n_chunks, g, br) == g


def tune_gluon(name, op, codes, scale, xs_loras, best, log, entry):
    """best with the fastest Gluon config (`GLUON_CANDIDATES`, same bits as best) as its "gluon" where one beats it;
    "gluon": None where the candidates ran and none did; best without the key where none could run here (the old
    entry's "gluon" then stays). xs_loras: (x, lora) per token count of the bucket."""
    base = {k: v for k, v in best.items() if k != "gluon"}
    runnable = [g for g in GLUON_CANDIDATES if all(gluon_runs(op, x, codes, lora, g) for x, lora in xs_loras)]
    if not runnable:
        return base
    timed = timed_totals(name, op, codes, scale, xs_loras, [base] + [dict(base, gluon=g) for g in runnable], log,
                         entry)
    fastest = min(timed, key=lambda t: t[0])[1]
    for us, c in sorted(timed, key=lambda t: t[0]):
        print(f"#   {name} {op} gluon {c.get('gluon', 'none (Triton)')}: {us:.1f} µs", flush=True)
    return dict(base, gluon=fastest.get("gluon"))


def timed_totals(name, op, codes, scale, xs_loras, cands, log, entry) -> list:
    """(µs summed over the bucket's token counts, config) of each candidate that ran, with the same bits as the
    first, at every (x, lora) of xs_loras (`time_candidates`)."""
    totals: dict[int, list] = {}
    for x, lora in xs_loras:
        for us, c in time_candidates(name, op, codes, scale, x, cands, log, dict(entry, tokens=x.shape[0]), lora):
            totals.setdefault(id(c), [0.0, c, 0])[0] += us
            totals[id(c)][2] += 1
    return [(us, c) for us, c, n in totals.values() if n == len(xs_loras)]


def cublas_us(op, x, codes, scale, lora=None):
    """The vendor path a user would pick instead: cuBLAS bf16 on a bf16 copy of the same weight, plus the same
    LoRA term as separate matmuls when the candidates were timed with one (`lora_args`)."""
    w16 = (codes.float() * scale).bfloat16()
    base = (lambda: x @ w16.t()) if op == "fwd" else (lambda: x @ w16)
    if not lora:
        return graph_us(base)
    b_t, s = lora["lora_b"].t(), lora["lora_scale"]
    xa = (lambda: x @ lora["lora_a"].t()) if op == "fwd" else (lambda: lora["xa"])
    return graph_us(lambda: base() + s * (xa() @ b_t))


def tune_shape(name, K, N, log, bounds=None, tma=False, with_lora=True, gluon=False, kept=None):
    """kept (`--gluon-only`): {op: the table's many-token entry}, the one Triton candidate of that bucket (its
    "gluon" decided anew); other buckets are skipped."""
    _, codes, scale, a, b = make_layer(K, N)
    if not with_lora:
        a = b = None
    rows = {}
    for op, buckets in (("fwd", FWD_BUCKETS), ("dx", DX_BUCKETS)):
        n_out, k_red = (N, K) if op == "fwd" else (K, N)
        row = {}
        for bound, (tokens, cands) in buckets.items():
            if (bounds and bound not in bounds) or (kept is not None and bound != BIG):
                continue
            cands = with_twins(cands, tma) if bound >= 256 else cands
            if kept is not None:
                cands = [{k: v for k, v in kept[op].items() if k != "gluon"}]
            xs = [torch.randn(M, k_red, device="cuda", dtype=torch.bfloat16) for M in tokens]
            xs_loras = [(x, lora_args(op, x, a, b)) for x in xs]
            x, lora = xs_loras[-1]
            entry = dict(shape=name, op=op, N=n_out, K=k_red, bucket=bound)
            timed = timed_totals(name, op, codes, scale, xs_loras, cands, log, entry)
            best_us, best = min(timed, key=lambda t: t[0])
            if gluon and bound == BIG:
                best = tune_gluon(name, op, codes, scale, xs_loras, best, log, entry)
            row[str(bound)] = best
            ref = f" | {cublas_us(op, x, codes, scale, lora):.1f}" if bound == BIG else " | –"
            if tma and bound >= 256:  # best of each kernel kind: what TMA loads bought
                kinds = {kind: [t for t in timed if t[1].get("tma", False) == mode]
                         for kind, mode in (("ptr", False), ("tma", True))}
                ref += " | " + ", ".join(f"{k} {min(v, key=lambda t: t[0])[0]:.1f}" for k, v in kinds.items() if v)
            print(f"| {name} | {op} | ≤{bound} | {tokens} | {best_us:.1f} | {describe(best)} | "
                  f"{max(t[0] for t in timed):.1f}{ref} |", flush=True)
            if bound == BIG and not tma:
                w = codes if op == "fwd" else codes.t()
                one = one_chunk_us(x, w, scale, best)  # base GEMM only: compare with the same call chunked
                chunked = time_config(op, x, codes, scale, best, {}) if lora else best_us
                log.append(dict(shape=name, op=op, diagnostic="one_chunk", chunks=k_chunking(n_out, k_red)[1],
                                us=one, chunked_us=chunked))
                print(f"#   {name} {op} {x.shape[0]} tok, no LoRA: {k_chunking(n_out, k_red)[1]} chunks {chunked:.1f} µs, "
                      f"one chunk {one:.1f} µs", flush=True)
        rows[op] = (f"{n_out}x{k_red}", row)
    del codes
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ws_configs_tma.json"))
    ap.add_argument("--start", default=None, help="the table to start from and merge into (default: the committed one)")
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--shapes", nargs="*", help="shape names (default: all)")
    ap.add_argument("--buckets", nargs="*", type=int, help="bucket bounds to tune (default: all; 1000000000 = many)")
    ap.add_argument("--tma", action="store_true", help="also TMA-load candidates for buckets >= 256")
    ap.add_argument("--tma-all", action="store_true", help="with --tma: twins of every tile, not only TMA_TUNER_TILES")
    ap.add_argument("--no-lora", action="store_true", help="time the base GEMM alone (no rank-64 LoRA)")
    ap.add_argument("--big-tokens", type=int, nargs="+", default=None,
                    help="token counts timed for the many-token bucket (default 4096; the trainer's steps run 8192)")
    ap.add_argument("--gluon", action="store_true",
                    help="time the Gluon kernel's configs (GLUON_CANDIDATES) beside the many-token bucket's best, forward "
                         "and dX, and set or drop each entry's \"gluon\" by the result")
    ap.add_argument("--gluon-only", action="store_true",
                    help="--gluon against the table's own many-token entries: no Triton config is re-tuned")
    args = ap.parse_args()
    args.gluon = args.gluon or args.gluon_only
    if args.big_tokens:
        for buckets in (FWD_BUCKETS, DX_BUCKETS):
            buckets[BIG] = (args.big_tokens, buckets[BIG][1])
    table = json.loads(json.dumps(load_table(args.start)))  # a copy: the loaded table is cached
    log = []
    t0 = time.time()
    print("| shape | op | bucket | tokens | best µs | BN/BM/BK/warps/stages | worst µs | cuBLAS bf16 µs (many) "
          "| best per kernel kind µs (--tma) |\n|---|---|---|---|---|---|---|---|---|")
    shapes = (SHAPES + EXTRA_SHAPES)[:2] if args.quick else SHAPES + EXTRA_SHAPES
    shapes = [s for s in shapes if not args.shapes or s[0] in args.shapes]
    for name, K, N in shapes:
        tma = "all" if args.tma and args.tma_all else args.tma
        kept = None
        if args.gluon_only:  # the entry of the starting table (`ws_config`'s key: "{N}x{K}" of the op's output)
            kept = {op: table[op].get(f"{n}x{k}", table[op]["default"])[str(BIG)]
                    for op, n, k in (("fwd", N, K), ("dx", K, N))}
        for op, (key, row) in tune_shape(name, K, N, log, args.buckets, tma, not args.no_lora, args.gluon,
                                         kept).items():
            old = table[op].setdefault(key, {})
            old.update({b: merged_entry(old.get(b, {}), c) for b, c in row.items()})
        print(f"# {name} done at {time.time() - t0:.0f}s", flush=True)
        write_outputs(args.out, table, log)  # after every shape: a run cut by a time limit keeps what it tuned


def merged_entry(old: dict, tuned: dict) -> dict:
    """The table entry for a tuned config: its "gluon" as `tune_gluon` decided (None: dropped), or, where the Gluon
    kernel was not timed, the old entry's "gluon" (a copy: candidates are shared between entries)."""
    if "gluon" in tuned:
        return {k: v for k, v in tuned.items() if k != "gluon" or v is not None}
    return dict(tuned, gluon=old["gluon"]) if "gluon" in old else dict(tuned)


def write_outputs(path, table, log):
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.splitext(path)[0] + "_log.json", "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, log=log), f, indent=1)


if __name__ == "__main__":
    main()
