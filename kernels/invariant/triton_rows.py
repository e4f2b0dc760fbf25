"""Batch-invariant Triton kernels for the row and elementwise ops of the bitwise pairing (RMSNorm with residual,
rotary, SiLU-and-multiply, the LM head's logits, log-softmax and token log-probs): the same signatures and semantics
as reference.py, computed in fp32 instead of float64. They do not reproduce the reference's bits; they reproduce
their own, so that the engine and the trainer, both calling them, agree bit for bit.

Invariance contract. A row's output bits are a function of that row's input bits and the op's fixed parameters
(hidden size, intermediate size, head layout, vocabulary size, dtypes) only: not of how many rows the call has, their
order, the strides or contents of other rows, the alignment of the tensors handed in, or the state of the GPU. Why:

- One compiled kernel per op and width. Every tile size, num_warps and num_stages is computed from the width alone
  (`*_config`); row counts and row strides are never specialized on (`do_not_specialize`), so Triton does not
  compile another variant for one row, for 16 rows or for a stride that happens to divide by 16. fp contraction is
  off (`enable_fp_fusion=False`), so every multiply and add rounds as written, whatever the environment's
  TRITON_DEFAULT_FP_FUSION says.
- The same data layout in every call. Triton picks a reduction's thread layout (how many consecutive elements a
  thread sums first) from what it can prove about the pointers' alignment: a misaligned row start gives one element
  a thread where an aligned one gives eight, and another summation tree. The host side therefore hands every kernel
  that reduces a 16-byte aligned base and a row stride that is a multiple of `_row_align(width)` (a view that is not
  gets copied, which changes no value), and the kernel states that alignment itself (`_hint`): the compiler sees the
  same facts for a contiguous batch, a single row and a strided slice of a bigger tensor. (The elementwise kernels
  take any view: each element there is the same IEEE operations whatever the layout.)
- One program per row, or per fixed tile of a row, and reductions in an order fixed by the width: RMSNorm sums a
  row's squares in one block (or in fixed chunks of one block for very wide rows); log-softmax takes each tile's max
  and sum of exp, then combines the row's tiles in tile order in one program. The logits GEMM has one config for
  every N with a K loop in fixed order and no split-K: an MMA output element is the reduction of its own row of the
  hidden states against its own column of the weight, so padding rows and neighbouring rows never reach it.
- Elementwise ops (rotary, SiLU, the residual sum, x - lse) have no reduction at all.

token_logprobs equals log_softmax(logits).gather(-1, ids) bit for bit by construction: both take the row's
log-sum-exp from the same two kernels (`_lse`) and then compute one fp32 subtraction x - lse, which is correctly
rounded wherever it runs.

Triton's CPU interpreter (tests only) computes bf16 `tl.dot` wrongly and truncates fp32 -> bf16 instead of rounding
to nearest; there the dot is computed from fp32 products summed lane by lane (DOT_F32) and bf16 outputs are rounded
to nearest-even by hand before the conversion (ROUND_BF16), so that the interpreter rounds as the GPU does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import interpreting

MAX_NORM_BLOCK = 8192  # widest RMSNorm row held in one block; wider rows loop over chunks of this size
LSE_TILE = 4096  # logits per log-softmax program: a 151936-word row is 38 programs, parallel enough for one token
LOGITS_CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3)  # for every N: see `logits`
_LAUNCH = dict(enable_fp_fusion=False)  # every multiply and add rounds as written (see the module docstring)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _row_align(width: int, element_size: int) -> int:
    """Elements of the row stride alignment the kernels assume for rows of `width`: the largest power of two that
    divides the width, at most 16 bytes. A contiguous tensor has it; so does any slice whose stride keeps it."""
    align = max(1, 16 // element_size)
    while align > 1 and width % align:
        align //= 2
    return align


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t as `[R, width]` rows with unit feature stride, a 16-byte aligned start and a row stride that is a multiple of
    `_row_align`: the view itself when it is one, else a fresh contiguous copy (the same values, so the same bits;
    see the module docstring for why the alignment must not vary between calls)."""
    rows = t.reshape(-1, width)
    align = _row_align(width, rows.element_size())
    if rows.stride(-1) != 1 or rows.data_ptr() % 16 or rows.stride(0) % align:
        rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device).copy_(rows)
    return rows


