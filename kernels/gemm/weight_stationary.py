"""Weight-stationary W8A16 GEMM: yᵀ = W·xᵀ with e4m3 codes widened to bf16 in registers (wgmma's A operand).

    y[m, n] = act( (Σ_k x[m,k] w[n,k]) * s_w + σ Σ_j xa[m,j] b[n,j] + bias[n] ),   xa = act(x · Aᵀ)

for bf16 x and e4m3 (or bf16) w of any strides: the forward (w = codes `[N, K]`) and the backward dX
(w = codes read `[K, N]` with N as the reduction, strides (1, K)). Tokens are wgmma's N dimension.

Batch invariance (a row's bits never depend on M or on the other rows): the K loop runs in chunks fixed by
(N, K) (`configs.k_chunking`); each chunk is accumulated from zero in 16-deep wgmma k-steps and the chunks
are added in chunk order. Two schedules give the same bits:
- single pass (many tokens): one program per output tile loops over the chunks (`_ws_single_kernel`);
- split-K (few tokens): one program per (tile, chunk) writes its fp32 chunk partial, and
  `_ws_reduce_kernel` adds them in chunk order and runs the same epilogue. The LoRA down-projection
  xaᵀ = A·xᵀ is the same GEMM with A as the weight, over finer sub-chunks (`configs.xa_chunking`: at most
  512 deep, so no down program is longer than a base program): in split-K it rides in the partial kernel as its
  first programs (no extra launch; split-K is then used for a one-chunk layer too), and `_ws_reduce_kernel`
  sums its sub-chunks in order before rounding xa to bf16; for many tokens `lora_down` runs those programs
  alone (same sub-chunks, same order), then the single pass. With PDL (default on Hopper) a decode call runs
  `lora_down` first and the base partial kernel, compiled as without LoRA, as its programmatic dependent; the
  reduce reads the bf16 xa (same bits; the weight stream does not carry the LoRA branch's registers).
  By default (`ws_splitk`, EPIRL_WS_TICKET=0 turns it off) split-K without the fused down-projection, and `lora_down`
  at decode sizes, are one launch each: the last-arriving program of a tile does the reduce kernel's work.
The σ·LoRA + y step is an explicit `tl.fma` (no compiler-chosen contraction).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._dispatch import check_reduction, interpreting, pdl_supported
from . import wgmma_drain
from .configs import CHUNK_ALIGN, k_chunking, tile_of, ws_config, xa_chunking
from .ws_epilogue import _load_xa, _lora_b_tile, _sum_parts, _ws_chunk, _ws_epilogue, _ws_tile, _ws_tile_of, _xa_from_parts
from .ws_splitk import launch_ticket, ticket_enabled
from .ws_tma import checked_tma_single, launch_tma_single, tma_ok

PDL_ENV = "EPIRL_WS_PDL"  # "0": launch the split-K reduce kernel plainly, not as a PDL dependent (on by default)
DOWN_GROUP_ENV = "EPIRL_WS_DOWN_GROUP"
GLUON_ENV = "EPIRL_WS_GLUON"  # "0": a table entry's Gluon forward off (its TMA / pointer config runs instead)
_GLUON: dict = {}  # "module": ws_gluon once imported; "broken": why it cannot run in this process
LORA_TILE_MIN = 64  # rows of a LoRA-down program: >= 64 keeps it on wgmma like the base tiles
DOWN_FIRST_MAX_M = 64  # the decode buckets: above, xa's launch is not worth hiding behind the base GEMM
# `lora_down` as one pass per token tile (`_down_single_pass`) from this many programs at DOWN_SINGLE_BM tokens a tile
DOWN_SINGLE_MIN_PROGRAMS = 128
DOWN_SINGLE_BM = 32


@triton.jit(do_not_specialize=["M"])
def _ws_partial_kernel(
    x_ptr, w_ptr, a_ptr, part_ptr, xa_part_ptr, M, N, K, R, K_CHUNK, XA_CHUNK, XA_SUBS,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ar, stride_ak,
    HAS_BASE: tl.constexpr, HAS_DOWN: tl.constexpr, DOT_F32: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr, BRT: tl.constexpr, GROUP_N: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
    WAIT_AT_END: tl.constexpr = False, EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False,
    EVEN_M: tl.constexpr = False,
):
    """Program (p, chunk c). With HAS_DOWN the first m_tiles x XA_SUBS x ⌈R / BRT⌉ programs of each chunk compute
    the fp32 partials of the LoRA down-projection xaᵀ = A·xᵀ, one (token tile, sub-chunk, rank tile) each: first in
    their chunk's row of the grid, so that they are not the last to start. The others compute the chunk's partial
    of one base tile. WAIT_AT_END: launched as the PDL dependent of `lora_down` (whose xa it does not read): it
    waits for it only before it exits, so that its own dependent (the reduce, which reads xa) may rely on both."""
    if LAUNCH_DEPENDENTS:  # PDL: the reduce kernel may launch now; it reads nothing of ours before its gdc_wait
        tl.extra.cuda.gdc_launch_dependents()
    m_tiles = tl.cdiv(M, BM)
    c = tl.program_id(1)
    pid = tl.program_id(0)
    k_lo = c * K_CHUNK
    # HAS_BASE=False (lora_down alone) compiles only the LoRA branch: the branches' shared memory adds up
    if HAS_BASE:
        n_down = 0
        if HAS_DOWN:
            n_down = m_tiles * XA_SUBS * tl.cdiv(R, BRT)
        if pid >= n_down:
            rn, rm, mask_n, mask_m = _ws_tile_of(pid - n_down, N, M, BN, BM, GROUP_N)
            acc = _ws_chunk(w_ptr, x_ptr, rn, rm, N, M, k_lo, k_lo + K_CHUNK, K, stride_wn, stride_wk,
                            stride_xm, stride_xk, BN, BM, BK, DOT_F32, EVEN_K, EVEN_N, EVEN_M)
            tl.store(part_ptr + (c * M + rm[None, :].to(tl.int64)) * N + rn[:, None], acc,
                     mask=mask_n[:, None] & mask_m[None, :])
        elif HAS_DOWN:
            _down_partial(x_ptr, a_ptr, xa_part_ptr, pid, c, M, K, R, k_lo, XA_CHUNK, XA_SUBS,
                          stride_xm, stride_xk, stride_ar, stride_ak, DOT_F32, BM, BK, BRT, EVEN_K, EVEN_M)
    else:
        _down_partial(x_ptr, a_ptr, xa_part_ptr, pid, c, M, K, R, k_lo, XA_CHUNK, XA_SUBS,
                      stride_xm, stride_xk, stride_ar, stride_ak, DOT_F32, BM, BK, BRT, EVEN_K, EVEN_M)
    if WAIT_AT_END:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _down_partial(x_ptr, a_ptr, xa_part_ptr, pid, c, M, K, R, k_lo, XA_CHUNK, XA_SUBS, stride_xm, stride_xk,
                  stride_ar, stride_ak, DOT_F32: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                  BRT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_M: tl.constexpr):
    """Down program pid of base chunk c: the fp32 partial of xaᵀ = A·xᵀ over one sub-chunk of the chunk (from zero,
    A as the weight: same k-steps as a base tile) for one token tile and BRT rows of A (`_down_tile_rows`: all of
    them up to r = 128), stored as partial c·XA_SUBS + sub (the order in which `_xa_from_parts` adds them)."""
    m_tiles = tl.cdiv(M, BM)
    rest = pid // m_tiles
    r_tiles = tl.cdiv(R, BRT)
    sub = rest // r_tiles
    rr = (rest % r_tiles) * BRT + tl.arange(0, BRT)
    rm = (pid % m_tiles) * BM + tl.arange(0, BM)
    mask_r = rr < R
    mask_m = rm < M
    k_sub = k_lo + sub * XA_CHUNK
    acc = _ws_chunk(a_ptr, x_ptr, rr, rm, R, M, k_sub, k_sub + XA_CHUNK, K, stride_ar, stride_ak,
                    stride_xm, stride_xk, BRT, BM, BK, DOT_F32, EVEN_K, False, EVEN_M)
    tl.store(xa_part_ptr + ((c * XA_SUBS + sub) * M + rm[None, :].to(tl.int64)) * R + rr[:, None], acc,
             mask=mask_r[:, None] & mask_m[None, :])


@triton.jit(do_not_specialize=["M"])
def _ws_reduce_kernel(
    part_ptr, xa_part_ptr, xa_ptr, y_ptr, w_scale_ptr, b_ptr, bias_ptr, M, N, R, N_CHUNKS, N_XA, lora_scale,
    stride_ym, stride_yn, stride_xam, stride_xar, stride_bn, stride_br,
    HAS_W_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, XA_PARTS: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
    WAIT_PDL: tl.constexpr,
):
    """Adds the chunk partials in chunk order (as the single pass does) and runs the epilogue; with XA_PARTS the
    N_XA partials of the down-projection are added in order into xa first. WAIT_PDL: launched as the partial
    kernel's programmatic dependent (resident while it runs), so it fetches its rows of B, which the partial
    kernel does not write, and then waits for it before the first read of a partial."""
    rn, rm, mask_n, mask_m = _ws_tile(N, M, BN, BM, GROUP_N)
    b = _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, HAS_LORA, BN, BR)
    if WAIT_PDL:
        tl.extra.cuda.gdc_wait()
    total = _sum_parts(part_ptr, M * N, rm[None, :].to(tl.int64) * N + rn[:, None],
                       mask_n[:, None] & mask_m[None, :], N_CHUNKS, BN, BM, False)
    xa_t = _load_xa(xa_part_ptr, xa_ptr, rm, mask_m, M, R, N_XA, stride_xam, stride_xar,
                    HAS_LORA, XA_PARTS, BR, BM)
    _ws_epilogue(total, xa_t, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, bias_ptr, lora_scale,
                 stride_ym, stride_yn, HAS_W_SCALE, HAS_LORA, HAS_BIAS, DOT_F32)


@triton.jit(do_not_specialize=["M"])
def _xa_reduce_kernel(xa_part_ptr, xa_ptr, M, R, N_CHUNKS, BR: tl.constexpr, BM: tl.constexpr,
                      PDL: tl.constexpr):
    """xa `[M, R]` bf16 from the down-projection's chunk partials (same order as `_ws_reduce_kernel`). PDL: the
    partial kernel's programmatic dependent and the primary of the base GEMM that reads xa (it lets that one
    launch at once, then waits for the partials)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = rm < M
    rr = tl.arange(0, BR)
    xa_t = _xa_from_parts(xa_part_ptr, rm, mask_m, M, R, N_CHUNKS, BR, BM)
    tl.store(xa_ptr + rm[None, :].to(tl.int64) * R + rr[:, None], xa_t, mask=(rr < R)[:, None] & mask_m[None, :])


