"""CPU tests of the FP8 LoRA linear: reference backward vs float64 autograd, the module's contract."""

import math

import pytest
import torch
from torch import nn

from epirl.kernels import (Fp8LoRALinear, lora_linear_backward_reference, quantize_weight_fp8,
                           split_fused, w8a16_lora)
from epirl.kernels.lora_linear.reference import lora_linear_backward_fp64


def problem(M, K, N, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g) * 0.05, backend="reference")
    a = (torch.randn(r, K, generator=g) * 0.1).to(dtype)
    b = (torch.randn(N, r, generator=g) * 0.1).to(dtype)
    gy = torch.randn(M, N, generator=g).to(dtype)
    return x, codes, scale, a, b, gy


def autograd_fp64_grads(x, codes, scale, a, b, sigma, gy):
    """Independent float64 autograd of y = x Wᵀ + σ (x Aᵀ) Bᵀ."""
    x64, a64, b64 = (t.double().requires_grad_() for t in (x, a, b))
    w = codes.double() * scale.double()
    y = x64 @ w.t() + sigma * (x64 @ a64.t()) @ b64.t()
    return torch.autograd.grad(y, (x64, a64, b64), gy.double())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_reference_backward_vs_float64_autograd(dtype, tol):
    x, codes, scale, a, b, gy = problem(M=19, K=72, N=40, r=8, dtype=dtype)
    dx, da, db = lora_linear_backward_reference(gy, x, codes, scale, a, b, 2.0)
    want = autograd_fp64_grads(x, codes, scale, a, b, 2.0, gy)
    for got, ref in zip((dx, da, db), want):
        assert ((got.double() - ref).norm() / ref.norm()).item() < tol
    for got, ref in zip(lora_linear_backward_fp64(gy, x, codes, scale, a, b, 2.0), want):
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_autograd_function_gradients_fp32_tight():
    x, codes, scale, a, b, gy = problem(M=11, K=48, N=24, r=4, dtype=torch.float32, seed=5)
    layer = Fp8LoRALinear(codes, scale, a.clone(), b.clone(), lora_scale=0.5, backend="reference")
    xr = x.clone().requires_grad_()
    layer(xr).backward(gy)
    want = autograd_fp64_grads(x, codes, scale, a, b, 0.5, gy)
    for got, ref in zip((xr.grad, layer.lora_A.grad, layer.lora_B.grad), want):
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_finite_difference_on_lora_a():
    x, codes, scale, a, b, gy = problem(M=5, K=16, N=12, r=2, dtype=torch.float32, seed=7)
    layer = Fp8LoRALinear(codes, scale, a.clone(), b.clone(), lora_scale=1.0, backend="reference")
    (layer(x) * gy).sum().backward()
    eps = 1e-2
    for idx in [(0, 3), (1, 10)]:
        plus, minus = a.clone(), a.clone()
        plus[idx] += eps
        minus[idx] -= eps
        f = lambda aa: (w8a16_lora(x, codes, scale, aa, b, 1.0, backend="reference") * gy).sum().item()
        fd = (f(plus) - f(minus)) / (2 * eps)
        assert layer.lora_A.grad[idx].item() == pytest.approx(fd, rel=1e-3, abs=1e-3)


def test_module_contract_buffers_views_init():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True)
    layer = Fp8LoRALinear.from_linear(lin, rank=8, alpha=16, seed=123, backend="reference")
    assert {n for n, _ in layer.named_parameters()} == {"lora_A", "lora_B"}
    assert {n for n, _ in layer.named_buffers()} == {"codes", "scale", "bias"}
    assert layer.in_features == 64 and layer.out_features == 96 and layer.r == 8
    assert layer.lora_scale == 2.0 and layer.lora_A.shape == (8, 64) and layer.lora_B.shape == (96, 8)
    assert torch.all(layer.lora_B == 0) and layer.lora_A.abs().max() <= 1 / math.sqrt(64)
    again = Fp8LoRALinear.from_linear(lin, rank=8, alpha=16, seed=123, backend="reference")
    assert torch.equal(layer.lora_A, again.lora_A)
    assert "codes" not in layer.state_dict()  # the base belongs to its owner, not to the adapter

    # codes may be views of another owner's fused buffer: never copied
    fused, scale = quantize_weight_fp8(torch.randn(96 + 32, 64), backend="reference")
    q_view, _ = split_fused(fused, [96, 32])
    shared = Fp8LoRALinear.from_codes(q_view, scale, rank=4, alpha=8, backend="reference")
    assert shared.codes.data_ptr() == fused.data_ptr()


def test_module_forward_is_the_engine_call_bitwise():
    x, codes, scale, a, b, _ = problem(M=7, K=40, N=24, r=4, dtype=torch.bfloat16, seed=9)
    bias = torch.randn(24).bfloat16()
    layer = Fp8LoRALinear(codes, scale, a.clone(), b.clone(), lora_scale=0.25, bias=bias,
                          backend="reference")
    y_train = layer(x.reshape(7, 1, 40))
    y_engine = w8a16_lora(x, codes, scale, a, b, 0.25, bias, backend="reference")
    assert torch.equal(y_train.reshape(7, 24), y_engine)


def test_fp32_master_params_round_like_published_bf16():
    x, codes, scale, a, b, _ = problem(M=3, K=32, N=16, r=4, dtype=torch.bfloat16, seed=11)
    layer = Fp8LoRALinear(codes, scale, a.float() + 1e-4, b.float(), 1.0, backend="reference")
    published = w8a16_lora(x, codes, scale, layer.lora_A.detach().bfloat16(), b, 1.0, backend="reference")
    assert torch.equal(layer(x), published)


def test_function_without_lora_gives_dx_only():
    """Frozen projections outside the LoRA targets run the same Function with A = B = None."""
    from epirl.kernels import Fp8LoRAFunction

    x, codes, scale, a, b, gy = problem(M=9, K=32, N=20, r=4, dtype=torch.float32, seed=13)
    xr = x.clone().requires_grad_()
    y = Fp8LoRAFunction.apply(xr, None, None, codes, scale, None, 0.0, "reference")
    assert torch.equal(y, w8a16_lora(x, codes, scale, backend="reference"))
    y.backward(gy)
    want = gy.double() @ (codes.double() * scale.double())
    assert ((xr.grad.double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_reads_the_saved_lora_intermediate(dtype):
    """The forward returns xa = bf16(x Aᵀ) with y (`return_xa`), the Function saves it, and the backward's dB reads it
    instead of recomputing it: the same gradients, bitwise, as the backward that recomputes xa."""
    x, codes, scale, a, b, gy = problem(M=13, K=40, N=24, r=4, dtype=torch.bfloat16, seed=15)
    y, xa = w8a16_lora(x, codes, scale, a, b, 0.5, backend="reference", return_xa=True)
    assert torch.equal(y, w8a16_lora(x, codes, scale, a, b, 0.5, backend="reference"))
    assert xa.dtype == torch.bfloat16 and xa.shape == (13, 4)
    assert w8a16_lora(x, codes, scale, backend="reference", return_xa=True)[1] is None
    layer = Fp8LoRALinear(codes, scale, a.to(dtype), b.to(dtype), lora_scale=0.5, backend="reference")
    xr = x.clone().requires_grad_()
    layer(xr).backward(gy)
    dx, da, db = lora_linear_backward_reference(gy, x, codes, scale, a.to(dtype), b.to(dtype), 0.5)
    assert torch.equal(xr.grad, dx)
    assert torch.equal(layer.lora_A.grad, da.to(dtype)) and torch.equal(layer.lora_B.grad, db.to(dtype))
