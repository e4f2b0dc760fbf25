"""Reference W8A8 GEMM (vLLM's FP8 engine numerics) with the same LoRA epilogue as W8A16.

    q_x, s_x = per-token dynamic quantization of x (fp8_quant.reference.quantize_per_token)
    acc = fp32( q_x · codesᵀ )      exact e4m3 x e4m3 dot (float64 accumulator), rounded once
    y   = (acc * s_w) * s_x          fp32, weight scale first (vLLM's ScaledEpilogue: s_a * (s_b * acc))
    y   = fma(σ, fp32(act(x Aᵀ) Bᵀ), y) + bias   LoRA on the bf16 x, as in w8a16.reference
    out = act(y)
"""

from __future__ import annotations

from ..fp8_quant.reference import quantize_per_token
from ..w8a16.reference import check_lora_args, exact_dot_fp32, lora_epilogue


def w8a8_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale=1.0, bias=None, scale_ub=None):
    N, K = codes.shape
    check_lora_args(K, N, lora_a, lora_b)
    x2 = x.reshape(-1, K)
    q_x, s_x = quantize_per_token(x2, scale_ub)
    y32 = (exact_dot_fp32(q_x.float(), codes) * scale.float().reshape(())) * s_x
    y32 = lora_epilogue(y32, x2, lora_a, lora_b, lora_scale, bias)
    return y32.to(x.dtype).reshape(*x.shape[:-1], N)
