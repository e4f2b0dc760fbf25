"""W8A8 GEMM with the LoRA epilogue (vLLM's FP8 numerics): reference.py (the numerics), triton.py (the op on CUDA)
over the row-major scaled GEMM of scaled.py. `w8a8_lora` here picks reference or Triton per call."""

from __future__ import annotations

from .. import _dispatch
from . import reference


def w8a8_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale: float = 1.0, bias=None,
              backend: str | None = None):
    """vLLM's W8A8 numerics: per-token FP8 x times FP8 codes, `(acc · s_w) · s_x`, then the LoRA
    epilogue on bf16 x, then bf16. Same arguments as `w8a16_lora`."""
    if _dispatch.use_triton(x, backend):
        from .triton import w8a8_lora as impl  # deferred: importing epirl.kernels needs no Triton
        return impl(x, codes, scale, lora_a, lora_b, lora_scale, bias)
    return reference.w8a8_lora(x, codes, scale, lora_a, lora_b, lora_scale, bias)