@triton.jit(do_not_specialize=["M"])
def _ws_single_kernel(
    x_ptr, w_ptr, y_ptr, w_scale_ptr, xa_ptr, b_ptr, bias_ptr, M, N, K, R, K_CHUNK, N_CHUNKS, lora_scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    stride_xam, stride_xar, stride_bn, stride_br,
    HAS_W_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
    WAIT_PDL: tl.constexpr = False, EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False,
    EVEN_M: tl.constexpr = False, FLATTEN: tl.constexpr = False,
):
    """One program per output tile: every chunk from zero, added in chunk order, then the epilogue. WAIT_PDL:
    launched as the programmatic dependent of the kernel that writes xa (`lora_down`), so the weights stream
    while the down-projection runs; it waits for xa only before its epilogue. FLATTEN: the chunk loop and each
    chunk's K loop are one software-pipelined loop (Triton's loop flattening), so the loads of chunk c + 1 are in
    flight while chunk c ends instead of the pipeline draining and refilling at every chunk; same operations in
    the same order."""
    rn, rm, mask_n, mask_m = _ws_tile(N, M, BN, BM, GROUP_N)
    total = tl.zeros((BN, BM), dtype=tl.float32)
    tl.assume(N_CHUNKS > 0)
    for c in tl.range(0, N_CHUNKS, flatten=FLATTEN):
        total += _ws_chunk(w_ptr, x_ptr, rn, rm, N, M, c * K_CHUNK, (c + 1) * K_CHUNK, K,
                           stride_wn, stride_wk, stride_xm, stride_xk, BN, BM, BK, DOT_F32, EVEN_K, EVEN_N, EVEN_M)
    b = _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, HAS_LORA, BN, BR)
    if WAIT_PDL:
        tl.extra.cuda.gdc_wait()
    xa_t = _load_xa(xa_ptr, xa_ptr, rm, mask_m, M, R, 1, stride_xam, stride_xar, HAS_LORA, False, BR, BM)
    _ws_epilogue(total, xa_t, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, bias_ptr, lora_scale,
                 stride_ym, stride_yn, HAS_W_SCALE, HAS_LORA, HAS_BIAS, DOT_F32)


