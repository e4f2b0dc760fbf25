"""Where a training step leaves the GPU idle (H200): the idle gaps of one profiled step, pinned on the host work.

Builds the step of `bench_trainer.py` (random production-shaped policy, fp8 or bf16 base), runs a warm-up step, then
profiles one step with CPU and CUDA activities (torch.profiler). The kernels' busy intervals are merged; every gap
between them is idle GPU time. Each gap is attributed to the innermost host op running when it opened (what the host
was doing instead of launching the next kernel: a sync such as `aten::item`, an allocation, Python between
launches), and to its outermost op (which layer / autograd function). Prints the step's wall, busy and idle time, the
idle time per innermost and per outermost op, and the largest gaps.
Usage: python scripts/profile_step_gaps.py [--shape qwen3-8b] [--bases fp8 bf16] [--min-gap-us 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_trainer import training_step  # noqa: E402

from epirl.model import random_policy  # noqa: E402
from epirl.model.lora import ALL_PROJECTIONS  # noqa: E402
from epirl.model.shapes import SHAPES  # noqa: E402


def busy_intervals(kernels: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) kernel intervals, sorted (PDL or several streams may overlap kernels)."""
    merged: list[list[float]] = []
    for start, end in sorted(kernels):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def host_ops_at(cpu_events, times: list[float]) -> list[tuple[str, str]]:
    """For each of the ascending times t: (innermost, outermost) names of the host ops whose span holds t (any
    thread: the main one or autograd's). One sweep over the ops sorted by start, keeping the ones still open."""
    ops = sorted(cpu_events, key=lambda e: e.time_range.start)
    out, active, i = [], [], 0
    for t in times:
        while i < len(ops) and ops[i].time_range.start <= t:
            active.append(ops[i])
            i += 1
        active = [e for e in active if e.time_range.end > t]
        if not active:
            out.append(("(no host op)", "(no host op)"))
            continue
        by_span = sorted(active, key=lambda e: e.time_range.end - e.time_range.start)
        out.append((by_span[0].name[:60], by_span[-1].name[:60]))
    return out


def gap_report(prof, min_gap_us: float, top: int) -> None:
    events = prof.events()
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
           and not e.name.startswith(("cudaLaunch", "cuLaunch", "cudaStreamIsCapturing", "ProfilerStep"))]
    busy = busy_intervals(kernels)
    wall = busy[-1][1] - busy[0][0]
    busy_us = sum(e - s for s, e in busy)
    gaps = [(busy[i + 1][0] - busy[i][1], busy[i][1]) for i in range(len(busy) - 1)]
    by_inner, by_outer = defaultdict(float), defaultdict(float)
    counts = defaultdict(int)
    small = [g for g in gaps if g[0] < min_gap_us]
    if small:
        by_inner["(gaps below --min-gap-us)"] = sum(g[0] for g in small)
    large = sorted((g for g in gaps if g[0] >= min_gap_us), key=lambda g: g[1])
    big = []
    for (length, _), (inner, outer) in zip(large, host_ops_at(cpu, [at + 0.5 for _, at in large])):
        by_inner[inner] += length
        by_outer[outer] += length
        counts[inner] += 1
        big.append((length, inner, outer))
    print(f"first to last kernel {wall / 1e3:.1f} ms, GPU busy {busy_us / 1e3:.1f} ms ({busy_us / wall:.1%}), "
          f"idle {(wall - busy_us) / 1e3:.1f} ms in {len(gaps)} gaps ({sum(1 for g in gaps if g[0] >= min_gap_us)} "
          f">= {min_gap_us:g} µs)")
    print("\n| innermost host op at the gap | idle ms | gaps |\n|---|---|---|")
    for name, us in sorted(by_inner.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| `{name}` | {us / 1e3:.2f} | {counts.get(name, '-')} |")
    print("\n| outermost host op at the gap | idle ms |\n|---|---|")
    for name, us in sorted(by_outer.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| `{name}` | {us / 1e3:.2f} |")
    print("\n| largest gaps µs | innermost | outermost |\n|---|---|---|")
    for length, inner, outer in sorted(big, reverse=True)[:top]:
        print(f"| {length:.0f} | `{inner}` | `{outer}` |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    ap.add_argument("--bases", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16"])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    config = SHAPES[args.shape]()
    for base in args.bases:
        policy = random_policy(config, base, "cuda", rank=64, alpha=128.0, targets=list(ALL_PROJECTIONS), seed=0,
                               gradient_checkpointing=True)
        optimizer = torch.optim.AdamW(policy.lora_parameters(), lr=1e-5)
        ids = torch.randint(0, config.vocab_size, (args.seqs, args.seq_len + 1), device="cuda")
        for _ in range(2):  # compiles, first-call checks, allocator warm-up
            training_step(policy, optimizer, ids, args.micro_batch, args.chunk_tokens)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            training_step(policy, optimizer, ids, args.micro_batch, args.chunk_tokens)
            torch.cuda.synchronize()
        print(f"\n### {args.shape} base={base}: {args.seqs} x {args.seq_len} tokens, micro-batch {args.micro_batch}")
        gap_report(prof, args.min_gap_us, args.top)
        del policy, optimizer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
