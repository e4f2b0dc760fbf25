"""One RL-style LoRA training step on production-shaped random models, base=fp8 vs base=bf16, one process.

A step = forward + backward of every micro-batch (chunked fp32 log-probs, token-mean loss, gradient
checkpointing) + grad clip + AdamW on the LoRA parameters. Prints a table (s/step, tokens/s, peak GPU
memory, base-weight GiB, fp8/bf16 ratios) and writes JSON.

    python scripts/bench_trainer.py                       # Qwen3-8B and Qwen3.5-9B shapes, 8 x 2048, r=64
    python scripts/bench_trainer.py --shapes qwen3-8b --steps 2 --json /tmp/out/bench_trainer.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import time

import torch

from epirl.model import random_policy
from epirl.model.loading import make_bitwise
from epirl.model.lora import ALL_PROJECTIONS
from epirl.model.shapes import SHAPES

GiB = 2 ** 30


def training_step(policy, optimizer, ids_B_T1: torch.Tensor, micro_batch: int, chunk_tokens: int) -> float:
    optimizer.zero_grad(set_to_none=True)
    total_tokens = ids_B_T1[:, 1:].numel()
    loss_sum = 0.0
    for start in range(0, ids_B_T1.shape[0], micro_batch):
        mb = ids_B_T1[start:start + micro_batch]
        logprobs_B_T, _ = policy.token_logprobs(mb[:, :-1], mb[:, 1:], 1.0, chunk_tokens)
        loss = -logprobs_B_T.sum() / total_tokens  # DAPO-style token mean over the whole step
        loss.backward()
        loss_sum += loss.item()
    torch.nn.utils.clip_grad_norm_(policy.lora_parameters(), 1.0)
    optimizer.step()
    return loss_sum


def bench_one(shape: str, base: str, args) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    config = SHAPES[shape]()
    policy = random_policy(config, base.removesuffix("-bitwise"), "cuda", rank=args.rank, alpha=2.0 * args.rank,
                           targets=list(ALL_PROJECTIONS), seed=0, gradient_checkpointing=not args.no_checkpointing,
                           fused_slices=getattr(args, "fused_slices", "on") == "on")
    if base.endswith("-bitwise"):  # the trainer of `engine.bitwise`: the invariant ops around the projections
        make_bitwise(policy, config)
    load_peak = torch.cuda.max_memory_allocated()
    optimizer = torch.optim.AdamW(policy.lora_parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (args.seqs, args.seq_len + 1), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    training_step(policy, optimizer, ids, args.micro_batch, args.chunk_tokens)  # warm-up (Triton autotune/JIT)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    steps = args.steps if shape != "qwen3.5-9b" or has_fla() else max(1, args.steps // 2)
    start = time.perf_counter()
    for _ in range(steps):
        loss = training_step(policy, optimizer, ids, args.micro_batch, args.chunk_tokens)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    kernel_s, kernels = step_kernel_seconds(policy, optimizer, ids, args) if args.kernel_sum else (None, None)
    report = policy.memory_report()
    result = {
        "shape": shape, "base": base, "s_per_step": seconds, "tokens_per_s": args.seqs * args.seq_len / seconds,
        "step_peak_gib": torch.cuda.max_memory_allocated() / GiB, "load_peak_gib": load_peak / GiB,
        "base_weight_gib": report["base_weight_bytes"] / GiB,
        "base_projection_gib": report["base_projection_bytes"] / GiB,
        "base_other_gib": report["base_other_bytes"] / GiB, "lora_gib": report["lora_param_bytes"] / GiB,
        "loss": loss, "steps_timed": steps, "kernel_s_per_step": kernel_s,
        "gpu_busy": kernel_s / seconds if kernel_s else None, "kernels": kernels,
        "gdn": ("fla" if has_fla() else "torch-fallback") if shape == "qwen3.5-9b" else "-",
    }
    del policy, optimizer
    return result


def step_kernel_seconds(policy, optimizer, ids, args) -> tuple[float, dict[str, tuple[float, int]]]:
    """The CUDA kernel time of one step (torch.profiler, summed over kernels) and {kernel name: (seconds, launches)}.
    Against the unprofiled wall time it says how busy the host keeps the GPU: a step whose kernels sum to much less
    than its wall time waits on Python, autograd and kernel launches, not on the GPU."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        training_step(policy, optimizer, ids, args.micro_batch, args.chunk_tokens)
        torch.cuda.synchronize()
    per_kernel: dict[str, tuple[float, int]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            seconds, launches = per_kernel.get(e.name[:80], (0.0, 0))
            per_kernel[e.name[:80]] = (seconds + e.device_time / 1e6, launches + 1)
    return sum(s for s, _ in per_kernel.values()), per_kernel


# kernel-name fragments -> the group a step's kernel time is reported under (first match wins)
KERNEL_GROUPS = (("W8A16 / LoRA (epirl Triton)", ("_ws_", "_xa_", "lora", "scaled_gemm")),
                 ("GEMM (cuBLAS)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
                 ("attention", ("flash", "fmha", "attention")))


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((group for group, parts in KERNEL_GROUPS if any(p in low for p in parts)), "other")


def print_kernel_groups(results: list[dict], top: int) -> None:
    """Per base: the step's kernel time by group and its `top` kernels (from --kernel-sum's profiled step)."""
    for r in results:
        kernels = r.get("kernels") or {}
        groups: dict[str, float] = {}
        for name, (seconds, _) in kernels.items():
            groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + seconds
        print(f"\n{r['shape']} {r['base']}: kernel ms by group: "
              + ", ".join(f"{g} {s * 1e3:.1f}" for g, s in sorted(groups.items(), key=lambda kv: -kv[1])))
        print(f"| {r['base']} kernel | launches | ms |\n|---|---|---|")
        for name, (seconds, launches) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"| `{name[:70]}` | {launches} | {seconds * 1e3:.1f} |")


def has_fla() -> bool:
    return importlib.util.find_spec("fla") is not None


def print_table(results: list[dict]) -> None:
    print(f"\n{'shape':<11} {'base':<12} {'s/step':>7} {'tok/s':>8} {'peak GiB':>9} {'base GiB':>9} "
          f"{'(proj)':>7} {'(other)':>8} {'GDN':>15} {'GPU busy':>9}")
    for r in results:
        print(f"{r['shape']:<11} {r['base']:<12} {r['s_per_step']:7.3f} {r['tokens_per_s']:8.0f} {r['step_peak_gib']:9.2f} "
              f"{r['base_weight_gib']:9.2f} {r['base_projection_gib']:7.2f} {r['base_other_gib']:8.2f} {r['gdn']:>15} "
              f"{format(r['gpu_busy'], '9.0%') if r.get('gpu_busy') else '-':>9}")
    by_key = {(r["shape"], r["base"]): r for r in results}
    for shape in dict.fromkeys(r["shape"] for r in results):
        if (shape, "fp8") in by_key and (shape, "bf16") in by_key:
            fp8, bf16 = by_key[(shape, "fp8")], by_key[(shape, "bf16")]
            print(f"{shape}: fp8/bf16 step time {fp8['s_per_step'] / bf16['s_per_step']:.2f}x, "
                  f"peak {fp8['step_peak_gib'] / bf16['step_peak_gib']:.2f}x, "
                  f"base {fp8['base_weight_gib']:.2f} vs {bf16['base_weight_gib']:.2f} GiB")
        if (shape, "fp8") in by_key and (shape, "fp8-bitwise") in by_key:  # the bitwise pairing's cost (target 1.10x)
            fp8, bitwise = by_key[(shape, "fp8")], by_key[(shape, "fp8-bitwise")]
            print(f"{shape}: fp8-bitwise/fp8 step time {bitwise['s_per_step'] / fp8['s_per_step']:.2f}x, "
                  f"peak {bitwise['step_peak_gib'] / fp8['step_peak_gib']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--bases", nargs="+", default=["fp8", "bf16"], choices=["fp8", "bf16", "fp8-bitwise"],
                        help="fp8-bitwise: the FP8 trainer of `engine.bitwise` (invariant norms, rotary, attention, "
                             "activation, LM head)")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="keep all activations (use a smaller --micro-batch: ~60 GB per 8k tokens at 8B)")
    parser.add_argument("--kernel-sum", action="store_true",
                        help="profile one more step: its kernel time against the wall time (GPU busy %%)")
    parser.add_argument("--backward-thread", choices=["autograd", "caller"], default="autograd",
                        help="caller: run backward on the calling thread (torch.autograd.set_multithreading_enabled"
                             "(False)) instead of autograd's CUDA device thread")
    parser.add_argument("--fused-slices", choices=["on", "off"], default="on",
                        help="on (default, `kernels.fused_slices`): the FP8 trainer runs each layer of ONE_CALL_LAYERS "
                             "(q, k, v) as one call (the matched engine's call, kernels/w8a16/slices.py); off: one "
                             "call per slice")
    parser.add_argument("--kernel-table", type=int, default=0, metavar="N",
                        help="with --kernel-sum: print the step's kernel time by group and its N largest kernels")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.seqs} x {args.seq_len} tokens, micro-batch {args.micro_batch}, rank {args.rank}, "
          f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}, backward on the {args.backward_thread} "
          f"thread, q, k, v as {'one call' if args.fused_slices == 'on' else 'one call per slice'}, "
          f"flash-linear-attention {'yes' if has_fla() else 'NO (Qwen3.5 uses the torch GDN fallback)'}")
    results = []
    torch.autograd.set_multithreading_enabled(args.backward_thread == "autograd")
    for shape in args.shapes:
        for base in args.bases:
            result = bench_one(shape, base, args)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "kernels"}), flush=True)
    print_table(results)
    if args.kernel_sum and args.kernel_table:
        print_kernel_groups(results, args.kernel_table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
