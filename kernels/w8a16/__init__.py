"""W8A16 GEMM with the LoRA epilogue (the matched engine's and the trainer's forward): reference.py (the numerics),
triton.py (the op on CUDA) over the weight-stationary GEMM (weight_stationary.py, its kernels ws_*.py, the tile
table configs.py / ws_configs_tma.json, the widening widen.py), and slices.py (one call per fused layer).
`w8a16_lora` here picks reference or Triton per call."""

from __future__ import annotations

from .. import _dispatch
from . import reference


def w8a16_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale: float = 1.0, bias=None,
               backend: str | None = None, return_xa: bool = False, out=None, settings=None):
    """`bf16((x · bf16(codes)ᵀ)_fp32 · s_w + σ (x Aᵀ) Bᵀ + bias)`: the matched engine's and trainer's
    forward. x `[..., K]` bf16, codes `[N, K]`, A `[r, K]`, B `[N, r]` -> `[..., N]`. Batch invariant.
    return_xa: (y, xa) with xa = bf16(x Aᵀ) `[M, r]`, the intermediate the epilogue used (None without LoRA):
    what the trainer's backward needs, so that it need not compute it again. out: an `[M, N]` view to write y into
    (any row stride, e.g. one slice's columns of a fused layer's output; x 2-D), returned as y. settings: a
    `plan.KernelSettings` for the Triton kernels (another tile table; the reference ignores it)."""
    if out is not None and (x.dim() != 2 or tuple(out.shape) != (x.shape[0], codes.shape[0])):
        raise ValueError(f"out: want shape {(x.shape[0], codes.shape[0])} for a 2-D x, got {tuple(out.shape)} "
                         f"for x {tuple(x.shape)}")
    if _dispatch.use_triton(x, backend):
        from .triton import w8a16_lora as impl  # deferred: importing epirl.kernels needs no Triton
        return impl(x, codes, scale, lora_a, lora_b, lora_scale, bias, return_xa=return_xa, out=out, settings=settings)
    return reference.w8a16_lora(x, codes, scale, lora_a, lora_b, lora_scale, bias, return_xa=return_xa, out=out)
