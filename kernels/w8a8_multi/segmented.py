"""Segment-tiled LoRA shrink and expand for batches spread over many adapters (Hopper, Triton): the LoRA term of a
multi-adapter layer added after a vendor FP8 GEMM (dispatch candidate "vendor+seg").

Why: the grouped shrink and K2's epilogue take tiles of tokens in adapter order and loop over every adapter present
in a tile (one full-tile dot each). With 32 tenants a 64-token tile holds ~32 adapters, so a tile does 32 serial
dots and reloads its x columns 32 times (measured on the H200: 1.8-2.0x vLLM's own LoRA kernels at 64
tokens). Here every tile holds the tokens of ONE adapter: the batch's tokens sorted by adapter are cut into
segments (one per adapter, vLLM's `LoRAKernelMeta` layout: sorted token indices, each segment's adapter, token
count and first position), each segment into tiles of BT tokens, and the tiles of all segments are numbered in
segment order; program p finds its tile from the segment counts (a cumsum over the slots, no host sync), so the
launch grid depends only on M and the slot count (CUDA-graph safe) and a tile's work is one dot per K step. The
expand takes a run of 128-row tiles of one slice per program: the tile's fixed costs (its segment, its tokens, h
summed over the K chunks) are paid once per run (one tile per program was 2.7 ms at 8192 tokens on the H200).

Numerics: identical, bit for bit, to `expand_into` on the same tokens (the shrink's chunk and dot are
`_shrink_chunk`, the chunk sum `_sum_chunk_partials`, both shared with triton.py; the expand does K2's epilogue
arithmetic: a [rows, r] x [r, tokens] bf16 dot and an explicit FMA): y_t = fma(σ_l, B_l · bf16(Σ_chunks x_t A_lᵀ),
y_t), every output element from its own token only, so a mixed batch equals each group alone. Tokens of no adapter
(-1) are left untouched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._dispatch import interpreting
from .triton import Slices, _bf16_slices, _shrink_chunk, _sigma, _sum_chunk_partials, shrink_chunking

SEG_SHRINK_CONFIG = dict(BT=64, BK=64, num_warps=4, num_stages=3)
# expand tiles: 128 rows x 32 tokens compiles to 204 registers without spills for sm_90a (128 x 64: 255 and spills,
# one CTA per SM); the timed dispatch also tries SEG_VARIANTS ("vendor+seg[<tag>]")
SEG_EXPAND_CONFIG = dict(BN=128, BT=32, num_warps=4, num_stages=3)
SEG_VARIANTS = {"bt16": dict(BN=128, BT=16, num_warps=4, num_stages=3),
                "bn64": dict(BN=64, BT=64, num_warps=4, num_stages=2)}
EXPAND_PROGRAMS = 528  # the expand's launch: about four programs per SM of an H200, each over a run of row tiles


class Segments(NamedTuple):
    """A batch's tokens grouped by adapter, in vLLM's `LoRAKernelMeta` layout (its tensors can be passed as they
    are): tokens `[>= M]` int32, the token indices sorted by adapter; lora_ids `[S]` int32, segment i's adapter
    (-1: no adapter, or an unused segment); counts `[S]` int32, its token count. A segment starts where the
    counts before it end (vLLM's `lora_token_start_loc`; the kernels compute it from the counts)."""
    tokens: torch.Tensor
    lora_ids: torch.Tensor
    counts: torch.Tensor


def segments(token_lora: torch.Tensor, slots: int) -> Segments:
    """The segments of a batch whose tokens use adapters 0..slots-1 (-1: none): one per slot plus the no-adapter
    one, all on the device, no host sync (capturable in a CUDA graph), as vLLM prepares its metadata."""
    ids = token_lora.reshape(-1).to(torch.int64)
    dev = ids.device
    tokens = torch.sort(ids, stable=True).indices.to(torch.int32)
    counts = torch.zeros(slots + 1, dtype=torch.int32, device=dev)
    counts.scatter_add_(0, ids + 1, torch.ones_like(ids, dtype=torch.int32))
    return Segments(tokens, torch.arange(-1, slots, dtype=torch.int32, device=dev), counts)


@triton.jit
def _segment_tile(p, lora_ids_ptr, counts_ptr, S, BT: tl.constexpr, BS: tl.constexpr):
    # tile p of the segments' tiles (BT tokens each, numbered in segment order; no-adapter segments have none):
    # (its adapter, its first position in the sorted tokens, its token count; <= 0 past the last tile). A
    # segment's start is the sum of the counts before it (computed here rather than loaded from vLLM's
    # `lora_token_start_loc`: one dependent memory round trip less before the tile's first load)
    rs = tl.arange(0, BS)
    in_range = rs < S
    lora = tl.load(lora_ids_ptr + rs, mask=in_range, other=-1)
    count = tl.load(counts_ptr + rs, mask=in_range, other=0)
    tiles = tl.where(lora >= 0, (count + BT - 1) // BT, 0)
    ends = tl.cumsum(tiles, axis=0)
    seg = tl.sum((ends <= p).to(tl.int32), axis=0)  # segments wholly before tile p
    here = rs == seg
    lo = (p - tl.sum(tl.where(here, ends - tiles, 0), axis=0)) * BT
    n = tl.minimum(tl.sum(tl.where(here, count, 0), axis=0) - lo, BT)
    start = tl.sum(tl.where(rs < seg, count, 0), axis=0)
    return tl.sum(tl.where(here, lora, 0), axis=0), start + lo, n


@triton.jit(do_not_specialize=["M"])
def _seg_shrink_kernel(x_ptr, a_tab, tokens_ptr, lora_ids_ptr, counts_ptr, part_ptr, M, K, R, S,
                       K_CHUNK, N_CHUNKS, stride_xm, stride_al, stride_ar, stride_ak, SUM_CHUNKS: tl.constexpr,
                       DOT_F32: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                       BS: tl.constexpr):
    # program (segment tile, K chunk, slice): the fp32 shrink partial of the tile's tokens (one adapter) for the
    # chunk, K1's layout [slice, chunk, token, r]; SUM_CHUNKS: every chunk, added in chunk order into chunk 0
    adapter, lo, n = _segment_tile(tl.program_id(0), lora_ids_ptr, counts_ptr, S, BT, BS)
    if n > 0:
        split = tl.program_id(1)
        slice_id = tl.program_id(2)
        rt = tl.arange(0, BT)
        mask_t = rt < n
        tok = tl.load(tokens_ptr + lo + rt, mask=mask_t, other=0).to(tl.int64)
        rr = tl.arange(0, BR)
        mask_r = rr < R
        a_ptr = tl.load(a_tab + slice_id).to(tl.pointer_type(tl.bfloat16))
        a_rows = a_ptr + adapter.to(tl.int64) * stride_al + rr[:, None] * stride_ar
        x_cols = x_ptr + tok[None, :] * stride_xm
        mask_out = mask_r[:, None] & mask_t[None, :]
        if SUM_CHUNKS:  # h = ((0 + p_0) + p_1) + ...: sum_chunks' order, so the same bits
            h = tl.zeros((BR, BT), dtype=tl.float32)
            for c in range(0, N_CHUNKS):
                h += _shrink_chunk(a_rows, x_cols, c * K_CHUNK, K_CHUNK, K, mask_r, mask_t, stride_ak, DOT_F32, BR,
                                   BT, BK)
            tl.store(part_ptr + (slice_id * M + tok[None, :]) * BR + rr[:, None], h, mask=mask_out)
        else:
            acc = _shrink_chunk(a_rows, x_cols, split * K_CHUNK, K_CHUNK, K, mask_r, mask_t, stride_ak, DOT_F32, BR,
                                BT, BK)
            tl.store(part_ptr + ((slice_id * N_CHUNKS + split) * M + tok[None, :]) * BR + rr[:, None], acc,
                     mask=mask_out)


@triton.jit(do_not_specialize=["M"])
def _seg_expand_kernel(y_ptr, tokens_ptr, lora_ids_ptr, counts_ptr, part_ptr, b_tab, bl_tab, slice_starts_ptr,
                       sigma_ptr, M, R, S, N_CHUNKS, GROUPS, sigma_const, stride_ym, stride_bn,
                       SIGMA_PER_ADAPTER: tl.constexpr, DOT_F32: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
                       BR: tl.constexpr, BS: tl.constexpr, NUM_STAGES: tl.constexpr):
    # program (segment tile, slice x group): y[tile's tokens, rows] += σ_l B_l h for a run of BN-row tiles of one
    # slice. The tile's fixed costs (finding its segment, its tokens, h summed over the K chunks and widened to
    # bf16) are paid once for the run, and the run's y / B loads are software-pipelined; per tile of rows the
    # arithmetic is K2's epilogue's (the same dot shape and explicit FMA: same bits).
    adapter, lo, n = _segment_tile(tl.program_id(0), lora_ids_ptr, counts_ptr, S, BT, BS)
    if n > 0:
        sl = tl.program_id(1) // GROUPS
        group = tl.program_id(1) % GROUPS
        row_lo = tl.load(slice_starts_ptr + sl)
        width = tl.load(slice_starts_ptr + sl + 1) - row_lo
        per_group = tl.cdiv(tl.cdiv(width, BN), GROUPS)
        first = group * per_group
        last = tl.minimum(first + per_group, tl.cdiv(width, BN))
        rt = tl.arange(0, BT)
        mask_t = rt < n
        tok = tl.load(tokens_ptr + lo + rt, mask=mask_t, other=0).to(tl.int64)
        rr = tl.arange(0, BR)
        mask_r = rr < R
        h = _sum_chunk_partials(part_ptr, sl, N_CHUNKS, M, tok, rr, mask_r[:, None] & mask_t[None, :], BR,
                                BT).to(tl.bfloat16)
        b_rows = (tl.load(b_tab + sl).to(tl.pointer_type(tl.bfloat16)) + adapter.to(tl.int64) * tl.load(bl_tab + sl)
                  + rr[None, :])
        if SIGMA_PER_ADAPTER:
            sigma = tl.load(sigma_ptr + adapter)
        else:
            sigma = sigma_const
        y_cols = y_ptr + tok[None, :] * stride_ym + row_lo
        for t in tl.range(first, last, num_stages=NUM_STAGES):
            rn = t * BN + tl.arange(0, BN)  # rows within the slice
            mask_n = rn < width
            mask_y = mask_n[:, None] & mask_t[None, :]
            y = tl.load(y_cols + rn[:, None], mask=mask_y, other=0.0).to(tl.float32)
            b = tl.load(b_rows + rn[:, None].to(tl.int64) * stride_bn, mask=mask_n[:, None] & mask_r[None, :],
                        other=0.0)
            if DOT_F32:  # Triton's CPU interpreter: fp32 dots (tests only)
                lora = tl.dot(b.to(tl.float32), h.to(tl.float32))
            else:
                lora = tl.dot(b, h)
            tl.store(y_cols + rn[:, None], tl.fma(lora, sigma, y).to(y_ptr.dtype.element_ty), mask=mask_y)


def _check_segments(segs: Segments, M: int):
    S = segs.counts.numel()
    if segs.lora_ids.numel() != S or segs.tokens.numel() < M:
        raise ValueError(f"segments: lora_ids {segs.lora_ids.numel()}, counts {S}, tokens {segs.tokens.numel()} "
                         f"(want S, S, >= M={M})")
    return S


def shrink_segments(x2, slices: Slices, segs: Segments, config=None, sum_in_shrink: bool = False):
    """The shrink of every adapter token: fp32 `[slices, chunks, M, BR]` (K1's chunking, or chunks 1 when summed in
    the shrink); rows of no-adapter tokens are left unwritten (the expand never reads them). sum_in_shrink: one
    program per tile adds all K chunks in chunk order (the same bits as the expand adding them) - measured slower
    on the H200 at 16-8192 tokens (too few programs, long serial loops), kept for comparison."""
    M, K = x2.shape
    if x2.dtype != torch.bfloat16 or x2.stride(1) != 1:
        raise TypeError(f"segmented shrink needs bf16 x with unit K stride, got {x2.dtype} strides {x2.stride()}")
    cfg = dict(config or SEG_SHRINK_CONFIG)
    S = _check_segments(segs, M)
    BR = max(16, next_power_of_2(slices.R))
    k_chunk, n_chunks = shrink_chunking(K)
    if k_chunk % cfg["BK"]:
        raise ValueError(f"segmented shrink BK={cfg['BK']} must divide the K chunk {k_chunk}")
    n_slices = len(slices.widths)
    tiles = cdiv(M, cfg["BT"]) + S  # bound on the segments' tiles
    sum_in_shrink = sum_in_shrink or n_chunks == 1
    out_chunks = 1 if sum_in_shrink else n_chunks
    part = torch.empty(n_slices, out_chunks, M, BR, device=x2.device, dtype=torch.float32)
    if M:
        _seg_shrink_kernel[(tiles, out_chunks, n_slices)](
            x2, slices.a_tab, segs.tokens, segs.lora_ids, segs.counts, part, M, K, slices.R, S, k_chunk,
            n_chunks, x2.stride(0), *slices.stride_a, SUM_CHUNKS=sum_in_shrink, DOT_F32=interpreting(),
            BT=cfg["BT"], BR=BR, BK=cfg["BK"], BS=max(16, next_power_of_2(S)), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    return part


def expand_segments(y, x2, lora_a, lora_b, segs: Segments, lora_scale, widths=None, config=None,
                    shrink_config=None, sum_in_shrink: bool = False, groups: int | None = None):
    """`y += σ_l · bf16(x A_lᵀ) B_lᵀ` in place for every token of an adapter segment (y: a vendor GEMM's `[M, N]`
    output). lora_a / lora_b: one `[L, r, K]` / `[L, N, r]` tensor, or lists of slices with `widths`; segs: from
    `segments` or vLLM's `LoRAKernelMeta`; groups: runs of row tiles per slice (None: `expand_groups`). Same bits
    as `expand_into` on the same tokens."""
    if isinstance(lora_a, torch.Tensor):
        lora_a, lora_b, widths = [lora_a], [lora_b], [y.shape[1]]
    slices = _bf16_slices(lora_a, lora_b, widths)
    M, N = y.shape
    if y.stride(1) != 1 or x2.shape[0] != M:
        raise ValueError(f"y must be [M={x2.shape[0]}, N] with unit column stride, got {tuple(y.shape)} {y.stride()}")
    if M == 0 or N == 0 or not slices.active:
        return y
    cfg = dict(config or SEG_EXPAND_CONFIG)
    part = shrink_segments(x2 if x2.stride(1) == 1 else x2.contiguous(), slices, segs, shrink_config, sum_in_shrink)
    sigma = _sigma(lora_scale, slices.L, x2.device)
    per_adapter = isinstance(sigma, torch.Tensor)
    S = segs.counts.numel()
    tiles = cdiv(M, cfg["BT"]) + S
    n_slices = len(slices.widths)
    groups = groups or expand_groups(tiles * n_slices, max(cdiv(w, cfg["BN"]) for w in slices.widths))
    _seg_expand_kernel[(tiles, n_slices * groups)](
        y, segs.tokens, segs.lora_ids, segs.counts, part, slices.b_tab, slices.bl_tab, slices.starts,
        sigma if per_adapter else y, M, slices.R, S, part.shape[1], groups, 0.0 if per_adapter else float(sigma),
        y.stride(0), slices.stride_bn, SIGMA_PER_ADAPTER=per_adapter, DOT_F32=interpreting(), BN=cfg["BN"],
        BT=cfg["BT"], BR=part.shape[3], BS=max(16, next_power_of_2(S)), NUM_STAGES=cfg["num_stages"],
        num_warps=cfg["num_warps"])
    return y


def expand_groups(programs: int, row_tiles: int, target: int = EXPAND_PROGRAMS) -> int:
    """Groups each slice's BN-row tiles are split into (one program per segment tile and group): enough programs
    for `target` in all, at most one group per row tile of the widest slice."""
    return max(1, min(row_tiles, cdiv(target, max(programs, 1))))
