"""Parts shared by the W8A16 GEMM kernels (weight-stationary, its one-launch split-K and its TMA twin): the output
tile in grouped order, one chunk's K loop, partials summed in chunk order, and the epilogue in the reference's op
order on a [weight rows, tokens] tile."""

from __future__ import annotations

import triton
import triton.language as tl

from .._tiles import _grouped_tile_ids_of, _load_tile, _sum_parts
from .widen import widen_e4m3

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
    return _sum_parts(xa_part_ptr, M * R, offs, mask, N_CHUNKS, BR, BM, False).to(tl.bfloat16)


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


@triton.jit
def _ws_chunk(w_ptr, x_ptr, rn, rm, n_rows, m_rows, k_lo, k_hi, K, stride_wn, stride_wk, stride_xm, stride_xk,
              BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
              EVEN_N: tl.constexpr, EVEN_M: tl.constexpr):
    """fp32 [BN, BM] = w[rn, k_lo:k_hi] · x[rm, k_lo:k_hi]ᵀ, accumulated from zero in k order.

    Loads carry no predicates where the shape allows: EVEN_K, the chunk lies inside K (`even_k`); EVEN_N, n_rows is
    a multiple of BN; EVEN_M, m_rows a multiple of BM (no token column past the edge). Otherwise the edge loads as
    zeros (masked). Same k-steps in the same order in every case: the same bits. Without the masks the loop issues
    8 % (decode tile) to 23 % (dX training tile) fewer instructions per trip (`scripts/sass_report.py`). Token
    columns past M are masked, not clamped to the last token: clamped, a decode call (1-15 tokens in a 16-token tile)
    read its one token's row once per column, which cost gate_up 45.6 -> 56.0 µs at one token on the H200."""
    rk = tl.arange(0, BK)
    # Every caller passes a non-empty chunk. Said to the compiler: without it the loop's zero-trip path defines the
    # accumulator outside a wgmma, and ptxas then serializes every wgmma of the kernel (C7515: each waits for the
    # one before), which stalls the tensor core on the e4m3 -> bf16 widening of the next k-step. Same wgmmas in
    # the same order on the same accumulator: the same bits. Not for tiles of 128 x 256 and up, whose accumulator
    # alone takes half of a thread's 255 registers: there wgmmas kept in flight spill inside the K loop and
    # ptxas serializes them anyway (C7512); `scripts/sass_report.py --wgmma` shows both, per table config.
    if BN * BM < 128 * 256:
        tl.assume(k_hi > k_lo)
    in_n = rn < n_rows
    in_m = rm < m_rows
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :].to(tl.int64) * stride_wk
    x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + (k_lo + rk)[:, None] * stride_xk
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        in_k = (k0 + rk) < K
        w = _load_tile(w_ptrs, in_n, in_k, EVEN_N, EVEN_K)
        x_t = _load_tile(x_ptrs, in_k, in_m, EVEN_K, EVEN_M)
        if DOT_F32:  # Triton's CPU interpreter mis-computes bf16 dots; widen (tests only)
            acc += tl.dot(w.to(tl.float32), x_t.to(tl.float32))
        else:
            acc = tl.dot(widen_e4m3(w), x_t, acc)  # e4m3 -> bf16 is exact (widen.py)
        w_ptrs += BK * stride_wk
        x_ptrs += BK * stride_xk
    return acc
