"""W8A8 GEMM with one LoRA adapter per token (serving): reference.py (the numerics), triton.py (K1 shrink + K2 FP8
GEMM with the multi-adapter epilogue), segmented.py (segment-tiled shrink + expand after a vendor GEMM, one adapter
per tile) and dispatch.py (timed choice between the fused path, vendor GEMM + adapter kernels and vendor GEMM +
vLLM's own LoRA kernels). `w8a8_multi_lora` here picks reference or Triton per call."""

from __future__ import annotations

from .. import _dispatch
from . import reference


def w8a8_multi_lora(x, codes, scale, lora_a, lora_b, token_lora, lora_scale=1.0, bias=None,
                    backend: str | None = None, **triton_options):
    """Multi-adapter W8A8: x `[M, K]` bf16, codes `[N, K]`, scale `[1]`, lora_a `[L, r, K]`, lora_b `[L, N, r]`,
    token_lora `[M]` int64 (-1 = no adapter) -> `[M, N]`, each token with `w8a8_lora`'s numerics for its own
    adapter; lora_scale a float or `[L]`. triton_options (path, config, order) reach the Triton kernels only."""
    if _dispatch.use_triton(x, backend):
        from .triton import w8a8_multi_lora as impl  # deferred: importing epirl.kernels needs no Triton
        return impl(x, codes, scale, lora_a, lora_b, token_lora, lora_scale, bias, **triton_options)
    return reference.w8a8_multi_lora(x, codes, scale, lora_a, lora_b, token_lora, lora_scale, bias)
