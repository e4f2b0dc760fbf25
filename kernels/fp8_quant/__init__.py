"""FP8 quantization, bit-for-bit vLLM's `scaled_fp8_quant`: reference.py (the numerics) and triton.py (the CUDA
kernel); the functions here pick one per call (`epirl.kernels._dispatch`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _dispatch
from . import reference


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
        from .triton import quantize_per_tensor  # deferred: importing epirl.kernels needs no Triton
    else:
        quantize_per_tensor = reference.quantize_per_tensor
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
        from . import triton as impl  # deferred: importing epirl.kernels needs no Triton
    else:
        impl = reference
    if per_token:
        return impl.quantize_per_token(x, scale_ub)
    if scale_ub is not None:
        raise ValueError("scale_ub applies to per-token quantization only")
    return impl.quantize_per_tensor(x)
