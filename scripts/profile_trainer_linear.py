"""Where the FP8 trainer linear's time goes (H200): per-kernel CUDA time of one Fp8LoRALinear forward +
backward against the frozen bf16 Linear + LoRA it replaces, from torch.profiler, same process.

For each shape: the step's total CUDA µs and every kernel's µs per step (mean over the profiled steps), so a
miss against bf16 can be pinned on a kernel (the base GEMMs, the LoRA pieces, casts, copies), then one line per side
that says whether the host keeps the GPU fed: the step's wall time (`triton.testing.do_bench`, L2 flushed, as
bench_kernels times it), its kernel sum, and the host's enqueue time for it (the step called while the GPU is held
busy by a sleep kernel, so no launch waits for the GPU: Python, autograd and Triton's launcher alone). When the
host time is near or above the kernel sum, the GPU idles between launches.
Usage: python scripts/profile_trainer_linear.py [--shapes q3_qkv q3_o ...] [--tokens 1024 4096] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, TRAINER_SHAPES, bench_us, kernel_us_per_step, make_layer, trainer_steps  # noqa: E402


def host_enqueue_us(step, params, reps: int = 15) -> float:
    """Median host time of one step while the GPU is busy (a sleep kernel queued first): launches only queue."""
    times = []
    for _ in range(reps):
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time at H200 clocks: longer than any step's enqueue
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def host_profile(name: str, K: int, N: int, M: int, reps: int = 20, top: int = 30) -> None:
    """cProfile of `reps` FP8 steps enqueued while the GPU sleeps: where the host's time goes (Python, autograd,
    Triton's launcher), functions by own time."""
    import cProfile
    import pstats

    step, params = trainer_steps(K, N, M, *make_layer(K, N))["fp8"]
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: every launch below only queues
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        step()
        for p in params:
            p.grad = None
    profiler.disable()
    torch.cuda.synchronize()
    print(f"\n### host profile: {name} M={M} fp8, {reps} steps (µs per step = tottime / {reps} x 1e6)")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def profile_shape(name: str, K: int, N: int, M: int, steps: int) -> list[str]:
    """Prints the kernel table of each side; returns its wall / kernels / host line."""
    lines = []
    for tag, (step, params) in trainer_steps(K, N, M, *make_layer(K, N)).items():
        kernels, launches = kernel_us_per_step(step, steps, params)
        total = sum(kernels.values())
        wall = bench_us(step, grad_to_none=params)
        host = host_enqueue_us(step, params)
        lines.append(f"| {name} | {M} | {tag} | {wall:.0f} | {total:.0f} | {host:.0f} | {launches:.0f} |")
        print(f"\n### {name} K={K} N={N} M={M} {tag}: {total:.0f} µs of kernels per step")
        print("| kernel | µs/step | share |\n|---|---|---|")
        for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            if us >= 2.0:
                print(f"| `{kname}` | {us:.1f} | {us / total:.0%} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["q3_qkv", "q3_o", "q3_gate_up"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--host-profile", action="store_true",
                    help="also cProfile the FP8 step's host side (first shape, first token count)")
    args = ap.parse_args()
    by_name = {s[0]: s for s in SHAPES + TRAINER_SHAPES}  # q3_gate / q3_kv: the trainer's unfused modules
    unknown = [s for s in args.shapes if s not in by_name]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {sorted(by_name)}")
    print(torch.cuda.get_device_name(), torch.__version__)
    if args.host_profile:
        host_profile(*by_name[args.shapes[0]], args.tokens[0])
    lines = []
    for s in args.shapes:
        for M in args.tokens:
            lines += profile_shape(*by_name[s], M, args.steps)
    print("\n| shape | tokens | side | wall µs (do_bench) | kernel sum µs | host enqueue µs | kernels per step |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
