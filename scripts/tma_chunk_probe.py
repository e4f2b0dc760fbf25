"""Does the TMA kernel's miscompile follow the chunk depth? (GPU; issue 12, 2026-12-02)

The TMA-load W8A16 kernel gave wrong values in some tiles (a different count each run) on the 4096 -> 24576 gate_up
forward, the one Qwen forward whose fixed K chunking has a single 4096-deep chunk (`k_chunking` gives the others 2-8
chunks of 512-2048). This probe runs each tile config with TMA loads against the pointer kernel with the same
chunking, bitwise, output NaN-poisoned first (a NaN left is an element never written), twice: on q3_gate_up (one
chunk) and on q3_qkv with its own 4 chunks and forced to one chunk, so the chunk depth is the only change; and dX
(always one chunk) on both.
--variants adds TMA kernel variants beside it, each with its bits column, and times every kernel (CUDA-graph replay, L2
flushed, µs) on the trainer's own shapes too (q3_o, q3_down, the Qwen3-8B trainer's separate gate / up):
  sync  a CTA barrier every k-step (SYNC_K: no warp more than one k-step ahead of another, so no TMA load can
        overwrite a stage buffer that a lagging warp still copies into registers: the hypothesis that the wrong
        values are that write-after-read race; 2026-12-02: it removes every wrong value, at 1.1-10x the time);
  x     only x through its descriptor, the codes by pointers (cp.async, as the pointer kernel loads them);
  flat, xflat   full TMA / x-only with the chunk loop flattened into one pipelined loop (FLATTEN).
--tiles picks tiles (BN/BM/BK/warps/stages; default: all of TILES).
Usage: python scripts/tma_chunk_probe.py [--tokens 4096] [--variants sync x flat xflat]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import triton

from epirl.kernels import quantize_weight_fp8
from epirl.kernels.gemm import weight_stationary as ws_mod

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import graph_us  # noqa: E402

TILES = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 256, 32, 8, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 4)]
SHAPES = {"q3_gate_up": (4096, 24576), "q3_qkv": (4096, 6144)}
TIMED_SHAPES = {"q3_o": (4096, 4096), "q3_down": (12288, 4096), "q3_gate": (4096, 12288)}  # (K, N), with --variants
VARIANTS = {"sync": dict(tma=True, sync=True), "x": dict(tma="x"), "flat": dict(tma=True, flatten=True),
            "xflat": dict(tma="x", flatten=True)}


@contextlib.contextmanager
def one_chunk_forward():
    """The forward's K chunking forced to one chunk (the module's `k_chunking` is what the call reads)."""
    natural = ws_mod.k_chunking
    ws_mod.k_chunking = lambda N, K: (K, 1)
    try:
        yield
    finally:
        ws_mod.k_chunking = natural


def config(tile, **extra):
    bn, bm, bk, warps, stages = tile
    return dict(BN=bn, BM=bm, BK=bk, num_warps=warps, num_stages=stages, split=False, **extra)


def compare(run, tile, tma=True, **extra) -> str:
    """'differing (never written)' of two TMA runs against the pointer kernel, e.g. '0 (0) / 0 (0)'."""
    want = run(config(tile), None)
    cells = []
    for _ in range(2):
        out = torch.full_like(want, float("nan"))
        got = run(config(tile, tma=tma, **extra), out)
        torch.cuda.synchronize()
        differ = got.view(torch.int16) != want.view(torch.int16)
        cells.append(f"{int(differ.sum())} ({int(got.isnan().sum())})")
    return " / ".join(cells)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS), help="TMA kernel variants, timed")
    ap.add_argument("--tiles", nargs="*", default=None, help="tiles as BN/BM/BK/warps/stages (default: all of TILES)")
    args = ap.parse_args()
    tiles = TILES if args.tiles is None else [tuple(int(v) for v in t.split("/")) for t in args.tiles]
    g = torch.Generator(device="cuda").manual_seed(0)
    M = args.tokens
    print(f"triton {triton.__version__}, {torch.cuda.get_device_name()}, M={M}; cells: elements differing from the "
          f"pointer kernel (never written), run 1 / run 2")
    extra_cols = "".join(f" TMA {v} vs pointer |" for v in args.variants)
    if args.variants:
        extra_cols += f" µs pointer / TMA / {' / '.join('TMA ' + v for v in args.variants)} |"
    print(f"| shape | op | tile | chunks | TMA vs pointer: differing (never written), run 1 / run 2 |{extra_cols}")
    print("|---|---|---|---|---|" + "---|" * (len(args.variants) + bool(args.variants)))
    for name, (K, N) in {**SHAPES, **(TIMED_SHAPES if args.variants else {})}.items():
        codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g, device="cuda") * 0.02)
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        gy = torch.randn(M, N, generator=g, device="cuda").bfloat16()
        xa = (torch.randn(M, 64, generator=g, device="cuda") * 0.1).bfloat16()
        b = (torch.randn(N, 64, generator=g, device="cuda") * 0.05).bfloat16()

        def fwd(c, out):
            return ws_mod.weight_stationary_gemm(x, codes, torch.bfloat16, w_scale=scale, xa=xa, lora_b=b,
                                                 lora_scale=2.0, config=c, allow_split=False, out=out)

        def dx(c, out):
            return ws_mod.weight_stationary_gemm(gy, codes.t(), torch.bfloat16, w_scale=scale, config=c, op="dx",
                                                 out=out)
        n_chunks = ws_mod.k_chunking(N, K)[1]

        def row(op, run, chunks):
            cells = [compare(run, tile)] + [compare(run, tile, **VARIANTS[v]) for v in args.variants]
            if args.variants:
                out = run(config(tile), None)
                kinds = [{}, {"tma": True}] + [VARIANTS[v] for v in args.variants]
                times = [graph_us(lambda c=config(tile, **extra): run(c, out)) for extra in kinds]
                cells.append(" / ".join(f"{t:.1f}" for t in times))
            print(f"| {name} | {op} | {label} | {chunks} | {' | '.join(cells)} |", flush=True)
        for tile in tiles:
            label = "/".join(map(str, tile))
            row("fwd", fwd, n_chunks)
            if n_chunks > 1:
                with one_chunk_forward():
                    row("fwd", fwd, "1 (forced)")
            row("dx", dx, 1)


if __name__ == "__main__":
    main()
