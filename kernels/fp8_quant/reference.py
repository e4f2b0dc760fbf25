"""Plain-torch FP8 (e4m3fn) quantization, bit-for-bit vLLM's CUDA kernels (read from vLLM 0.26-0.33).

Numerics (all fp32, as vLLM's `scaled_fp8_conversion` / `dynamic_*_scaled_fp8_quant` kernels):
- amax is a chain of `fmaxf(acc, fabsf(x))` from 0, so NaN inputs are ignored (fmaxf returns the
  non-NaN operand) and +-Inf make amax = Inf.
- per-token dynamic: `s = fmaxf(fminf(amax, ub) / 448, 1/(448*512))`; `q = x / s` (true division).
- per-tensor dynamic (also vLLM's online weight quantization): `s = amax / 448`, no minimum;
  `q = x * (1/s)` (the kernel multiplies by the reciprocal).
- then `r = fmaxf(-448, fminf(q, 448))` - so NaN becomes +448 - and a round-to-nearest-even,
  saturating conversion to e4m3fn (torch's cast is RNE; after the clamp nothing can overflow).
Consequences kept on purpose because the engine has them: an all-zero tensor quantized per tensor gets
s = 0 and codes 448 (0 * inf = NaN -> 448) and dequantizes to 0; an Inf in a row makes that row's scale
Inf, its finite entries 0 and the Inf itself 448 (Inf/Inf = NaN).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# vLLM computes 1.0f / (FP8_MAX * 512.f) in fp32; do the same division in fp32.
MIN_SCALE = (torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX * 512.0)).item()


def _abs_ignoring_nan(x32: torch.Tensor) -> torch.Tensor:
    a = x32.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def saturating_cast(q32: torch.Tensor) -> torch.Tensor:
    """`fmaxf(-448, fminf(q, 448))` then RNE to e4m3fn: NaN -> +448 exactly like the CUDA kernel."""
    q32 = torch.where(torch.isnan(q32), torch.full_like(q32, FP8_MAX), q32)
    return q32.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 scale `[1]` = amax / 448 (NaN ignored), as vLLM's dynamic per-tensor kernel."""
    amax = _abs_ignoring_nan(x.float()).amax() if x.numel() else torch.zeros((), device=x.device)
    return (amax / torch.tensor(FP8_MAX, device=x.device)).reshape(1)


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None):
    """Static (given `scale`) or dynamic per-tensor quantization: `q = e4m3(clamp(x * (1/s)))`."""
    if scale is None:
        scale = per_tensor_scale(x)
    scale = scale.float().reshape(1)
    inv = torch.tensor(1.0, device=x.device) / scale  # fp32 reciprocal, like `1.0f / (*scale)`
    return saturating_cast(x.float() * inv), scale


def quantize_per_token(x: torch.Tensor, scale_ub: float | None = None):
    """Per-token dynamic quantization of the last dim. Returns codes (x's shape) and scales `[..., 1]`."""
    x32 = x.float()
    amax = _abs_ignoring_nan(x32).amax(dim=-1, keepdim=True) if x.shape[-1] else torch.zeros(
        (*x.shape[:-1], 1), device=x.device)
    if scale_ub is not None and scale_ub > 0:
        amax = torch.minimum(amax, torch.tensor(float(scale_ub), device=x.device))
    scales = torch.maximum(amax / torch.tensor(FP8_MAX, device=x.device),
                           torch.tensor(MIN_SCALE, device=x.device))
    return saturating_cast(x32 / scales), scales


def quantize_activation(x: torch.Tensor, per_token: bool = True, scale_ub: float | None = None):
    if per_token:
        return quantize_per_token(x, scale_ub)
    return quantize_per_tensor(x)


def quantize_weight(w: torch.Tensor):
    """vLLM online `fp8_per_tensor`: one fp32 scale over the whole (possibly fused) `[N, K]` weight."""
    return quantize_per_tensor(w)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """codes * scale in fp32 (CPU/test helper: materialises the weight, never use it in the trainer)."""
    return (codes.float() * scale.float()).to(dtype)  # scale `[1]` or per-row `[..., 1]` broadcasts


NAN_CODE_MAGNITUDE = 0x7F  # e4m3fn's NaN: every exponent and mantissa bit set (0x7f, 0xff)
CHECK_BLOCK = 1 << 24  # codes checked at once: the check's temporaries stay at a few 16 MiB blocks, whatever the layer


def check_weight_codes(codes: torch.Tensor) -> None:
    """The frozen FP8 base of a trainer layer: a 2-D e4m3fn tensor without NaN codes (which the W8A16 kernels'
    widening, `w8a16/widen.py`, would read as ±480); else one line naming it. FP8 quantization (epirl's and vLLM's)
    saturates at ±448 and never writes one, so this guards codes from elsewhere (a corrupt checkpoint, a hand-built
    tensor). One read of the codes, in blocks."""
    if codes.dtype != FP8_DTYPE or codes.dim() != 2:
        raise ValueError(f"codes must be a 2-D {FP8_DTYPE} tensor, got {codes.dtype} {tuple(codes.shape)}")
    what = f"codes {tuple(codes.shape)}"
    if codes.dim() == 2 and not codes.is_contiguous() and codes.t().is_contiguous():
        codes = codes.t()  # the engine's [K, N] view: the same elements, read in storage order
    raw = codes.contiguous().reshape(-1).view(torch.uint8)
    for lo in range(0, raw.numel(), CHECK_BLOCK):
        block = raw[lo:lo + CHECK_BLOCK]
        if bool(((block & NAN_CODE_MAGNITUDE) == NAN_CODE_MAGNITUDE).any()):
            raise ValueError(f"{what}: holds NaN e4m3 codes (0x7f/0xff); FP8 weights must be finite (quantize with "
                             f"saturation, as epirl.kernels.quantize_weight_fp8 does)")
