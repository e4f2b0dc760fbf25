"""The GEMM problems the GPU kernel tests share (test_gpu_kernels.py, test_gpu_gluon.py): random bf16 tokens, FP8
codes of a random weight with its scale, a LoRA and a bias, from one seeded generator on the GPU."""

import torch

from epirl.kernels import quantize_weight_fp8

DEV = "cuda"


def problem(M, K, N, r, seed=0, bias=True):
    """x `[M, K]` bf16, codes `[N, K]` e4m3 and their scale, LoRA A `[r, K]` and B `[N, r]`, bias `[N]` (or None)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g, device=DEV) * 0.02, backend="reference")
    a = (torch.randn(r, K, generator=g, device=DEV) / K ** 0.5).bfloat16()
    b = (torch.randn(N, r, generator=g, device=DEV) * 0.05).bfloat16()
    bb = torch.randn(N, generator=g, device=DEV).bfloat16() if bias else None
    return x, codes, scale, a, b, bb