def split_pdl(x: torch.Tensor) -> bool:
    """Whether the split-K reduce launches as the partial kernel's programmatic dependent (PDL: its launch and
    prologue overlap the partial kernel, which matters at decode, where both take a few µs). Same arithmetic
    either way (GPU test: same bits, graph-capturable). On by default since the H200 measurement of 2026-12-01
    (`scripts/bench_kernels.py`, both timed in one run): 1-16 tokens 0-15 % faster on every Qwen3-8B / Qwen3.5-9B
    projection (q3_down at 1 token 45.9 -> 39.3 µs), 64 tokens within ±4 %. EPIRL_WS_PDL=0 turns it off."""
    return x.is_cuda and os.environ.get(PDL_ENV, "1") != "0" and pdl_supported(x.device.index or 0)


def whole_k(K: int) -> tuple[int, int]:
    """One chunk (one accumulator): for dX, which need not be batch invariant (measured 1.3-1.45x faster
    than the forward's chunking at 4096 tokens on the H200, scripts/tune_w8a16.py)."""
    check_reduction(K)
    return cdiv(K, CHUNK_ALIGN) * CHUNK_ALIGN, 1


def even_k(K: int, k_chunk: int, n_chunks: int) -> bool:
    """Whether the chunks tile K exactly (every real Qwen shape): the K loops then load without masks."""
    return k_chunk * n_chunks == K


