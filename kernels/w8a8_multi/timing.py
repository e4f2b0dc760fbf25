"""GPU side of the timed dispatch and of scripts/bench_serving.py: the candidate implementations of one projection
with its adapters (timed with `epirl.kernels.gpu_timing.graph_us`).

Candidates (same contract: y `[M, N]` bf16 for bf16 x, each token with its adapter; the M tokens spread evenly
over min(shape.adapters, M) adapters in random order):
  fused         epirl's K1 + K2 (decode: PDL when the GPU/Triton support it; prefill: quantize, grouped shrink, K2)
  fused[<tag>]  above DECODE_MAX_TOKENS tokens: the prefill path with K2's token tile PREFILL_VARIANTS[tag]
  vendor+epirl  epirl's per-token quantization + torch._scaled_mm (cuBLASLt FP8) + epirl's shrink + K2 expand
  vendor+seg    the same vendor GEMM + the segment-tiled shrink and expand (segmented.py: one adapter per tile;
                the segments prepared outside the graph, as vLLM prepares its metadata once per step);
                vendor+seg[<tag>] with the expand tile SEG_VARIANTS[tag]
  extra         whatever the caller adds: the engine adds "vllm", vendor GEMM + vLLM's own LoRA kernels
                (`epirl.engine.serving_lora.vllm_candidate`; kernels/ does not import the engine)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..fp8_quant import quantize_activation_fp8, quantize_weight_fp8
from .dispatch import Shape


def random_projection(shape: Shape, L: int = 1, seed: int = 0):
    """codes/scale of a random FP8 weight and L random rank-r adapters (bf16), on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes, scale = quantize_weight_fp8(torch.randn(shape.N, shape.K, device="cuda", generator=g) * 0.02)
    a = (torch.randn(L, shape.r, shape.K, device="cuda", generator=g) / shape.K ** 0.5).bfloat16()
    b = (torch.randn(L, shape.N, shape.r, device="cuda", generator=g) * 0.02).bfloat16()
    return codes, scale, a, b


def vendor_base(x, codes, scale_b):
    """vLLM's FP8 linear without adapter: per-token quantization + FP8 GEMM (torch._scaled_mm, rowwise)."""
    q, s = quantize_activation_fp8(x)
    return torch._scaled_mm(q, codes.t(), scale_a=s, scale_b=scale_b, out_dtype=torch.bfloat16)


def spread_adapters(M: int, adapters: int, seed: int = 0) -> torch.Tensor:
    """token -> adapter for M tokens spread evenly over min(adapters, M) adapters, in random (seeded) order."""
    used = max(1, min(adapters, M))
    g = torch.Generator().manual_seed(seed)
    return (torch.arange(M) * used // max(M, 1))[torch.randperm(M, generator=g)]


def gpu_candidates(shape: Shape, M: int, sigma: float = 2.0, extra=None) -> dict[str, Callable[[], object]]:
    """The dispatch candidates for `shape` at M tokens, spread over min(shape.adapters, M) adapters.
    extra(x, codes, scale, a, b, ids, sigma) -> {name: fn} adds caller-provided candidates."""
    # deferred: the Triton kernels load on the first timing (tests read this module's helpers without them)
    from .segmented import SEG_VARIANTS, expand_segments, segments
    from .triton import DECODE_MAX_TOKENS, PREFILL_VARIANTS, expand_into, expand_order, w8a8_multi_lora

    codes, scale, a, b = random_projection(shape, L=shape.adapters)
    x = torch.randn(M, shape.K, device="cuda", dtype=torch.bfloat16)
    ids = spread_adapters(M, shape.adapters).to("cuda")
    scale_b = scale.reshape(1, 1).expand(1, shape.N).contiguous()
    cands = {
        "fused": lambda: w8a8_multi_lora(x, codes, scale, a, b, ids, sigma),
        "vendor+epirl": lambda: expand_into(vendor_base(x, codes, scale_b), x, a, b, ids, sigma,
                                            order=expand_order(ids)),
    }
    segs = segments(ids, shape.adapters)
    for tag, cfg in {"": None, **SEG_VARIANTS}.items():
        cands[f"vendor+seg[{tag}]" if tag else "vendor+seg"] = lambda cfg=cfg: expand_segments(
            vendor_base(x, codes, scale_b), x, a, b, segs, sigma, config=cfg)
    if M > DECODE_MAX_TOKENS:  # the prefill path's other K2 tiles
        for tag, cfg in PREFILL_VARIANTS.items():
            cands[f"fused[{tag}]"] = lambda cfg=cfg: w8a8_multi_lora(x, codes, scale, a, b, ids, sigma, path="prefill",
                                                                     config=cfg)
    if extra is not None:
        cands.update(extra(x, codes, scale, a, b, ids, sigma))
    return cands


def candidate_names() -> list[str]:
    """Every name gpu_candidates (plus the engine's "vllm") can return: part of the dispatch cache key."""
    # deferred: the Triton kernels, as in gpu_candidates
    from .segmented import SEG_VARIANTS
    from .triton import PREFILL_VARIANTS

    return ["fused", *(f"fused[{tag}]" for tag in PREFILL_VARIANTS), "vendor+epirl", "vendor+seg",
            *(f"vendor+seg[{tag}]" for tag in SEG_VARIANTS), "vllm"]
