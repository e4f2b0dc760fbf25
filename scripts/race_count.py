"""How often does each W8A16 kernel give other bits than on its other calls? (GPU; issue 12, 2026-12-04)

The Triton TMA kernel gives wrong tiles on some calls, differently each run, and the SASS of every W8A16 Triton kernel
built by Triton 3.6 / 3.7.1 writes registers of still-pending register-A wgmmas (`scripts/sass_report.py --wgmma`,
triton-lang/triton#9433; Triton 3.9 does not). This counts it: per shape and kernel (the table's training tile as the
pointer kernel, its TMA twin, the table's Gluon forward, the decode split-K at 16 tokens, dX pointer and TMA), CALLS
calls into a NaN-filled output each, every one compared bitwise with the pointer kernel's first call (all the
kernels give the same bits by contract). A kernel that races shows calls with wrong elements; one that never does
shows 0 after enough calls to trust it.

    python scripts/race_count.py [--calls 200] [--shapes q3_qkv q3_down] [--tokens 4096]

Prints one table row per (shape, kernel): calls with any wrong element, wrong elements in all, the largest |diff|
relative to max |y|, and the Triton version (run it under two Tritons to compare). On Triton < 3.9 the W8A16 Triton
kernels are built with `wgmma_drain.py`'s pass unless EPIRL_WGMMA_DRAIN=0 (H200, 2026-12-04: TMA forward 11 wrong calls in
16,000 without it under 3.6, 0 in 12,000 with it, 0 in 16,000 under 3.9).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

from epirl.kernels.gemm import wgmma_drain
from epirl.kernels.gemm.configs import ws_config
from epirl.kernels.gemm.weight_stationary import lora_down, weight_stationary_gemm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import make_layer  # noqa: E402  (the rank-64 layer every bench script times)
from probe_gluon_fwd import config_label, parse_config  # noqa: E402

SHAPES = {"q3_qkv": (4096, 6144), "q3_o": (4096, 4096), "q3_down": (12288, 4096), "q3_gate": (4096, 12288),
          "q3_gate_up": (4096, 24576)}


def kernels(x, gy, codes, scale, a, b, decode_x, gluon_configs=()):
    """(name, reference (pointer kernel) call, runs) per kernel kind that applies here; a call writes `out`.
    gluon_configs: explicit Gluon configs (`probe_gluon_fwd.parse_config`) run as forward and as dX rows too."""
    N, K = codes.shape
    M = x.shape[0]
    xa = lora_down(x, a, N)
    lora = dict(xa=xa, lora_b=b, lora_scale=2.0)
    table = {k: v for k, v in ws_config("fwd", N, K, M).items() if k != "gluon"}
    pointer = dict(table, tma=False)

    def fwd(cfg):
        return lambda out: weight_stationary_gemm(x, codes, torch.bfloat16, w_scale=scale, config=cfg, out=out, **lora)

    def dx(cfg):
        return lambda out: weight_stationary_gemm(gy, codes.t(), torch.bfloat16, w_scale=scale, config=cfg, out=out,
                                                  op="dx")

    def decode(cfg):
        return lambda out: weight_stationary_gemm(decode_x, codes, torch.bfloat16, w_scale=scale, lora_a=a, lora_b=b,
                                                  lora_scale=2.0, config=cfg, out=out)
    rows = [("fwd pointer", fwd(pointer), fwd(pointer))]
    if x.is_cuda and table.get("tma"):
        rows.append(("fwd TMA", fwd(pointer), fwd(table)))
    gluon = ws_config("fwd", N, K, M).get("gluon")
    if x.is_cuda and gluon:
        rows.append(("fwd Gluon", fwd(pointer), fwd(dict(table, gluon=gluon))))
    dx_table = dict(ws_config("dx", K, N, M))
    rows.append(("dx pointer", dx(dict(dx_table, tma=False)), dx(dict(dx_table, tma=False))))
    if x.is_cuda and dx_table.get("tma"):
        rows.append(("dx TMA", dx(dict(dx_table, tma=False)), dx(dx_table)))
    for g in gluon_configs if x.is_cuda else ():
        tag = config_label(g)
        rows.append((f"fwd Gluon {tag}", fwd(pointer), fwd(dict(table, gluon=g))))
        rows.append((f"dx Gluon {tag}", dx(dict(dx_table, tma=False)), dx(dict(dx_table, gluon=g))))
    dec = dict(ws_config("fwd", N, K, decode_x.shape[0]))
    rows.append((f"decode {decode_x.shape[0]} tok", decode(dec), decode(dec)))
    return rows


def count(reference, run, calls: int, out_shape, device) -> tuple[int, int, float]:
    """(calls with a wrong element, wrong elements in all, max |diff| / max |y|) of `calls` calls of run against one
    call of reference."""
    want = torch.full(out_shape, float("nan"), device=device, dtype=torch.bfloat16)
    reference(want)
    bits, scale = want.view(torch.int16), want.float().abs().max().clamp_min(1e-30)
    bad_calls = bad_elems = 0
    worst = 0.0
    for _ in range(calls):
        out = torch.full(out_shape, float("nan"), device=device, dtype=torch.bfloat16)
        run(out)
        wrong = out.view(torch.int16) != bits
        n = int(wrong.sum())
        if n:
            bad_calls += 1
            bad_elems += n
            diff = (out.float() - want.float()).abs()[wrong]
            worst = max(worst, float(torch.nan_to_num(diff, nan=float("inf")).max() / scale))
    return bad_calls, bad_elems, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--gluon", nargs="*", default=[], metavar="BM/BK/STAGES[/GROUP_N][/s][/r]",
                    help="also these Gluon configs, forward and dX (s: the codes widened in shared memory; r: the LoRA "
                         "through the k-step ring, forward only: dX runs without LoRA here)")
    args = ap.parse_args()
    gluon_configs = [parse_config(c) for c in args.gluon]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"# triton {triton.__version__} (wgmma drain {'on' if wgmma_drain.DRAIN else 'off'}: "
          f"kernels/gemm/wgmma_drain.py), {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}; "
          f"{args.calls} calls per kernel, {args.tokens} tokens (decode {args.decode_tokens})")
    print("| shape | kernel | calls with wrong elements | wrong elements | max |diff| / max |y| | triton |")
    print("|---|---|---|---|---|---|")
    for name in args.shapes:
        K, N = SHAPES[name]
        _, codes, scale, a, b = make_layer(K, N, dev=device)
        x = torch.randn(args.tokens, K, device=device).bfloat16()
        gy = torch.randn(args.tokens, N, device=device).bfloat16()
        decode_x = x[:args.decode_tokens].contiguous()
        for label, reference, run in kernels(x, gy, codes, scale, a, b, decode_x, gluon_configs):
            rows = args.decode_tokens if label.startswith("decode") else args.tokens
            cols = K if label.startswith("dx") else N
            calls, elems, worst = count(reference, run, args.calls, (rows, cols), device)
            print(f"| {name} | {label} | {calls} / {args.calls} | {elems} | {worst:.2e} | {triton.__version__} |",
                  flush=True)


if __name__ == "__main__":
    main()
