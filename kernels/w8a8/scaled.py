"""Row-major scaled GEMM with the LoRA epilogue, the split LoRA down-projection, and operand preparation.

`scaled_gemm_lora` computes `y[m, n] = act( (Σ_k x[m,k] w[n,k]) * s_w [* s_x[m]] + σ Σ_j xa[m,j] b[n,j] + bias[n] )`
for any strides of w: W8A8 on FP8 tensor cores (`max_num_imprecise_acc=32`), and bf16 operands (the FP8
trainer's backward took its rank-r g·B from here before the current kernels; cuBLAS now). Batch invariance: one pinned
config for every M, compiled once for every M (`do_not_specialize`), an explicit FMA for σ·LoRA + y, and
`lora_down_split` sums 16 K chunks fixed by K alone in a fixed order.
Importing needs triton but no GPU; kernels compile on first launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._dispatch import check_reduction, interpreting
from .._tiles import _grouped_tile_ids, _load_tile
from ..w8a16.widen import widen_e4m3

# Pinned config of `scaled_gemm_lora` (W8A8 batch invariance): BM 64 keeps Hopper on wgmma for every M;
# BN 64 gives >= 64 programs for the 4096-wide Qwen projections at 1 token, BK 128 halves loop trips.
FWD_CONFIG = dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4)
LORA_SPLITS = 16  # K chunks of the LoRA down-projection (fixed per K: batch invariant)


@triton.jit(do_not_specialize=["M"])
def _scaled_gemm_lora_kernel(
    x_ptr, w_ptr, y_ptr, w_scale_ptr, x_scale_ptr, xa_ptr, b_ptr, bias_ptr,
    M, N, K, R, lora_scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    stride_xam, stride_xar, stride_bn, stride_br,
    HAS_W_SCALE: tl.constexpr, HAS_X_SCALE: tl.constexpr, HAS_LORA: tl.constexpr,
    HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, EVEN_M: tl.constexpr = False,
):
    # grouped program order: GROUP_M row-tiles share each column tile while it is hot in L2
    pid_m, pid_n = _grouped_tile_ids(tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mask_m = rm < M
    mask_n = rn < N
    # the K loop's loads without predicates where the shape allows (as `weight_stationary._ws_chunk`: EVEN_M /
    # EVEN_N / EVEN_K, no row of x / column of w / column of K past the edge); same bits
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk
    w_ptrs = w_ptr + rk[:, None].to(tl.int64) * stride_wk + rn[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    tl.assume(K > 0)  # (a non-empty loop: see `_ws_chunk`; without it ptxas serializes every wgmma, C7515)
    for k0 in range(0, K, BK):
        mask_k = (k0 + rk) < K
        x = _load_tile(x_ptrs, mask_m, mask_k, EVEN_M, EVEN_K)
        w = _load_tile(w_ptrs, mask_k, mask_n, EVEN_K, EVEN_N)
        if DOT_F32:  # Triton's CPU interpreter mis-computes bf16 dots; widen (tests only)
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32))
        elif FP8_DOT:
            # promote every wgmma k-step (32 for e4m3) into the fp32 accumulator: precise accumulation
            acc = tl.dot(x, w, acc, max_num_imprecise_acc=32)
        else:
            acc = tl.dot(x, widen_e4m3(w), acc)  # e4m3 -> bf16 is exact (widen.py)
        x_ptrs += BK * stride_xk
        w_ptrs += BK * stride_wk

    if HAS_W_SCALE:
        acc = acc * tl.load(w_scale_ptr)
    if HAS_X_SCALE:
        acc = acc * tl.load(x_scale_ptr + rm, mask=mask_m, other=0.0)[:, None]
    if HAS_LORA:
        rr = tl.arange(0, BR)
        mask_r = rr < R
        xa = tl.load(xa_ptr + rm[:, None].to(tl.int64) * stride_xam + rr[None, :] * stride_xar,
                     mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptr + rr[:, None] * stride_br + rn[None, :].to(tl.int64) * stride_bn,
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        if DOT_F32:
            lora = tl.dot(xa.to(tl.float32), b.to(tl.float32))
        else:
            lora = tl.dot(xa, b)
        acc = tl.fma(lora, lora_scale, acc)  # explicit FMA: no compiler-dependent contraction
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def scaled_gemm_lora(x, w, out_dtype=torch.bfloat16, w_scale=None, x_scale=None, xa=None, lora_b=None,
                     lora_scale=1.0, bias=None, config=None, out=None):
    """y `[M, N]` = (x `[M, K]` · w `[N, K]`ᵀ) * w_scale * x_scale + σ xa · lora_bᵀ + bias (any w strides)."""
    M, K = x.shape
    N = w.shape[0]
    check_reduction(K)
    cfg = dict(FWD_CONFIG if config is None else config)
    y = torch.empty(M, N, device=x.device, dtype=out_dtype) if out is None else out
    if M == 0 or N == 0:
        return y
    R = 0 if xa is None else xa.shape[1]
    BR = max(16, next_power_of_2(R)) if R else 16
    dummy = y  # never dereferenced when the matching HAS_* flag is off
    grid = (cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]),)
    _scaled_gemm_lora_kernel[grid](
        x, w, y, w_scale if w_scale is not None else dummy, x_scale if x_scale is not None else dummy,
        xa if xa is not None else dummy, lora_b if lora_b is not None else dummy,
        bias if bias is not None else dummy,
        M, N, K, R, float(lora_scale),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        xa.stride(0) if R else 0, xa.stride(1) if R else 0,
        lora_b.stride(0) if R else 0, lora_b.stride(1) if R else 0,
        HAS_W_SCALE=w_scale is not None, HAS_X_SCALE=x_scale is not None, HAS_LORA=R > 0,
        HAS_BIAS=bias is not None, FP8_DOT=(x.dtype == torch.float8_e4m3fn), DOT_F32=interpreting(),
        BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], BR=BR, GROUP_M=cfg.get("GROUP_M", 8),
        EVEN_K=K % cfg["BK"] == 0, EVEN_N=N % cfg["BN"] == 0, EVEN_M=M % cfg["BM"] == 0, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


@triton.jit(do_not_specialize=["M"])
def _lora_down_partial_kernel(
    x_ptr, a_ptr, part_ptr, M, K, R, K_CHUNK,
    stride_xm, stride_xk, stride_ar, stride_ak,
    DOT_F32: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
):
    # program (m-tile, split): partial[split, m, :] = x[m, chunk] · A[:, chunk]ᵀ in fp32
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rr = tl.arange(0, BR)
    rk = tl.arange(0, BK)
    mask_m = rm < M
    mask_r = rr < R
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    k_lo = split * K_CHUNK
    tl.assume(K_CHUNK > 0)  # (a non-empty loop: see `_ws_chunk`; without it ptxas serializes every wgmma, C7515)
    for k0 in range(k_lo, k_lo + K_CHUNK, BK):
        mask_k = ((k0 + rk) < K) & ((k0 + rk) < k_lo + K_CHUNK)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptr + rr[None, :] * stride_ar + (k0 + rk)[:, None] * stride_ak,
                    mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
        else:
            acc = tl.dot(x, a, acc)
    out = part_ptr + (split * M + rm[:, None].to(tl.int64)) * BR + rr[None, :]
    tl.store(out, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(part_ptr, out_ptr, M, R, SPLITS: tl.constexpr, BR: tl.constexpr, BM: tl.constexpr):
    # fixed summation order split 0, 1, ..., SPLITS-1 (same for every M), then round to out dtype
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rr = tl.arange(0, BR)
    mask = (rm[:, None] < M) & (rr[None, :] < R)
    offs = rm[:, None].to(tl.int64) * BR + rr[None, :]
    total = tl.zeros((BM, BR), dtype=tl.float32)
    for s in range(SPLITS):
        total += tl.load(part_ptr + s * M * BR + offs, mask=mask, other=0.0)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * R + rr[None, :], total.to(out_ptr.dtype.element_ty),
             mask=mask)


def lora_down_split(x, lora_a, splits: int = LORA_SPLITS):
    """xa `[M, r]` = act(x · Aᵀ), batch invariant: K split into `splits` chunks fixed by K alone."""
    M, K = x.shape
    check_reduction(K)
    R = lora_a.shape[0]
    BR = max(16, next_power_of_2(R))
    BK = 64
    k_chunk = cdiv(cdiv(K, splits), BK) * BK
    n_split = cdiv(K, k_chunk)
    part = torch.empty(n_split, M, BR, device=x.device, dtype=torch.float32)
    out = torch.empty(M, R, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    BM = 64
    _lora_down_partial_kernel[(cdiv(M, BM), n_split)](
        x, lora_a, part, M, K, R, k_chunk, x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1),
        DOT_F32=interpreting(), BM=BM, BR=BR, BK=BK, num_warps=4, num_stages=3)
    _sum_splits_kernel[(cdiv(M, 32),)](part, out, M, R, SPLITS=n_split, BR=BR, BM=32, num_warps=4)
    return out

