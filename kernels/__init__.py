"""epirl.kernels: FP8 quantization, W8A16/W8A8 GEMMs with a LoRA epilogue, and the FP8 LoRA linear.

Every op dispatches to its Triton kernel for CUDA tensors and to its plain-torch reference elsewhere;
`EPIRL_KERNELS=reference` or `backend="reference"` forces the reference. The references define the
numerics (see kernels/README.md); shapes and layouts:
  codes  `[N, K]` float8_e4m3fn row-major (nn.Linear layout; vLLM stores `weight = codes.t()`, `[K, N]`)
  scale  fp32 `[1]` (one per fused module)      x `[..., K]` bf16      A `[r, K]`      B `[N, r]`
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _dispatch
from .fp8_quant import reference as _quant_ref
from .fp8_quant.reference import FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize
from .lora_linear.module import Fp8LoRAFunction, Fp8LoRALinear, lora_linear_backward, peft_lora_init
from .lora_linear.reference import lora_linear_backward as lora_linear_backward_reference

# The ops `w8a16_lora` / `w8a8_lora` share their names with their subpackages. Python binds a subpackage
# to the parent's attribute only on its first import, so importing them here, before the functions below
# are defined, keeps `epirl.kernels.w8a16_lora` the function for the whole process (no caller needs a
# guard; tests/kernels/test_gemm_configs.py checks it).
from . import w8a8_lora as _w8a8_pkg  # noqa: E402,F401
from . import w8a16_lora as _w8a16_pkg  # noqa: E402,F401

__all__ = [
    "FP8_DTYPE", "FP8_MAX", "MIN_SCALE", "dequantize", "quantize_weight_fp8", "quantize_activation_fp8",
    "split_fused", "weight_kn_view", "w8a16_lora", "w8a8_lora", "lora_linear_backward",
    "lora_linear_backward_reference", "Fp8LoRAFunction", "Fp8LoRALinear", "peft_lora_init",
]


def quantize_weight_fp8(w, group_sizes: Sequence[int] | None = None, backend: str | None = None):
    """vLLM online `fp8_per_tensor` weight quantization -> (codes `[N, K]` e4m3fn, scale fp32 `[1]`).

    `w` is the `[N, K]` weight, or a sequence of weights fused along N (q, k, v / gate, up). One scale
    covers the whole concatenation, exactly as vLLM quantizes its fused `qkv_proj` / `gate_up_proj`;
    `group_sizes` (rows per fused module) is validated against N - use `split_fused` for the per-module
    views. Quantizing fused modules separately does NOT match the engine.
    """
    if not isinstance(w, torch.Tensor):
        parts = list(w)
        if group_sizes is None:
            group_sizes = [p.shape[0] for p in parts]
        w = torch.cat(parts, dim=0)
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got {tuple(w.shape)}")
    if group_sizes is not None and sum(group_sizes) != w.shape[0]:
        raise ValueError(f"group_sizes {list(group_sizes)} do not sum to N={w.shape[0]}")
    if _dispatch.use_triton(w, backend):
        from .fp8_quant.triton import quantize_per_tensor
    else:
        quantize_per_tensor = _quant_ref.quantize_per_tensor
    return quantize_per_tensor(w.contiguous())


def split_fused(codes: torch.Tensor, group_sizes: Sequence[int]) -> list[torch.Tensor]:
    """Row views (no copies) of a fused module's codes, one per module: q, k, v or gate, up."""
    return list(torch.split(codes, list(group_sizes), dim=0))


def weight_kn_view(codes: torch.Tensor) -> torch.Tensor:
    """vLLM's `[K, N]` `layer.weight` view of `[N, K]` row-major codes (and back: `.t()` again)."""
    return codes.t()


