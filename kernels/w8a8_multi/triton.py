"""Triton multi-adapter W8A8 GEMM (Hopper): K1 = quantize + LoRA shrink, K2 = FP8 x FP8 GEMM with a multi-adapter
epilogue.

K1 `quant_shrink`: program (token, K chunk) computes the token's amax over its row, writes the chunk's e4m3 codes
  (and, chunk 0, the scale) with the same ops as fp8_quant.triton (`div_rn`, saturating RNE: bit-exact with
  vLLM), and the fp32 shrink partial x_t[chunk] · A_l[:, chunk]ᵀ of the token's adapter l (none for -1). The
  chunks are fixed by K alone (`SHRINK_CHUNK`); K2 adds them in chunk order, so h = bf16(Σ partials) never
  depends on the batch.
K2 `multi_lora_gemm`: weight-stationary, yᵀ[n, t] = Σ_k codes[n, k] q_x[t, k] on FP8 wgmma (the code tile is the
  A operand, tokens the N dimension, so a 1-token call does 16 columns of work, not 64), tokens taken in adapter
  order through `order` (rows written back in token order). Epilogue: (acc · s_w) · s_x, then for each adapter
  l present in the tile, fma(σ_l, B_l[tile rows] · h, y) on its columns only - every output element depends
  only on its own token, so a mixed batch equals each group alone, bitwise.
Decode (≤ DECODE_MAX_TOKENS tokens) with PDL: K1 signals `gdc_launch_dependents` at once, K2 (launched
  `launch_pdl`) is scheduled while K1 runs and calls `gdc_wait` before its first read of K1's output, which
  hides K2's launch and prologue behind K1.
Prefill: fp8_quant.triton quantizes all tokens in one kernel, `grouped_shrink` computes the shrink on tensor cores
  over tiles of tokens in adapter order (one dot per adapter in a tile, same K chunking as K1), `sum_chunks` adds
  its chunk partials once (in K2's order: same bits), K2 uses a 128-token tile. `expand_into` (after a vendor
  GEMM) shrinks the same way above DECODE_MAX_TOKENS tokens.
(A variant that quantized x inside every K2 program was measured slower: every weight tile
re-quantizes the activations, and IEEE division of the zero-padded token columns takes a slow path.)
Importing needs triton, no GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._dispatch import check_reduction, interpreting, pdl_supported  # noqa: F401  (pdl_supported: re-export)
from .._tiles import _grouped_tile_ids, _load_tile, _sum_parts
from ..fp8_quant.reference import FP8_DTYPE, FP8_MAX, MIN_SCALE
from ..fp8_quant.triton import _abs_nan_to_zero, _saturating_e4m3, quantize_per_token
from .reference import check_args

DECODE_MAX_TOKENS = 32
DECODE_CONFIG = dict(BN=64, BT=16, BK=256, num_warps=4, num_stages=4)
PREFILL_CONFIG = dict(BN=128, BT=128, BK=128, num_warps=8, num_stages=3)
# K2 token tiles the engine's timed dispatch also tries above DECODE_MAX_TOKENS ("fused[<tag>]"): a narrower tile
# holds fewer adapters of a many-tenant batch (the epilogue does one full-tile dot per adapter present) at the cost
# of more passes over the weights; which wins depends on the batch's mix, so the dispatch measures it
PREFILL_VARIANTS = {"bt64": dict(BN=128, BT=64, BK=128, num_warps=4, num_stages=4),
                    "bt32": dict(BN=128, BT=32, BK=128, num_warps=4, num_stages=4)}
SHRINK_CHUNK = 512   # K chunk of one K1 program (the chunking is fixed by K: batch invariant)
SHRINK_BK = 128
QUANT_BK = 1024      # K1's amax pass
GROUPED_SHRINK_CONFIG = dict(BT=64, BK=64, num_warps=4, num_stages=3)  # above DECODE_MAX_TOKENS tokens
PATHS = ("pdl", "decode", "prefill")


@triton.jit(do_not_specialize=["M"])
def _quant_shrink_kernel(x_ptr, q_ptr, s_ptr, a_tab, ids_ptr, part_ptr, M, K, R, K_CHUNK, N_CHUNKS,
                         stride_xm, stride_qm, stride_al, stride_ar, stride_ak,
                         QUANT: tl.constexpr, HAS_LORA: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
                         FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                         QBK: tl.constexpr):
    # program (token m, K chunk, slice): codes and (chunk 0) scale of the chunk (slice 0 only), and the shrink
    # partial of the chunk with the slice's A (a_tab holds each slice's A base address).
    # Few trips per loop, each moving a lot: the LoRA cost measured on the H200 grew with the
    # trips of this loop (~1.4 µs each: every trip waits for its loads), so chunks are 512 wide in 128-wide steps
    # (4 trips) and large K is spread over more programs instead of longer loops.
    if LAUNCH_DEPENDENTS:  # let K2 launch now: it reads nothing of ours before its gdc_wait
        tl.extra.cuda.gdc_launch_dependents()
    m = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    slice_id = tl.program_id(2)
    rk = tl.arange(0, BK)
    k_lo = split * K_CHUNK
    x_row = x_ptr + m * stride_xm
    if QUANT:  # slice 0's programs: the token's amax over the whole row (fmaxf chain, NaN ignored), then codes
        if slice_id == 0:
            rq = tl.arange(0, QBK)
            amax = tl.zeros((QBK,), dtype=tl.float32)
            for k0 in range(0, K, QBK):
                amax = tl.maximum(amax, _abs_nan_to_zero(tl.load(x_row + k0 + rq, mask=(k0 + rq) < K,
                                                                  other=0.0).to(tl.float32)))
            scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
            if split == 0:
                tl.store(s_ptr + m, scale)
            for k0 in range(k_lo, k_lo + K_CHUNK, BK):
                mask_k = (k0 + rk) < K
                xv = tl.load(x_row + k0 + rk, mask=mask_k, other=0.0).to(tl.float32)
                q = _saturating_e4m3(tl.div_rn(xv, scale), FP8_MAX)
                tl.store(q_ptr + m * stride_qm + k0 + rk, q, mask=mask_k)
    if HAS_LORA:
        adapter = tl.load(ids_ptr + m).to(tl.int64)
        if adapter >= 0:
            rr = tl.arange(0, BR)
            mask_r = rr < R
            a_ptr = tl.load(a_tab + slice_id).to(tl.pointer_type(tl.bfloat16))
            a_rows = a_ptr + adapter * stride_al + rr[:, None] * stride_ar
            acc = tl.zeros((BR, BK), dtype=tl.float32)  # bf16 x bf16 products are exact in fp32
            for k0 in range(k_lo, k_lo + K_CHUNK, BK):
                mask_k = (k0 + rk) < K
                xv = tl.load(x_row + k0 + rk, mask=mask_k, other=0.0).to(tl.float32)
                a = tl.load(a_rows + (k0 + rk)[None, :] * stride_ak, mask=mask_r[:, None] & mask_k[None, :],
                            other=0.0).to(tl.float32)
                acc += a * xv[None, :]
            tl.store(part_ptr + ((slice_id * N_CHUNKS + split) * M + m) * BR + rr, tl.sum(acc, axis=1), mask=mask_r)


@triton.jit
def _shrink_chunk(a_rows, x_cols, k_lo, K_CHUNK, K, mask_r, mask_t, stride_ak, DOT_F32: tl.constexpr,
                  BR: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    # fp32 [r, tokens] partial of one K chunk: A rows of one adapter times the tile's x columns, in BK steps
    # (a token's column comes from its own x row and the adapter's A: an MMA output element never mixes columns)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BR, BT), dtype=tl.float32)
    tl.assume(K_CHUNK > 0)  # (a non-empty loop: see `_ws_chunk`; without it ptxas serializes every wgmma, C7515)
    for k0 in range(k_lo, k_lo + K_CHUNK, BK):
        mask_k = (k0 + rk) < K
        a = tl.load(a_rows + (k0 + rk)[None, :] * stride_ak, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        xv = tl.load(x_cols + (k0 + rk)[:, None], mask=mask_k[:, None] & mask_t[None, :], other=0.0)
        if DOT_F32:  # Triton's CPU interpreter: fp32 dots (tests only)
            acc += tl.dot(a.to(tl.float32), xv.to(tl.float32))
        else:  # bf16 x bf16 products are exact; the tensor core accumulates them in fp32
            acc = tl.dot(a, xv, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _grouped_shrink_kernel(x_ptr, a_tab, ids_ptr, order_ptr, part_ptr, M, K, R, K_CHUNK, N_CHUNKS, stride_xm,
                           stride_al, stride_ar, stride_ak, HAS_ORDER: tl.constexpr, DOT_F32: tl.constexpr,
                           BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    # program (token tile in adapter order, K chunk, slice): the shrink partials of the tile's tokens on tensor
    # cores, one [r, chunk] x [chunk, BT] dot per adapter present in the tile (A as the left operand, tokens as
    # the MMA's N: the orientation of K2), stored for that adapter's tokens only. A token's partial comes from
    # its own x row and its adapter's A (an MMA output element never mixes columns), in K steps of BK inside the
    # fixed chunk: the same bits whichever tokens share the tile.
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    slice_id = tl.program_id(2)
    rt = pid_t * BT + tl.arange(0, BT)
    mask_t = rt < M
    if HAS_ORDER:
        tok = tl.load(order_ptr + rt, mask=mask_t, other=0).to(tl.int64)
    else:
        tok = rt.to(tl.int64)
    ids = tl.load(ids_ptr + tok, mask=mask_t, other=-1).to(tl.int32)
    rr = tl.arange(0, BR)
    mask_r = rr < R
    k_lo = split * K_CHUNK
    a_ptr = tl.load(a_tab + slice_id).to(tl.pointer_type(tl.bfloat16))
    x_cols = x_ptr + tok[None, :] * stride_xm  # x as [k, token]
    out = part_ptr + ((slice_id * N_CHUNKS + split) * M + tok[None, :]) * BR + rr[:, None]
    big = 2147483647
    cur = tl.min(tl.where(ids >= 0, ids, big), axis=0)
    last = tl.max(ids, axis=0)
    while cur <= last:
        a_rows = a_ptr + cur.to(tl.int64) * stride_al + rr[:, None] * stride_ar
        acc = _shrink_chunk(a_rows, x_cols, k_lo, K_CHUNK, K, mask_r, mask_t, stride_ak, DOT_F32, BR, BT, BK)
        tl.store(out, acc, mask=mask_r[:, None] & (ids == cur)[None, :])
        cur = tl.min(tl.where(ids > cur, ids, big), axis=0)


@triton.jit(do_not_specialize=["M"])
def _sum_chunks_kernel(part_ptr, out_ptr, M, N_CHUNKS, BR: tl.constexpr, BLOCK: tl.constexpr):
    # out[slice, 0, m, r] = sum over c of part[slice, c, m, r], added in chunk order starting from zero: the very
    # sum K2's epilogue forms, so K2 reading it as one chunk (0 + h = h) gives the same bits, and its tiles stop
    # re-reading every chunk's partials (K2 loads them once per weight tile: N / BN times)
    pid = tl.program_id(0)
    sl = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * BR
    h = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, N_CHUNKS):
        h += tl.load(part_ptr + (sl * N_CHUNKS + c) * M * BR + offs, mask=mask, other=0.0)
    tl.store(out_ptr + sl * M * BR + offs, h, mask=mask)


@triton.jit
def _slice_lora(acc, rn, rows, ids, h, b_ptr, stride_bl, stride_bn, sigma_ptr, sigma_const, R,
                SIGMA_PER_ADAPTER: tl.constexpr, DOT_F32: tl.constexpr, BR: tl.constexpr):
    # one slice's rows of the tile (rn = row within the slice): for each adapter present, fma(σ_l, B_l h, y)
    rr = tl.arange(0, BR)
    big = 2147483647
    cur = tl.min(tl.where(ids >= 0, ids, big), axis=0)
    last = tl.max(ids, axis=0)
    while cur <= last:
        sel = ids == cur
        b = tl.load(b_ptr + cur.to(tl.int64) * stride_bl + rn[:, None].to(tl.int64) * stride_bn + rr[None, :],
                    mask=rows[:, None] & (rr < R)[None, :], other=0.0)
        h_sel = tl.where(sel[None, :], h, 0.0)
        if DOT_F32:
            lora = tl.dot(b.to(tl.float32), h_sel.to(tl.float32))
        else:
            lora = tl.dot(b, h_sel)
        if SIGMA_PER_ADAPTER:
            sigma = tl.load(sigma_ptr + cur)
        else:
            sigma = sigma_const
        # explicit FMA (no contraction choice), only on this adapter's columns and this slice's rows
        acc = tl.where(rows[:, None] & sel[None, :], tl.fma(lora, sigma, acc), acc)
        cur = tl.min(tl.where(ids > cur, ids, big), axis=0)
    return acc


@triton.jit
def _sum_chunk_partials(part_ptr, sl, N_CHUNKS, M, tok, rr, mask_rt, BR: tl.constexpr, BT: tl.constexpr):
    # h [r, tokens] fp32 of slice sl: its K chunks' partials added in chunk order from zero (h is the same for every
    # batch composition), several chunks' loads in flight (the W8A16 split-K reduce's `_sum_parts`)
    offs = (sl * N_CHUNKS * M + tok[None, :]) * BR + rr[:, None]
    return _sum_parts(part_ptr, M * BR, offs, mask_rt, N_CHUNKS, BR, BT, False)


@triton.jit
def _lora_epilogue(acc, rn, mask_n, tok, mask_t, ids, M, R, part_ptr, b_tab, bl_tab, starts_ptr, N_SLICES,
                   sigma_ptr, sigma_const, stride_bn, N_CHUNKS, SIGMA_PER_ADAPTER: tl.constexpr,
                   DOT_F32: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr):
    # ids: the adapter of each of the tile's tokens (int32, -1 = none)
    rr = tl.arange(0, BR)
    mask_rt = (rr < R)[:, None] & mask_t[None, :] & (ids >= 0)[None, :]
    tile_lo = tl.min(rn, axis=0)
    for sl in range(0, N_SLICES):  # the slices (q, k, v / gate, up) whose rows meet this tile
        lo = tl.load(starts_ptr + sl)
        hi = tl.load(starts_ptr + sl + 1)
        if (lo < tile_lo + BN) & (hi > tile_lo):
            h = _sum_chunk_partials(part_ptr, sl, N_CHUNKS, M, tok, rr, mask_rt, BR, BT)
            b_ptr = tl.load(b_tab + sl).to(tl.pointer_type(tl.bfloat16))
            rows = mask_n & (rn >= lo) & (rn < hi)
            acc = _slice_lora(acc, rn - lo, rows, ids, h.to(tl.bfloat16), b_ptr, tl.load(bl_tab + sl), stride_bn,
                              sigma_ptr, sigma_const, R, SIGMA_PER_ADAPTER, DOT_F32, BR)
    return acc


@triton.jit(do_not_specialize=["M"])
def _multi_lora_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, y_ptr, ws_ptr, order_ptr, ids_ptr, part_ptr, b_tab, bl_tab, starts_ptr, sigma_ptr,
    bias_ptr, M, N, K, R, N_CHUNKS, N_SLICES, sigma_const, stride_xm, stride_wn, stride_ym, stride_bn,
    HAS_BASE: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_LORA: tl.constexpr,
    SIGMA_PER_ADAPTER: tl.constexpr, HAS_BIAS: tl.constexpr, WAIT_PDL: tl.constexpr, DOT_F32: tl.constexpr,
    BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, EVEN_T: tl.constexpr = False,
):
    pid_n, pid_t = _grouped_tile_ids(tl.cdiv(N, BN), tl.cdiv(M, BT), GROUP_N)
    rn = pid_n * BN + tl.arange(0, BN)
    rt = pid_t * BT + tl.arange(0, BT)
    mask_n = rn < N
    mask_t = rt < M
    if HAS_ORDER:  # column j of the tile is token order[j] (tokens sorted by adapter)
        tok = tl.load(order_ptr + rt, mask=mask_t, other=0).to(tl.int64)
    else:
        tok = rt.to(tl.int64)
    y_ptrs = y_ptr + tok[None, :] * stride_ym + rn[:, None]
    mask_y = mask_n[:, None] & mask_t[None, :]
    if WAIT_PDL:  # the codes, scales and h come from K1, which may still be running (PDL)
        tl.extra.cuda.gdc_wait()
    if HAS_BASE:
        rk = tl.arange(0, BK)
        s_x = tl.load(xs_ptr + tok, mask=mask_t, other=1.0)
        acc = tl.zeros((BN, BT), dtype=tl.float32)
        tl.assume(K > 0)  # (a non-empty loop: see `_ws_chunk`; without it ptxas serializes every wgmma, C7515)
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        # no load predicates where the shape allows (`w8a16.weight_stationary._ws_chunk`): EVEN_T / EVEN_N / EVEN_K,
        # no token column / weight row / K column past the edge
        x_ptrs = x_ptr + tok[None, :] * stride_xm + rk[:, None]
        for k0 in range(0, K, BK):
            mask_k = (k0 + rk) < K
            w = _load_tile(w_ptrs + k0, mask_n, mask_k, EVEN_N, EVEN_K)
            q = _load_tile(x_ptrs + k0, mask_k, mask_t, EVEN_K, EVEN_T)
            if DOT_F32:  # Triton's CPU interpreter: fp32 dots (tests only)
                acc += tl.dot(w.to(tl.float32), q.to(tl.float32))
            else:  # promote every 32-deep wgmma step into the fp32 accumulator (precise accumulation)
                acc = tl.dot(w, q, acc, max_num_imprecise_acc=32)
        acc = (acc * tl.load(ws_ptr)) * s_x[None, :]  # vLLM's order: s_a * (s_b * acc)
    else:  # expand only: add the LoRA term to a vendor GEMM's output in place
        acc = tl.load(y_ptrs, mask=mask_y, other=0.0).to(tl.float32)
    if HAS_LORA:
        ids = tl.load(ids_ptr + tok, mask=mask_t, other=-1).to(tl.int32)
        acc = _lora_epilogue(acc, rn, mask_n, tok, mask_t, ids, M, R, part_ptr, b_tab, bl_tab, starts_ptr,
                             N_SLICES, sigma_ptr, sigma_const, stride_bn, N_CHUNKS, SIGMA_PER_ADAPTER, DOT_F32, BR,
                             BT, BN)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_y)


def shrink_chunking(K: int) -> tuple[int, int]:
    """(K_CHUNK, N_CHUNKS) of K1: a function of K only."""
    check_reduction(K)
    chunk = min(SHRINK_CHUNK, cdiv(K, SHRINK_BK) * SHRINK_BK)
    return chunk, cdiv(K, chunk)


class Slices:
    """A layer's adapter slices (q, k, v / gate, up, or one): per slice A `[L, r, K]` and B `[L, N_s, r]` bf16
    (vLLM's slot buffers are such views), and the device tables the kernels read: A / B base addresses, B's
    adapter stride per slice, and the slices' first output rows. Tables are cached by address and stride, so a
    layer's fixed buffers build them once (before CUDA-graph capture) and a freed-and-reused address still maps
    to the right table."""

    _cache: dict = {}

    def __init__(self, lora_a, lora_b, widths):
        if len(lora_a) != len(lora_b) or len(lora_a) != len(widths) or not widths:
            raise ValueError(f"{len(lora_a)} A, {len(lora_b)} B slices for widths {list(widths)}")
        a0 = lora_a[0]
        self.L, self.R, self.K = a0.shape
        for i, (a, b, w) in enumerate(zip(lora_a, lora_b, widths)):
            if a.shape != a0.shape or a.stride() != a0.stride() or a.stride(2) != 1:
                raise ValueError(f"lora_a slice {i}: {tuple(a.shape)} strides {a.stride()} differ from slice 0's "
                                 f"{tuple(a0.shape)} {a0.stride()} (or K is not contiguous)")
            if b.shape != (self.L, w, self.R) or b.stride(2) != 1 or b.stride(1) != lora_b[0].stride(1):
                raise ValueError(f"lora_b slice {i}: {tuple(b.shape)} strides {b.stride()}, want [L={self.L}, "
                                 f"{w}, r={self.R}] with r contiguous")
        self.a, self.b, self.widths = list(lora_a), list(lora_b), [int(w) for w in widths]
        self.stride_a = a0.stride()
        self.stride_bn = lora_b[0].stride(1)
        key = (a0.device, tuple(t.data_ptr() for t in lora_a), tuple(t.data_ptr() for t in lora_b),
               tuple(b.stride(0) for b in lora_b), tuple(self.widths))
        tables = self._cache.get(key)
        if tables is None:
            if len(self._cache) > 4096:
                self._cache.clear()
            starts = [0]
            for w in self.widths:
                starts.append(starts[-1] + w)
            dev = a0.device
            tables = self._cache[key] = (
                torch.tensor([t.data_ptr() for t in lora_a], dtype=torch.int64, device=dev),
                torch.tensor([t.data_ptr() for t in lora_b], dtype=torch.int64, device=dev),
                torch.tensor([b.stride(0) for b in lora_b], dtype=torch.int64, device=dev),
                torch.tensor(starts, dtype=torch.int32, device=dev))
        self.a_tab, self.b_tab, self.bl_tab, self.starts = tables

    @property
    def active(self) -> bool:
        return self.L > 0 and self.R > 0


def quant_shrink(x2, slices: Slices | None, token_lora, quant: bool = True, launch_dependents: bool = False):
    """K1: (codes `[M, K]` e4m3, scales `[M]` fp32) of x when `quant` (else None, None), and the fp32 shrink
    partials `[slices, N_CHUNKS, M, BR]` of x_t · A_lᵀ (rows of -1 tokens left unwritten; None without adapter)."""
    M, K = x2.shape
    has_lora = slices is not None and slices.active
    R = slices.R if has_lora else 0
    BR = max(16, next_power_of_2(R))
    k_chunk, n_chunks = shrink_chunking(K)
    n_slices = len(slices.widths) if has_lora else 1
    part = torch.empty(n_slices, n_chunks, M, BR, device=x2.device, dtype=torch.float32) if has_lora else None
    q = torch.empty(M, K, device=x2.device, dtype=FP8_DTYPE) if quant else None
    s = torch.empty(M, device=x2.device, dtype=torch.float32) if quant else None
    if M and (quant or has_lora):
        dummy = x2
        _quant_shrink_kernel[(M, n_chunks, n_slices)](
            x2, q if quant else dummy, s if quant else dummy, slices.a_tab if has_lora else dummy, token_lora,
            part if has_lora else dummy, M, K, R, k_chunk, n_chunks, x2.stride(0), K,
            *(slices.stride_a if has_lora else (0, 0, 0)),
            QUANT=quant, HAS_LORA=has_lora, LAUNCH_DEPENDENTS=launch_dependents, FP8_MAX=FP8_MAX,
            MIN_SCALE=MIN_SCALE, BR=BR, BK=SHRINK_BK, QBK=QUANT_BK, num_warps=8, num_stages=4)
    return q, s, part


def grouped_shrink(x2, slices: Slices, token_lora, order=None, config=None):
    """The shrink partials `[slices, N_CHUNKS, M, BR]` fp32 (K1's layout and K chunking) on tensor cores: tiles of
    tokens in adapter order (`order`, or token order when None), one dot per adapter present in a tile. For
    batches above DECODE_MAX_TOKENS, where K1's per-token programs re-read their adapter's A for every token on
    CUDA cores (measured 2.2x slower prefill with 32 tenants)."""
    M, K = x2.shape
    if x2.dtype != torch.bfloat16 or x2.stride(1) != 1:
        raise TypeError(f"grouped shrink needs bf16 x with unit K stride, got {x2.dtype} strides {x2.stride()}")
    cfg = dict(config or GROUPED_SHRINK_CONFIG)
    BR = max(16, next_power_of_2(slices.R))
    k_chunk, n_chunks = shrink_chunking(K)
    if k_chunk % cfg["BK"]:
        raise ValueError(f"grouped shrink BK={cfg['BK']} must divide the K chunk {k_chunk}")
    n_slices = len(slices.widths)
    part = torch.empty(n_slices, n_chunks, M, BR, device=x2.device, dtype=torch.float32)
    if M:
        _grouped_shrink_kernel[(cdiv(M, cfg["BT"]), n_chunks, n_slices)](
            x2, slices.a_tab, token_lora, order if order is not None else token_lora, part, M, K, slices.R,
            k_chunk, n_chunks, x2.stride(0), *slices.stride_a, HAS_ORDER=order is not None,
            DOT_F32=interpreting(), BT=cfg["BT"], BR=BR, BK=cfg["BK"], num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    return part


def sum_chunks(part):
    """`[slices, N_CHUNKS, M, BR]` fp32 partials -> `[slices, 1, M, BR]`, each summed in chunk order from zero (what
    K2 would add, so K2's output bits do not change) in one pass, instead of in every weight tile of K2."""
    n_slices, n_chunks, M, BR = part.shape
    if n_chunks == 1 or M == 0:
        return part
    out = torch.empty(n_slices, 1, M, BR, device=part.device, dtype=torch.float32)
    _sum_chunks_kernel[(cdiv(M * BR, 1024), n_slices)](part, out, M, n_chunks, BR=BR, BLOCK=1024,
                                                              num_warps=4)
    return out


def _shrink_only(x2, slices: Slices, token_lora, order, grouped: bool):
    """The shrink partials without quantization: grouped on tensor cores (then summed over the K chunks once), or
    per token (K1)."""
    if grouped and slices.active:
        return sum_chunks(grouped_shrink(x2, slices, token_lora, order))
    return quant_shrink(x2, slices, token_lora, quant=False)[2]


def multi_lora_gemm(x, codes, w_scale, y, token_lora, part, slices: Slices | None, lora_scale, x_scale=None,
                    order=None, bias=None, config=None, wait_pdl=False, has_base=True):
    """K2 into `y` `[M, N]`: x the e4m3 codes `[M, K]` with x_scale `[M]` fp32.
    has_base False: y already holds a base GEMM's output and only the LoRA term is added (expand)."""
    M, K = x.shape
    N = y.shape[1]
    check_reduction(K)
    cfg = dict(config or (DECODE_CONFIG if M <= DECODE_MAX_TOKENS else PREFILL_CONFIG))
    if not has_base:
        codes, w_scale = y, y  # never read without the base GEMM
    if M == 0 or N == 0:
        return y
    has_lora = part is not None
    R = slices.R if has_lora else 0
    BR = max(16, next_power_of_2(R)) if R else 16
    per_adapter = isinstance(lora_scale, torch.Tensor)
    dummy = y
    grid = (cdiv(N, cfg["BN"]) * cdiv(M, cfg["BT"]),)
    launch = dict(launch_pdl=True) if wait_pdl else {}
    _multi_lora_gemm_kernel[grid](
        x, x_scale if x_scale is not None else dummy, codes, y, w_scale, order if order is not None else dummy,
        token_lora, part if has_lora else dummy, *((slices.b_tab, slices.bl_tab, slices.starts) if has_lora
                                                   else (dummy, dummy, dummy)),
        lora_scale if per_adapter else dummy, bias if bias is not None else dummy,
        M, N, K, R, part.shape[1] if has_lora else 0, len(slices.widths) if has_lora else 0,
        0.0 if per_adapter else float(lora_scale), x.stride(0), codes.stride(0), y.stride(0),
        slices.stride_bn if has_lora else 0,
        HAS_BASE=has_base, HAS_ORDER=order is not None, HAS_LORA=has_lora,
        SIGMA_PER_ADAPTER=per_adapter, HAS_BIAS=bias is not None, WAIT_PDL=wait_pdl, DOT_F32=interpreting(),
        BN=cfg["BN"], BT=cfg["BT"], BK=cfg["BK"], BR=BR, GROUP_N=cfg.get("GROUP_N", 8),
        EVEN_K=K % cfg["BK"] == 0, EVEN_N=N % cfg["BN"] == 0, EVEN_T=M % cfg["BT"] == 0, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **launch)
    return y


def adapter_order(token_lora, tile_tokens: int):
    """Tokens sorted by adapter (stable), or None when one token tile holds them all (sorting buys nothing)."""
    if token_lora.numel() <= tile_tokens:
        return None
    return torch.sort(token_lora, stable=True).indices


def expand_order(token_lora):
    """Tokens in adapter order for K2's expand after a vendor GEMM (`expand_into`), at the tile its batch size
    gets; None when one tile holds them all."""
    tile = (DECODE_CONFIG if token_lora.numel() <= DECODE_MAX_TOKENS else PREFILL_CONFIG)["BT"]
    return adapter_order(token_lora, tile)


def choose_path(M: int, device) -> str:
    if M > DECODE_MAX_TOKENS:
        return "prefill"
    index = (device.index or 0) if device.type == "cuda" else 0
    return "pdl" if pdl_supported(index) else "decode"


def _bf16_slices(lora_a, lora_b, widths):
    cast = [t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16) for t in (*lora_a, *lora_b)]
    return Slices(cast[:len(lora_a)], cast[len(lora_a):], widths)


def _sigma(lora_scale, L, device):
    if isinstance(lora_scale, torch.Tensor):
        return lora_scale.to(device, torch.float32).reshape(-1).expand(L).contiguous()
    return float(lora_scale)


def w8a8_multi_lora_slices(x2, codes, scale, lora_a, lora_b, widths, token_lora, lora_scale=1.0, bias=None,
                           path=None, config=None, order=None, out=None):
    """A fused layer (slices of `widths` rows of codes, each with its own A/B slot buffers) in one K1 + one K2.
    x2 `[M, K]` bf16; lora_a / lora_b lists of `[L, r, K]` / `[L, N_s, r]`. Same numerics per slice as
    `w8a8_multi_lora` on that slice's rows of codes."""
    M, K = x2.shape
    N = codes.shape[0]
    if x2.dtype != torch.bfloat16:
        raise TypeError(f"x must be bf16, got {x2.dtype}")
    if sum(widths) != N:
        raise ValueError(f"slice widths {list(widths)} do not sum to the codes' N={N}")
    if path is not None and path not in PATHS:
        raise ValueError(f"unknown path {path!r}; expected one of {PATHS}")
    path = path or choose_path(M, x2.device)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    slices = _bf16_slices(lora_a, lora_b, widths)
    sigma = _sigma(lora_scale, slices.L, x2.device)
    bias = None if bias is None else bias.to(x2.dtype)
    w_scale = scale.float().reshape(1)
    cfg = dict(config or (PREFILL_CONFIG if path == "prefill" else DECODE_CONFIG))
    if order is None:
        order = adapter_order(token_lora, cfg["BT"])
    y = torch.empty(M, N, device=x2.device, dtype=x2.dtype) if out is None else out
    if y.shape != (M, N) or y.stride(1) != 1:
        raise ValueError(f"out must be [M={M}, N={N}] with unit column stride, got {tuple(y.shape)} {y.stride()}")
    use_pdl = path == "pdl"
    if path == "prefill":  # one quantization kernel over all tokens, the shrink grouped by adapter
        q, s = quantize_per_token(x2)
        s = s.reshape(-1)
        part = _shrink_only(x2, slices, token_lora, order, grouped=True)
    else:  # K1 quantizes and shrinks; with PDL, K2 launches while K1 runs and waits for it on its first read
        q, s, part = quant_shrink(x2, slices, token_lora, launch_dependents=use_pdl)
    return multi_lora_gemm(q, codes, w_scale, y, token_lora, part, slices, sigma, x_scale=s, order=order, bias=bias,
                           config=cfg, wait_pdl=use_pdl)


def w8a8_multi_lora(x, codes, scale, lora_a, lora_b, token_lora, lora_scale=1.0, bias=None, path=None,
                    config=None, order=None, out=None):
    """Triton twin of reference.w8a8_multi_lora. path: "pdl" | "decode" | "prefill" | None (by M, see
    `choose_path`); order: tokens sorted by adapter if the caller has them (vLLM's punica metadata does);
    out: an `[M, N]` view to write into (unit column stride)."""
    M, N, K, L, r = check_args(x, codes, scale, lora_a, lora_b, token_lora, lora_scale)
    y = w8a8_multi_lora_slices(x.reshape(M, K), codes, scale, [lora_a], [lora_b], [N], token_lora, lora_scale,
                               bias, path, config, order, out)
    return y if out is not None else y.reshape(*x.shape[:-1], N)


def expand_into(y, x2, lora_a, lora_b, token_lora, lora_scale, order=None, widths=None):
    """`y += σ_l · bf16(x A_lᵀ) B_lᵀ` per token in place (K1 + K2 without the base GEMM): epirl's adapter
    kernels after a vendor FP8 GEMM (dispatch candidate "vendor+epirl"). lora_a / lora_b: one `[L, r, K]` /
    `[L, N, r]` tensor, or lists of slices with `widths`."""
    if isinstance(lora_a, torch.Tensor):
        lora_a, lora_b, widths = [lora_a], [lora_b], [y.shape[1]]
    slices = _bf16_slices(lora_a, lora_b, widths)
    part = _shrink_only(x2, slices, token_lora, order, grouped=x2.shape[0] > DECODE_MAX_TOKENS)
    return multi_lora_gemm(x2, None, None, y, token_lora, part, slices, _sigma(lora_scale, slices.L, x2.device),
                           order=order, has_base=False)
