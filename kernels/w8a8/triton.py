"""Triton W8A8 GEMM (vLLM's FP8 engine numerics) with the LoRA epilogue.

Per-token quantization (fp8_quant.triton, bit-exact with vLLM), then the shared scaled GEMM on FP8 tensor
cores with `max_num_imprecise_acc=32`: on sm_90 an FP8 wgmma accumulates with reduced precision, and
Triton's default lets it run across the whole K loop (relative error ~4e-3 at K=4096); promoting every
32-deep wgmma step into the fp32 accumulator makes the sum as precise as an fp32 accumulation.
(vLLM's own CUTLASS FP8 GEMM uses "fast accumulation", so it is itself less precise than this.)
"""

from __future__ import annotations

from ..fp8_quant.triton import quantize_per_token
from .._host import prepare_operands
from .scaled import lora_down_split, scaled_gemm_lora

W8A8_CONFIG = dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4)


def w8a8_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale=1.0, bias=None, scale_ub=None):
    x2, a, b, bias = prepare_operands(x, codes, lora_a, lora_b, bias)
    q_x, s_x = quantize_per_token(x2, scale_ub)
    xa = lora_down_split(x2, a) if a is not None else None
    y = scaled_gemm_lora(q_x, codes, x.dtype, w_scale=scale.float().reshape(1), x_scale=s_x.reshape(-1),
                         xa=xa, lora_b=b, lora_scale=lora_scale, bias=bias, config=W8A8_CONFIG)
    return y.reshape(*x.shape[:-1], codes.shape[0])
