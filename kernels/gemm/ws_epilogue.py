"""Parts shared by the W8A16 GEMM kernels (weight-stationary and its TMA twin): the output tile in
grouped order, the LoRA intermediate summed in chunk order, and the epilogue in the reference's op order on a
[weight rows, tokens] tile."""

from __future__ import annotations

import triton
import triton.language as tl

from .scaled import _grouped_tile_ids_of

# Partials (split-K chunks, LoRA-down sub-chunks) loaded at once when summed: the sum is a chain of dependent adds,
# but the loads need not be; with one load per add, every partial paid a full L2 round trip in turn (decode).
PART_UNROLL = tl.constexpr(4)


@triton.jit
def _ws_tile(N, M, BN: tl.constexpr, BM: tl.constexpr, GROUP_N: tl.constexpr):
    """This program's output tile in grouped order: weight rows rn, token columns rm and their masks."""
    return _ws_tile_of(tl.program_id(0), N, M, BN, BM, GROUP_N)


@triton.jit
def _ws_tile_of(pid, N, M, BN: tl.constexpr, BM: tl.constexpr, GROUP_N: tl.constexpr):
    """`_ws_tile` for tile number pid."""
    pid_n, pid_m = _grouped_tile_ids_of(pid, tl.cdiv(N, BN), tl.cdiv(M, BM), GROUP_N)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    return rn, rm, rn < N, rm < M


@triton.jit
def _sum_parts(ptr, part_stride, offs, mask, n_parts, BA: tl.constexpr, BB: tl.constexpr):
    """fp32 [BA, BB]: partials ptr[c * part_stride + offs] for c < n_parts added in c order from +0.0, PART_UNROLL
    loads in flight. A partial past the last adds +0.0, which leaves every sum unchanged (a sum started at +0.0 is
    never -0.0): the same bits as one add per partial."""
    total = tl.zeros((BA, BB), dtype=tl.float32)
    for c0 in range(0, n_parts, PART_UNROLL):
        for j in tl.static_range(PART_UNROLL):
            in_parts = (offs * 0 + c0 + j) < n_parts  # a tensor (the interpreter masks by tensors)
            total += tl.load(ptr + offs + (c0 + j) * part_stride, mask=mask & in_parts, other=0.0)
    return total


@triton.jit
def _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, HAS_LORA: tl.constexpr, BN: tl.constexpr,
                 BR: tl.constexpr):
    """The tile's rows of B `[BN, BR]` bf16 (zeros without LoRA): loaded apart from the epilogue so that a PDL
    dependent can fetch it before it waits for its primary."""
    rr = tl.arange(0, BR)
    if HAS_LORA:
        b = tl.load(b_ptr + rn[:, None].to(tl.int64) * stride_bn + rr[None, :] * stride_br,
                    mask=mask_n[:, None] & (rr < R)[None, :], other=0.0)
    else:
        b = tl.zeros((BN, BR), dtype=tl.bfloat16)
    return b


@triton.jit
def _ws_epilogue(total, xa_t, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, bias_ptr, lora_scale,
                 stride_ym, stride_yn, HAS_W_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_F32: tl.constexpr):
    # total: yᵀ tile [BN, BM]; xa_t: bf16 [BR, BM]; b: `_lora_b_tile`. Op order of reference.py: scale, + σ·LoRA,
    # + bias, round
    if HAS_W_SCALE:
        total = total * tl.load(w_scale_ptr)
    if HAS_LORA:
        if DOT_F32:
            lora = tl.dot(b.to(tl.float32), xa_t.to(tl.float32))
        else:
            lora = tl.dot(b, xa_t)
        total = tl.fma(lora, lora_scale, total)  # explicit FMA: no compiler-dependent contraction
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + rm[None, :].to(tl.int64) * stride_ym + rn[:, None].to(tl.int64) * stride_yn
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def _xa_from_parts(xa_part_ptr, rm, mask_m, M, R, N_CHUNKS, BR: tl.constexpr, BM: tl.constexpr):
    """bf16 xa tile [BR, BM]: the chunk partials of the down-projection added in chunk order, then rounded."""
    rr = tl.arange(0, BR)
    mask = (rr < R)[:, None] & mask_m[None, :]
    offs = rm[None, :].to(tl.int64) * R + rr[:, None]
    return _sum_parts(xa_part_ptr, M * R, offs, mask, N_CHUNKS, BR, BM).to(tl.bfloat16)


@triton.jit
def _load_xa(xa_part_ptr, xa_ptr, rm, mask_m, M, R, N_CHUNKS, stride_xam, stride_xar,
             HAS_LORA: tl.constexpr, XA_PARTS: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr):
    if HAS_LORA:
        if XA_PARTS:
            xa_t = _xa_from_parts(xa_part_ptr, rm, mask_m, M, R, N_CHUNKS, BR, BM)
        else:
            rr = tl.arange(0, BR)
            xa_t = tl.load(xa_ptr + rm[None, :].to(tl.int64) * stride_xam + rr[:, None] * stride_xar,
                           mask=(rr < R)[:, None] & mask_m[None, :], other=0.0)
    else:
        xa_t = tl.zeros((BR, BM), dtype=tl.bfloat16)
    return xa_t
