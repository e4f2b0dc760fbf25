"""Benchmark epirl.kernels on the GPU, side by side in one process; prints markdown tables, writes JSON.

Forward (rank-64 LoRA, Qwen3-8B and Qwen3.5-9B projection shapes, 1..16384 tokens): our W8A16 and W8A8
kernels vs cuBLAS bf16 + separate LoRA matmuls and vs our FP8 quant + torch._scaled_mm + LoRA, with the
HBM floor (bytes of the W8A16 call / 4.4 TB/s), and the W8A16 + LoRA call as planned for this GPU with and
without programmatic dependent launch (`plan.Device.pdl`; same bits). Trainer: Fp8LoRALinear forward+backward vs a frozen bf16
nn.Linear + LoRA (time and peak memory). Timing: forward calls are replayed from a CUDA graph (as vLLM
decodes; without it Python launch overhead, ~20-40 µs per call, hides the GPU time) with a 256 MB L2 flush
before each call, whose own time is measured in a flush-only graph and subtracted; trainer steps use
triton.testing.do_bench (L2 flushed).
Usage: python scripts/bench_kernels.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from epirl.kernels import Fp8LoRALinear, quantize_activation_fp8, quantize_weight_fp8, w8a8_lora, w8a16_lora
from dataclasses import replace

from epirl.kernels.w8a16.weight_stationary import weight_stationary_gemm
from epirl.kernels.gpu_timing import flush_mode, graph_us
from epirl.kernels.plan import describe

HBM_BYTES_PER_S = 4.4e12
RANK, ALPHA = 64, 128
# (name, K in, N out). Qwen3.5-9B: gated attention q(+gate) 16x256x2 + k,v 4x256 each; GatedDeltaNet
# in_proj_qkvz 2*16*128 + 2*32*128; its o/out_proj and MLP have the Qwen3-8B shapes.
SHAPES = [("q3_qkv", 4096, 6144), ("q3_o", 4096, 4096), ("q3_gate_up", 4096, 24576),
          ("q3_down", 12288, 4096), ("q35_attn_qkv", 4096, 10240), ("q35_gdn_qkvz", 4096, 12288)]
# the unfused HF modules the trainer runs (vLLM's engine fuses q/k/v and gate/up; a training step runs q, k, v, gate,
# up apart, on views of the same codes): trainer rows only, through --shapes
TRAINER_SHAPES = [("q3_kv", 4096, 1024), ("q3_gate", 4096, 12288)]
TOKENS = [1, 4, 16, 64, 512, 4096, 16384]
TRAIN_TOKENS = [4096, 8192]


def bench_us(fn, **kw) -> float:
    return do_bench(fn, warmup=10, rep=40, **kw) * 1e3


def floor_us(M, K, N, r=RANK) -> float:
    nbytes = N * K + M * K * 2 + M * N * 2 + (r * K + N * r) * 2
    return nbytes / HBM_BYTES_PER_S * 1e6


def make_layer(K, N, dev="cuda"):
    w = torch.randn(N, K, device=dev) * 0.02
    codes, scale = quantize_weight_fp8(w)
    a = (torch.randn(RANK, K, device=dev) / K ** 0.5).bfloat16()
    b = (torch.randn(N, RANK, device=dev) * 0.02).bfloat16()
    return w.bfloat16(), codes, scale, a, b


def forward_row(name, K, N, M, w16, codes, scale, a, b):
    sigma = ALPHA / RANK
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    scale_b = scale.reshape(1, 1).expand(1, N).contiguous()

    def scaled_mm_lora():
        q, s = quantize_activation_fp8(x)
        y = torch._scaled_mm(q, codes.t(), scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16)
        return y + sigma * ((x @ a.t()) @ b.t())

    row = dict(shape=name, K=K, N=N, M=M, floor_us=floor_us(M, K, N))
    row["w8a16_lora_us"] = graph_us(lambda: w8a16_lora(x, codes, scale, a, b, sigma))
    row["w8a16_us"] = graph_us(lambda: w8a16_lora(x, codes, scale))
    here = describe(x.device)
    # the other path, same bits: lora_down + its PDL dependent, or the down-projection fused into split-K (PDL needs a
    # Hopper GPU: elsewhere, e.g. in Triton's interpreter, both rows time the one path)
    other = replace(here, pdl=not here.pdl) if here.hopper else here
    row["w8a16_lora_other_pdl_us"] = graph_us(lambda: weight_stationary_gemm(
        x, codes, torch.bfloat16, w_scale=scale.float().reshape(1), lora_a=a, lora_b=b, lora_scale=sigma, device=other))
    row["pdl"] = here.pdl
    row["w8a8_lora_us"] = graph_us(lambda: w8a8_lora(x, codes, scale, a, b, sigma))
    row["bf16_lora_us"] = graph_us(lambda: x @ w16.t() + sigma * ((x @ a.t()) @ b.t()))
    row["scaled_mm_lora_us"] = graph_us(scaled_mm_lora)
    row["eager_w8a16_lora_us"] = bench_us(lambda: w8a16_lora(x, codes, scale, a, b, sigma))
    return row


def trainer_steps(K, N, M, w16, codes, scale, a, b):
    """{"fp8": (step, params), "bf16": (step, params)}: one forward + backward of Fp8LoRALinear and of the frozen
    bf16 Linear + LoRA it replaces, on the same random x and upstream gradient; params get .grad."""
    sigma = ALPHA / RANK
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8LoRALinear(codes, scale, a.clone(), b.clone(), sigma)
    a16, b16 = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())

    def fp8_step():
        fp8(x).backward(gy)

    def bf16_step():
        (F.linear(x, w16) + sigma * F.linear(F.linear(x, a16), b16)).backward(gy)

    return {"fp8": (fp8_step, [x, fp8.lora_A, fp8.lora_B]), "bf16": (bf16_step, [x, a16, b16])}


def kernel_us_per_step(step, steps: int, params=()) -> tuple[dict[str, float], float]:
    """(CUDA kernel name -> µs per step, kernel launches per step), over `steps` profiled steps after two
    warm-ups (torch.profiler); the grads of `params` are cleared after each step (as do_bench's grad_to_none)."""
    from collections import defaultdict

    def step_and_clear():
        step()
        for p in params:
            p.grad = None

    for _ in range(2):
        step_and_clear()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_and_clear()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    launches = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:70]] += event.device_time / steps
            launches += 1
    return dict(per_kernel), launches / steps


