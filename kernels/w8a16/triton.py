"""Triton W8A16 GEMM with the LoRA epilogue (Hopper): the matched engine's and the trainer's forward.

The GEMM itself is the weight-stationary kernel of `kernels/w8a16/weight_stationary.py` (see its docstring for the
batch-invariance argument); which of its kernels runs for a call is `kernels/plan.py`'s choice, its tile configs come
from the committed table `kernels/w8a16/ws_configs_tma.json`.
"""

from __future__ import annotations

from .._host import prepare_operands
from .weight_stationary import weight_stationary_gemm


def w8a16_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale=1.0, bias=None, return_xa=False, out=None,
               settings=None):
    x2, a, b, bias = prepare_operands(x, codes, lora_a, lora_b, bias)
    res = weight_stationary_gemm(x2, codes, x.dtype, w_scale=scale.float().reshape(1), lora_a=a, lora_b=b,
                                 lora_scale=lora_scale, bias=bias, return_xa=return_xa, out=out, settings=settings)
    y, xa = res if return_xa else (res, None)
    if out is None:
        y = y.reshape(*x.shape[:-1], codes.shape[0])
    return (y, xa) if return_xa else y
