"""The e4m3 → bf16 widening of the W8A16 kernels (kernels/w8a16/widen.py): the bit recipe on CPU, the PTX on the GPU,
and whole GEMMs with it against the same GEMMs with Triton's conversion instructions, bitwise."""


import pytest
import torch

from epirl.kernels.w8a16.widen import widen_e4m3_reference

ALL_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
NAN_CODES = (0x7F, 0xFF)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_recipe_widens_every_finite_code_exactly():
    """Every finite code (zeros of both signs, the 14 subnormals, ±448) to torch's own bf16, bit for bit; the two NaN
    codes, which FP8 quantization never writes, to ±480 (documented)."""
    got, want = widen_e4m3_reference(ALL_CODES), ALL_CODES.to(torch.bfloat16)
    finite = ~want.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(_bits(got)[finite], _bits(want)[finite])
    assert got[~finite].tolist() == [480.0, -480.0]


def test_quantized_weights_hold_no_nan_code():
    """The widening's one exception never reaches it: weight quantization saturates (codes 0x7e / 0xfe at most)."""
    from epirl.kernels import quantize_weight_fp8
    w = torch.randn(64, 256) * 0.02
    w[0, :3] = torch.tensor([1e6, -1e6, float("inf")])
    codes, _ = quantize_weight_fp8(w, backend="reference")
    raw = codes.view(torch.uint8)
    assert not any(bool((raw == c).any()) for c in NAN_CODES)


@pytest.mark.parametrize("layout", ["nk", "kn_view"])
def test_linear_refuses_nan_codes_with_one_line(layout, monkeypatch):
    """Codes from elsewhere that hold a NaN are refused when the trainer's layer is built (row-major codes, and the
    engine's [K, N] view transposed back), before any kernel could widen them to ±480; the check reads in blocks
    (here 64 codes: the NaN sits in the last one)."""
    from epirl.kernels import Fp8LoRALinear, quantize_weight_fp8
    from epirl.kernels.fp8_quant import reference
    monkeypatch.setattr(reference, "CHECK_BLOCK", 64)
    codes, scale = quantize_weight_fp8(torch.randn(48, 40) * 0.02, backend="reference")
    Fp8LoRALinear.from_codes(codes, scale, rank=4, alpha=8)  # finite codes: accepted
    raw = codes.view(torch.uint8).clone()
    raw[47, 39] = 0xFF
    bad = raw.view(torch.float8_e4m3fn)
    if layout == "kn_view":
        bad = bad.t().contiguous().t()  # [48, 40] over a [40, 48] row-major buffer
    with pytest.raises(ValueError, match=r"codes \(48, 40\): holds NaN e4m3 codes"):
        Fp8LoRALinear.from_codes(bad, scale, rank=4, alpha=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(16, 16), (64, 128), (128, 64)])
def test_ptx_widening_is_the_conversion_bitwise_on_the_gpu(shape):
    import triton
    import triton.language as tl

    from epirl.kernels.w8a16.widen import widen_e4m3

    @triton.jit
    def widen_kernel(c_ptr, y_ptr, R: tl.constexpr, C: tl.constexpr):
        offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
        tl.store(y_ptr + offs, widen_e4m3(tl.load(c_ptr + offs)))

    R, C = shape
    codes = ALL_CODES.repeat(R * C // 256 + 1)[: R * C].reshape(R, C)
    codes = codes.view(torch.uint8)[torch.randperm(R)].view(torch.float8_e4m3fn).cuda()  # mixed rows
    y = torch.full((R, C), float("nan"), device="cuda", dtype=torch.bfloat16)
    widen_kernel[(1,)](codes, y, R, C)
    want = codes.to(torch.bfloat16)
    finite = ~want.isnan()
    assert torch.equal(_bits(y)[finite], _bits(want)[finite])