def _down_tile_rows(R: int) -> int:
    """Rows of A per down-projection program (`lora_down`, and the down partials the split-K launch fuses): all r
    rows up to 128; above (the block-diagonal rank S·r of one call per fused layer, kernels/w8a16_lora/slices.py),
    64-row tiles side by side - one 256-row tile's pipeline needs 272 KiB of shared memory (H200: 227 KiB). Each xa
    column is its own dot over K in the same BK steps whatever the tile's height, so the bits do not depend on this
    choice (tests/kernels/test_fused_slices_gpu.py; interpreter case `rank_tiled_down_projection`)."""
    return max(LORA_TILE_MIN, next_power_of_2(R)) if R <= 128 else LORA_TILE_MIN


def _epilogue_rows(R: int) -> int:
    return max(16, next_power_of_2(R)) if R else 16


def _launch_partials(x, w, lora_a, M, N, K, R, k_chunk, n_chunks, cfg, xa_chunk=0, xa_subs=1,
                     launch_dependents=False, after_down=False):
    """fp32 chunk partials of the base tiles (w given) and/or of xaᵀ = A·xᵀ (lora_a given, `xa_subs` sub-chunks
    of `xa_chunk` per base chunk): one launch (that lets a PDL dependent launch at once if asked; after_down: it
    is itself the PDL dependent of `lora_down(..., pdl=True)`)."""
    n_base = N if w is not None else 0
    part = torch.empty(n_chunks, M, n_base, device=x.device, dtype=torch.float32) if n_base else None
    xa_part = (torch.empty(n_chunks * xa_subs, M, R, device=x.device, dtype=torch.float32)
               if lora_a is not None else None)
    dummy = part if part is not None else xa_part
    m_tiles = cdiv(M, cfg["BM"])
    down_rows = _down_tile_rows(R)
    down_programs = m_tiles * xa_subs * cdiv(R, down_rows) if lora_a is not None else 0
    programs = cdiv(n_base, cfg["BN"]) * m_tiles + down_programs
    w_ = w if w is not None else lora_a
    a_ = lora_a if lora_a is not None else w_
    _ws_partial_kernel[(programs, n_chunks)](
        x, w_, a_, dummy if part is None else part, dummy if xa_part is None else xa_part,
        M, n_base, K, R, k_chunk, xa_chunk, xa_subs,
        x.stride(0), x.stride(1), w_.stride(0), w_.stride(1), a_.stride(0), a_.stride(1),
        HAS_BASE=n_base > 0, HAS_DOWN=lora_a is not None, DOT_F32=interpreting(), BN=cfg["BN"], BM=cfg["BM"],
        BK=cfg["BK"], BRT=down_rows, GROUP_N=cfg.get("GROUP_N", 8), LAUNCH_DEPENDENTS=launch_dependents,
        WAIT_AT_END=after_down, EVEN_K=even_k(K, k_chunk, n_chunks), EVEN_N=n_base % cfg["BN"] == 0,
        EVEN_M=M % cfg["BM"] == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"launch_pdl": True} if after_down else {}))
    return part, xa_part


