"""CPU tests of the FP8 quantization reference: rounding vs float64, vLLM's scale rules, edge cases."""

import pytest
import torch

from epirl.kernels import (FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize, quantize_activation_fp8,
                           quantize_weight_fp8, split_fused, weight_kn_view)


def e4m3_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """All finite e4m3fn values (float64) and their codes, from the bit patterns (independent of casts)."""
    codes = torch.arange(256, dtype=torch.int64)
    sign = torch.where(codes >= 128, -1.0, 1.0).double()
    exp = (codes >> 3) & 0xF
    man = (codes & 7).double()
    val = torch.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp.double() - 7)) * sign
    finite = (codes & 0x7F) != 0x7F
    return val[finite], codes[finite]


def rne_e4m3_float64(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values (already clamped to +-448) to the nearest e4m3 value, ties to even code."""
    grid, codes = e4m3_grid()
    d = (v.reshape(-1, 1) - grid.reshape(1, -1)).abs()
    best = d.min(dim=1, keepdim=True).values
    tie_ok = (d == best)
    # among ties prefer an even mantissa (code LSB 0); +0 and -0 both qualify for v = 0
    score = tie_ok.double() * 2 + (tie_ok & (codes.reshape(1, -1) % 2 == 0)).double()
    return grid[score.argmax(dim=1)].reshape(v.shape)


def test_per_token_matches_float64_rounding():
    torch.manual_seed(0)
    x = (torch.randn(37, 301) * torch.logspace(-3, 3, 37).reshape(-1, 1)).bfloat16()
    q, s = quantize_activation_fp8(x, backend="reference")
    amax = x.double().abs().amax(dim=1, keepdim=True)
    s64 = torch.maximum((amax.float() / 448.0).double(), torch.tensor(MIN_SCALE, dtype=torch.float64))
    assert torch.equal(s.double(), s64)
    scaled = (x.float() / s).double()  # the fp32 true division, then exact rounding in float64
    want = rne_e4m3_float64(scaled.clamp(-FP8_MAX, FP8_MAX))
    assert torch.equal(q.double(), want)


def test_per_tensor_uses_reciprocal_and_no_min_scale():
    torch.manual_seed(1)
    x = torch.randn(33, 65, dtype=torch.bfloat16) * 1e-6
    q, s = quantize_activation_fp8(x, per_token=False, backend="reference")
    assert s.shape == (1,) and s.dtype == torch.float32
    assert s.item() == pytest.approx(x.float().abs().max().item() / 448.0, rel=1e-6)
    assert s.item() < MIN_SCALE  # no minimum for per-tensor dynamic
    inv = torch.tensor(1.0) / s
    want = rne_e4m3_float64((x.float() * inv).double().clamp(-FP8_MAX, FP8_MAX))
    assert torch.equal(q.double(), want)


def test_edge_cases_documented_behaviour():
    row_zero = torch.zeros(8)
    row_max = torch.tensor([448.0, -448.0, 1.0, 0.5, 0, 0, 0, 0])
    row_sub = torch.tensor([448.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, -2.0 ** -8, 0, 0, 0])
    row_nan = torch.tensor([float("nan"), 1.0, -2.0, 0, 0, 0, 0, 0])
    row_inf = torch.tensor([float("inf"), 1.0, -2.0, 0, 0, 0, 0, 0])
    row_huge = torch.tensor([3e38, -1e38, 1.0, 0, 0, 0, 0, 0])
    x = torch.stack([row_zero, row_max, row_sub, row_nan, row_inf, row_huge]).bfloat16()
    q, s = quantize_activation_fp8(x, backend="reference")
    qf = q.float()
    assert s[0].item() == MIN_SCALE and torch.all(qf[0] == 0)
    assert s[1].item() == 1.0 and torch.equal(qf[1], x[1].float())
    # 2^-9 is the smallest subnormal; 2^-10 ties to 0 (even), 3*2^-10 ties up to 2^-8 (even mantissa)
    assert qf[2, :5].tolist() == [448.0, 2.0 ** -9, 0.0, 2.0 ** -8, -2.0 ** -8]
    # NaN is ignored by amax (fmaxf) and becomes +448 (fminf(NaN, 448) = 448)
    assert s[3].item() == pytest.approx(2.0 / 448) and qf[3, 0].item() == 448.0
    # Inf makes the scale Inf: finite entries -> 0, the Inf itself -> Inf/Inf = NaN -> 448
    assert s[4].item() == float("inf") and qf[4, 0].item() == 448.0 and torch.all(qf[4, 1:] == 0)
    assert torch.isfinite(s[5]) and qf[5, 0].item() == 448.0 and torch.isfinite(qf[5]).all()
    assert q.dtype == FP8_DTYPE and s.shape == (6, 1)


def test_scale_upper_bound_and_leading_dims():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16) * 100
    q, s = quantize_activation_fp8(x, scale_ub=10.0, backend="reference")
    assert q.shape == x.shape and s.shape == (2, 3, 1)
    assert torch.all(s == torch.tensor(10.0) / 448.0)
    assert q.float().abs().max().item() == 448.0  # saturated, not NaN


def test_per_tensor_all_zero_is_vllm_behaviour():
    q, s = quantize_weight_fp8(torch.zeros(4, 8), backend="reference")
    assert s.item() == 0.0 and torch.all(q.float() == 448.0)  # 0 * (1/0) = NaN -> 448
    assert torch.all(dequantize(q, s) == 0)


def test_weight_quant_fused_scale_and_views():
    torch.manual_seed(2)
    wq, wk, wv = torch.randn(48, 32), torch.randn(16, 32) * 3, torch.randn(16, 32) * 0.1
    codes, scale = quantize_weight_fp8([wq, wk, wv], backend="reference")
    fused = torch.cat([wq, wk, wv])
    assert scale.item() == pytest.approx(fused.abs().max().item() / 448.0, rel=1e-7)
    codes2, scale2 = quantize_weight_fp8(fused, group_sizes=[48, 16, 16], backend="reference")
    assert torch.equal(codes.view(torch.uint8), codes2.view(torch.uint8)) and torch.equal(scale, scale2)
    q_only, s_only = quantize_weight_fp8(wq, backend="reference")
    assert not torch.equal(s_only, scale)  # separate quantization does not match the engine
    parts = split_fused(codes, [48, 16, 16])
    assert parts[1].data_ptr() == codes[48:].data_ptr() and parts[2].shape == (16, 32)
    kn = weight_kn_view(codes)
    assert kn.shape == (32, 80) and kn.data_ptr() == codes.data_ptr()
    rel = (dequantize(codes, scale) - fused).abs().max() / fused.abs().max()
    assert rel < 2 ** -4  # e4m3 has 3 mantissa bits
    with pytest.raises(ValueError):
        quantize_weight_fp8(fused, group_sizes=[48, 16])
