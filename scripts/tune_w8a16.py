"""Tune the weight-stationary W8A16 GEMM's tile table (kernels/gemm/ws_configs.json) on the GPU.

For each Qwen3-8B / Qwen3.5-9B projection shape, op ("fwd": y = x·Wᵀ; "dx": dX = dY·W, codes read
transposed) and M bucket, times every candidate config (CUDA-graph replay, L2 flushed: bench_kernels'
`graph_us`) at the bucket's representative token counts and keeps the fastest (sum over those counts).
Candidates differ only in tiling (BN, BM, BK, warps, stages, split-K or not), never in the K chunking, so
every entry of the table gives the same bits (tests/kernels/test_gpu_kernels.py checks it). Also prints
the cost of the chunked K loop itself at 4096 tokens (same kernel with one chunk; not batch invariant
with split-K, diagnostic only).
Usage: python scripts/tune_w8a16.py [--out PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, graph_us, make_layer  # noqa: E402

from epirl.kernels.gemm.configs import k_chunking, load_table  # noqa: E402
from epirl.kernels.gemm.weight_stationary import _ws_single_kernel, weight_stationary_gemm  # noqa: E402


def cfg(bn, bm, bk, warps, stages, split):
    return dict(BN=bn, BM=bm, BK=bk, num_warps=warps, num_stages=stages, split=split)


BIG = 1_000_000_000
# bucket bound -> (representative token counts, candidate configs)
FWD_BUCKETS = {
    16: ([1, 16], [cfg(64, 16, 128, 4, 4, True), cfg(64, 16, 256, 4, 3, True), cfg(128, 16, 128, 4, 4, True),
                   cfg(128, 16, 128, 8, 4, True), cfg(64, 16, 128, 4, 6, True), cfg(64, 16, 128, 4, 4, False)]),
    64: ([64], [cfg(64, 64, 128, 4, 4, True), cfg(128, 64, 128, 8, 3, True), cfg(64, 64, 128, 4, 4, False),
                cfg(64, 32, 128, 4, 4, True)]),
    256: ([256], [cfg(64, 64, 128, 4, 4, False), cfg(128, 64, 128, 4, 3, False), cfg(128, 128, 64, 8, 4, False),
                  cfg(64, 128, 128, 4, 3, False)]),
    BIG: ([4096], [cfg(128, 128, 64, 8, 4, False), cfg(128, 256, 64, 8, 3, False), cfg(128, 256, 64, 8, 4, False),
                   cfg(256, 128, 64, 8, 3, False), cfg(128, 128, 128, 8, 3, False), cfg(128, 256, 128, 8, 2, False)]),
}
DX_BUCKETS = {256: FWD_BUCKETS[256], BIG: FWD_BUCKETS[BIG]}
EXTRA_SHAPES = [("q3_kv_slice", 4096, 1024)]  # the engine calls k and v of the fused qkv per slice


def time_config(op, x, codes, scale, c):
    w = codes if op == "fwd" else codes.t()
    return graph_us(lambda: weight_stationary_gemm(x, w, torch.bfloat16, w_scale=scale, config=c, op=op))


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
                                    BM=c["BM"], BK=c["BK"], BR=16, GROUP_N=8, num_warps=c["num_warps"],
                                    num_stages=c["num_stages"])
    return graph_us(run)


def tune_shape(name, K, N, log):
    _, codes, scale, _, _ = make_layer(K, N)
    rows = {}
    for op, buckets in (("fwd", FWD_BUCKETS), ("dx", DX_BUCKETS)):
        n_out, k_red = (N, K) if op == "fwd" else (K, N)
        row = {}
        for bound, (tokens, cands) in buckets.items():
            xs = {M: torch.randn(M, k_red, device="cuda", dtype=torch.bfloat16) for M in tokens}
            timed = []
            for c in cands:
                try:
                    us = sum(time_config(op, xs[M], codes, scale, c) for M in tokens)
                except Exception as err:  # e.g. out of shared memory: not a candidate here
                    print(f"# {name} {op} {c}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                    continue
                timed.append((us, c))
                log.append(dict(shape=name, op=op, N=n_out, K=k_red, bucket=bound, tokens=tokens, config=c, us=us))
            best_us, best = min(timed, key=lambda t: t[0])
            row[str(bound)] = best
            print(f"| {name} | {op} | ≤{bound} | {tokens} | {best_us:.1f} | "
                  f"{'/'.join(str(best[k]) for k in ('BN', 'BM', 'BK', 'num_warps', 'num_stages'))}"
                  f"{' split' if best['split'] else ''} | {max(t[0] for t in timed):.1f} |", flush=True)
            if bound == BIG:
                w = codes if op == "fwd" else codes.t()
                one = one_chunk_us(xs[tokens[0]], w, scale, best)
                log.append(dict(shape=name, op=op, diagnostic="one_chunk", chunks=k_chunking(n_out, k_red)[1],
                                us=one, chunked_us=best_us))
                print(f"#   {name} {op} 4096 tok: {k_chunking(n_out, k_red)[1]} chunks {best_us:.1f} µs, "
                      f"one chunk {one:.1f} µs", flush=True)
        rows[op] = (f"{n_out}x{k_red}", row)
    del codes
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "ws_configs.json"))
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    args = ap.parse_args()
    table = json.loads(json.dumps(load_table()))  # start from the committed defaults
    log = []
    t0 = time.time()
    print("| shape | op | bucket | tokens | best µs | BN/BM/BK/warps/stages | worst µs |\n|---|---|---|---|---|---|---|")
    shapes = (SHAPES + EXTRA_SHAPES)[:2] if args.quick else SHAPES + EXTRA_SHAPES
    for name, K, N in shapes:
        for op, (key, row) in tune_shape(name, K, N, log).items():
            table[op][key] = row
        print(f"# {name} done at {time.time() - t0:.0f}s", flush=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.splitext(args.out)[0] + "_log.json", "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), log=log), f, indent=1)


if __name__ == "__main__":
    main()
