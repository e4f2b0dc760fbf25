"""The warp-specialized Gluon training forward (`kernels/gemm/ws_gluon.py`) against the Triton kernels and cuBLAS.

On the GPU, per shape at --tokens (default 8192), with a rank-64 LoRA from a given xa (as the trainer's forward calls
the base GEMM after `lora_down`) and the weight scale: the table entry's Triton kernel (TMA where it says; its
"gluon" left out), the pointer kernel, and each Gluon config (`parse_config`: BM / BK / stages [/ GROUP_N] [/s] [/r] [/p]);
every output compared bitwise with the pointer kernel's
(count of differing elements), times in µs (CUDA-graph replay, L2 flushed: `gpu_timing.graph_us`) and the ratio to
cuBLAS bf16 on a bf16 copy of the weight + the same LoRA as separate matmuls.

    python scripts/probe_gluon_fwd.py [--shapes q3_down ...] [--tokens 8192] [--configs 256/64/4/16 256/64/4/16/r ...]
                                      [--rank 192] [--dx]

Without a GPU, `--compile-only` compiles each Gluon config for sm_90a with the installed Triton (Gluon's API is
experimental: the H200 image has 3.6) and prints registers, spills, the loops and the A-operand race check
(`scripts/sass_report.py --gluon`).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"q3_down": (12288, 4096), "q3_qkv": (4096, 6144), "q3_o": (4096, 4096), "q3_gate": (4096, 12288),
          "q3_gate_up": (4096, 24576), "q35_attn_qkv": (4096, 10240),
          "q35_gdn_qkvz": (4096, 12288), "q3_kv": (4096, 1024),
          "k256": (256, 4096), "k512": (512, 4096), "k1024": (1024, 4096)}


FLAGS = {"s": "A_SMEM", "r": "LORA_RING", "p": "PERSISTENT"}  # a config's trailing letters


def parse_config(text: str) -> dict:
    """BM/BK/STAGES[/GROUP_N][/s][/r][/p] (GROUP_N: weight-row tiles swept together over the token tiles, default 8;
    s: the codes widened into shared memory, A_SMEM; r: the LoRA ranks through the k-step ring, LORA_RING; p: a
    program per SM over many tiles, PERSISTENT)."""
    fields = text.split("/")
    flags = [f for f in fields if f in FLAGS]
    bm, bk, stages, *group = map(int, fields[:len(fields) - len(flags)])
    cfg = dict(BM=bm, BK=bk, num_stages=stages, GROUP_N=group[0] if group else 8)
    return dict(cfg, **{key: letter in flags for letter, key in FLAGS.items()})


def config_label(c: dict) -> str:
    """`parse_config`'s text of a config (GROUP_N included)."""
    flags = "".join(f"/{letter}" for letter, key in FLAGS.items() if c.get(key))
    return f"{c['BM']}/{c['BK']}/{c['num_stages']}/{c.get('GROUP_N', 8)}{flags}"


def compile_only(configs: list[dict], dx: bool = False, rank: int = 64) -> None:
    """Each config compiled for sm_90a with a rank-`rank` LoRA (`sass_report.compile_gluon`): registers, stack, shared
    memory, wgmma serialization, loops and A-operand races (`sass_report --gluon` prints the same)."""
    from sass_report import compile_gluon, loop_report, ptxas_notes, report, wgmma_register_hazards

    from epirl.kernels.gemm.weight_stationary import _epilogue_rows
    for c in configs:
        k = compile_gluon(c, br=_epilogue_rows(rank), dx=dx, a_smem=c.get("A_SMEM", False),
                          lora_ring=c.get("LORA_RING", False), persistent=c.get("PERSISTENT", False))
        rep, notes = report(k.asm["cubin"]), ptxas_notes(k.asm["ptx"])
        loops = ", ".join(f"{r['instructions']}/{r['HGMMA']}/{r['spill']}" for r in loop_report(k.asm["cubin"]))
        print(f"# {'dx' if dx else 'fwd'} {config_label(c)}, rank {rank}: regs {rep['regs']}, stack {rep['stack']} B, "
              f"shared {k.metadata.shared} B, wgmma serialized: {notes['serialized'] or 'no'}, A-operand races "
              f"{len(wgmma_register_hazards(k.asm['cubin']))}; loops (instructions / HGMMA / spill): {loops}")


