"""Reference multi-adapter W8A8 GEMM: every token gets `w8a8_lora`'s numerics with its own adapter.

    q_x, s_x = per-token dynamic quantization of x (bit-exact with vLLM's scaled_fp8_quant)
    acc      = fp32( q_x · codesᵀ )          exact e4m3 x e4m3 dot (float64 accumulator), rounded once
    y        = (acc * s_w) * s_x             fp32, vLLM's epilogue order s_a · (s_b · acc)
    for a token t with adapter l = token_lora[t] >= 0:
      xa_t   = bf16( fp32( x_t · A_lᵀ ) )     the LoRA intermediate from the bf16 x
      y_t    = fma(σ_l, fp32( xa_t · B_lᵀ ), y_t)
    token_lora[t] = -1: no LoRA term at all (the base W8A8 row, bitwise)
    y        = y + bias;  out = bf16(y)
Dots accumulate in float64 (exact for these operands), so a token's row depends only on that token, its
adapter and the weights: a batch mixing adapters equals each group run alone, bitwise.
"""

from __future__ import annotations

import torch

from ..fp8_quant.reference import quantize_per_token
from ..w8a16.reference import exact_dot_fp32


def check_args(x, codes, scale, lora_a, lora_b, token_lora, lora_scale):
    """Validate shapes/dtypes; returns (M, N, K, L, r). One line per problem, naming the argument."""
    N, K = codes.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} but codes are [N={N}, K={K}]")
    if scale.numel() != 1:
        raise ValueError(f"scale must be the per-tensor fp32 [1] weight scale, got {tuple(scale.shape)}")
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(f"lora_a must be [L, r, K] and lora_b [L, N, r], got {tuple(lora_a.shape)}, "
                         f"{tuple(lora_b.shape)}")
    L, r, _ = lora_a.shape
    if lora_a.shape != (L, r, K) or lora_b.shape != (L, N, r):
        raise ValueError(f"LoRA shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit K={K}, "
                         f"N={N} (want A [L, r, K], B [L, N, r])")
    M = x.numel() // K if K else 0
    if token_lora.shape != (M,) or token_lora.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"token_lora must be int64 [M={M}] (-1 = no adapter), got {token_lora.dtype} "
                         f"{tuple(token_lora.shape)}")
    if isinstance(lora_scale, torch.Tensor) and lora_scale.numel() not in (1, L):
        raise ValueError(f"lora_scale must be a float or a [L={L}] tensor, got {tuple(lora_scale.shape)}")
    return M, N, K, L, r


def sigmas_fp32(lora_scale, L: int, device) -> torch.Tensor:
    """σ per adapter as fp32 `[L]` (a float is broadcast; the kernels use fp32 σ, like w8a8_lora)."""
    if isinstance(lora_scale, torch.Tensor):
        return lora_scale.to(device=device, dtype=torch.float32).reshape(-1).expand(L).contiguous()
    return torch.full((L,), float(lora_scale), dtype=torch.float32, device=device)


def w8a8_multi_lora(x, codes, scale, lora_a, lora_b, token_lora, lora_scale=1.0, bias=None):
    M, N, K, L, r = check_args(x, codes, scale, lora_a, lora_b, token_lora, lora_scale)
    x2 = x.reshape(-1, K)
    q_x, s_x = quantize_per_token(x2)
    y32 = (exact_dot_fp32(q_x.float(), codes) * scale.float().reshape(())) * s_x
    sigma = sigmas_fp32(lora_scale, L, "cpu")
    ids = token_lora.to(torch.int64)
    if bool(((ids < -1) | (ids >= L)).any()):
        raise ValueError(f"token_lora entries must be in [-1, {L - 1}]")
    for adapter in torch.unique(ids[ids >= 0]).tolist():
        rows = (ids == adapter).nonzero().reshape(-1)
        xa = exact_dot_fp32(x2[rows], lora_a[adapter].to(x.dtype)).to(x.dtype)
        lora = exact_dot_fp32(xa, lora_b[adapter].to(x.dtype))
        # fma like the kernels' tl.fma: fp32 σ times fp32 lora is exact in float64, one rounding
        y32[rows] = (y32[rows].double() + sigma[adapter].double() * lora.double()).float()
    if bias is not None:
        y32 = y32 + bias.float()
    return y32.to(x.dtype).reshape(*x.shape[:-1], N)
