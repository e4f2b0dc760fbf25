"""Triton backward of the FP8 LoRA linear (see reference.py for the math and rounding points).

dX reads the codes in place as `[N, K]` with N as the reduction dim (strides (1, K) in the shared
weight-stationary GEMM, configs from the table's "dx" rows) and widens them to bf16 in registers - no
dequantized weight ever exists; the LoRA term σ(gB)A rides in the same kernel's epilogue. gB = g·B is a
rank-r Triton GEMM; the weight gradients dA = σ gBᵀx and dB = σ gᵀxa reduce over tokens and go to cuBLAS
(bf16 inputs, fp32 accumulation, bf16 result); xa is recomputed with the forward's chunking (same bits).
Backward need not be batch invariant (cuBLAS may pick M-dependent algorithms there).
"""

from __future__ import annotations

import torch

from ..gemm.scaled import scaled_gemm_lora
from ..gemm.weight_stationary import lora_down, weight_stationary_gemm

GB_CONFIG = dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4)


def lora_linear_backward(grad_y, x, codes, scale, lora_a, lora_b, lora_scale, need_dx=True):
    N, K = codes.shape
    g = grad_y.reshape(-1, N).to(x.dtype)
    if g.stride(1) != 1:
        g = g.contiguous()
    x2 = x.reshape(-1, K)
    has_lora = lora_a is not None
    a = lora_a.to(x.dtype).contiguous() if has_lora else None
    b = lora_b.to(x.dtype) if has_lora else None
    # gb = act(g · B): the shared GEMM with w = Bᵀ viewed `[r, N]`, no scale
    gb = scaled_gemm_lora(g, b.t(), x.dtype, config=GB_CONFIG) if has_lora else None
    dx = None
    if need_dx:
        # dXᵀ = codesᵀ · gᵀ: the codes tile (read from `[N, K]`, N = reduction) is the register operand
        dx = weight_stationary_gemm(g, codes.t(), x.dtype, w_scale=scale.float().reshape(1),
                                    xa=gb, lora_b=a.t() if has_lora else None, lora_scale=lora_scale,
                                    op="dx").reshape(x.shape)
    if not has_lora:
        return dx, None, None
    d_a = torch.mm(gb.t(), x2).float() * lora_scale
    xa = lora_down(x2.contiguous() if x2.stride(1) != 1 else x2, a, chunk_n=N)
    d_b = torch.mm(g.t(), xa).float() * lora_scale
    return dx, d_a, d_b
