"""Reference W8A16 GEMM with LoRA epilogue: the definition of the matched engine's/trainer's forward.

Op order (every rounding point named; the Triton kernel follows it, with fp32 tensor-core accumulation
in place of the exact dot):
    acc  = fp32( x · e4m3→bf16(codes)ᵀ )        exact dot product, rounded once to fp32
    y    = acc * s_w                              fp32
    xa   = act( fp32( x · Aᵀ ) )                  LoRA down-projection, rounded to x.dtype (bf16)
    y    = fma(σ, fp32( xa · Bᵀ ), y)             one rounding to fp32 (computed in float64), σ = lora_scale
    y    = y + bias                               fp32 (bias widened)
    out  = act(y)                                 x.dtype (bf16)
A and B are first cast to x.dtype (the trainer may keep fp32 masters; the engine holds bf16 copies).
The dot products accumulate in float64: products of bf16 and e4m3 values are exact there and their sum
is exact for any realistic dynamic range, so the result does not depend on summation order, i.e. not on
the number of tokens M or on the CPU BLAS blocking - the CPU reference is batch invariant too.
"""

from __future__ import annotations

import torch


def exact_dot_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """fp32(a @ b_tᵀ) with a float64 accumulator (order-independent for bf16/e4m3 operands)."""
    return (a.double() @ b_t.double().t()).float()


def lora_down(x2: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    """xa = act(x · Aᵀ): the LoRA intermediate, rounded to the activation dtype."""
    return exact_dot_fp32(x2, lora_a.to(x2.dtype)).to(x2.dtype)


def lora_epilogue(y32, x2, lora_a, lora_b, lora_scale, bias, xa=None):
    """y32 + σ (xa Bᵀ) + bias in fp32, in that order (shared by W8A16 and W8A8); xa: the LoRA intermediate if
    already computed."""
    if lora_a is not None:
        xa = lora_down(x2, lora_a) if xa is None else xa
        lora = exact_dot_fp32(xa, lora_b.to(x2.dtype))
        # fused multiply-add like the kernels' tl.fma: fp32 σ times fp32 lora is exact in float64
        sigma = torch.tensor(float(lora_scale), dtype=torch.float32).double()
        y32 = (y32.double() + sigma * lora.double()).float()
    if bias is not None:
        y32 = y32 + bias.float()
    return y32


def check_lora_args(K: int, N: int, lora_a, lora_b):
    if (lora_a is None) != (lora_b is None):
        raise ValueError("lora_a and lora_b must be given together")
    if lora_a is not None:
        r = lora_a.shape[0]
        if lora_a.shape != (r, K) or lora_b.shape != (N, r):
            raise ValueError(f"LoRA shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} "
                             f"do not fit K={K}, N={N} (want A [r, K], B [N, r])")


def w8a16_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale=1.0, bias=None, return_xa=False, out=None):
    """x `[..., K]`, codes `[N, K]` e4m3fn, scale fp32 `[1]`, A `[r, K]`, B `[N, r]` -> `[..., N]` x.dtype
    (return_xa: and xa `[M, r]`, the rounded LoRA intermediate; None without LoRA; out: written and returned)."""
    N, K = codes.shape
    check_lora_args(K, N, lora_a, lora_b)
    x2 = x.reshape(-1, K)
    xa = lora_down(x2, lora_a) if lora_a is not None else None
    y32 = exact_dot_fp32(x2, codes) * scale.float().reshape(())
    y32 = lora_epilogue(y32, x2, lora_a, lora_b, lora_scale, bias, xa)
    y = y32.to(x.dtype).reshape(*x.shape[:-1], N)
    if out is not None:
        y = out.copy_(y)
    return (y, xa) if return_xa else y
