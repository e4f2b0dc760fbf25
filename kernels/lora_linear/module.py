"""`Fp8LoRALinear`: frozen FP8 base (codes + scale buffers) with a trainable LoRA adapter.

Forward is exactly `epirl.kernels.w8a16_lora(x, codes, scale, A, B, σ, bias)` - the same function (and on
CUDA the same Triton kernel and tile config) the matched engine calls, so logits agree bitwise. The
autograd Function saves only x, A, B, codes, scale and the rank-r LoRA intermediate; backward reads the codes
in place (N as the reduction dim), never materialising a dequantized weight.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import _dispatch
from ..fp8_quant import quantize_weight_fp8
from ..fp8_quant.reference import check_weight_codes
from ..w8a16 import w8a16_lora
from . import reference


def _forward(x, codes, scale, lora_a, lora_b, lora_scale, bias, backend):
    """(y, xa): the public dispatcher's call (identical math to a direct engine-side call) and the LoRA intermediate
    it used, which the backward's dB needs."""
    return w8a16_lora(x, codes, scale, lora_a, lora_b, lora_scale, bias, backend=backend, return_xa=True)


def lora_linear_backward(grad_y, x, codes, scale, lora_a, lora_b, lora_scale, need_dx, backend=None, xa=None,
                         grad_dtypes=None):
    """(dX, dA, dB); xa: the forward's LoRA intermediate bf16(x Aᵀ) when saved (else it is computed again, with the
    forward's chunking: the same bits). dA / dB come in fp32 from the reference and, from the Triton path, in
    grad_dtypes (default: lora_a's and lora_b's dtypes), rounded there once; callers cast to the parameters' dtype."""
    if _dispatch.use_triton(x, backend):
        from .triton import lora_linear_backward as impl  # deferred: importing epirl.kernels needs no Triton
        return impl(grad_y, x, codes, scale, lora_a, lora_b, lora_scale, need_dx, xa=xa, grad_dtypes=grad_dtypes)
    return reference.lora_linear_backward(grad_y, x, codes, scale, lora_a, lora_b, lora_scale, need_dx, xa=xa)


class Fp8LoRAFunction(torch.autograd.Function):
    """y = w8a16_lora(x, codes, scale, A, B, σ, bias); gradients for x, A and B only. Saves x, A and B in x's dtype
    (the forward rounds fp32 masters to it once, and the backward uses those copies: no second cast), codes, scale
    and xa = bf16(x Aᵀ) `[M, r]` (r/K of x's size: the backward's dB reads it instead of a second pass over x)."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, codes, scale, bias, lora_scale, backend):
        has_lora = lora_a is not None
        # the rounding the kernels would do, once (a no-op for bf16 parameters)
        a, b = (lora_a.to(x.dtype), lora_b.to(x.dtype)) if has_lora else (None, None)
        y, xa = _forward(x, codes, scale, a, b, lora_scale, bias, backend)
        ctx.save_for_backward(x, a, b, codes, scale, xa)
        ctx.lora_scale, ctx.backend = lora_scale, backend
        ctx.grad_dtypes = (lora_a.dtype, lora_b.dtype) if has_lora else None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, a, b, codes, scale, xa = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        dx, d_a, d_b = lora_linear_backward(grad_y.contiguous(), x, codes, scale, a, b, ctx.lora_scale, need_dx,
                                            ctx.backend, xa=xa, grad_dtypes=ctx.grad_dtypes)
        d_a = d_a.to(ctx.grad_dtypes[0]) if ctx.needs_input_grad[1] else None
        d_b = d_b.to(ctx.grad_dtypes[1]) if ctx.needs_input_grad[2] else None
        return dx, d_a, d_b, None, None, None, None, None


def peft_lora_init(rank: int, in_features: int, out_features: int, dtype, device, seed=None):
    """PEFT's default init: A kaiming-uniform(a=sqrt(5)) `[r, in]`, B zeros `[out, r]`, drawn in fp32 on the CPU
    (from a generator seeded with `seed`, else torch's default one) so every device gets the same bits; then cast
    and moved. The one LoRA initialiser: the trainer's policies (epirl.model.lora) seed it per module name."""
    gen = None
    if seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.empty(rank, in_features, dtype=torch.float32)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on fan_in = in_features
    a.uniform_(-bound, bound, generator=gen)
    b = torch.zeros(out_features, rank, dtype=torch.float32)
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


class Fp8LoRALinear(nn.Module):
    """Linear layer `y = x Wᵀ + σ (x Aᵀ) Bᵀ + bias` over a frozen FP8 weight W = codes · scale.

    codes `[out, in]` e4m3fn (nn.Linear layout; may be a view of the engine's `[in, out]`-viewed buffer,
    never copied), scale fp32 `[1]`, lora_a `[r, in]`, lora_b `[out, r]`, σ = lora_scale (alpha / r).
    codes, scale and bias are non-persistent buffers: they belong to the base model, not the adapter.
    """

    def __init__(self, codes, scale, lora_a, lora_b, lora_scale: float, bias=None, backend=None):
        super().__init__()
        check_weight_codes(codes)
        self.out_features, self.in_features = codes.shape
        self.r = lora_a.shape[0]
        self.lora_scale = float(lora_scale)
        self.backend = backend
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scale", scale.float().reshape(1), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.lora_A = nn.Parameter(lora_a)
        self.lora_B = nn.Parameter(lora_b)

    @classmethod
    def from_codes(cls, codes, scale, rank: int, alpha: float, bias=None, seed=None,
                   lora_dtype=torch.bfloat16, backend=None):
        """New adapter (PEFT init) over existing codes; σ = alpha / rank."""
        out_f, in_f = codes.shape
        a, b = peft_lora_init(rank, in_f, out_f, lora_dtype, codes.device, seed)
        return cls(codes, scale, a, b, alpha / rank, bias, backend)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, alpha: float, seed=None,
                    lora_dtype=torch.bfloat16, backend=None, codes_scale=None):
        """Quantize `linear.weight` with vLLM's online per-tensor scheme (or take `codes_scale`, e.g.
        slices of a fused module quantized once with `quantize_weight_fp8`) and attach a fresh adapter."""
        if codes_scale is None:
            codes_scale = quantize_weight_fp8(linear.weight.detach(), backend=backend)
        codes, scale = codes_scale
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls.from_codes(codes, scale, rank, alpha, bias, seed, lora_dtype, backend)

    def forward(self, x):
        if getattr(self, "slice_group", None) is not None:  # grouped only where kernels.fused_slices is on
            return self.slice_group.output(self.slice_index, x)  # one call for the fused layer (sliced.py)
        return Fp8LoRAFunction.apply(x, self.lora_A, self.lora_B, self.codes, self.scale, self.bias,
                                     self.lora_scale, self.backend)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, lora_scale={self.lora_scale}"