def quantize_activation_fp8(x: torch.Tensor, per_token: bool = True, scale_ub: float | None = None,
                            backend: str | None = None):
    """vLLM `scaled_fp8_quant(x, use_per_token_if_dynamic=per_token)` -> (codes like x, scales).

    per_token: scales fp32 `[..., 1]`, `s = max(min(amax, ub)/448, 1/(448*512))`, `q = x / s`.
    per-tensor: scale fp32 `[1]`, `s = amax/448`, `q = x * (1/s)`. Both clamp to +-448 (NaN -> 448) and
    round to nearest even.
    """
    if _dispatch.use_triton(x, backend):
        from .fp8_quant import triton as impl
    else:
        impl = _quant_ref
    if per_token:
        return impl.quantize_per_token(x, scale_ub)
    if scale_ub is not None:
        raise ValueError("scale_ub applies to per-token quantization only")
    return impl.quantize_per_tensor(x)


def w8a16_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale: float = 1.0, bias=None,
               backend: str | None = None, return_xa: bool = False, out=None, settings=None):
    """`bf16((x · bf16(codes)ᵀ)_fp32 · s_w + σ (x Aᵀ) Bᵀ + bias)`: the matched engine's and trainer's
    forward. x `[..., K]` bf16, codes `[N, K]`, A `[r, K]`, B `[N, r]` -> `[..., N]`. Batch invariant.
    return_xa: (y, xa) with xa = bf16(x Aᵀ) `[M, r]`, the intermediate the epilogue used (None without LoRA):
    what the trainer's backward needs, so that it need not compute it again. out: an `[M, N]` view to write y into
    (any row stride, e.g. one slice's columns of a fused layer's output; x 2-D), returned as y. settings: a
    `plan.KernelSettings` for the Triton kernels (another tile table; the reference ignores it)."""
    if out is not None and (x.dim() != 2 or tuple(out.shape) != (x.shape[0], codes.shape[0])):
        raise ValueError(f"out: want shape {(x.shape[0], codes.shape[0])} for a 2-D x, got {tuple(out.shape)} "
                         f"for x {tuple(x.shape)}")
    if _dispatch.use_triton(x, backend):
        from .w8a16_lora.triton import w8a16_lora as impl
        return impl(x, codes, scale, lora_a, lora_b, lora_scale, bias, return_xa=return_xa, out=out, settings=settings)
    from .w8a16_lora.reference import w8a16_lora as impl
    return impl(x, codes, scale, lora_a, lora_b, lora_scale, bias, return_xa=return_xa, out=out)


def w8a8_lora(x, codes, scale, lora_a=None, lora_b=None, lora_scale: float = 1.0, bias=None,
              backend: str | None = None):
    """vLLM's W8A8 numerics: per-token FP8 x times FP8 codes, `(acc · s_w) · s_x`, then the LoRA
    epilogue on bf16 x, then bf16. Same arguments as `w8a16_lora`."""
    if _dispatch.use_triton(x, backend):
        from .w8a8_lora.triton import w8a8_lora as impl
    else:
        from .w8a8_lora.reference import w8a8_lora as impl
    return impl(x, codes, scale, lora_a, lora_b, lora_scale, bias)


# Subpackage imported before the function of the same name is defined (see the note at the top imports).
from . import w8a8_multi_lora as _w8a8_multi_pkg  # noqa: E402,F401

__all__.append("w8a8_multi_lora")


def w8a8_multi_lora(x, codes, scale, lora_a, lora_b, token_lora, lora_scale=1.0, bias=None,
                    backend: str | None = None, **triton_options):
    """Multi-adapter W8A8: x `[M, K]` bf16, codes `[N, K]`, scale `[1]`, lora_a `[L, r, K]`, lora_b `[L, N, r]`,
    token_lora `[M]` int64 (-1 = no adapter) -> `[M, N]`, each token with `w8a8_lora`'s numerics for its own
    adapter; lora_scale a float or `[L]`. triton_options (path, config, order) reach the Triton kernels only."""
    if _dispatch.use_triton(x, backend):
        from .w8a8_multi_lora.triton import w8a8_multi_lora as impl
        return impl(x, codes, scale, lora_a, lora_b, token_lora, lora_scale, bias, **triton_options)
    from .w8a8_multi_lora.reference import w8a8_multi_lora as impl
    return impl(x, codes, scale, lora_a, lora_b, token_lora, lora_scale, bias)