def trainer_row(name, K, N, M, w16, codes, scale, a, b):
    """One forward + backward per side: wall time (do_bench; on small shapes it measures the host's launches, not the
    GPU), the kernel sum (torch.profiler: what the GPU spends), and memory."""
    row = dict(shape=name, K=K, N=N, M=M)
    for tag, (step, params) in trainer_steps(K, N, M, w16, codes, scale, a, b).items():
        step()
        row[f"{tag}_us"] = bench_us(step, grad_to_none=params)
        row[f"{tag}_kernel_us"] = sum(kernel_us_per_step(step, 3, params)[0].values())
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        # weight + what the step allocates on top of the live tensors (x, gy, both layers' weights)
        weight = codes.numel() if tag == "fp8" else w16.numel() * 2
        row[f"{tag}_step_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        row[f"{tag}_weight_mib"] = weight / 2 ** 20
        row[f"{tag}_peak_mib"] = row[f"{tag}_step_mib"] + row[f"{tag}_weight_mib"]
        for p in params:
            p.grad = None
    flops = 2 * M * K * N * 2 + 4 * 2 * M * RANK * (K + N)  # fwd+dX base GEMMs + LoRA matmuls
    row["fp8_tflops"] = flops / row["fp8_us"] / 1e6
    return row


SWEEP_CONFIGS = [dict(BN=128, BM=64, BK=64, num_warps=4, num_stages=4),
                 dict(BN=64, BM=64, BK=128, num_warps=4, num_stages=4),
                 dict(BN=128, BM=128, BK=64, num_warps=8, num_stages=4),
                 dict(BN=128, BM=64, BK=128, num_warps=4, num_stages=3),
                 dict(BN=256, BM=64, BK=64, num_warps=8, num_stages=3),
                 dict(BN=128, BM=128, BK=128, num_warps=8, num_stages=3)]


def sweep_weight_stationary():
    """Candidate pinned configs for the W8A16 kernel (one config must serve every M)."""
    from epirl.kernels.w8a16.weight_stationary import weight_stationary_gemm

    print("\n| config | shape | tokens | µs |\n|---|---|---|---|")
    rows = []
    for name, K, N in (SHAPES[0], SHAPES[3]):
        _, codes, scale, _, _ = make_layer(K, N)
        for M in (1, 16, 4096):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            for cfg in SWEEP_CONFIGS:
                us = graph_us(lambda: weight_stationary_gemm(x, codes, torch.bfloat16, w_scale=scale, config=cfg))
                tag = "BN{BN}-BM{BM}-BK{BK}-w{num_warps}-s{num_stages}".format(**cfg)
                rows.append(dict(config=tag, shape=name, M=M, us=us))
                print(f"| {tag} | {name} | {M} | {us:.1f} |", flush=True)
    return rows


def pdl_on_off(r) -> str:
    on, off = ((r["w8a16_lora_us"], r["w8a16_lora_other_pdl_us"]) if r["pdl"]
               else (r["w8a16_lora_other_pdl_us"], r["w8a16_lora_us"]))
    return f"{on:.1f} / {off:.1f}"


def print_tables(fwd, train):
    print("\n| shape | K→N | tokens | floor µs | w8a16+LoRA µs | ×floor | w8a16 µs | LoRA +% | w8a8+LoRA µs "
          "| bf16 cuBLAS+LoRA µs | quant+_scaled_mm+LoRA µs | w8a16+LoRA, PDL on / off µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in fwd:
        print(f"| {r['shape']} | {r['K']}→{r['N']} | {r['M']} | {r['floor_us']:.1f} | {r['w8a16_lora_us']:.1f} "
              f"| {r['w8a16_lora_us'] / r['floor_us']:.2f} | {r['w8a16_us']:.1f} "
              f"| {100 * (r['w8a16_lora_us'] / r['w8a16_us'] - 1):.0f} | {r['w8a8_lora_us']:.1f} "
              f"| {r['bf16_lora_us']:.1f} | {r['scaled_mm_lora_us']:.1f} | {pdl_on_off(r)} |")
    print("\n| shape | tokens | Fp8LoRALinear fwd+bwd µs | bf16 Linear+LoRA µs | fp8/bf16 | kernel sum µs fp8 / bf16 "
          "| kernel fp8/bf16 | fp8 TFLOP/s | weight+step peak MiB fp8 (weight) | bf16 (weight) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in train:
        kernel_ratio = r["fp8_kernel_us"] / r["bf16_kernel_us"] if r["bf16_kernel_us"] else float("nan")
        print(f"| {r['shape']} | {r['M']} | {r['fp8_us']:.0f} | {r['bf16_us']:.0f} | {r['fp8_us'] / r['bf16_us']:.2f} "
              f"| {r['fp8_kernel_us']:.0f} / {r['bf16_kernel_us']:.0f} | {kernel_ratio:.2f} "
              f"| {r['fp8_tflops']:.0f} | {r['fp8_peak_mib']:.0f} ({r['fp8_weight_mib']:.0f}) "
              f"| {r['bf16_peak_mib']:.0f} ({r['bf16_weight_mib']:.0f}) |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes/tokens (smoke run)")
    ap.add_argument("--sweep", action="store_true", help="also time candidate W8A16 tile configs")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="forward token counts")
    ap.add_argument("--train-tokens", type=int, nargs="*", default=None,
                    help="trainer token counts (given without values: no trainer rows)")
    ap.add_argument("--shapes", nargs="+", default=None, choices=[s[0] for s in SHAPES + TRAINER_SHAPES],
                    help="only these shapes (default: every engine shape; q3_kv / q3_gate are the trainer's unfused "
                         "k/v and gate/up modules)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_kernels.json"))
    args = ap.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.shapes:
        shapes = [s for s in SHAPES + TRAINER_SHAPES if s[0] in args.shapes]
    tokens = args.tokens or ([1, 16, 4096] if args.quick else TOKENS)
    train_tokens = (args.train_tokens if args.train_tokens is not None
                    else TRAIN_TOKENS[:1] if args.quick else TRAIN_TOKENS)
    t0 = time.time()
    print(f"# timer: CUDA-graph replays, L2 {flush_mode()}-flushed before each call", flush=True)
    sweep = sweep_weight_stationary() if args.sweep else []
    fwd, train = [], []
    for name, K, N in shapes:
        w16, codes, scale, a, b = make_layer(K, N)
        for M in tokens:
            fwd.append(forward_row(name, K, N, M, w16, codes, scale, a, b))
        for M in train_tokens:
            train.append(trainer_row(name, K, N, M, w16, codes, scale, a, b))
        print(f"# {name} done at {time.time() - t0:.0f}s", flush=True)
        del w16, codes
        torch.cuda.empty_cache()
    print_tables(fwd, train)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, l2_flush=flush_mode(),
                       forward=fwd, trainer=train, sweep=sweep), f, indent=1)


if __name__ == "__main__":
    main()
