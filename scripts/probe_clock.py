"""Does the W8A16 training GEMM run at a lower SM clock than cuBLAS bf16 (power), or at the same clock doing less per
cycle? Issue 12's ceiling question: every W8A16 training kernel runs at ~590–620 TFLOP/s whatever the shape, and the
SASS of the Gluon k-step (`scripts/sass_report.py --gluon`) issues ~124 instructions a warp per 64-deep step, a
quarter of the scheduler slots the wgmmas leave, so instruction issue alone does not explain it.

On the GPU, per shape at --tokens: cuBLAS bf16 (`x @ w16.t()`, a bf16 copy of the weight made for this comparison)
and the W8A16 forward through the committed table (`weight_stationary_gemm`, no LoRA), each run back to back for
--seconds while `nvidia-smi` samples the SM clock and the board power every 50 ms; the two alternate --rounds times
(drift shows as a difference between rounds). Per run: TFLOP/s, mean SM MHz, mean W, and TFLOP/s per GHz — the work
per clock, which a power-capped clock does not change.

    python scripts/probe_clock.py [--shapes q3_down q3_gate_up] [--tokens 8192] [--seconds 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, make_layer  # noqa: E402


def sustained(fn, seconds: float) -> tuple[float, float, float]:
    """(seconds per call, mean SM MHz, mean W) over `seconds` of back-to-back calls, clocks sampled by nvidia-smi."""
    fn()
    torch.cuda.synchronize()
    index = torch.cuda.current_device()
    smi = subprocess.Popen(["nvidia-smi", "-i", str(index), "--query-gpu=clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)  # nvidia-smi's first sample; the GPU is idle until here
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    smi.terminate()
    out, _ = smi.communicate()
    samples = [tuple(float(v) for v in line.split(",")) for line in out.strip().splitlines()[6:] if "," in line]
    if not samples:
        return elapsed / calls, float("nan"), float("nan")
    mhz = sum(s[0] for s in samples) / len(samples)
    watts = sum(s[1] for s in samples) / len(samples)
    return elapsed / calls, mhz, watts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["q3_down", "q3_gate_up"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from epirl.kernels.gemm.weight_stationary import weight_stationary_gemm
    by_name = {s[0]: s for s in SHAPES}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; forward, {args.tokens} tokens, no LoRA")
    print("| shape | kernel | round | µs | TFLOP/s | SM MHz | W | TFLOP/s per GHz |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        _, K, N = by_name[name]
        w16, codes, scale, _, _ = make_layer(K, N)
        x = torch.randn(args.tokens, K, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(args.tokens, N, device="cuda", dtype=torch.bfloat16)
        kernels = {"cuBLAS bf16": lambda: torch.matmul(x, w16.t(), out=y),
                   "W8A16 (table)": lambda: weight_stationary_gemm(x, codes, w_scale=scale, out=y, op="fwd")}
        flops = 2.0 * args.tokens * K * N
        for r in range(args.rounds):
            for label, fn in kernels.items():
                sec, mhz, watts = sustained(fn, args.seconds)
                tflops = flops / sec / 1e12
                print(f"| {name} | {label} | {r} | {sec * 1e6:.1f} | {tflops:.0f} | {mhz:.0f} | {watts:.0f} | "
                      f"{tflops / (mhz / 1000):.0f} |", flush=True)


if __name__ == "__main__":
    main()
