"""Where the W8A16 + LoRA decode layer's time goes (H200): one call replayed from a CUDA graph after an L2 flush,
under torch.profiler, kernel by kernel with its start offset and duration (µs, mean over replays), so that the
timeline shows what overlaps (PDL) and what waits. Variants: without LoRA, with LoRA (PDL on, the default), with
LoRA and EPIRL_WS_PDL=0; the first two also with the two-launch split-K (EPIRL_WS_TICKET=0).

    python scripts/profile_decode_lora.py [--shapes q3_qkv q3_gate_up] [--tokens 1 16] [--replays 20]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import RANK, SHAPES, make_layer  # noqa: E402

from epirl.kernels import w8a16_lora  # noqa: E402
from epirl.kernels.gemm.weight_stationary import PDL_ENV  # noqa: E402
from epirl.kernels.gemm.ws_splitk import TICKET_ENV  # noqa: E402
from epirl.kernels.gpu_timing import FLUSH_BYTES, flush_mode, l2_flush  # noqa: E402


def timeline(fn, replays: int) -> list[tuple[str, float, float]]:
    """(kernel, start µs after the call's first kernel, duration µs) per kernel of one call, mean over replays."""
    buf = torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_flush(buf, sink, flush_mode())
        fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.device_time > 0 and "Memcpy" not in e.name and "Memset" not in e.name),
                     key=lambda e: e.time_range.start)
    per = len(kernels) // replays
    sums: dict[int, list] = defaultdict(lambda: ["", 0.0, 0.0])
    for r in range(replays):
        group = kernels[r * per:(r + 1) * per]
        flush_end = next(e.time_range.end for e in group if "_ws_" not in e.name and "_xa_" not in e.name)
        for i, e in enumerate(group):
            sums[i][0] = e.name
            sums[i][1] += (e.time_range.start - flush_end) / replays
            sums[i][2] += e.device_time / replays
    return [tuple(v) for _, v in sorted(sums.items())]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["q3_qkv", "q3_o", "q3_gate_up", "q3_down"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    by_name = {s[0]: s for s in SHAPES}
    for name in args.shapes:
        _, K, N = by_name[name]
        w16, codes, scale, a, b = make_layer(K, N)
        del w16
        for M in args.tokens:
            x = torch.randn(M, K, device="cuda").bfloat16()
            def base():
                return w8a16_lora(x, codes, scale)

            def lora():
                return w8a16_lora(x, codes, scale, a, b, 2.0)

            variants = {"no LoRA": ({}, base), "no LoRA, two-launch split-K": ({TICKET_ENV: "0"}, base),
                        "LoRA, PDL on": ({}, lora), "LoRA, PDL on, two-launch split-K": ({TICKET_ENV: "0"}, lora),
                        "LoRA, PDL off": ({PDL_ENV: "0"}, lora)}
            for tag, (env, fn) in variants.items():
                for var in (PDL_ENV, TICKET_ENV):
                    os.environ[var] = env.get(var, "1")
                rows = timeline(fn, args.replays)
                call = [r for r in rows if "_ws_" in r[0] or "_xa_" in r[0]]
                span = max(s + d for _, s, d in call) if call else 0.0
                print(f"\n### {name} K={K} N={N} M={M} r={RANK}, {tag}: span {span:.1f} µs after the flush")
                print("| kernel | start µs | duration µs |\n|---|---|---|")
                for kname, start, dur in call:
                    print(f"| `{kname[:60]}` | {start:.1f} | {dur:.1f} |")
    os.environ.pop(PDL_ENV, None)
    os.environ.pop(TICKET_ENV, None)


if __name__ == "__main__":
    main()
