"""Which weight-stationary tile configs give the pointer kernel's bits, and by how much the others differ (GPU).

For each config (pointer loads, and its TMA twin `tma=True`), forward (with LoRA + bias) and dX, at a ragged and a
many-token M, compares the output with the reference
config's (pointer loads, 128/128/64/8/4): equal or not, how many elements differ, the largest difference in bf16
ulps of the element, and each side's error against a float64 product (so a rounding-order difference reads as
~1 ulp on both sides and a wrong load as large).
Usage: python scripts/ws_bits_report.py [--shape K N] [--tokens 257 4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_w8a16 import FWD_BUCKETS, BIG, describe  # noqa: E402

from epirl.kernels import quantize_weight_fp8  # noqa: E402
from epirl.kernels.gemm.weight_stationary import lora_down, weight_stationary_gemm  # noqa: E402

REF = dict(BN=128, BM=128, BK=64, num_warps=8, num_stages=4, split=False)


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of want's bf16 ulp (2^(exponent - 7))."""
    w = want.float()
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs().clamp_min(2.0 ** -100))[1] - 8)
    return ((got.float() - w).abs() / ulp).max().item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs=2, type=int, default=[4096, 4096], metavar=("K", "N"))
    ap.add_argument("--tokens", nargs="+", type=int, default=[257, 4096])
    args = ap.parse_args()
    K, N = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g, device="cuda") * 0.02)
    a = (torch.randn(64, K, generator=g, device="cuda") / K ** 0.5).bfloat16()
    b = (torch.randn(N, 64, generator=g, device="cuda") * 0.05).bfloat16()
    bias = torch.randn(N, generator=g, device="cuda").bfloat16()
    cands = FWD_BUCKETS[BIG][1] + FWD_BUCKETS[256][1]
    cands = cands + [dict(c, tma=True) for c in cands]
    w64 = codes.double() * scale.double()
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, K={K} N={N}")
    print("| op | M | config | equal | differing | max ulps vs ref config | max ulps vs fp64 (this / ref) |")
    print("|---|---|---|---|---|---|---|")
    for M in args.tokens:
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        gy = torch.randn(M, N, generator=g, device="cuda").bfloat16()
        xa = lora_down(x, a, chunk_n=N)
        fwd_args = dict(w_scale=scale, xa=xa, lora_b=b, lora_scale=2.0, bias=bias)
        exact = {"fwd": (x.double() @ w64.t() + 2.0 * (xa.double() @ b.double().t()) + bias.double()),
                 "dx": gy.double() @ w64}
        runs = {"fwd": lambda c: weight_stationary_gemm(x, codes, torch.bfloat16, config=c, allow_split=False,
                                                        **fwd_args),
                "dx": lambda c: weight_stationary_gemm(gy, codes.t(), torch.bfloat16, w_scale=scale, config=c,
                                                       op="dx")}
        for op, run in runs.items():
            ref = run(REF)
            ref_err = ulps(ref, exact[op].bfloat16())
            for c in cands:
                try:
                    y = run(c)
                    torch.cuda.synchronize()
                except Exception as err:
                    print(f"| {op} | {M} | {describe(c)} | error: {type(err).__name__}: {str(err)[:80]} | | | |")
                    continue
                diff = int((y != ref).sum())
                print(f"| {op} | {M} | {describe(c)} | {diff == 0} | {diff} | {ulps(y, ref):.2f} | "
                      f"{ulps(y, exact[op].bfloat16()):.2f} / {ref_err:.2f} |", flush=True)


if __name__ == "__main__":
    main()
