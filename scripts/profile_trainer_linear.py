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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, make_layer, trainer_steps  # noqa: E402


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
    for tag, (step, params) in trainer_steps(K, N, M, *make_layer(K, N)).items():
        def step_and_clear(step=step, params=params):
            step()
            for p in params:
                p.grad = None

        kernels = kernel_us_per_step(step_and_clear, steps)
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
