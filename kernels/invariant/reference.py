"""Batch-invariant references of the forward pass around the projections: what the engine and the trainer both run
when `engine.bitwise` is on, so that a sampled token's log-prob is the same number on both sides.

Every op names its rounding points; between them it computes in float64. bf16 and e4m3 operands, and their
products with fp32 tables, are exact in float64, so a reduction's order (the number of tokens in the call, a BLAS
blocking, where the keys sit in a paged cache) changes a float64 result only in its last bits, far below the bf16 /
fp32 rounding that follows: the rounded outputs agree unless a value lies within ~2^-40 of a rounding boundary
(never seen on a real model). Elementwise ops (products, sums of two terms) are correctly rounded and therefore equal
whatever the layout.

    rms_norm      y = bf16(x · 1/sqrt(mean(x²) + eps) · w); with a residual r: first x = bf16(fp32(x) + fp32(r)),
                  the sum torch and vLLM compute for a bf16 add, returned as the new residual
    rotary        Neox-style rotation of the first `rotary_dim` features: a = bf16(q₁c - q₂s), b = bf16(q₂c + q₁s),
                  cos / sin from `rotary_table` (fp32)
    silu_mul      bf16(silu(g) · u)
    attention     causal softmax(q kᵀ · scale) v, fp64 scores and softmax, rounded to bf16 once
                  (decode_attention: the same for one query per request, R requests at once)
    logits        fp32(h · Wᵀ): the LM head, exact dot rounded once (the sampler's fp32 logits, no bf16 rounding)
    log_softmax   fp32(x - logsumexp(x)) of fp32 logits: the log-sum-exp in float64, one rounding per log-prob
                  (token_logprobs: the same numbers at given token ids, without the [N, V] output)
"""

from __future__ import annotations

