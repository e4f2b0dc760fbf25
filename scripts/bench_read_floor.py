"""The practical floor of a decode-size W8A16 layer: how fast ANY one kernel reads a layer's FP8 weight bytes once.

BENCHMARKS' HBM floor is bytes / 4.4 TB/s; small layers (4-25 MB) at 1-16 tokens sit at 1.6-3x it. This measures
how much of that no kernel avoids: one plain Triton kernel that reads the layer's codes (viewed as int32) once and
xors them into one word per program, swept over programs x BLOCK x warps, best kept; beside it our own layer
(w8a16_lora at 1 token, without and with LoRA) and an empty kernel (1 and 132 programs: the cost of one graph node).
Timing as bench_kernels.py: CUDA-graph replays, L2 flushed before each call (epirl.kernels.gpu_timing.graph_us).
Usage: python scripts/bench_read_floor.py [--quick] [--shapes q3_o ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import ALPHA, HBM_BYTES_PER_S, RANK, SHAPES, floor_us, make_layer  # noqa: E402

from epirl.kernels import w8a16_lora  # noqa: E402
from epirl.kernels.gpu_timing import flush_mode, graph_us  # noqa: E402

PROGRAMS, BLOCKS, WARPS = [132, 264, 528, 1056, 2112], [1024, 2048, 4096], [4, 8]
QUICK = dict(programs=[264, 1056], blocks=[2048], warps=[4])
EMPTY_PROGRAMS = [1, 132]


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, WORDS_PER_PROG, BLOCK: tl.constexpr):
    """Program p xors int32 words [p * WORDS_PER_PROG, (p + 1) * WORDS_PER_PROG) ∩ [0, n_words) into out[p]."""
    pid = tl.program_id(0)
    start = pid * WORDS_PER_PROG
    end = tl.minimum(start + WORDS_PER_PROG, n_words)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, WORDS_PER_PROG, BLOCK):
        idx = start + tl.multiple_of(i, BLOCK) + offs
        acc ^= tl.load(src_ptr + idx, mask=idx < end, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


@triton.jit
def _empty_kernel():
    pass


def words_per_prog(n_words: int, programs: int, block: int) -> int:
    """Each program's slice: n_words / programs rounded up to whole BLOCKs (only the last programs run short)."""
    return triton.cdiv(triton.cdiv(n_words, programs), block) * block


def read_once(buf, out, programs: int, block: int, num_warps: int):
    """Read every word of the flat int32 `buf` once with `programs` programs; out[p] = xor of program p's slice
    (out: int32, at least `programs` long). Returns out."""
    n = buf.numel()
    _read_kernel[(programs,)](buf, out, n, words_per_prog(n, programs, block), BLOCK=block, num_warps=num_warps)
    return out


def empty_launch(programs: int):
    _empty_kernel[(programs,)]()


def read_row(name, K, N, sweep_points, timer=None):
    """The best read of the layer's N*K code bytes over the sweep, and our layer at 1 token, for one shape."""
    timer = timer or graph_us
    _, codes, scale, a, b = make_layer(K, N)
    buf = codes.view(torch.int32).reshape(-1)  # exactly the layer's weight bytes
    out = torch.empty(max(sweep_points["programs"]), dtype=torch.int32, device=buf.device)
    sweep = []
    for programs in sweep_points["programs"]:
        for block in sweep_points["blocks"]:
            for warps in sweep_points["warps"]:
                us = timer(lambda: read_once(buf, out, programs, block, warps))
                sweep.append(dict(shape=name, programs=programs, BLOCK=block, num_warps=warps, us=us))
    best = min(sweep, key=lambda r: r["us"])
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    nbytes = N * K
    row = dict(shape=name, K=K, N=N, MB=nbytes / 1e6, hbm_floor_us=nbytes / HBM_BYTES_PER_S * 1e6,
               read_us=best["us"], config=f"P{best['programs']}-B{best['BLOCK']}-w{best['num_warps']}",
               layer_floor_us=floor_us(1, K, N))
    row["w8a16_us"] = timer(lambda: w8a16_lora(x, codes, scale))
    row["w8a16_lora_us"] = timer(lambda: w8a16_lora(x, codes, scale, a, b, ALPHA / RANK))
    return row, sweep


def empty_rows(timer=None):
    timer = timer or graph_us
    return [dict(programs=p, us=timer(lambda p=p: empty_launch(p))) for p in EMPTY_PROGRAMS]


def ratio(a, b):
    return a / b if b else float("nan")


def print_tables(rows, empty):
    print("\n| shape | K→N | MB | HBM floor µs | best read µs | read ×floor | best read config "
          "| floor for the same bytes µs | w8a16 µs | w8a16 ÷read | w8a16+LoRA µs | w8a16+LoRA ÷read |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['K']}→{r['N']} | {r['MB']:.1f} | {r['hbm_floor_us']:.2f} | {r['read_us']:.2f} "
              f"| {ratio(r['read_us'], r['hbm_floor_us']):.2f} | {r['config']} | {r['layer_floor_us']:.2f} "
              f"| {r['w8a16_us']:.2f} | {ratio(r['w8a16_us'], r['read_us']):.2f} | {r['w8a16_lora_us']:.2f} "
              f"| {ratio(r['w8a16_lora_us'], r['read_us']):.2f} |")
    print("\n| empty Triton kernel | programs | µs |\n|---|---|---|")
    for r in empty:
        print(f"| one graph node, no work | {r['programs']} | {r['us']:.2f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="programs {264, 1056} x BLOCK {2048} x 4 warps only")
    ap.add_argument("--shapes", nargs="+", default=None, choices=[s[0] for s in SHAPES], help="only these shapes")
    ap.add_argument("--json", default=None, help="also write the rows and every sweep point here")
    args = ap.parse_args()
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    points = QUICK if args.quick else dict(programs=PROGRAMS, blocks=BLOCKS, warps=WARPS)
    t0 = time.time()
    print(f"# timer: CUDA-graph replays, L2 {flush_mode()}-flushed before each call; HBM floor at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s", flush=True)
    rows, sweep = [], []
    for name, K, N in shapes:
        row, points_us = read_row(name, K, N, points)
        rows.append(row)
        sweep += points_us
        print(f"# {name} done at {time.time() - t0:.0f}s", flush=True)
        torch.cuda.empty_cache()
    empty = empty_rows()
    print_tables(rows, empty)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           l2_flush=flush_mode(), rows=rows, empty=empty, sweep=sweep), f, indent=1)


if __name__ == "__main__":
    main()
