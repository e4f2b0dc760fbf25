"""Registers, spills and the inner K loop's instruction mix of the W8A16 GEMM kernels, compiled for sm_90a on
any machine (no GPU: Triton's compiler, its bundled ptxas and cuobjdump). A profile of the code the compiler
emits, not of a run: the installed Triton may differ from the device's (the H200's image has 3.6), and the
device specializes integer arguments the same way (`tt.divisibility` 16 on pointers, N, K, row strides).

    python scripts/sass_report.py [--tiles 128/256/64/8/3 ...] [--one-chunk] [--dx]

Per tile (BN weight rows / BM tokens / BK / warps / stages): registers, stack bytes (spills), and per trip of the
innermost loop: HGMMA (wgmma), LDS/STS (shared-memory loads/stores), LDGSTS (cp.async), BAR, the e4m3 → bf16
widening (F2FP, F2F, PRMT) and LDL/STL (spill traffic). BENCHMARKS.md § Kernels (2026-12-01) reads them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KEYS = ["HGMMA", "LDS", "STS", "LDGSTS", "BAR", "F2FP", "F2F", "PRMT", "LDL", "STL"]
DIVISIBLE = {"x_ptr", "w_ptr", "y_ptr", "w_scale_ptr", "xa_ptr", "b_ptr", "bias_ptr", "N", "K", "K_CHUNK",
             "stride_xm", "stride_wn", "stride_wk", "stride_ym", "stride_xam", "stride_bn"}


def compile_cubin(tile: str, one_chunk: bool, dx: bool) -> bytes:
    """The weight-stationary single-pass kernel for sm_90a."""
    from epirl.kernels.gemm.weight_stationary import _ws_single_kernel as fn
    BN, BM, BK, warps, stages = map(int, tile.split("/"))
    const = dict(HAS_W_SCALE=True, HAS_LORA=False, HAS_BIAS=False, DOT_F32=False, BN=BN, BM=BM, BK=BK, BR=16,
                 GROUP_N=8, WAIT_PDL=False, stride_xk=1, stride_yn=1)
    const.update({"stride_wn": 1} if dx else {"stride_wk": 1})  # the contiguous dimension of w
    if one_chunk:
        const["N_CHUNKS"] = 1
    sig = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*fp8e4nv" if n == "w_ptr" else "*fp32" if n == "w_scale_ptr" else "*bf16"
        else:
            sig[n] = "fp32" if n == "lora_scale" else "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig
             if n in DIVISIBLE and sig[n] != "constexpr"}
    compiled = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    return compiled.asm["cubin"]


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def report(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    ops = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line) for line in sass.splitlines()) if m]
    loops = [(int(m.group(1), 16), a) for a, t in ops
             for m in [re.search(r"BRA.*?0x([0-9a-f]+)", t)] if m and int(m.group(1), 16) < a]
    lo, hi = min(loops, key=lambda lh: lh[1] - lh[0]) if loops else (0, -1)

    def opname(text: str) -> str:
        words = text.split(";")[0].split()
        return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]

    body = Counter(opname(t) for a, t in ops if lo <= a <= hi)
    return dict(regs=int(re.search(r"REG:(\d+)", usage).group(1)), stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                loop=sum(body.values()), **{k: body.get(k, 0) for k in KEYS})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", nargs="+", default=["128/256/64/8/3", "128/128/64/8/4", "256/128/64/8/3"])
    ap.add_argument("--one-chunk", action="store_true", help="N_CHUNKS = 1 (as Triton specializes it)")
    ap.add_argument("--dx", action="store_true", help="dX operand strides (codes read transposed)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90a, {'dX' if args.dx else 'forward'}, "
          f"{'one chunk' if args.one_chunk else 'chunked'}\n")
    print("| BN/BM/BK/warps/stages | regs | stack B | loop instr | " + " | ".join(KEYS) + " |")
    print("|---|---|---|---|" + "---|" * len(KEYS))
    for tile in args.tiles:
        r = report(compile_cubin(tile, args.one_chunk, args.dx))
        print(f"| {tile} | {r['regs']} | {r['stack']} | {r['loop']} | "
              + " | ".join(str(r[k]) for k in KEYS) + " |", flush=True)


if __name__ == "__main__":
    main()
