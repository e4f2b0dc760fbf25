"""Triton backward of the FP8 LoRA linear (see reference.py for the math and rounding points).

dX reads the codes in place as `[N, K]` with N as the reduction dim (strides (1, K) in the shared
weight-stationary GEMM, configs from the table's "dx" rows) and widens them to bf16 in registers - no
dequantized weight ever exists; the LoRA term σ(gB)A rides in the same kernel's epilogue. The rank-r products go
to cuBLAS (bf16 inputs, fp32 accumulation, bf16 result): gB = g·B, and the weight gradients dA = σ gBᵀx and
dB = σ gᵀxa, which reduce over tokens, then σ in fp32 and one rounding to the parameters' dtype (one elementwise
kernel each). (gB was a Triton GEMM; cuBLAS now: a cuBLAS call costs the host a third of a Triton launch's
time, and the FP8 training step is host-bound in its backward, scripts/profile_step_gaps.py.) xa is the forward's
(saved by `Fp8LoRAFunction`), else recomputed with the forward's chunking (same bits).
Backward need not be batch invariant (cuBLAS may pick M-dependent algorithms there).
"""

from __future__ import annotations

import torch

from ..w8a16.weight_stationary import lora_down, weight_stationary_gemm


def _scaled_weight_grad(mm: torch.Tensor, lora_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """dtype(σ · fp32(mm)) for cuBLAS's bf16 product mm in one kernel: a bf16 result is bf16(fp32(mm)·σ) computed
    in fp32 (PyTorch's opmath), the bits of `mm.float() * σ` rounded to bf16; fp32 keeps the fp32 product."""
    if dtype == mm.dtype:
        return torch.mul(mm, lora_scale)
    return mm.to(dtype).mul_(lora_scale)


def lora_linear_backward(grad_y, x, codes, scale, lora_a, lora_b, lora_scale, need_dx=True, xa=None, grad_dtypes=None):
    """(dX x.dtype, dA, dB in grad_dtypes, default lora_a's and lora_b's dtypes); xa: the forward's LoRA intermediate
    if saved."""
    N, K = codes.shape
    g = grad_y.reshape(-1, N).to(x.dtype)
    if g.stride(1) != 1:
        g = g.contiguous()
    x2 = x.reshape(-1, K)
    has_lora = lora_a is not None
    a = lora_a.to(x.dtype).contiguous() if has_lora else None
    b = lora_b.to(x.dtype) if has_lora else None
    gb = torch.mm(g, b) if has_lora else None  # act(g · B) `[M, r]`
    dx = None
    if need_dx:
        # dXᵀ = codesᵀ · gᵀ: the codes tile (read from `[N, K]`, N = reduction) is the register operand
        dx = weight_stationary_gemm(g, codes.t(), x.dtype, w_scale=scale.float().reshape(1),
                                    xa=gb, lora_b=a.t() if has_lora else None, lora_scale=lora_scale,
                                    op="dx").reshape(x.shape)
    if not has_lora:
        return dx, None, None
    dtype_a, dtype_b = grad_dtypes or (lora_a.dtype, lora_b.dtype)
    d_a = _scaled_weight_grad(torch.mm(gb.t(), x2), lora_scale, dtype_a)
    if xa is None:
        xa = lora_down(x2.contiguous() if x2.stride(1) != 1 else x2, a, chunk_n=N)
    d_b = _scaled_weight_grad(torch.mm(g.t(), xa.reshape(-1, xa.shape[-1])), lora_scale, dtype_b)
    return dx, d_a, d_b
