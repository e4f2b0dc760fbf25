"""Triton backward of the FP8 LoRA linear (see reference.py for the math and rounding points).

dX reads the codes in place as `[N, K]` with N as the reduction dim (strides (1, K) in the shared
weight-stationary GEMM, configs from the table's "dx" rows) and widens them to bf16 in registers - no
dequantized weight ever exists; the LoRA term σ(gB)A rides in the same kernel's epilogue. gB = g·B is a
rank-r Triton GEMM; the weight gradients dA = σ gBᵀx and dB = σ gᵀxa reduce over tokens and go to cuBLAS
(bf16 inputs, fp32 accumulation, bf16 result), then σ in fp32 and one rounding to the parameters' dtype (one
elementwise kernel each); xa is the forward's (saved by `Fp8LoRAFunction`), else recomputed with the forward's
chunking (same bits).
Backward need not be batch invariant (cuBLAS may pick M-dependent algorithms there).
"""

from __future__ import annotations

import torch

from ..gemm.scaled import scaled_gemm_lora
from ..gemm.weight_stationary import lora_down, weight_stationary_gemm

GB_CONFIG = dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4)


def _scaled_weight_grad(mm: torch.Tensor, lora_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """dtype(σ · fp32(mm)) for cuBLAS's bf16 product mm in one kernel: a bf16 result is bf16(fp32(mm)·σ) computed
    in fp32 (PyTorch's opmath), the bits of `mm.float() * σ` rounded to bf16; fp32 keeps the fp32 product."""
    if dtype == mm.dtype:
        return torch.mul(mm, lora_scale)
    return mm.to(dtype).mul_(lora_scale)


def lora_linear_backward(grad_y, x, codes, scale, lora_a, lora_b, lora_scale, need_dx=True, xa=None):
    """(dX x.dtype, dA in lora_a's dtype, dB in lora_b's dtype); xa: the forward's LoRA intermediate if saved."""
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
    d_a = _scaled_weight_grad(torch.mm(gb.t(), x2), lora_scale, lora_a.dtype)
    if xa is None:
        xa = lora_down(x2.contiguous() if x2.stride(1) != 1 else x2, a, chunk_n=N)
    d_b = _scaled_weight_grad(torch.mm(g.t(), xa.reshape(-1, xa.shape[-1])), lora_scale, lora_b.dtype)
    return dx, d_a, d_b