import functools

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             compute: torch.dtype = torch.float64):
    """x `[..., H]` -> y (x.dtype); with residual: (y, x + residual), the sum rounded to x.dtype and normed. compute:
    the arithmetic's dtype (float64 here; ops.py differentiates the same formula in float32)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xc = x.to(compute)
    inv = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = (xc * inv * weight.to(compute)).to(x.dtype)
    return y if residual is None else (y, x)


@functools.lru_cache(maxsize=8)
def _rotary_table_cpu(rotary_dim: int, base: float, positions: int) -> torch.Tensor:
    inv_freq = torch.pow(torch.tensor(float(base), dtype=torch.float64),
                         -torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def rotary_table(rotary_dim: int, base: float, positions: int, device) -> torch.Tensor:
    """`[positions, rotary_dim]` fp32: cos of every frequency, then sin (computed once on the CPU in float64, so
    both sides hold the same table whatever their device)."""
    return _rotary_table_cpu(int(rotary_dim), float(base), int(positions)).to(device)


def rotary(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
           compute: torch.dtype = torch.float64) -> torch.Tensor:
    """x `[T, heads, D]` (or `[..., T, heads, D]` with positions broadcasting over T), rotated Neox-style over its
    first `table.shape[1]` features; the rest pass through. compute: as in `rms_norm`."""
    rot = table.shape[1]
    half = rot // 2
    cs = table[positions].to(compute)  # [T, rot]
    cos, sin = cs[..., None, :half], cs[..., None, half:]
    x1, x2 = x[..., :half].to(compute), x[..., half:rot].to(compute)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rotated if rot == x.shape[-1] else torch.cat([rotated, x[..., rot:]], dim=-1)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, compute: torch.dtype = torch.float64) -> torch.Tensor:
    """bf16(silu(gate) · up). torch's silu rather than g / (1 + exp(-g)): as the backward's fp32 stand-in (ops.py),
    the spelled-out formula keeps three more MLP-wide activations for autograd, which slows the trainer's step and
    raises its peak memory (BENCHMARKS.md, Bitwise pairing)."""
    return (torch.nn.functional.silu(gate.to(compute)) * up.to(compute)).to(gate.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int = 0) -> torch.Tensor:
    """Causal attention of one sequence: q `[T, H, D]` at positions q_start .. q_start + T - 1 over k, v
    `[S, G, D]` at positions 0 .. S - 1 (G kv heads, H a multiple of G) -> `[T, H, D]` in q.dtype. Row t sees the
    keys at positions <= q_start + t."""
    T, H, _ = q.shape
    k, v = k[:q_start + T], v[:q_start + T]  # keys past the last query are seen by no row (nor read)
    S, G, _ = k.shape
    k64 = k.double().repeat_interleave(H // G, dim=1)
    v64 = v.double().repeat_interleave(H // G, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k64) * scale
    visible = torch.arange(S, device=q.device)[None, :] <= (q_start + torch.arange(T, device=q.device))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, v64).to(q.dtype)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`attention` for R requests of one query each, at once: q `[R, H, D]` at position lengths - 1 over k, v
    `[R, L, G, D]` (request r's keys at positions 0 .. lengths[r] - 1, then padding) -> `[R, H, D]`. The padding's
    probabilities are exact zeros, so each row is `attention`'s row up to the float64 sum's last bits."""
    R, H, _ = q.shape
    G = k.shape[2]
    k64 = k.double().repeat_interleave(H // G, dim=2)
    v64 = v.double().repeat_interleave(H // G, dim=2)
    scores = torch.einsum("rhd,rshd->rhs", q.double(), k64) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] < lengths[:, None]
    probs = torch.softmax(scores.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    v64 = v64.masked_fill(~visible[:, :, None, None], 0.0)  # padding never reaches a row, whatever it holds
    return torch.einsum("rhs,rshd->rhd", probs, v64).to(q.dtype)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden `[N, H]`, weight `[V, H]` -> fp32 `[N, V]`, the exact dot rounded once."""
    return (hidden.double() @ weight.double().t()).float()


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """logits `[N, V]` -> fp32 log-probs `[N, V]`, each x - logsumexp(x) in float64 rounded once. The samplers' own
    fp32 log-softmax kernels (torch's, vLLM's Triton one with approximate exp and log) round along the way, each in
    its own order."""
    x64 = logits.double()
    return (x64 - torch.logsumexp(x64, dim=-1, keepdim=True)).float()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits `[N, V]`, token_ids `[N, K]` -> fp32 `[N, K]`: `log_softmax(logits)` at those ids, bit for bit."""
    x64 = logits.double()
    lse = torch.logsumexp(x64, dim=-1, keepdim=True)
    return (x64.gather(-1, token_ids.long()) - lse).float()


def paged_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, block_table: torch.Tensor,
                    block_size: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's layout of `attention`: q `[N, H, D]` packs the rows of R requests (request r owns rows
    query_start_loc[r] .. query_start_loc[r + 1] - 1, the last positions of its seq_lens[r]-long sequence); the keys
    and values of request r at position p sit at slot `block_table[r, p // block_size] * block_size + p %
    block_size` of k_store / v_store `[slots, G, D]` (or `[num_blocks, block_size, G, D]`, any strides). Writes
    `out` `[N, H, D]` (new when None) and returns it.
    One-query requests (a decode step's) go through `decode_attention` together, the others one by one through
    `attention`, gathered in position order. max_query_len: unused here (the Triton kernel's grid)."""
    del max_query_len
    if k_store.dim() == 4:  # a paged cache: block b's offset o is slot b · block_size + o
        k_store, v_store = (t.reshape(-1, *t.shape[2:]) for t in (k_store, v_store))
    out = torch.empty_like(q) if out is None else out
    starts, lengths = query_start_loc.tolist(), seq_lens.tolist()
    decode = [r for r in range(len(lengths)) if starts[r + 1] - starts[r] == 1]
    if decode:
        rows = torch.tensor([starts[r] for r in decode], device=q.device)
        decode_lens = seq_lens[decode].long()
        positions = torch.arange(max(lengths[r] for r in decode), device=q.device)
        table = block_table[decode].long()
        slots = table[:, positions // block_size] * block_size + positions % block_size  # [R, L]; past a length: unread
        slots = torch.where(positions[None, :] < decode_lens[:, None], slots, 0)
        out[rows] = decode_attention(q[rows], k_store[slots], v_store[slots], decode_lens, scale)
    for r, seq_len in enumerate(lengths):
        first, last = starts[r], starts[r + 1]
        if last - first <= 1:
            continue
        positions = torch.arange(seq_len, device=q.device)
        slots = block_table[r].long()[positions // block_size] * block_size + positions % block_size
        out[first:last] = attention(q[first:last], k_store[slots], v_store[slots], scale, q_start=seq_len - (last - first))
    return out


def attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The trainer's layout of `attention`: q `[B, T, H, D]`, k, v `[B, T, G, D]`, right-padded sequences from
    position 0 -> `[B, T, H, D]`."""
    return torch.stack([attention(q[b], k[b], v[b], scale) for b in range(q.shape[0])])