@triton.jit
def _hint(stride, ALIGN: tl.constexpr):
    # the row stride with its alignment made visible to the compiler: (s // A) * A is s (the host checked that A
    # divides it) and Triton's axis analysis infers divisibility A for it, whatever the value of this call
    return (stride // ALIGN) * ALIGN


@triton.jit
def _round_bf16(v, ROUND_BF16: tl.constexpr):
    # fp32 -> the nearest bf16 value (ties to even), still in fp32, for the interpreter whose own conversion truncates;
    # the conversion that follows is then exact. Off on the GPU, whose conversion already rounds to nearest.
    if ROUND_BF16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    return v


# --- RMSNorm -----------------------------------------------------------------------------------------------------

def norm_config(hidden: int) -> dict:
    """The one RMSNorm config for a row width: the whole row in one block up to MAX_NORM_BLOCK, 512 elements a warp."""
    block = min(_next_pow2(hidden), MAX_NORM_BLOCK)
    return dict(BLOCK=block, N_CHUNKS=triton.cdiv(hidden, block), num_warps=min(16, max(1, block // 512)))


@triton.jit
def _norm_input(x_row, r_row, s_row, cols, mask, HAS_RES: tl.constexpr, STORE_SUM: tl.constexpr,
                ROUND_BF16: tl.constexpr):
    # the normed values in fp32: x, or s = x + r rounded to x's dtype (the reference's sum), stored when asked
    v = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        v = v + tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
        s = _round_bf16(v, ROUND_BF16).to(s_row.dtype.element_ty)
        if STORE_SUM:
            tl.store(s_row + cols, s, mask=mask)
        v = s.to(tl.float32)
    return v


@triton.jit(do_not_specialize=["stride_x", "stride_r", "stride_y", "stride_s"])
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, eps, stride_x, stride_r, stride_y, stride_s,
                     H: tl.constexpr, ALIGN: tl.constexpr, HAS_RES: tl.constexpr, ROUND_BF16: tl.constexpr,
                     BLOCK: tl.constexpr, N_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * _hint(stride_x, ALIGN)
    r_row = r_ptr + row * _hint(stride_r, ALIGN)
    y_row = y_ptr + row * _hint(stride_y, ALIGN)
    s_row = s_ptr + row * _hint(stride_s, ALIGN)
    cols = tl.arange(0, BLOCK)
    if N_CHUNKS == 1:  # the row stays in registers between the sum of squares and the scaling
        mask = cols < H
        v = _norm_input(x_row, r_row, s_row, cols, mask, HAS_RES, True, ROUND_BF16)
        inv = tl.math.rsqrt(tl.sum(v * v, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, _round_bf16(v * inv * w, ROUND_BF16).to(y_ptr.dtype.element_ty), mask=mask)
    else:  # squares summed lane-wise over the chunks in order, one tree at the end; the second pass recomputes s
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, H, BLOCK):
            mask = (c0 + cols) < H
            v = _norm_input(x_row, r_row, s_row, c0 + cols, mask, HAS_RES, False, ROUND_BF16)
            acc += v * v
        inv = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
        for c0 in range(0, H, BLOCK):
            mask = (c0 + cols) < H
            v = _norm_input(x_row, r_row, s_row, c0 + cols, mask, HAS_RES, True, ROUND_BF16)
            w = tl.load(w_ptr + c0 + cols, mask=mask, other=0.0).to(tl.float32)
            y = _round_bf16(v * inv * w, ROUND_BF16).to(y_ptr.dtype.element_ty)
            tl.store(y_row + c0 + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x `[..., H]` -> y (x.dtype); with residual: (y, s) where s = x + residual rounded to x.dtype (returned as the
    new residual) and y is s normed. fp32 math: y = s · rsqrt(mean(s²) + eps) · w, rounded once."""
    H = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    if x.numel() == 0:
        return y if residual is None else (y, s)
    xr = _rows(x, H)
    rr = _rows(residual, H) if residual is not None else xr
    w = _rows(weight, H)
    yr, sr = y.view(-1, H), s.view(-1, H)
    cfg = norm_config(H)
    _rms_norm_kernel[(xr.shape[0],)](
        xr, rr, w, yr, sr, float(eps), xr.stride(0), rr.stride(0), yr.stride(0), sr.stride(0), H=H,
        ALIGN=_row_align(H, x.element_size()), HAS_RES=residual is not None,
        ROUND_BF16=interpreting() and x.dtype == torch.bfloat16, BLOCK=cfg["BLOCK"], N_CHUNKS=cfg["N_CHUNKS"],
        num_warps=cfg["num_warps"], **_LAUNCH)
    return y if residual is None else (y, s)


# --- rotary ------------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["stride_xt", "stride_xh"])
def _rotary_kernel(x_ptr, pos_ptr, table_ptr, out_ptr, stride_xt, stride_xh, HEADS: tl.constexpr, D: tl.constexpr,
                   ROT: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_REST: tl.constexpr):
    # program (token row, block of heads): a = x1·cos - x2·sin, b = x2·cos + x1·sin in fp32, each product and sum
    # rounded as written; features from ROT on are copied
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    HALF: tl.constexpr = ROT // 2
    jm = j < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(table_ptr + pos * ROT + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(table_ptr + pos * ROT + HALF + j, mask=jm, other=0.0)[None, :]
    src = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh
    dst = out_ptr + t * (HEADS * D) + h[:, None] * D
    mask = (h < HEADS)[:, None] & jm[None, :]
    x1 = tl.load(src + j[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
    a = _round_bf16(x1 * cos - x2 * sin, ROUND_BF16)
    b = _round_bf16(x2 * cos + x1 * sin, ROUND_BF16)
    tl.store(dst + j[None, :], a.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + j[None, :], b.to(out_ptr.dtype.element_ty), mask=mask)
    if ROT < D:
        r = ROT + tl.arange(0, BLOCK_REST)
        rmask = (h < HEADS)[:, None] & (r < D)[None, :]
        tl.store(dst + r[None, :], tl.load(src + r[None, :], mask=rmask), mask=rmask)


def rotary_config(heads: int, head_dim: int, rot: int) -> dict:
    """Heads per program so that a program rotates ~2048 pairs (a whole token for most models); 4 warps."""
    block_half = _next_pow2(max(1, rot // 2))
    block_h = min(_next_pow2(heads), max(1, 2048 // block_half))
    return dict(BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_REST=_next_pow2(max(1, head_dim - rot)), num_warps=4)


def rotary(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x `[..., T, heads, D]` rotated Neox-style over its first `table.shape[1]` features (positions `[T]`, or the
    shape of x's leading dims), the rest passed through; a new tensor of x.dtype. table: fp32 `[P, rot]`, cos then
    sin."""
    heads, D = x.shape[-2], x.shape[-1]
    rot = table.shape[1]
    if rot % 2 or rot > D:
        raise ValueError(f"rotary_dim {rot} must be even and at most head_dim {D}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    pos = positions.expand(x.shape[:-2]).reshape(-1).contiguous()
    x3 = x.reshape(-1, heads, D)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    tab = table.float().contiguous()
    cfg = rotary_config(heads, D, rot)
    grid = (x3.shape[0], triton.cdiv(heads, cfg["BLOCK_H"]))
    _rotary_kernel[grid](x3, pos, tab, out, x3.stride(0), x3.stride(1), HEADS=heads, D=D, ROT=rot,
                         ROUND_BF16=interpreting() and x.dtype == torch.bfloat16, BLOCK_H=cfg["BLOCK_H"],
                         BLOCK_HALF=cfg["BLOCK_HALF"], BLOCK_REST=cfg["BLOCK_REST"], num_warps=cfg["num_warps"],
                         **_LAUNCH)
    return out


# --- SiLU and multiply -------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["stride_g", "stride_u"])
def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, stride_g, stride_u, I: tl.constexpr, ROUND_BF16: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u  # g -> -inf: exp overflows to inf and g / inf is -0, no NaN
    tl.store(o_ptr + row * I + cols, _round_bf16(y, ROUND_BF16).to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(silu(g) · u) elementwise in fp32; gate / up `[..., I]` may be strided row views (vLLM's halves of one
    `[T, 2I]` tensor). Returns a new contiguous tensor of gate.dtype."""
    I = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    g, u = gate.reshape(-1, I), up.reshape(-1, I)
    g = g if g.stride(-1) == 1 else g.contiguous()
    u = u if u.stride(-1) == 1 else u.contiguous()
    block = min(_next_pow2(I), 1024)
    _silu_mul_kernel[(g.shape[0], triton.cdiv(I, block))](
        g, u, out, g.stride(0), u.stride(0), I=I, ROUND_BF16=interpreting() and gate.dtype == torch.bfloat16,
        BLOCK=block, num_warps=4, **_LAUNCH)
    return out


# --- LM head -----------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "stride_hm", "stride_wv"])
def _logits_kernel(h_ptr, w_ptr, o_ptr, M, stride_hm, stride_wv, V: tl.constexpr, K: tl.constexpr,
                   ALIGN: tl.constexpr, DOT_F32: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr):
    # grouped tile order (GROUP_M row tiles share each weight tile in L2); the order changes no arithmetic
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n: tl.constexpr = (V + BN - 1) // BN
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m, mask_n = rm < M, rn < V
    h_rows = h_ptr + rm[:, None].to(tl.int64) * _hint(stride_hm, ALIGN)
    w_rows = w_ptr + rn[None, :].to(tl.int64) * _hint(stride_wv, ALIGN)  # [., BN] columns of the [V, K] weight
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if DOT_F32:  # Triton's CPU interpreter (tests only): its bf16 dot is wrong, and its fp32 dot (numpy's BLAS) rounds
        # a row differently by the row's slot in the tile; rank-1 updates in K order depend on the row's values only,
        # as the MMA's do
        for k in range(0, K):
            a = tl.load(h_rows + k, mask=mask_m[:, None], other=0.0).to(tl.float32)
            b = tl.load(w_rows + k, mask=mask_n[None, :], other=0.0).to(tl.float32)
            acc += a * b
    else:
        rk = tl.arange(0, BK)
        for k0 in range(0, K, BK):  # K in fixed BK steps, in order, one accumulator: no split-K
            if K % BK == 0:
                a = tl.load(h_rows + (k0 + rk)[None, :], mask=mask_m[:, None], other=0.0)
                b = tl.load(w_rows + (k0 + rk)[:, None], mask=mask_n[None, :], other=0.0)
            else:  # padded K columns are zeros on both sides: exact zero products
                mask_k = (k0 + rk) < K
                a = tl.load(h_rows + (k0 + rk)[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                b = tl.load(w_rows + (k0 + rk)[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if IEEE:  # fp32 inputs: no TF32
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:  # bf16 x bf16 products are exact; the tensor core accumulates them in fp32
                acc = tl.dot(a, b, acc)
    o_ptrs = o_ptr + rm[:, None].to(tl.int64) * V + rn[None, :]
    tl.store(o_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden `[N, H]` (or `[..., H]`), weight `[V, H]` (same dtype) -> fp32 `[N, V]`: a tiled GEMM with fp32
    accumulation, one config (LOGITS_CONFIG) for every N. Decode (N <= 128: one row tile) is bound by reading the
    weight: its idle MMA rows cost no memory traffic, and 3 stages of 256 x 64 weight keep 96 KB in flight a CTA. At
    training sizes the 128 x 256 tile (two warpgroups of 64 x 256 MMAs) reuses each operand tile the most; on an
    H100 (CUDA-graph replays, L2 flushed), Qwen3's head (V 151936, H 4096) took 448 us at N = 1 and 487 us at 128
    (cuBLAS bf16: 436 and 461; reading the weight at 3.35 TB/s: 372) and 9.0 ms at N = 4096 (cuBLAS: 6.8); a 64 x 128
    tile took 430 us and 13.4 ms."""
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden {hidden.dtype} and weight {weight.dtype} must share a dtype")
    K, V = hidden.shape[-1], weight.shape[0]
    out = torch.empty((*hidden.shape[:-1], V), dtype=torch.float32, device=hidden.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_()
    h, w = _rows(hidden, K), _rows(weight, K)
    N = h.shape[0]
    cfg = LOGITS_CONFIG
    grid = (triton.cdiv(N, cfg["BM"]) * triton.cdiv(V, cfg["BN"]),)
    _logits_kernel[grid](h, w, out, N, h.stride(0), w.stride(0), V=V, K=K, ALIGN=_row_align(K, h.element_size()),
                         DOT_F32=interpreting(), IEEE=hidden.dtype == torch.float32, BM=cfg["BM"], BN=cfg["BN"],
                         BK=cfg["BK"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
                         num_stages=cfg["num_stages"], **_LAUNCH)
    return out


# --- log-softmax and token log-probs ----------------------------------------------------------------------------

def lse_config(vocab: int) -> dict:
    """Tiles of LSE_TILE logits (one tile for a smaller vocabulary), 256 elements a warp."""
    block = min(_next_pow2(vocab), LSE_TILE)
    n_tiles = triton.cdiv(vocab, block)
    return dict(BLOCK_V=block, N_TILES=n_tiles, TILES_BLOCK=_next_pow2(n_tiles),
                num_warps=min(16, max(1, block // 256)))


@triton.jit(do_not_specialize=["stride_x"])
def _lse_tile_kernel(x_ptr, part_ptr, stride_x, V: tl.constexpr, ALIGN: tl.constexpr, BLOCK_V: tl.constexpr,
                     N_TILES: tl.constexpr):
    # program (row, tile): the tile's max m and sum of exp(x - m), one reduction tree each
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    cols = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + row * _hint(stride_x, ALIGN) + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    p = tl.where(m > float("-inf"), tl.exp(x - m), 0.0)  # an all -inf tile: sum 0 (not exp(-inf + inf) = NaN)
    tl.store(part_ptr + row * (2 * N_TILES) + tile, m)
    tl.store(part_ptr + row * (2 * N_TILES) + N_TILES + tile, tl.sum(p, axis=0))


@triton.jit
def _lse_combine_kernel(part_ptr, lse_ptr, N_TILES: tl.constexpr, TILES_BLOCK: tl.constexpr):
    # program per row: lse = M + log(Σ_t s_t · exp(m_t - M)) over the row's tiles, in one fixed tree
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, TILES_BLOCK)
    tm = t < N_TILES
    m = tl.load(part_ptr + row * (2 * N_TILES) + t, mask=tm, other=float("-inf"))
    s = tl.load(part_ptr + row * (2 * N_TILES) + N_TILES + t, mask=tm, other=0.0)
    big = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), s * tl.exp(m - big), 0.0)
    tl.store(lse_ptr + row, big + tl.log(tl.sum(w, axis=0)))  # a row of -inf only: -inf (the reference's NaNs follow)


def _lse(x: torch.Tensor) -> torch.Tensor:
    """fp32 `[N]` log-sum-exp of the rows of x `[N, V]` (already `_rows`-normalized): the one computation of it that
    log_softmax and token_logprobs share, so that they subtract the same number."""
    N, V = x.shape
    cfg = lse_config(V)
    part = torch.empty((N, 2 * cfg["N_TILES"]), dtype=torch.float32, device=x.device)
    lse = torch.empty(N, dtype=torch.float32, device=x.device)
    _lse_tile_kernel[(N, cfg["N_TILES"])](x, part, x.stride(0), V=V, ALIGN=_row_align(V, x.element_size()),
                                          BLOCK_V=cfg["BLOCK_V"], N_TILES=cfg["N_TILES"],
                                          num_warps=cfg["num_warps"], **_LAUNCH)
    _lse_combine_kernel[(N,)](part, lse, N_TILES=cfg["N_TILES"], TILES_BLOCK=cfg["TILES_BLOCK"], num_warps=1,
                              **_LAUNCH)
    return lse


@triton.jit(do_not_specialize=["stride_x"])
def _sub_lse_kernel(x_ptr, lse_ptr, out_ptr, stride_x, V: tl.constexpr, ALIGN: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(x_ptr + row * _hint(stride_x, ALIGN) + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * V + cols, x - tl.load(lse_ptr + row), mask=mask)


@triton.jit(do_not_specialize=["stride_x", "stride_in", "stride_ik"])
def _gather_sub_kernel(x_ptr, ids_ptr, lse_ptr, out_ptr, stride_x, stride_in, stride_ik, V: tl.constexpr,
                       K: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    km = k < K
    ids = tl.load(ids_ptr + row * stride_in + k * stride_ik, mask=km, other=0).to(tl.int64)
    ok = km & (ids >= 0) & (ids < V)  # an id outside the vocabulary reads nothing and gives NaN
    x = tl.load(x_ptr + row * stride_x + ids, mask=ok, other=float("nan")).to(tl.float32)
    tl.store(out_ptr + row * K + k, x - tl.load(lse_ptr + row), mask=km)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """logits `[N, V]` (or `[..., V]`) -> fp32 of the same shape: x - lse in fp32, lse from the row's tiles (`_lse`)."""
    V = logits.shape[-1]
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    x = _rows(logits, V)
    N = x.shape[0]
    cfg = lse_config(V)
    _sub_lse_kernel[(N, cfg["N_TILES"])](x, _lse(x), out, x.stride(0), V=V, ALIGN=_row_align(V, x.element_size()),
                                         BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"], **_LAUNCH)
    return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits `[N, V]`, token_ids `[N, K]` (integers in [0, V); or `[..., V]`, `[..., K]`) -> fp32 `[N, K]`:
    log_softmax(logits) at those ids, bit for bit (the same lse, the same one subtraction), without the `[N, V]`
    output. An id outside [0, V) gives NaN."""
    V, K = logits.shape[-1], token_ids.shape[-1]
    out = torch.empty(token_ids.shape, dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    x = _rows(logits, V)
    N = x.shape[0]
    ids = token_ids.reshape(N, K)
    _gather_sub_kernel[(N,)](x, ids, _lse(x), out, x.stride(0), ids.stride(0), ids.stride(1), V=V, K=K,
                             BLOCK_K=_next_pow2(K), num_warps=1, **_LAUNCH)
    return out
