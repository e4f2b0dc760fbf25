"""Reference backward of `y = w8a16_lora(x, codes, s_w, A, B, σ)` (the FP8 LoRA trainer's linear).

With g = dY `[M, N]` (x.dtype), every dot accumulated in fp32 or better:
    gb = act( g · B )                                   `[M, r]`, rounded to x.dtype like xa in forward
    dX = act( fp32(g · codes) * s_w + σ * fp32(gb · A) ) `[M, K]`, codes read with N as reduction
    dA = σ * fp32(gbᵀ · x)                               `[r, K]`
    dB = σ * fp32(gᵀ · xa),  xa = act(x · Aᵀ) as in forward `[N, r]`
The rounding of xa in forward is treated as identity in backward (straight-through), as bf16 PEFT does.
dA, dB are returned in fp32; the autograd Function casts them to the parameters' dtype.
"""

from __future__ import annotations

import torch

from ..w8a16.reference import exact_dot_fp32, lora_down


def lora_linear_backward(grad_y, x, codes, scale, lora_a, lora_b, lora_scale, need_dx=True, xa=None):
    """Returns (dX [M, K] x.dtype or None, dA [r, K] fp32 or None, dB [N, r] fp32 or None); xa: the forward's
    LoRA intermediate, if saved."""
    N, K = codes.shape
    g = grad_y.reshape(-1, N).to(x.dtype)
    x2 = x.reshape(-1, K)
    has_lora = lora_a is not None
    gb = exact_dot_fp32(g, lora_b.to(x.dtype).t()).to(x.dtype) if has_lora else None
    dx = None
    if need_dx:
        dx32 = exact_dot_fp32(g, codes.t()) * scale.float().reshape(())
        if has_lora:
            dx32 = dx32 + float(lora_scale) * exact_dot_fp32(gb, lora_a.to(x.dtype).t())
        dx = dx32.to(x.dtype).reshape(x.shape)
    if not has_lora:
        return dx, None, None
    d_a = float(lora_scale) * exact_dot_fp32(gb.t(), x2.t())
    xa = lora_down(x2, lora_a) if xa is None else xa.reshape(-1, xa.shape[-1])
    d_b = float(lora_scale) * exact_dot_fp32(g.t(), xa.t())
    return dx, d_a, d_b


def lora_linear_backward_fp64(grad_y, x, codes, scale, lora_a, lora_b, lora_scale):
    """Unrounded float64 math of the same gradients (tests compare the reference against it)."""
    N, K = codes.shape
    g = grad_y.reshape(-1, N).double()
    x2 = x.reshape(-1, K).double()
    w = codes.double() * scale.double().reshape(())
    a, b = lora_a.double(), lora_b.double()
    dx = g @ w + lora_scale * (g @ b) @ a
    d_a = lora_scale * (g @ b).t() @ x2
    d_b = lora_scale * g.t() @ (x2 @ a.t())
    return dx.reshape(x.shape), d_a, d_b
