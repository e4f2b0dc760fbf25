"""GPU side of the timed dispatch and of scripts/bench_serving.py: the candidate implementations of one projection
with one adapter (timed with `epirl.kernels.gpu_timing.graph_us`).

Candidates (same contract: y `[M, N]` bf16 for bf16 x with one adapter):
  fused         epirl's K1 + K2 (decode: PDL when the GPU/Triton support it; prefill: quantize, K1, K2)
  vendor+epirl  epirl's per-token quantization + torch._scaled_mm (cuBLASLt FP8) + epirl's K1 + K2 expand
  extra         whatever the caller adds (a hook for vendor GEMM + vLLM's punica kernels, which need a layer's live
                punica metadata; not wired yet: the --vllm benchmark compares against vLLM's path end to end)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .dispatch import Shape


def random_projection(shape: Shape, L: int = 1, seed: int = 0):
    """codes/scale of a random FP8 weight and L random rank-r adapters (bf16), on the GPU."""
    from epirl.kernels import quantize_weight_fp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    codes, scale = quantize_weight_fp8(torch.randn(shape.N, shape.K, device="cuda", generator=g) * 0.02)
    a = (torch.randn(L, shape.r, shape.K, device="cuda", generator=g) / shape.K ** 0.5).bfloat16()
    b = (torch.randn(L, shape.N, shape.r, device="cuda", generator=g) * 0.02).bfloat16()
    return codes, scale, a, b


def vendor_base(x, codes, scale_b):
    """vLLM's FP8 linear without adapter: per-token quantization + FP8 GEMM (torch._scaled_mm, rowwise)."""
    from epirl.kernels import quantize_activation_fp8

    q, s = quantize_activation_fp8(x)
    return torch._scaled_mm(q, codes.t(), scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16)


def gpu_candidates(shape: Shape, M: int, sigma: float = 2.0, extra=None) -> dict[str, Callable[[], object]]:
    """The dispatch candidates for `shape` at M tokens, one adapter (slot 0) on every token.
    extra(x, codes, scale, a, b, ids, sigma) -> {name: fn} adds caller-provided candidates."""
    from .triton import expand_into, w8a8_multi_lora

    codes, scale, a, b = random_projection(shape)
    x = torch.randn(M, shape.K, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(M, device="cuda", dtype=torch.int64)
    scale_b = scale.reshape(1, 1).expand(1, shape.N).contiguous()
    cands = {
        "fused": lambda: w8a8_multi_lora(x, codes, scale, a, b, ids, sigma),
        "vendor+epirl": lambda: expand_into(vendor_base(x, codes, scale_b), x, a, b, ids, sigma),
    }
    if extra is not None:
        cands.update(extra(x, codes, scale, a, b, ids, sigma))
    return cands
