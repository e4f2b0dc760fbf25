"""Where the FP8 trainer linear's time goes (H200): per-kernel CUDA time of one Fp8LoRALinear forward +
backward against the frozen bf16 Linear + LoRA it replaces, from torch.profiler, same process.

For each shape: the step's total CUDA µs and every kernel's µs per step (mean over the profiled steps), so a
miss against bf16 can be pinned on a kernel (the base GEMMs, the LoRA pieces, casts, copies).
Usage: python scripts/profile_trainer_linear.py [--shapes q3_qkv q3_o ...] [--tokens 4096] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import ALPHA, RANK, SHAPES, make_layer  # noqa: E402

from epirl.kernels import Fp8LoRALinear  # noqa: E402


def kernel_us_per_step(step, steps: int) -> dict[str, float]:
    """CUDA kernel name -> µs per step, over `steps` profiled steps after two warm-ups."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:70]] += event.device_time / steps
    return dict(per_kernel)


def profile_shape(name: str, K: int, N: int, M: int, steps: int) -> None:
    sigma = ALPHA / RANK
    w16, codes, scale, a, b = make_layer(K, N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8LoRALinear(codes, scale, a.clone(), b.clone(), sigma)
    a16, b16 = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())

    def fp8_step():
        fp8(x).backward(gy)
        x.grad = fp8.lora_A.grad = fp8.lora_B.grad = None

    def bf16_step():
        (F.linear(x, w16) + sigma * F.linear(F.linear(x, a16), b16)).backward(gy)
        x.grad = a16.grad = b16.grad = None

    for tag, step in (("fp8", fp8_step), ("bf16", bf16_step)):
        kernels = kernel_us_per_step(step, steps)
        total = sum(kernels.values())
        print(f"\n### {name} K={K} N={N} M={M} {tag}: {total:.0f} µs of kernels per step")
        print("| kernel | µs/step | share |\n|---|---|---|")
        for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            if us >= 2.0:
                print(f"| `{kname}` | {us:.1f} | {us / total:.0%} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["q3_qkv", "q3_o", "q3_gate_up"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    by_name = {s[0]: s for s in SHAPES}
    unknown = [s for s in args.shapes if s not in by_name]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {sorted(by_name)}")
    print(torch.cuda.get_device_name(), torch.__version__)
    for s in args.shapes:
        profile_shape(*by_name[s], args.tokens, args.steps)


if __name__ == "__main__":
    main()
