"""What the fixed K chunking's program target costs at both ends (issue 12), on the GPU, in one process.

`configs.k_chunking(N, K)` cuts K into chunks (each summed from zero, added in order) so that N/128 weight tiles x
chunks give about TARGET_PROGRAMS programs at decode; the bits of every W8A16 call follow from it, in the engine and
the trainer alike. More chunks feed more SMs at decode; each chunk end costs a training tile a pipeline drain and the
round trip of its spilled running total. This times, for each target, the rows that trade off:
- decode: `w8a16_lora` with rank-64 LoRA at 1 and 16 tokens, and without LoRA at 1 (CUDA-graph replays, L2 flushed);
- training: the forward alone (graph replay; bf16 cuBLAS + LoRA beside it) and `Fp8LoRALinear` forward + backward
  (torch.profiler kernel sum; --kernels lists its kernels) at --train-tokens, beside a frozen bf16 Linear + LoRA.
Every TMA call is checked against the pointer kernel as in production (ws_tma.checked_tma_single); the verdicts are
reset between targets (the check's key does not hold the chunking) and a fallback is printed.
MIN_CHUNKS stays the committed one unless --min-chunks says otherwise (the sixteenth session's first run, which
chose the committed values, predates it: one chunk where the target gave one).
--xa-chunk-max does the same for the LoRA down-projection's sub-chunk depth (configs.XA_CHUNK_MAX): a decode
`lora_down` program reads r x depth of A, and the base GEMM (its PDL dependent) waits for the last of them.
Usage: python scripts/probe_k_chunking.py [--targets 264 132 66] [--shapes q3_o q3_down] [--train-tokens 8192]
       [--min-chunks 1] [--xa-chunk-max 512 256] [--kernels]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bench  # noqa: E402

from epirl.kernels import w8a16_lora  # noqa: E402
from epirl.kernels.gemm import configs, ws_tma  # noqa: E402
from epirl.kernels.gpu_timing import graph_us  # noqa: E402

SHAPES = {name: (K, N) for name, K, N in bench.SHAPES + bench.TRAINER_SHAPES}
SIGMA = bench.ALPHA / bench.RANK


def probe_row(name: str, target: int, layer, train_tokens: int, bf16_kernel_us: float,
              xa_chunk_max: int | None = None) -> dict:
    """One row: `layer` (bench_kernels.make_layer) timed with configs.TARGET_PROGRAMS = target and, if given,
    configs.XA_CHUNK_MAX = xa_chunk_max (both restored after)."""
    K, N = SHAPES[name]
    w16, codes, scale, a, b = layer
    saved, configs.TARGET_PROGRAMS = configs.TARGET_PROGRAMS, target
    saved_xa = configs.XA_CHUNK_MAX
    configs.XA_CHUNK_MAX = xa_chunk_max or saved_xa
    ws_tma._CHECKED.clear()
    ws_tma._CALLS.clear()
    try:
        k_chunk, n_chunks = configs.k_chunking(N, K)
        xa_chunk, xa_subs, _ = configs.xa_chunking(N, K)
        row = dict(shape=name, K=K, N=N, target=target, k_chunk=k_chunk, n_chunks=n_chunks, xa_chunk=xa_chunk,
                   xa_subs=xa_subs)
        for M in (1, 16):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            row[f"lora_{M}_us"] = graph_us(lambda: w8a16_lora(x, codes, scale, a, b, SIGMA))
            if M == 1:
                row["nolora_1_us"] = graph_us(lambda: w8a16_lora(x, codes, scale))
        x = torch.randn(train_tokens, K, device="cuda", dtype=torch.bfloat16)
        row["fwd_us"] = graph_us(lambda: w8a16_lora(x, codes, scale, a, b, SIGMA), reps=5)
        step, params = bench.trainer_steps(K, N, train_tokens, w16, codes, scale, a, b)["fp8"]
        per_kernel = bench.kernel_us_per_step(step, 3, params)[0]
        row["train_kernel_us"] = sum(per_kernel.values())
        row["train_kernels"] = per_kernel
        row["train_vs_bf16"] = row["train_kernel_us"] / bf16_kernel_us
        row["tma_fallbacks"] = [str(k) for k, ok in ws_tma._CHECKED.items() if not ok]
    finally:
        configs.TARGET_PROGRAMS = saved
        configs.XA_CHUNK_MAX = saved_xa
        ws_tma._CHECKED.clear()  # (the check's key does not hold the chunking)
        ws_tma._CALLS.clear()
    return row


def format_row(r: dict) -> str:
    return (f"| {r['shape']} | {r['target']} | {r['n_chunks']} × {r['k_chunk']} | {r['xa_subs']} × {r['xa_chunk']} "
            f"| {r['lora_1_us']:.1f} / "
            f"{r['lora_16_us']:.1f} | {r['nolora_1_us']:.1f} | {100 * (r['lora_1_us'] / r['nolora_1_us'] - 1):.0f} "
            f"| {r['fwd_us']:.0f} ({r['bf16_fwd_us']:.0f}) | {r['train_kernel_us']:.0f} ({r['bf16_kernel_us']:.0f}) "
            f"| {r['train_vs_bf16']:.3f} | {len(r['tma_fallbacks'])} |")


def print_kernels(name: str, fp8: dict, bf16: dict) -> None:
    """The last target's FP8 fwd + bwd kernels beside the bf16 ones, µs per step, longest first."""
    for tag, kernels in (("fp8", fp8), ("bf16", bf16)):
        for kernel, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"#   {name} {tag} {us:8.1f} µs  {kernel}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", type=int, nargs="+", default=[264, 132, 66])
    ap.add_argument("--shapes", nargs="+", default=["q3_qkv", "q3_o", "q3_gate", "q3_down"], choices=list(SHAPES))
    ap.add_argument("--train-tokens", type=int, default=8192)
    ap.add_argument("--min-chunks", type=int, default=None, help="configs.MIN_CHUNKS (default: the committed one)")
    ap.add_argument("--xa-chunk-max", type=int, nargs="+", default=None,
                    help="configs.XA_CHUNK_MAX values to probe per target (default: the committed one)")
    ap.add_argument("--kernels", action="store_true", help="also print each fwd + bwd's kernels (FP8 and bf16)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "probe_k_chunking.json"))
    args = ap.parse_args()
    if args.min_chunks is not None:
        configs.MIN_CHUNKS = args.min_chunks
    print(f"# {torch.cuda.get_device_name()}; committed TARGET_PROGRAMS = {configs.TARGET_PROGRAMS}, "
          f"MIN_CHUNKS = {configs.MIN_CHUNKS}", flush=True)
    rows = []
    print("| shape | target | chunks × depth | xa sub-chunks × depth | LoRA 1 / 16 tok µs | no LoRA 1 tok µs | LoRA +% | fwd µs "
          f"@{args.train_tokens} (bf16) | fwd+bwd kernel µs (bf16) | ×bf16 | TMA fallbacks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.shapes:
        K, N = SHAPES[name]
        layer = bench.make_layer(K, N)
        bf16_step, bf16_params = bench.trainer_steps(K, N, args.train_tokens, *layer)["bf16"]
        bf16_kernels = bench.kernel_us_per_step(bf16_step, 3, bf16_params)[0]
        bf16_us = sum(bf16_kernels.values())
        w16, _, _, a, b = layer
        x = torch.randn(args.train_tokens, K, device="cuda", dtype=torch.bfloat16)
        bf16_fwd_us = graph_us(lambda: x @ w16.t() + SIGMA * ((x @ a.t()) @ b.t()), reps=5)
        del x
        for target in args.targets:
            for xa_max in args.xa_chunk_max or [None]:
                r = probe_row(name, target, layer, args.train_tokens, bf16_us, xa_max)
                r["bf16_kernel_us"], r["bf16_fwd_us"] = bf16_us, bf16_fwd_us
                rows.append(r)
                print(format_row(r), flush=True)
        if args.kernels:
            print_kernels(name, rows[-1]["train_kernels"], bf16_kernels)
        del layer, w16, a, b
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
