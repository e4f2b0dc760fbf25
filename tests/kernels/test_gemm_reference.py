"""CPU tests of the W8A16 / W8A8 references against float64 math and against each other."""

import pytest
import torch

from epirl.kernels import (dequantize, quantize_activation_fp8, quantize_weight_fp8, w8a8_lora,
                           w8a16_lora)


def make_problem(M=13, K=96, N=80, r=8, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g) * 0.05, backend="reference")
    a = (torch.randn(r, K, generator=g) * 0.1).bfloat16()
    b = (torch.randn(N, r, generator=g) * 0.1).bfloat16()
    bb = (torch.randn(N, generator=g)).bfloat16() if bias else None
    return x, codes, scale, a, b, bb


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_w8a16_equals_dequantize_matmul():
    x, codes, scale, *_ = make_problem()
    y = w8a16_lora(x, codes, scale, backend="reference")
    want = (x.double() @ dequantize(codes, scale, torch.float64).t())
    # only the final bf16 rounding separates them (acc*s in fp32 adds < 1 fp32 ulp)
    assert torch.equal(y, want.float().bfloat16()) or rel_err(y, want) < 2 ** -8
    assert torch.all((y.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-30)


def test_w8a16_lora_bias_vs_float64_math():
    x, codes, scale, a, b, bias = make_problem(r=16)
    sigma = 2.0
    y = w8a16_lora(x, codes, scale, a, b, sigma, bias, backend="reference")
    w = dequantize(codes, scale, torch.float64)
    xa = (x.double() @ a.double().t()).bfloat16().double()  # the documented rounding point
    want = x.double() @ w.t() + sigma * xa @ b.double().t() + bias.double()
    assert torch.all((y.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-6)
    y0 = w8a16_lora(x, codes, scale, backend="reference")
    assert rel_err(y - y0, want - x.double() @ w.t()) < 2e-2  # the LoRA + bias part is really there


def test_w8a16_leading_dims_and_batch_invariance():
    x, codes, scale, a, b, bias = make_problem(M=37)
    full = w8a16_lora(x.reshape(37, 1, -1), codes, scale, a, b, 0.5, bias, backend="reference")
    assert full.shape == (37, 1, 80)
    for rows in (slice(0, 1), slice(5, 8), slice(20, 37)):
        part = w8a16_lora(x[rows], codes, scale, a, b, 0.5, bias, backend="reference")
        assert torch.equal(part, full.reshape(37, -1)[rows])


def test_w8a16_rejects_bad_lora_shapes():
    x, codes, scale, a, b, _ = make_problem()
    with pytest.raises(ValueError):
        w8a16_lora(x, codes, scale, a, None, backend="reference")
    with pytest.raises(ValueError):
        w8a16_lora(x, codes, scale, b, a, backend="reference")


def test_w8a8_vs_float64_emulation():
    x, codes, scale, a, b, bias = make_problem(M=21, K=130, N=70, seed=3)
    y = w8a8_lora(x, codes, scale, a, b, 1.5, bias, backend="reference")
    q, s = quantize_activation_fp8(x, backend="reference")
    xa = (x.double() @ a.double().t()).bfloat16().double()
    want = (q.double() @ codes.double().t()) * scale.double() * s.double() + 1.5 * xa @ b.double().t() \
        + bias.double()
    assert torch.all((y.double() - want).abs() <= want.abs() * 2 ** -8 + 1e-6)
    # W8A8 differs from W8A16 by the activation quantization error (a few %), not by a bug-sized amount
    y16 = w8a16_lora(x, codes, scale, a, b, 1.5, bias, backend="reference")
    assert 1e-4 < rel_err(y, y16) < 0.1


def test_w8a8_batch_invariant_per_token():
    x, codes, scale, *_ = make_problem(M=9)
    full = w8a8_lora(x, codes, scale, backend="reference")
    assert torch.equal(w8a8_lora(x[4:5], codes, scale, backend="reference"), full[4:5])
