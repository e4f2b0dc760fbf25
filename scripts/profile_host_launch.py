"""Host cost of the FP8 trainer linear's launches (H200): µs of CPU time per call while the GPU is held busy.

Every call below is enqueued behind a long sleep kernel, so nothing waits for the GPU: what is timed is Python, the
autograd engine, Triton's launcher and the CUDA driver's enqueue. One row per piece of one `Fp8LoRALinear` forward +
backward, from a bare Triton launch up to the whole step, beside the bf16 path it replaces, so that a gap between
the step's wall time and its kernel sum can be pinned on a piece. The `compiled.run` rows call Triton's compiled
launcher directly (arguments bound once): what a launch costs without `JITFunction.run`'s binding and cache lookup.
Usage: python scripts/profile_host_launch.py [--shape q3_o] [--tokens 4096] [--calls 40] [--cprofile]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import SHAPES, make_layer, trainer_steps  # noqa: E402

from epirl.kernels import Fp8LoRALinear, w8a16_lora  # noqa: E402
from epirl.kernels.gemm.scaled import scaled_gemm_lora  # noqa: E402
from epirl.kernels.lora_linear.triton import lora_linear_backward  # noqa: E402
from epirl.kernels.gemm.weight_stationary import lora_down, weight_stationary_gemm  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr, n, BLOCK: tl.constexpr):
    pass


class _Identity(torch.autograd.Function):
    """A custom autograd Function that launches nothing: what autograd alone costs around one (Python backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def host_us(fn, calls: int, reps: int = 7, no_gc: bool = False) -> float:
    """Median over reps of the host µs per call of `calls` back-to-back calls behind a sleep kernel (no_gc: with
    Python's cyclic garbage collector off during the batches)."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time: longer than any batch of enqueues below
        if no_gc:
            gc.disable()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
        gc.enable()
    torch.cuda.synchronize()
    return statistics.median(out) * 1e6


def split_whole_step(layer, x, gy, calls: int) -> tuple[float, float, bool]:
    """(forward µs, backward µs, whether the backward body ran on the calling thread) of whole forward + backward
    steps timed apart inside one back-to-back batch (is a forward slower between backwards than in a row of its
    own?)."""
    threads = set()
    fwd, bwd = [], []
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    for _ in range(calls):
        t0 = time.perf_counter()
        y = layer(x)
        y.grad_fn.register_prehook(lambda grads: threads.add(threading.get_ident()))
        t1 = time.perf_counter()
        y.backward(gy)
        t2 = time.perf_counter()
        x.grad = layer.lora_A.grad = layer.lora_B.grad = None
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    torch.cuda.synchronize()
    return statistics.median(fwd) * 1e6, statistics.median(bwd) * 1e6, threads == {threading.get_ident()}


def cpu_trace(layer, x, gy, steps: int = 10, top: int = 25) -> None:
    """torch.profiler CPU events of `steps` whole forward + backward steps (behind a sleep kernel): host ops by self
    time, autograd's evaluate_function ranges and the CUDA launch calls included."""
    for _ in range(3):
        layer(x).backward(gy)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            layer(x).backward(gy)
            x.grad = layer.lora_A.grad = layer.lora_B.grad = None
    torch.cuda.synchronize()
    print(f"\n### CPU trace: {steps} Fp8LoRALinear forward + backward steps (self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def bound_launcher(jit_fn, grid, *args, **kwargs):
    """A closure that launches jit_fn's compiled kernel with these arguments through its compiled launcher only
    (Triton 3.4-3.6 internals: `device_caches` binder, `CompiledKernel.run`)."""
    compiled = jit_fn[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    binder = jit_fn.device_caches[device][4]
    bound_args, _, _ = binder(*args, **kwargs)
    values = list(bound_args.values())
    stream = torch.cuda.current_stream().cuda_stream
    g = tuple(grid) + (1,) * (3 - len(grid))

    def launch():
        meta = compiled.launch_metadata(grid, stream, *values)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta, None, None, *values)
    return launch


def autograd_rows() -> list[tuple[str, object]]:
    """What autograd alone costs around a custom Function and around a builtin op (no real kernels)."""
    xs = torch.randn(64, device="cuda", requires_grad=True)
    gs = torch.ones(64, device="cuda")

    def custom_function():
        _Identity.apply(xs).backward(gs)
        xs.grad = None

    def builtin_op():
        (xs * 2.0).backward(gs)
        xs.grad = None
    return [("autograd: custom Function (no kernel) fwd + bwd", custom_function),
            ("autograd: x * 2 fwd + bwd", builtin_op)]


def alternating_rows(pieces: dict) -> list[tuple[str, object]]:
    """Is a call slower when other work runs between its repetitions (cold caches, not the call itself)? Pairs of
    pieces, alternated: against the sum of their own rows."""
    def alternate(a, b):
        def both():
            pieces[a]()
            pieces[b]()
        return both
    return [(f"alternating: {a} + {b}", alternate(a, b)) for a, b in (
        ("ws fwd, table (TMA), xa given", "dX (ws op=dx, table)"),
        ("gb = g·B (torch.mm)", "triton: empty kernel, 2 args"),
        ("lora_down (fwd xa)", "gb = g·B (torch.mm)"))]


def piece_rows(K: int, N: int, M: int) -> tuple[list[tuple[str, object]], object, torch.Tensor, torch.Tensor]:
    """(label, call) per piece of one FP8 linear and the bf16 path, plus the layer, its input and upstream grad."""
    w16, codes, scale, a, b = make_layer(K, N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    ws = scale.float().reshape(1)
    xa = lora_down(x, a16, N)
    gb = scaled_gemm_lora(g, b16.t(), torch.bfloat16, config=dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4))
    buf = torch.empty(16, device="cuda")
    cfg_ptr = dict(BN=128, BM=128, BK=64, num_warps=8, num_stages=4)
    out = [
        ("triton: empty kernel, 2 args", lambda: _empty_kernel[(1,)](buf, 16, BLOCK=16)),
        ("triton: empty kernel, compiled.run", bound_launcher(_empty_kernel, (1,), buf, 16, BLOCK=16)),
        ("torch.mm x·Aᵀ", lambda: torch.mm(x, a16.t())),
        ("torch.empty", lambda: torch.empty(M, N, device="cuda", dtype=torch.bfloat16)),
        ("lora_down (fwd xa)", lambda: lora_down(x, a16, N)),
        ("ws fwd, pointer tile, xa given", lambda: weight_stationary_gemm(x, codes, w_scale=ws, xa=xa, lora_b=b16,
                                                                        config=cfg_ptr)),
        ("ws fwd, table (TMA), xa given", lambda: weight_stationary_gemm(x, codes, w_scale=ws, xa=xa, lora_b=b16)),
        ("ws fwd, table, return_xa (= forward)", lambda: weight_stationary_gemm(
            x, codes, w_scale=ws, lora_a=a16, lora_b=b16, return_xa=True)),
        ("gb = g·B (scaled_gemm_lora)", lambda: scaled_gemm_lora(g, b16.t(), torch.bfloat16,
                                                                  config=dict(BM=64, BN=64, BK=64, num_warps=4,
                                                                              num_stages=4))),
        ("gb = g·B (torch.mm)", lambda: torch.mm(g, b16)),
        ("dX (ws op=dx, table)", lambda: weight_stationary_gemm(g, codes.t(), w_scale=ws, xa=gb, lora_b=a16.t(),
                                                               op="dx")),
    ]
    for tag, (step, params) in trainer_steps(K, N, M, w16, codes, scale, a, b).items():
        def step_clear(step=step, params=params):
            step()
            for p in params:
                p.grad = None
        out.append((f"{tag} forward + backward (whole linear)", step_clear))
    layer = Fp8LoRALinear(codes, scale, a16.clone(), b16.clone(), 2.0)
    xg = x.clone().requires_grad_()
    out.append(("fp8 forward only (autograd graph built)", lambda: layer(xg)))
    out.append(("fp8 backward body (lora_linear_backward, saved xa)", lambda: lora_linear_backward(
        g, x, codes, scale, a16, b16, 2.0, True, xa=xa)))
    out.append(("fp8 forward + backward body called directly (no autograd)", lambda: lora_linear_backward(
        g, x, codes, scale, a16, b16, 2.0, True, xa=w8a16_lora(x, codes, scale, a16, b16, 2.0, return_xa=True)[1])))
    out.append(("bf16 F.linear forward only", lambda: F.linear(x, w16)))
    return out, layer, xg, g


def rows(name: str, K: int, N: int, M: int, calls: int) -> list[tuple[str, float]]:
    out, layer, xg, g = piece_rows(K, N, M)
    out += autograd_rows()
    out += alternating_rows(dict(out))
    results = []
    for label, fn in out:
        for _ in range(3):
            fn()
        results.append((label, host_us(fn, calls)))
    whole = dict(out)
    results.append(("fp8 forward + backward (whole linear), cyclic GC off",
                    host_us(whole["fp8 forward + backward (whole linear)"], calls, no_gc=True)))
    fwd_us, bwd_us, same_thread = split_whole_step(layer, xg, g, calls)
    results += [("fp8 whole linear timed apart: forward", fwd_us),
                (f"fp8 whole linear timed apart: backward (on the calling thread: {same_thread})", bwd_us)]
    # autograd runs a CUDA backward on its own device thread; with multithreading off it runs on the caller's
    with torch.autograd.set_multithreading_enabled(False):
        for tag in ("fp8", "bf16"):
            results.append((f"{tag} forward + backward (whole linear), autograd multithreading off",
                            host_us(whole[f"{tag} forward + backward (whole linear)"], calls)))
        fwd_us, bwd_us, same_thread = split_whole_step(layer, xg, g, calls)
        results += [("multithreading off, timed apart: forward", fwd_us),
                    (f"multithreading off, timed apart: backward (on the calling thread: {same_thread})", bwd_us)]
    return results


def cprofile_step(layer, x, gy, steps: int = 40, top: int = 30) -> None:
    """cProfile of whole FP8 forward + backward steps with autograd's multithreading off, so that the backward
    (which autograd otherwise runs on its device thread, out of cProfile's sight) is profiled too."""
    import cProfile
    import pstats
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(3):
            layer(x).backward(gy)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            layer(x).backward(gy)
            x.grad = layer.lora_A.grad = layer.lora_B.grad = None
        prof.disable()
    torch.cuda.synchronize()
    print(f"\n### cProfile: {steps} Fp8LoRALinear forward + backward steps, multithreading off (by own time)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="q3_o")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--cprofile", action="store_true", help="then cProfile the FP8 step (profile_trainer_linear)")
    ap.add_argument("--trace", action="store_true", help="then a torch.profiler CPU trace of the FP8 step")
    ap.add_argument("--cprofile-step", action="store_true",
                    help="then cProfile whole FP8 steps with the backward on the calling thread")
    args = ap.parse_args()
    by_name = {s[0]: s for s in SHAPES}
    if args.shape not in by_name:
        raise SystemExit(f"--shape: unknown {args.shape!r}; known: {sorted(by_name)}")
    _, K, N = by_name[args.shape]
    print(torch.cuda.get_device_name(), torch.__version__, "triton", triton.__version__)
    print(f"\n| {args.shape} M={args.tokens}: piece | host µs per call |\n|---|---|")
    for label, us in rows(args.shape, K, N, args.tokens, args.calls):
        print(f"| {label} | {us:.1f} |")
    if args.trace:
        _, codes, scale, a, b = make_layer(K, N)
        layer = Fp8LoRALinear(codes, scale, a, b, 2.0)
        x = torch.randn(args.tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cpu_trace(layer, x, torch.randn(args.tokens, N, device="cuda", dtype=torch.bfloat16))
    if args.cprofile_step:
        _, codes, scale, a, b = make_layer(K, N)
        layer = Fp8LoRALinear(codes, scale, a, b, 2.0)
        x = torch.randn(args.tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        cprofile_step(layer, x, torch.randn(args.tokens, N, device="cuda", dtype=torch.bfloat16))
    if args.cprofile:
        from profile_trainer_linear import host_profile
        host_profile(args.shape, K, N, args.tokens, top=35)


if __name__ == "__main__":
    main()
