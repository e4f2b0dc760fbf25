"""Causal attention forward in one Triton kernel, shared by the rollout engine (paged KV cache, packed requests) and
the trainer (right-padded batches): a row's output bits are a function of that row's query, its position and the
keys / values at positions 0 .. pos of its sequence only.

Invariance contract. For a query row at position `pos` of a sequence, `paged_attention` returns the same bf16 bits
whatever else is in the call: how many requests and rows, the row's place among them, whether it comes as a whole
prefill, a chunk of one (earlier chunks' keys already in the cache) or a one-token decode, and where its keys sit (any
block table and block size of a paged store, or the contiguous tensor `attention_batched` passes through the same
kernel). Why it holds:

- One compiled kernel, one config. Tile rows, BLOCK_N, num_warps and num_stages come from (head_dim, group size)
  only (`attention_config`), never from the number of rows, requests, lengths or the block size, so every call runs
  the same instruction stream: the same MMA shapes, the same reduction trees, the same fused multiply-adds. The
  values that change per call (block size, tile count) are not specialized on; they only move addresses.
- A row's arithmetic does not depend on its tile slot. A program owns BLOCK_P consecutive query positions of one
  request times the GROUP_P query heads of one kv head (GQA reads each key once per tile). An MMA output element is
  the reduction of its own row of the left operand against a column of the right one in a fixed order, and the
  row-wise max / sum / exp2 of the softmax run the same per-row sequence in every row of the layout, so the row's
  neighbours (other positions, other heads, padding rows beyond q_len or beyond the group) never reach it. Padding
  rows compute finite garbage and are never stored.
- Keys are visited in blocks of absolute positions starting at 0 (block j = positions j·BLOCK_N ..), in order,
  gathered by slot per key. The keys a row sees (positions <= pos < seq_len) are the same in every call; the others
  score -inf, so p = 0 exactly and they add exact zeros (0·v with v finite: a later chunk's real key, or the 0 a
  masked load gives past seq_len, where unused cache slots may hold NaN and are never read). So a row's running
  (m, l, acc) after block j is the same in every call.
- Rows of a tile differ in how many blocks they need (the tile runs to its last row's block; a decode row stops at
  its own), so the blocks a row visits beyond its own are fully masked for it, and such a block is a bitwise no-op:
  block 0 holds position 0, which every row sees, so m is finite after it; a fully masked block has row max -inf,
  so m_new = max(m, -inf) = m, alpha = exp2(m - m) = exp2(0) = 1 exactly, p = exp2(-inf - m) = 0 exactly, l·1 + 0 = l
  (l >= 1) and acc·1 + Σ 0·v = acc (v finite: real keys or masked-load zeros), except that an accumulator of exactly
  -0 may become +0, which the final canonicalization of zeros to +0 removes.
- The output is acc / l rounded to bf16 once, with -0 written as +0.

Triton's CPU interpreter (the CPU tests, DOT_F32) computes bf16 `tl.dot` wrongly, and its fp32 `tl.dot` is numpy's
BLAS matmul, which is not row-invariant (a row's last bits move with its slot in the tile), so there the two products
are fp32 broadcast-multiply-and-sum over k (`_dot_f32`): exact bf16 products summed in order, the same for every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._dispatch import interpreting

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x·scale) = exp2(x·scale·log2 e), one MUFU op per score


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def attention_config(head_dim: int, group: int) -> dict:
    """The one config for a (head_dim, H / G) pair. 128 tile rows (BLOCK_P positions x GROUP_P heads) keep the MMA
    wide for prefill; decode tiles use one position of them, which costs idle MMA rows but no extra key traffic (the
    kernel is bound by reading the keys there). BLOCK_N 64 keys per block, fewer for very wide heads (registers)."""
    block_d = max(16, _next_pow2(head_dim))  # tl.dot needs K and N >= 16; padded features are zeros on both sides
    group_p = _next_pow2(group)
    rows = 128 if block_d <= 128 else 64
    return dict(BLOCK_P=max(1, rows // group_p), GROUP_P=group_p, BLOCK_N=64 if block_d <= 128 else 32,
                BLOCK_D=block_d, num_warps=8 if block_d >= 64 else 4, num_stages=2)


@triton.jit
def _dot_f32(a, b):
    # Triton's CPU interpreter only (DOT_F32): its bf16 tl.dot is wrong, and its fp32 one is numpy's matmul, whose
    # BLAS gives a row different last bits depending on the row's slot in the matrix; this broadcast product summed
    # over k in order is the same for every row (bf16 x bf16 products are exact in fp32)
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _gather(ptr, blk, off, k_ok, kvh, d, d_ok, stride_b, stride_o, stride_h, stride_d):
    # [BLOCK_N, BLOCK_D] keys (or values) of one kv head, one slot per key; positions past seq_len are masked
    # (other=0): their slots may be unused and hold NaN, and 0·NaN would poison the row
    ptrs = ptr + (blk * stride_b + off * stride_o + kvh * stride_h)[:, None] + (d * stride_d)[None, :]
    return tl.load(ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit(do_not_specialize=["block_size", "tiles_per_req"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, qsl_ptr, seq_lens_ptr, qk_scale, block_size,
                      tiles_per_req, D, stride_qn, stride_qh, stride_qd, stride_kb, stride_ko, stride_kh, stride_kd,
                      stride_vb, stride_vo, stride_vh, stride_vd, stride_on, stride_oh, stride_od, stride_tr,
                      GROUP: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_P: tl.constexpr, GROUP_P: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (request x row tile, kv head): rows i = BLOCK_P query positions x GROUP_P query heads of kv head kvh
    # (position-major), online softmax over key blocks 0, 1, .. up to the tile's last position
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    req = pid // tiles_per_req
    first_row = (pid % tiles_per_req) * BLOCK_P
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if first_row >= q_len:  # past this request's rows (q_len 0 included): nothing to write
        return
    seq_len = tl.load(seq_lens_ptr + req)
    i = tl.arange(0, BLOCK_P * GROUP_P)
    q_idx = first_row + i // GROUP_P
    hg = i % GROUP_P
    row_ok = (q_idx < q_len) & (hg < GROUP)
    pos = seq_len - q_len + q_idx  # the request's rows are the last q_len positions of its sequence
    head = kvh * GROUP + hg
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_rows = (q_start + q_idx).to(tl.int64) * stride_qn + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + (d * stride_qd)[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    table_row = table_ptr + req.to(tl.int64) * stride_tr
    kvh64 = kvh.to(tl.int64)

    m = tl.full((BLOCK_P * GROUP_P,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_P * GROUP_P,), tl.float32)
    acc = tl.zeros((BLOCK_P * GROUP_P, BLOCK_D), tl.float32)
    # one past the tile's last position: later blocks are masked for every row of the tile
    end = seq_len - q_len + tl.minimum(first_row + BLOCK_P, q_len)
    for j in range(0, (end + BLOCK_N - 1) // BLOCK_N):
        kpos = j * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kpos < seq_len
        blk = tl.load(table_row + kpos // block_size, mask=k_ok, other=0).to(tl.int64)  # table past seq_len: unread
        off = (kpos % block_size).to(tl.int64)
        k = _gather(k_ptr, blk, off, k_ok, kvh64, d, d_ok, stride_kb, stride_ko, stride_kh, stride_kd)
        v = _gather(v_ptr, blk, off, k_ok, kvh64, d, d_ok, stride_vb, stride_vo, stride_vh, stride_vd)
        if DOT_F32:
            qk = _dot_f32(q, tl.trans(k.to(tl.float32)))
        else:  # bf16 operands, fp32 accumulation on the tensor cores
            qk = tl.dot(q, tl.trans(k))
        # the select between the scaling and the subtraction below keeps them two roundings in every row
        s = tl.where(kpos[None, :] <= pos[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite from block 0 on: position 0 is seen by every row
        alpha = tl.exp2(m - m_new)  # exactly 1 where the block is masked for the row (m_new == m)
        p = tl.exp2(s - m_new[:, None])  # exactly 0 at masked keys
        l = l * alpha + tl.sum(p, axis=1)
        p = p.to(v.dtype)  # the rounding the bf16 MMA takes, in both modes
        if DOT_F32:
            pv = _dot_f32(p.to(tl.float32), v.to(tl.float32))
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    o = acc / l[:, None]
    o = tl.where(o == 0.0, 0.0, o)  # -0 -> +0: an exactly-zero accumulator's sign may depend on masked blocks
    o_rows = (q_start + q_idx).to(tl.int64) * stride_on + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + (d * stride_od)[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _store_strides(store: torch.Tensor, block_size: int, what: str) -> tuple[int, int, int, int]:
    """(block, offset-in-block, head, feature) strides of a slot store `[slots, G, D]` or a paged cache
    `[num_blocks, block_size, G, D]` (vLLM's per-layer key or value cache), read in place."""
    if store.dim() == 3:
        return store.stride(0) * block_size, store.stride(0), store.stride(1), store.stride(2)
    if store.dim() == 4:
        if store.shape[1] != block_size:
            raise ValueError(f"{what}: a paged cache of block size {store.shape[1]}, called with {block_size}")
        return store.stride(0), store.stride(1), store.stride(2), store.stride(3)
    raise ValueError(f"{what}: expected [slots, G, D] or [blocks, block_size, G, D], got {tuple(store.shape)}")


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def paged_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, block_table: torch.Tensor,
                    block_size: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of R packed requests over a paged KV store.

    q `[N, H, D]`: request r owns rows query_start_loc[r] .. query_start_loc[r + 1] - 1 (int32 `[R + 1]`), the
    last q_len_r positions of its sequence: seq_lens[r] - q_len_r .. seq_lens[r] - 1 (int32 `[R]`). Its key at
    position p lives at slot block_table[r, p // block_size] · block_size + p % block_size of k_store / v_store
    `[slots, G, D]` (or `[num_blocks, block_size, G, D]`), H a multiple of G. max_query_len: a host int >= every
    q_len (it sizes the grid). Writes `[N, H, D]` into `out` (any strides, e.g. a view of the engine's output
    buffer) or a new tensor of q's dtype; rows no request owns are left as they are. Keys at positions >= seq_len
    are never read."""
    N, H, D = q.shape
    G = k_store.shape[-2]
    if H % G or k_store.shape[-1] != D or v_store.shape != k_store.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, k {tuple(k_store.shape)}, v {tuple(v_store.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape:
        raise ValueError(f"paged_attention: out {tuple(out.shape)} for q {tuple(q.shape)}")
    R = seq_lens.shape[0]
    cfg = attention_config(D, H // G)
    tiles = triton.cdiv(int(max_query_len), cfg["BLOCK_P"])
    if R == 0 or tiles == 0:
        return out
    block_table, query_start_loc, seq_lens = _int32(block_table), _int32(query_start_loc), _int32(seq_lens)
    ks = _store_strides(k_store, block_size, "k_store")
    vs = _store_strides(v_store, block_size, "v_store")
    _attention_kernel[(R * tiles, G)](
        q, k_store, v_store, out, block_table, query_start_loc, seq_lens, float(scale) * LOG2E, int(block_size),
        tiles, D, *q.stride(), *ks, *vs, *out.stride(), block_table.stride(0), GROUP=H // G,
        DOT_F32=interpreting(), BLOCK_P=cfg["BLOCK_P"], GROUP_P=cfg["GROUP_P"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The trainer's layout: q `[B, T, H, D]`, k / v `[B, T, G, D]`, right-padded sequences from position 0, causal
    -> `[B, T, H, D]`. The same kernel and config as `paged_attention`, through the identity mapping: sequence b is
    request b with T rows, its keys one block of size T (slot b·T + p), so every row has the engine's bits."""
    B, T, H, D = q.shape
    G = k.shape[2]
    out = torch.empty((B * T, H, D), dtype=q.dtype, device=q.device)
    if B == 0 or T == 0:
        return out.view(B, T, H, D)
    idx = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    paged_attention(q.reshape(B * T, H, D), k.reshape(B * T, G, D), v.reshape(B * T, G, D), idx[:B, None], T,
                    idx * T, torch.full((B,), T, dtype=torch.int32, device=q.device), T, scale, out=out)
    return out.view(B, T, H, D)
