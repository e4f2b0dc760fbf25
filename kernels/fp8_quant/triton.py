"""Triton FP8 (e4m3fn) quantization kernels, bit-exact with reference.py (= vLLM's CUDA kernels).

True division and the reciprocal use `tl.div_rn` (IEEE round-to-nearest): Triton's `/` on fp32 may lower
to an approximate division, which would break bit-exactness with vLLM's `x / s`.
Importing this module needs triton but no GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .reference import FP8_DTYPE, FP8_MAX, MIN_SCALE


@triton.jit
def _saturating_e4m3(q, FP8_MAX: tl.constexpr):
    # fmaxf(-448, fminf(q, 448)): NaN -> +448, like vLLM's scaled_fp8_conversion
    q = tl.where(q != q, FP8_MAX, q)
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    return q.to(tl.float8e4nv)  # cvt.rn.satfinite: round to nearest even


@triton.jit
def _abs_nan_to_zero(x):
    a = tl.abs(x)
    return tl.where(a != a, 0.0, a)


@triton.jit
def _per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, scale_ub,
                      HAS_UB: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=(k0 + cols) < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, _abs_nan_to_zero(x))
    token_amax = tl.max(amax, axis=0)
    if HAS_UB:
        token_amax = tl.minimum(token_amax, scale_ub)
    scale = tl.maximum(tl.div_rn(token_amax, FP8_MAX), MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK):
        mask = (k0 + cols) < K
        x = tl.load(x_ptr + row * stride_xm + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = _saturating_e4m3(tl.div_rn(x, scale), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k0 + cols, q, mask=mask)


@triton.jit
def _block_amax_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.max(_abs_nan_to_zero(x), axis=0))


@triton.jit
def _static_quant_kernel(x_ptr, q_ptr, s_ptr, n, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    inv = tl.div_rn(1.0, tl.load(s_ptr))  # vLLM: inverted_scale = 1.0f / (*scale); then multiply
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, _saturating_e4m3(x * inv, FP8_MAX), mask=mask)


def quantize_per_token(x: torch.Tensor, scale_ub: float | None = None):
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty(M, K, device=x.device, dtype=FP8_DTYPE)
    s = torch.empty(M, 1, device=x.device, dtype=torch.float32)
    if M:
        has_ub = scale_ub is not None and scale_ub > 0
        _per_token_kernel[(M,)](x2, q, s, K, x2.stride(0), q.stride(0), float(scale_ub) if has_ub else 0.0,
                                HAS_UB=has_ub, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                BLOCK=min(2048, next_power_of_2(max(K, 16))), num_warps=4)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], 1)


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None):
    """Dynamic (scale None: amax/448, NaN ignored) or static per-tensor quantization, multiply by 1/s."""
    xf = x.contiguous().reshape(-1)
    n = xf.numel()
    BLOCK = 4096
    if scale is None:
        partial = torch.zeros(max(1, cdiv(n, BLOCK)), device=x.device, dtype=torch.float32)
        if n:
            _block_amax_kernel[(cdiv(n, BLOCK),)](xf, partial, n, BLOCK=BLOCK, num_warps=8)
        # max is exact in any order; divide in fp32 exactly like amax / 448.f
        scale = (partial.amax() / torch.tensor(FP8_MAX, device=x.device)).reshape(1)
    scale = scale.float().reshape(1).contiguous()
    q = torch.empty(x.shape, device=x.device, dtype=FP8_DTYPE)
    if n:
        _static_quant_kernel[(cdiv(n, BLOCK),)](xf, q, scale, n, FP8_MAX=FP8_MAX, BLOCK=BLOCK, num_warps=8)
    return q, scale