def run_gpu(shapes: list[str], tokens: int, configs: list[dict], rank: int = 64, op: str = "fwd",
            chunks: tuple[int, int] | None = None) -> None:
    import torch

    from bench_kernels import graph_us, make_layer
    from epirl.kernels.gemm.configs import k_chunking, ws_config
    from epirl.kernels.gemm.weight_stationary import _epilogue_rows, lora_down, weight_stationary_gemm, whole_k
    from epirl.kernels.gemm.ws_gluon import gluon_ok, launch_gluon_fwd

    br = _epilogue_rows(rank)  # the padded rank of the Triton kernels' epilogue (256 for the fused qkv's 192)
    print(f"# {torch.cuda.get_device_name()}; {op}, {tokens} tokens, rank-{rank} LoRA from a given xa, weight scale")
    print("| shape | kernel | µs | ×cuBLAS | wrong elements |")
    print("|---|---|---|---|---|")
    for name in shapes:
        K, N = SHAPES[name]
        _, codes, scale, a, b = make_layer(K, N)
        if rank != a.shape[0]:
            a = (torch.randn(rank, K, device="cuda") / K ** 0.5).bfloat16()
            b = (torch.randn(N, rank, device="cuda") * 0.02).bfloat16()
        sigma = 2.0
        w16 = (codes.float() * scale).bfloat16()
        if op == "fwd":  # y = x·Wᵀ + σ·(x·Aᵀ)·Bᵀ over K in the forward's chunks
            x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16)
            w, xa, lb = codes, lora_down(x, a, N), b
            cublas = graph_us(lambda: x @ w16.t() + sigma * (xa @ b.t()))
            k_chunk, n_chunks = k_chunking(N, K)
            table = dict(ws_config("fwd", N, K, tokens))
        else:  # dX = gy·W + σ·(gy·B)·A over N in one chunk, the codes read transposed
            x = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)
            w, xa, lb = codes.t(), (x @ b).bfloat16(), a.t()
            cublas = graph_us(lambda: x @ w16 + sigma * (xa @ a))
            k_chunk, n_chunks = whole_k(N)
            table = dict(ws_config("dx", K, N, tokens))
        if chunks:  # a diagnostic: the Gluon rows at another K chunking (other bits: their wrong counts are expected)
            k_chunk, n_chunks = chunks
        print(f"| {name} | cuBLAS bf16 + LoRA | {cublas:.1f} | 1.00 | – |", flush=True)
        lora = dict(xa=xa, lora_b=lb, lora_scale=sigma)

        def call(out, c):
            return weight_stationary_gemm(x, w, w_scale=scale, config=c, out=out, op=op, **lora)
        triton_cfg = {k: v for k, v in table.items() if k != "gluon"}  # the entry's Triton kernels (an explicit
        pointer = dict(triton_cfg, tma=False)                          # config with "gluon" runs the Gluon kernel)
        want = call(None, pointer)
        bits = want.view(torch.int16)
        rows = [("pointer " + "/".join(str(pointer[k]) for k in ("BN", "BM", "BK", "num_warps", "num_stages")),
                 lambda out, c=pointer: call(out, c))]
        if table.get("tma"):
            rows.append(("TMA (the table's)", lambda out, c=triton_cfg: call(out, c)))
        for c in configs:
            if not gluon_ok(x, w, want, xa, lb, k_chunk, n_chunks, c, br):
                print(f"| {name} | gluon {c} | – | – | not applicable |")
                continue
            rows.append((f"gluon {config_label(c)}",
                         lambda out, c=c: launch_gluon_fwd(x, w, out, scale, xa, lb, sigma, None, k_chunk, n_chunks,
                                                           c, br)))
        for label, run in rows:
            out = torch.full_like(want, float("nan"))
            try:
                run(out)
                torch.cuda.synchronize()
            except Exception as err:  # a config that does not compile or launch here: say so, go on
                print(f"| {name} | {label} | – | – | {type(err).__name__}: {str(err)[:120]} |", flush=True)
                continue
            wrong = int((out.view(torch.int16) != bits).sum())
            us = graph_us(lambda: run(out))
            run(out)
            wrong = max(wrong, int((out.view(torch.int16) != bits).sum()))
            print(f"| {name} | {label} | {us:.1f} | {us / cublas:.2f} | {wrong} |", flush=True)
            if wrong:
                print("#   " + where_wrong(out, want), flush=True)


def where_wrong(out, want) -> str:
    """Which rows of the 128-row weight tiles (warpgroup 0: 0-63, 1: 64-127) and which tokens hold the wrong
    elements, and how far off they are."""
    import torch
    bad = out.view(torch.int16) != want.view(torch.int16)
    rows = bad.nonzero()[:, 1] % 128
    toks = bad.any(dim=1).nonzero().flatten()
    rel = ((out.float() - want.float()).abs()[bad] / want.float().abs().max()).max().item()
    return (f"wrong in warpgroup 0 rows {int((rows < 64).sum())}, warpgroup 1 rows {int((rows >= 64).sum())}; "
            f"tokens {toks.numel()} (first {toks[:4].tolist()}); NaN {int(out.isnan().sum())}; max |diff| / max|y| "
            f"{rel:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--configs", nargs="+", default=["256/64/4", "256/64/3", "128/64/4", "128/128/3"])
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank (192: the fused qkv's block-diagonal rank)")
    ap.add_argument("--dx", action="store_true", help="dX = gy·W (the codes read transposed) instead of the forward")
    ap.add_argument("--chunks", help="K_CHUNK/N_CHUNKS for the Gluon rows (timing only: other bits than the table's)")
    args = ap.parse_args()
    configs = [parse_config(c) for c in args.configs]
    if args.compile_only:
        compile_only(configs, args.dx, args.rank)
    else:
        chunks = tuple(map(int, args.chunks.split("/"))) if args.chunks else None
        run_gpu(args.shapes, args.tokens, configs, args.rank, "dx" if args.dx else "fwd", chunks)


if __name__ == "__main__":
    main()