def down_parts_per_program(cfg: dict, K: int, k_chunk: int, n_chunks: int, rows: int, xa_chunk: int,
                           x_bytes: int, device_groups: bool = True) -> int:
    """Sub-chunks of xa per `lora_down` program at decode, where the base GEMM (config `cfg`) runs as its PDL
    dependent. Behind an 8-warp base tile (one CTA an SM) the down programs, which start first, each hold an SM a base
    program then waits for: 24 one-sub-chunk programs beside q3_down's 128 base programs. There a down program takes as
    many sub-chunks as make it read about what a base program reads (its BN rows of codes over a chunk, or over all of
    K for a single pass): q3_down 4 programs of 6, LoRA +14 -> +10 % at 16 tokens (24.2 -> 23.2 µs, H200, two runs
    each way). Behind 4-warp tiles, two or three CTAs an SM, a down CTA finds room and longer programs only lengthen
    xa's chain (q3_qkv +0.3 µs grouped): one sub-chunk each. Same partials, same order, same bits
    (`_ws_ticket_kernel`'s GROUPED). device_groups (`_device_groups_down`): whether this device gains from it at all -
    an H100 does not (q3_down 26.1 / 28.0 µs ungrouped against 30.1 / 31.8 grouped at 1 / 16 tokens, two runs each
    way, 2026-12-05). EPIRL_WS_DOWN_GROUP=0 / 1: one sub-chunk per program / grouped on any device (for A/B timing)."""
    setting = os.environ.get(DOWN_GROUP_ENV, "")
    if setting == "0" or (setting != "1" and not device_groups) or cfg["num_warps"] < 8:
        return 1
    base_depth = k_chunk if cfg.get("split", True) and n_chunks > 1 else K
    return max(1, (cfg["BN"] * base_depth) // (rows * xa_chunk * x_bytes))


@functools.lru_cache(maxsize=8)
def _device_groups_down(device_index) -> bool:
    """Whether `lora_down` groups its decode programs on this CUDA device (`down_parts_per_program`): measured a gain
    on the H200 (the decode table's device) and a loss on the H100; other devices follow the H200."""
    return "H100" not in torch.cuda.get_device_name(device_index)


def _gluon_gemm(x, w, y, w_scale, xa, lora_b, lora_scale, bias, k_chunk, n_chunks, gluon_cfg, br, pointer,
                checked, op="fwd") -> bool:
    """y from the Gluon kernel (`ws_gluon`: forward, or dX with w = `codes.t()`) of a table entry's "gluon" config,
    if it can run this call: checked against the pointer kernel (`pointer(out)`) on its first call per key and every
    RECHECK_EVERY calls, as a table TMA entry is (`checked`; an explicit config runs it as it is). False: the caller
    runs its Triton kernels."""
    gluon_mod = _gluon() if x.is_cuda else None
    gluon_cfg = gluon_mod.fitting_config(x, w, y, xa, lora_b, k_chunk, n_chunks, gluon_cfg, br) if gluon_mod else None
    if gluon_cfg is None:
        return False

    def gluon(out):
        try:
            return gluon_mod.launch_gluon_fwd(x, w, out, w_scale, xa, lora_b, lora_scale, bias, k_chunk, n_chunks,
                                              gluon_cfg, br)
        except Exception as err:  # Gluon is experimental: an API this Triton moved fails here, not silently
            _GLUON["broken"] = f"{type(err).__name__}: {str(err)[:200]}"
            warnings.warn(f"W8A16 Gluon kernel unavailable on this Triton ({_GLUON['broken']}); the table's Triton "
                          f"kernels run instead ({GLUON_ENV}=0 turns it off)")
            return pointer(out)

    if checked:
        M, N = y.shape
        key = (f"{op}-gluon", N, x.shape[1], tuple(sorted(gluon_cfg.items())), xa is not None, bias is not None,
               M.bit_length())
        checked_tma_single(key, y, gluon, pointer, kernel=f"Gluon {op} ({GLUON_ENV}=0 turns it off)")
    else:
        gluon(y)
    return True


def _gluon():
    """`ws_gluon` (the warp-specialized Gluon kernel a table entry's "gluon" asks for), or None: turned off
    (EPIRL_WS_GLUON=0), a Triton without Gluon's Hopper API, or one whose first launch failed here."""
    if os.environ.get(GLUON_ENV, "1") == "0" or "broken" in _GLUON:
        return None
    if "module" not in _GLUON:
        try:
            from . import ws_gluon
        except (ImportError, AttributeError) as err:
            _GLUON["broken"] = f"{type(err).__name__}: {err}"
            return None
        _GLUON["module"] = ws_gluon
    return _GLUON["module"]


def lora_down(x, lora_a, chunk_n: int | None = None, op: str = "fwd", pdl: bool = False, keep: list | None = None):
    """xa `[M, r]` = bf16(x · Aᵀ), batch invariant: the sub-chunks of `configs.xa_chunking` for the base layer
    `[chunk_n, K]` (default r), each from zero, added in order - the same bits as the down-projection fused into
    the split-K path. pdl: both launches let their dependents launch at once (the next kernel launched with
    launch_pdl must gdc_wait before it reads xa)."""
    M, K = x.shape
    R = lora_a.shape[0]
    out = torch.empty(M, R, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    if x.is_cuda:
        wgmma_drain.install()  # (a no-op unless the pass is wanted and something replaced Triton's hook)
    k_chunk, n_chunks = k_chunking(chunk_n or R, K)
    xa_chunk, xa_subs, n_xa = xa_chunking(chunk_n or R, K)
    rows = _down_tile_rows(R)
    if not pdl and cdiv(M, DOWN_SINGLE_BM) * cdiv(R, rows) >= DOWN_SINGLE_MIN_PROGRAMS:
        return _down_single_pass(x, lora_a, out, xa_chunk, n_xa, rows)
    cfg = ws_config(op, chunk_n or R, K, M)
    if ticket_enabled():  # one launch (ws_splitk): at decode the launch pair's tail, in training a launch's host time
        group = down_parts_per_program(cfg, K, k_chunk, n_chunks, rows, xa_chunk, x.element_size(),
                                       _device_groups_down(x.device.index) if x.is_cuda else True) if pdl else 1
        return launch_ticket(x, lora_a, out, R, xa_chunk, n_xa, dict(cfg, BN=rows), down=True,
                             launch_dependents=pdl, dot_f32=interpreting(), even_k=even_k(K, k_chunk, n_chunks),
                             parts_per_program=group, keep=keep)
    _, xa_part = _launch_partials(x, None, lora_a, M, 0, K, R, k_chunk, n_chunks, cfg, xa_chunk, xa_subs,
                                  launch_dependents=pdl)
    if keep is not None:
        keep.append(xa_part)
    BM = 32
    _xa_reduce_kernel[(cdiv(M, BM),)](xa_part, out, M, R, n_xa, BR=_epilogue_rows(R), BM=BM, PDL=pdl,
                                      num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out


def _split_two_launches(x, w, y, ws, xa, fused_a, b_, bias_, R, k_chunk, n_chunks, lora_scale, lora_strides, cfg,
                        flags, pdl, after_down):
    """Split-K as the partial kernel (with the down-projection's partials when fused_a, A, is given) and the reduce
    kernel (EPIRL_WS_TICKET=0, or the fused down-projection without PDL); R: the LoRA rank (0 without)."""
    M, K = x.shape
    N = w.shape[0]
    xa_chunk, xa_subs, n_xa = xa_chunking(N, K) if fused_a is not None else (0, 1, 0)
    part, xa_part = _launch_partials(x, w, fused_a, M, N, K, R, k_chunk, n_chunks, cfg, xa_chunk, xa_subs,
                                     launch_dependents=pdl, after_down=after_down)
    xa_ = xa if xa is not None else y
    tiles = cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"])
    _ws_reduce_kernel[(tiles,)](
        part, xa_part if fused_a is not None else part, xa_, y, ws, b_, bias_, M, N, R, n_chunks, n_xa,
        float(lora_scale), y.stride(0), y.stride(1), xa.stride(0) if xa is not None else 0,
        xa.stride(1) if xa is not None else 0, *lora_strides, XA_PARTS=fused_a is not None, WAIT_PDL=pdl,
        num_warps=4, **flags, **({"launch_pdl": True} if pdl else {}))


def _down_single_pass(x, lora_a, out, xa_chunk, n_xa, rows):
    """`lora_down` for many tokens: one program per (token tile, rank tile) runs every sub-chunk of xa's K chunking
    (each from zero, added in order: `_ws_single_kernel` with A as the weight) and rounds once. The split-K paths
    sum the same sub-chunk partials in the same order from +0.0, so the bits are theirs; but no fp32 partial goes
    through memory, which made a training `lora_down` 2.6-2.9x its HBM floor (Qwen3-8B at 8192 tokens: 40 µs for
    K = 4096, 134 µs for down's K = 12288, against cuBLAS's ~50 µs for the latter; scripts/probe_k_chunking.py
    --kernels). A pass streams x once; 32-64-token tiles keep >= DOWN_SINGLE_MIN_PROGRAMS programs."""
    M, K = x.shape
    R = lora_a.shape[0]
    BM = 64 if cdiv(M, 64) * cdiv(R, rows) >= DOWN_SINGLE_MIN_PROGRAMS else DOWN_SINGLE_BM
    tiles = cdiv(M, BM) * cdiv(R, rows)
    _ws_single_kernel[(tiles,)](
        x, lora_a, out, out, out, out, out, M, R, K, 0, xa_chunk, n_xa, 1.0,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), out.stride(0), out.stride(1), 0, 0, 0, 0,
        HAS_W_SCALE=False, HAS_LORA=False, HAS_BIAS=False, DOT_F32=interpreting(), BN=rows, BM=BM, BK=128, BR=16,
        GROUP_N=8, EVEN_K=even_k(K, xa_chunk, n_xa), EVEN_N=R % rows == 0, EVEN_M=M % BM == 0,
        num_warps=4, num_stages=4)
    return out


def weight_stationary_gemm(x, w, out_dtype=torch.bfloat16, w_scale=None, xa=None, lora_b=None, lora_scale=1.0,
                           bias=None, config=None, allow_split=True, out=None, lora_a=None, op="fwd", return_xa=False):
    """y `[M, N]` for bf16 x `[M, K]` and w `[N, K]` (any strides), LoRA from xa (given) or lora_a (computed
    here, fused into the split-K launch), config from the committed table unless given. return_xa: (y, xa), the
    bf16 LoRA intermediate the epilogue used (the trainer saves it for the backward instead of recomputing it; to
    have it, a decode-size call without PDL runs `lora_down` before the split-K pair instead of fusing the
    down-projection into it: the same bits)."""
    if x.is_cuda:
        wgmma_drain.install()  # (a no-op unless the pass is wanted and something replaced Triton's hook)
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=out_dtype) if out is None else out
    if return_xa and xa is None and lora_a is not None and (M == 0 or N == 0):
        xa = torch.empty(M, lora_a.shape[0], device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return (y, xa) if return_xa else y
    cfg = dict(ws_config(op, N, K, M) if config is None else config)
    k_chunk, n_chunks = k_chunking(N, K) if op == "fwd" else whole_k(K)
    has_lora = xa is not None or lora_a is not None
    fuse_down = xa is None and has_lora and op == "fwd"
    pdl = split_pdl(x)
    # Decode with the down-projection to compute and PDL: `lora_down` first (one launch), the base GEMM as its
    # dependent, streaming the weights while xa is computed, split-K or single pass as the table says (both wait for
    # xa only before their epilogue; until 2026-12-03 a decode call with LoRA always took split-K, which the table's
    # single-pass entries - tuned with LoRA since - beat on the wide layers: gate_up 38.3 -> 32.4 µs at one token,
    # H200). Without PDL the down-projection rides in the split-K launch and the reduce sums its partials.
    down_first = fuse_down and pdl and M <= DOWN_FIRST_MAX_M
    # The down-projection's fp32 partials, held until the base GEMM is launched: that launch lets the base kernel run
    # beside lora_down's kernels (PDL), which the caching allocator does not know, so a workspace freed when lora_down
    # returns could be handed to the base GEMM's partials while lora_down still reads it (seen on the H200 in CUDA-graph
    # replays once the down programs ran as long as the base ones). Any later allocation is for a kernel that starts
    # after the base grid ends, which its last programs' gdc_wait puts after lora_down's.
    down_workspace: list = []
    if down_first:
        xa = lora_down(x, lora_a, N, op, pdl=True, keep=down_workspace)
        fuse_down = False
    elif return_xa and fuse_down:
        xa = lora_down(x, lora_a, N, op)
        fuse_down = False
    split = allow_split and cfg.get("split", M <= 64) and (n_chunks > 1 or fuse_down)
    R = (xa.shape[1] if xa is not None else lora_a.shape[0]) if has_lora else 0
    BR = _epilogue_rows(R)
    ws = w_scale if w_scale is not None else y
    b_ = lora_b if has_lora else y
    bias_ = bias if bias is not None else y
    lora_strides = (lora_b.stride(0), lora_b.stride(1)) if has_lora else (0, 0)
    flags = dict(HAS_W_SCALE=w_scale is not None, HAS_LORA=has_lora, HAS_BIAS=bias is not None,
                 DOT_F32=interpreting(), BN=cfg["BN"], BM=cfg["BM"], BR=BR, GROUP_N=cfg.get("GROUP_N", 8))
    tiles = cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"])
    if split and not fuse_down and ticket_enabled():  # one launch, reduced by each tile's last program (ws_splitk)
        launch_ticket(x, w, y, N, k_chunk, n_chunks, cfg, w_scale=w_scale, xa=xa, lora_b=lora_b if has_lora else None,
                      lora_scale=lora_scale, bias=bias, br=BR, wait_pdl=down_first, dot_f32=interpreting(),
                      even_k=even_k(K, k_chunk, n_chunks))
        return (y, xa) if return_xa else y
    if split:
        _split_two_launches(x, w, y, ws, xa, lora_a if fuse_down else None, b_, bias_, R, k_chunk, n_chunks,
                            lora_scale, lora_strides, cfg, flags, pdl, down_first)
        return (y, xa) if return_xa else y
    if xa is None and has_lora:
        xa = lora_down(x, lora_a, N, op)
    wait_down = down_first  # xa comes from lora_down's PDL launch pair: wait for it before the epilogue
    def pointer(out):
        _ws_single_kernel[(tiles,)](
            x, w, out, ws, xa if has_lora else out, b_, bias_, M, N, K, R, k_chunk, n_chunks, float(lora_scale),
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            xa.stride(0) if has_lora else 0, xa.stride(1) if has_lora else 0, *lora_strides,
            BK=cfg["BK"], WAIT_PDL=wait_down, EVEN_K=even_k(K, k_chunk, n_chunks), EVEN_N=N % cfg["BN"] == 0,
            EVEN_M=M % cfg["BM"] == 0, FLATTEN=bool(cfg.get("flatten", False)),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags,
            **({"launch_pdl": True} if wait_down else {}))
        return out

    def tma(out):
        return launch_tma_single(x, w, out, ws, xa, b_, bias_, M, N, K, R, k_chunk, n_chunks, lora_scale,
                                 lora_strides, cfg, flags)

    gluon_cfg = cfg.get("gluon") if not wait_down else None  # the warp-specialized forward / dX
    if gluon_cfg and _gluon_gemm(x, w, y, w_scale, xa if has_lora else None, lora_b if has_lora else None,
                                 lora_scale, bias, k_chunk, n_chunks, gluon_cfg, BR, pointer, config is None, op):
        return (y, xa) if return_xa else y
    if not (cfg.get("tma") and tma_ok(x, w) and not wait_down):
        pointer(y)
    elif config is None:  # a table TMA entry (on unless EPIRL_WS_TMA=0), checked per key (ws_tma.checked_tma_single)
        key = (op, N, K, tile_of(cfg), cfg["tma"], bool(cfg.get("flatten")), has_lora, bias is not None, M.bit_length())
        checked_tma_single(key, y, tma, pointer)
    else:  # an explicit config (tuner, bits report, tests): the TMA kernel as it is, so a miscompile shows
        tma(y)
    return (y, xa) if return_xa else y
