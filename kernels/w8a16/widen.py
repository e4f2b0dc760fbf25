"""The e4m3 → bf16 widening of the W8A16 kernels, in integer and bf16-FMA instructions instead of conversions.

Why: Triton lowers `codes.to(tl.bfloat16)` on Hopper to `cvt.rn.f16x2.e4m3x2` + one `cvt.bf16.f16` per element
(SASS F2FP + F2F), and float-to-float conversions issue at 16 per clock per SM on sm_90 (a quarter of the
integer rate; CUDA programming guide, throughput table). At 1.5 conversions per weight that caps a weight stream
at ~2.8 T codes/s on an H200, under its 4.4 TB/s of HBM: the decode kernels could not reach their memory floor,
and in the training tiles the conversions compete with the wgmmas' issue slots.

How (exact, for every finite code): a code `s eeee mmm` (bias 7) placed as bf16 bits `s 0000eeee mmm0000`
is the bf16 number value × 2⁻¹²⁰ (bias 127: normals keep their exponent field; subnormals `e = 0` become bf16
subnormals with the same 2⁻¹²⁰ ratio), and one bf16 FMA by 2¹²⁰ (+ -0.0, which keeps the sign of zero) brings it
back exactly: a power of two, the result a normal bf16 in [2⁻⁹, 448]. Per 2 codes (one 16-bit shared-memory load,
one bf16x2 register of wgmma's A operand): PRMT (sign-replicating byte spread into 16-bit lanes), SHL, AND,
FMA.bf16x2 - all on full-rate pipes, no conversion instruction (`scripts/sass_report.py` counts them per K loop).
The two e4m3fn NaN codes (0x7f, 0xff) would widen to ±480 instead of NaN; FP8 quantization saturates at ±448
(`fp8_quant`: codes 0x7e / 0xfe at most), so no weight epirl quantizes or maps from vLLM holds them, and
the trainer's FP8 layers refuse codes that do (`fp8_quant.reference.check_weight_codes`).

`widen_e4m3_reference` is the same bit recipe in torch, so CPU tests pin it against torch's own widening on all 254
finite codes; the GPU tests (tests/kernels/test_widen.py) hold the PTX to the conversion bitwise, per code and per GEMM.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import wgmma_drain
from .wgmma_drain import DRAIN as WGMMA_DRAIN

# Triton's CPU interpreter runs no PTX: there every caller takes `.to` (scripts that launch with DOT_F32=False too)
PTX_WIDEN = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

# Register recipe for 2 codes b0, b1 (byte i = element i): lanes [int16(b1), int16(b0)] (PRMT selector nibble 8 | i
# replicates byte i's sign bit), << 4 puts the 7 magnitude bits at bf16 bits 4..10 and a sign copy at 11..15, & 0x87f0
# keeps bits 4..10 and 15 (and drops what the shift carried into the other lane), then × 2^120 (bf16 0x7b80) + -0.0.
_WIDEN_ASM = tl.constexpr("""{
.reg .b32 v, two120, nzero;
mov.b32 two120, 0x7B807B80;
mov.b32 nzero, 0x80008000;
prmt.b32 v, $1, 0, 0x9180;
shl.b32 v, v, 4;
and.b32 v, v, 0x87F087F0;
fma.rn.bf16x2 $0, v, two120, nzero;
}""")

if os.environ.get("TRITON_INTERPRET", "0") != "1":
    wgmma_drain.install()  # the register-A race fix for the kernels that call widen_e4m3 (Triton < 3.9)


@triton.jit
def widen_e4m3(w):
    """bf16 of an e4m3 tile (any layout), bitwise `w.to(tl.bfloat16)` for every finite code. Other dtypes (a bf16
    LoRA A in the weight operand's place) and Triton's CPU interpreter (it runs no PTX) take `.to(tl.bfloat16)`."""
    if WGMMA_DRAIN:  # no code: naming the flag puts wgmma_drain's PTX pass into every caller's Triton cache key
        pass
    if (w.dtype == tl.float8e4nv) and PTX_WIDEN:
        # pack=2: the two codes of one 16-bit shared-memory load in, one bf16x2 wgmma A register out (pack=4 made
        # Triton add ~3 byte moves per code to gather and scatter the packs)
        return tl.inline_asm_elementwise(_WIDEN_ASM, "=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return w.to(tl.bfloat16)


def widen_e4m3_reference(codes: torch.Tensor) -> torch.Tensor:
    """The bit recipe of `widen_e4m3` in torch (per element): what the kernel's instructions compute."""
    b = codes.view(torch.uint8).to(torch.int32)
    lane = torch.where(b >= 128, b - 256, b) & 0xFFFF  # int16(int8(b)): PRMT's sign-replicated byte
    bits = ((lane << 4) & 0x87F0).to(torch.int16)      # SHL 4, AND
    scaled = bits.view(torch.bfloat16).float() * 2.0 ** 120  # FMA by 2^120 (+ -0.0): exact, see the module text
    return scaled.to(torch.bfloat16)
