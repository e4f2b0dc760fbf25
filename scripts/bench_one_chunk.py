"""What the forward's fixed K chunking costs and buys (issue 12), on the GPU, in one run.

The weight-stationary forward sums K in `k_chunking(N, K)` chunks (each from zero, added in order) so that the
few-token split-K path and the many-token single pass give the same bits. Two accumulators ("total" and the
chunk's) are what make the 128×256 training tiles spill (tune_w8a16's register report). The alternative contract
is one chunk for every M: no split-K at decode (parallelism only from BN-row weight tiles) and one accumulator
in training. This measures both sides of that trade, W8A16 without LoRA, CUDA-graph replay, L2 flushed:
- decode (1, 16 tokens): today's path (table config, split-K partials + ordered reduce) vs one chunk, single
  pass, for a few BN=64 configs;
- training (4096 tokens): the table config chunked vs the same tiles with one chunk, pointer loads and TMA loads
  (`kernels/gemm/ws_tma.py`), with cuBLAS bf16 on the same shape beside them.
Usage: python scripts/bench_one_chunk.py [--shapes q3_qkv ...]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, make_layer  # noqa: E402
from tune_w8a16 import cublas_us, one_chunk_us  # noqa: E402

from epirl.kernels.gemm.configs import k_chunking, ws_config  # noqa: E402
from epirl.kernels.gemm.weight_stationary import weight_stationary_gemm  # noqa: E402
from epirl.kernels.gemm.ws_tma import launch_tma_single  # noqa: E402
from epirl.kernels.gpu_timing import graph_us  # noqa: E402

TRAIN_M = 4096
DECODE_ONE_CHUNK = [dict(BN=64, BM=16, BK=128, num_warps=4, num_stages=4),
                    dict(BN=64, BM=16, BK=256, num_warps=4, num_stages=3),
                    dict(BN=64, BM=16, BK=128, num_warps=4, num_stages=6)]


def tma_one_chunk_us(x, codes, scale, cfg):
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
    flags = dict(HAS_W_SCALE=True, HAS_LORA=False, HAS_BIAS=False, DOT_F32=False, BN=cfg["BN"], BM=cfg["BM"], BR=16,
                 GROUP_N=8)
    k_all = -(-K // 256) * 256
    return graph_us(lambda: launch_tma_single(x, codes, y, scale, None, y, y, M, N, K, 0, k_all, 1, 1.0, (0, 0),
                                              cfg, flags))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["q3_qkv", "q3_o", "q3_down", "q35_attn_qkv"])
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}\n\n| shape | chunks | tokens | today µs | one chunk µs (best) | config |\n"
          "|---|---|---|---|---|---|")
    train = []
    for name, K, N in [s for s in SHAPES if s[0] in args.shapes]:
        _, codes, scale, _, _ = make_layer(K, N)
        chunks = k_chunking(N, K)[1]
        for M in (1, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            today = graph_us(lambda: weight_stationary_gemm(x, codes, torch.bfloat16, w_scale=scale))
            best = min(((one_chunk_us(x, codes, scale, c), c) for c in DECODE_ONE_CHUNK), key=lambda t: t[0])
            print(f"| {name} | {chunks} | {M} | {today:.1f} | {best[0]:.1f} | "
                  f"{best[1]['BN']}/{best[1]['BM']}/{best[1]['BK']}/{best[1]['num_warps']}/{best[1]['num_stages']} |",
                  flush=True)
        x = torch.randn(TRAIN_M, K, device="cuda", dtype=torch.bfloat16)
        cfg = dict(ws_config("fwd", N, K, TRAIN_M))
        row = dict(shape=name, chunks=chunks, cfg=cfg)
        row["chunked"] = graph_us(lambda: weight_stationary_gemm(x, codes, torch.bfloat16, w_scale=scale))
        row["one"] = one_chunk_us(x, codes, scale, cfg)
        row["tma_chunked"] = graph_us(lambda: weight_stationary_gemm(x, codes, torch.bfloat16, w_scale=scale,
                                                                     config=dict(cfg, tma=True)))
        row["tma_one"] = tma_one_chunk_us(x, codes, scale, cfg)
        row["cublas"] = cublas_us("fwd", x, codes, scale)
        train.append(row)
        del codes
        torch.cuda.empty_cache()
    print("\n| shape (4096 tokens, fwd) | chunks | chunked µs | one chunk µs | TMA chunked µs | TMA one chunk µs "
          "| cuBLAS bf16 µs | best / cuBLAS |\n|---|---|---|---|---|---|---|---|")
    for r in train:
        best = min(r["chunked"], r["one"], r["tma_chunked"], r["tma_one"])
        print(f"| {r['shape']} | {r['chunks']} | {r['chunked']:.1f} | {r['one']:.1f} | {r['tma_chunked']:.1f} | "
              f"{r['tma_one']:.1f} | {r['cublas']:.1f} | {best / r['cublas']:.2f} |")


if __name__ == "__main__":
    main()
