"""One call per fused layer against one call per slice (`kernels.fused_slices`, kernels/w8a16/slices.py), side by
side in one process on the GPU; prints markdown tables, writes JSON.

Decode (1-16 tokens, rank-64 LoRA on every slice): the matched engine's fused layer as it runs by default (`w8a16_lora`
per slice into its columns of one output, as `epirl::w8a16_lora_slices` does) against one `w8a16_lora` over the
whole layer with the block-diagonal A_cat / B_bd; CUDA-graph replays, L2 flushed; HBM floor of the one call.
Training (4096-8192 tokens): the trainer's q / k / v (gate / up) modules forward + backward, each alone against
their SliceGroup, and against frozen bf16 Linears + LoRA per slice (what a bf16 trainer runs); torch.profiler
kernel sums and do_bench walls.
Usage: python scripts/bench_fused_slices.py [--tokens 1 16] [--train-tokens 4096 8192] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bench  # noqa: E402  (its timers, so that the CPU test patches them in one place)

from epirl.kernels import Fp8LoRALinear, quantize_weight_fp8, split_fused, w8a16_lora  # noqa: E402
from epirl.kernels.lora_linear.sliced import attach_slice_group  # noqa: E402
from epirl.kernels.w8a16.slices import sliced_lora_operands  # noqa: E402

# Qwen3-8B's fused layers: (K, slice widths)
LAYERS = {"q3_qkv": (4096, [4096, 1024, 1024]), "q3_gate_up": (4096, [12288, 12288])}
SIGMA = bench.ALPHA / bench.RANK


def make_group(K: int, widths: list[int], dev: str = "cuda", seed: int = 0, grouped: bool = True):
    """(codes, scale, modules, w16 per slice): a fused layer's FP8 codes (one scale), its slices' Fp8LoRALinear
    modules (grouped: one call for the layer, as with `kernels.fused_slices`), and each slice's bf16 weight."""
    g = torch.Generator(device=dev).manual_seed(seed)
    weights = [torch.randn(w, K, generator=g, device=dev) * 0.02 for w in widths]
    codes, scale = quantize_weight_fp8(weights)
    modules = [Fp8LoRALinear(view, scale,
                             torch.nn.Parameter((torch.randn(bench.RANK, K, generator=g, device=dev) / K ** 0.5)),
                             torch.nn.Parameter(torch.randn(w, bench.RANK, generator=g, device=dev) * 0.02), SIGMA)
               for w, view in zip(widths, split_fused(codes, widths))]
    if grouped:
        attach_slice_group(modules)
    return codes, scale, modules, [w.bfloat16() for w in weights]


def decode_row(name: str, K: int, widths: list[int], M: int, dev: str = "cuda") -> dict:
    codes, scale, modules, _ = make_group(K, widths, dev)
    a = [m.lora_A.detach().bfloat16() for m in modules]
    b = [m.lora_B.detach().bfloat16() for m in modules]
    a_cat, b_bd = sliced_lora_operands(a, b, widths, torch.bfloat16)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(M, sum(widths), device=dev, dtype=torch.bfloat16)

    def per_slice():  # `epirl::w8a16_lora_slices` without the block buffers
        start = 0
        for width, view, ai, bi in zip(widths, split_fused(codes, widths), a, b):
            w8a16_lora(x, view, scale, ai, bi, SIGMA, out=y[:, start:start + width])
            start += width
        return y

    N = sum(widths)
    floor = (N * K + M * K * 2 + M * N * 2 + (a_cat.numel() + b_bd.numel()) * 2) / bench.HBM_BYTES_PER_S * 1e6
    return dict(layer=name, K=K, widths=widths, M=M, floor_us=floor, per_slice_us=bench.graph_us(per_slice),
                one_call_us=bench.graph_us(lambda: w8a16_lora(x, codes, scale, a_cat, b_bd, SIGMA)))


def train_row(name: str, K: int, widths: list[int], M: int, dev: str = "cuda") -> dict:
    codes, scale, modules, w16 = make_group(K, widths, dev)
    ungrouped = make_group(K, widths, dev, grouped=False)[2]  # same seed: the same weights and adapters
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gys = [torch.randn(M, w, device=dev, dtype=torch.bfloat16) for w in widths]
    lora16 = [(torch.nn.Parameter(m.lora_A.detach().bfloat16()), torch.nn.Parameter(m.lora_B.detach().bfloat16()))
              for m in modules]
    fp8_params = [x] + [p for m in modules for p in (m.lora_A, m.lora_B)]
    per_slice_params = [x] + [p for m in ungrouped for p in (m.lora_A, m.lora_B)]
    bf16_params = [x] + [p for pair in lora16 for p in pair]

    def fp8_step(group):
        def step():
            torch.autograd.backward([m(x) for m in group], gys)
        return step

    def bf16_step():
        outs = [F.linear(x, w) + SIGMA * F.linear(F.linear(x, a), b) for w, (a, b) in zip(w16, lora16)]
        torch.autograd.backward(outs, gys)

    row = dict(layer=name, K=K, widths=widths, M=M)
    for tag, step, params in (("per_slice", fp8_step(ungrouped), per_slice_params),
                              ("one_call", fp8_step(modules), fp8_params), ("bf16", bf16_step, bf16_params)):
        step()
        row[f"{tag}_us"] = bench.bench_us(step, grad_to_none=params)
        row[f"{tag}_kernel_us"] = sum(bench.kernel_us_per_step(step, 3, params)[0].values())
        for p in params:
            p.grad = None
    return row


def print_tables(decode: list[dict], train: list[dict]) -> None:
    if decode:
        print("\n| layer | tokens | floor µs | per slice µs | one call µs | one call / per slice | one call × floor |")
        print("|---|---|---|---|---|---|---|")
        for r in decode:
            print(f"| {r['layer']} | {r['M']} | {r['floor_us']:.1f} | {r['per_slice_us']:.1f} | {r['one_call_us']:.1f} "
                  f"| {r['one_call_us'] / r['per_slice_us']:.2f} | {r['one_call_us'] / r['floor_us']:.2f} |")
    if train:
        print("\n| layer | tokens | kernel sum µs per slice / one call / bf16 | one call / bf16 | per slice / bf16 "
              "| wall µs per slice / one call / bf16 |")
        print("|---|---|---|---|---|---|")
        for r in train:
            print(f"| {r['layer']} | {r['M']} | {r['per_slice_kernel_us']:.0f} / {r['one_call_kernel_us']:.0f} / "
                  f"{r['bf16_kernel_us']:.0f} | {r['one_call_kernel_us'] / r['bf16_kernel_us']:.2f} "
                  f"| {r['per_slice_kernel_us'] / r['bf16_kernel_us']:.2f} | {r['per_slice_us']:.0f} / "
                  f"{r['one_call_us']:.0f} / {r['bf16_us']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--train-tokens", type=int, nargs="*", default=[4096, 8192])
    ap.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_fused_slices.json"))
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; decode: CUDA-graph replays, L2 flushed",
          flush=True)
    decode = [decode_row(n, *LAYERS[n], M) for n in args.layers for M in args.tokens]
    train = [train_row(n, *LAYERS[n], M) for n in args.layers for M in args.train_tokens]
    print_tables(decode, train)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), decode=decode, train=train), f, indent=1)


if __name__ == "__main__":
    main()
