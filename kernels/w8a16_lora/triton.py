"""Triton W8A16 GEMM with the LoRA epilogue (Hopper): the matched engine's and the trainer's forward.

The GEMM itself is the shared weight-stationary kernel of `kernels/gemm/weight_stationary.py` (see its
docstring for the batch-invariance argument); its tile configs come from the committed table
`kernels/gemm/ws_configs.json`. For few tokens the whole layer is two launches: the split-K partial kernel
(base tiles + the LoRA down-projection as extra programs) and the ordered chunk sum with the epilogue.
The other names below are re-exported for the ops and tests that import them from here.
"""

from __future__ import annotations

from ..gemm.configs import k_chunking  # noqa: F401  (re-export)
from ..gemm.scaled import (FWD_CONFIG, LORA_SPLITS, _grouped_tile_ids, lora_down_split,  # noqa: F401
                           prepare_operands, scaled_gemm_lora)
from ..gemm.weight_stationary import weight_stationary_gemm  # noqa: F401

prepare = prepare_operands  # the names w8a8_lora imports (unchanged numerics for it)
lora_down = lora_down_split


def w8a16_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale=1.0, bias=None, return_xa=False, out=None,
               settings=None):
    x2, a, b, bias = prepare_operands(x, codes, lora_a, lora_b, bias)
    res = weight_stationary_gemm(x2, codes, x.dtype, w_scale=scale.float().reshape(1), lora_a=a, lora_b=b,
                                 lora_scale=lora_scale, bias=bias, return_xa=return_xa, out=out, settings=settings)
    y, xa = res if return_xa else (res, None)
    if out is None:
        y = y.reshape(*x.shape[:-1], codes.shape[0])
    return (y, xa) if return_xa else y
