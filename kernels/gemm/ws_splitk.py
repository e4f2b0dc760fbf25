"""Split-K in one launch: the W8A16 decode GEMM and the LoRA down-projection reduce in their last-arriving program.

The two-launch split-K of `weight_stationary.py` (a partial kernel, then a reduce kernel that adds the chunk partials
in chunk order and runs the epilogue) pays a second kernel's launch and its wait for the first one's completion in
the tail of every decode call: 2.5 µs of q3_o's 11.3 µs at one token on the H200 (`scripts/profile_decode_lora.py`,
2026-12-03). Here each program (output tile t, chunk p) stores its fp32 partial as before and then takes a ticket, an
atomic increment of t's counter; the program that draws the last ticket resets the counter and does what the reduce
kernel did: it adds the tile's partials **in chunk order** (whichever program arrives last, the sum is the same chain
of adds, so the bits are the two-launch path's, the single pass's and the reference-order's; the atomic orders
arrivals, never values) and runs the same epilogue (`ws_epilogue`).

One kernel, two roles (DOWN):
- base: w = codes `[N, K]`, chunks of `configs.k_chunking(N, K)`, epilogue y = act(Σ·s_w + σ·xa·Bᵀ + bias);
  WAIT_PDL: launched as the programmatic dependent of the down-projection (PDL), its last programs wait for it
  before they read xa;
- DOWN: w = A `[r, K]`, the sub-chunks of `configs.xa_chunking` (row tiles of A side by side), the sum rounded to
  bf16 and stored as xa `[M, r]` (what `_xa_reduce_kernel` stored); LAUNCH_DEPENDENTS lets the base GEMM launch at
  once behind it.
Counters live in a per-(device, stream, role) int32 workspace that starts zeroed and that every use leaves zeroed
(CUDA-graph replays included); two kernels of one role never overlap on a stream (only the base kernel is launched
as a PDL dependent, and of the down kernel, which has the other role). `EPIRL_WS_TICKET=0` restores the two-launch
path (for A/B timing).

Decode with LoRA in ONE launch (`launch_fused_down`, `_ws_fused_down_kernel`): the down-projection's (rank tile,
sub-chunk) programs are the grid's first programs and the base (tile, chunk) programs follow; a base tile's last arrival
waits for xa (a counter of stored xa tiles, release / acquire) before its epilogue. The wait is a spin, safe without
any promise about dispatch order: the down programs wait on nothing, and at most one program per base tile ever
spins, so while fewer base tiles than SMs exist (`fused_down_fits`), a free slot always remains for every down program
to run in. Each program computes what its twin in the two-launch pair (`lora_down`, then the base GEMM as its PDL
dependent) computes, in the same order: the same bits. It saves the second kernel node, which cost a 4 µs-floor layer
(q3_o) ~2 µs a call in CUDA-graph replays (`EPIRL_WS_FUSED_DOWN=0` restores the pair).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._host import cdiv
from .ws_epilogue import _load_xa, _lora_b_tile, _sum_parts, _ws_chunk, _ws_epilogue, _ws_tile_of

TICKET_ENV = "EPIRL_WS_TICKET"
FUSED_DOWN_ENV = "EPIRL_WS_FUSED_DOWN"
# the down programs' k-step group in the one-launch LoRA kernel: its shared memory is the larger branch's pipeline, and
# a 64-deep bf16 A tile takes what a 128-deep e4m3 base tile takes (BK groups k-steps only: same bits; sm_90a compile:
# 40 KiB at the 64 x 16 decode tile, as the base kernel alone)
FUSED_DOWN_BK = 64
COUNTER_SLOTS = 1 << 16  # tiles per launch the workspace holds before it grows (decode: <= 1536 base tiles)
_COUNTERS: dict[tuple, torch.Tensor] = {}


def ticket_enabled() -> bool:
    """One-launch split-K (this module) unless EPIRL_WS_TICKET=0."""
    return os.environ.get(TICKET_ENV, "1") != "0"


def fused_down_fits(x: torch.Tensor, base_tiles: int) -> bool:
    """Whether a decode call with LoRA runs as one launch (`launch_fused_down`): on a GPU, with the one-launch split-K
    on, EPIRL_WS_FUSED_DOWN not 0, and fewer base tiles than SMs (the spin's progress guarantee, module text)."""
    if not x.is_cuda or not ticket_enabled() or os.environ.get(FUSED_DOWN_ENV, "1") == "0":
        return False
    return base_tiles < _sm_count(x.device.index or 0)


_SMS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _counters(device: torch.device, role: str, slots: int) -> torch.Tensor:
    """A zeroed int32 workspace of at least `slots` counters for this device, stream and role (kept zeroed by use)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, role)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < slots:
        buf = torch.zeros(max(COUNTER_SLOTS, slots), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


@triton.jit
def _is_last_arrival(cnt_ptr, slot, n_parts):
    """Whether this program stored the last of slot's n_parts partials. The barrier puts every thread's partial
    stores before the one thread's acq_rel atomic (release: they are visible to the program that draws the last
    ticket; acquire: that program then sees every other program's partials). The last arrival zeroes the counter
    for the next launch."""
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
    last = ticket == n_parts - 1
    if last:
        tl.store(cnt_ptr + slot, 0)
    return last


@triton.jit(do_not_specialize=["M"])
def _ws_ticket_kernel(
    x_ptr, w_ptr, part_ptr, cnt_ptr, y_ptr, w_scale_ptr, xa_ptr, b_ptr, bias_ptr,
    M, N, K, R, K_CHUNK, N_PARTS, lora_scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_xam, stride_xar, stride_bn, stride_br,
    DOWN: tl.constexpr, HAS_W_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    GROUP_N: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, WAIT_PDL: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, ONE_PART: tl.constexpr = False,
):
    """Program (tile, part p): the fp32 partial of w[tile rows] · x[tile tokens]ᵀ over K[p·K_CHUNK, (p+1)·K_CHUNK)
    into part[p], then, in the tile's last arrival, Σ_p part[p] in p order and the epilogue (DOWN: xa = bf16(Σ))."""
    if LAUNCH_DEPENDENTS:  # PDL: the base GEMM behind the down-projection may launch now (it waits before xa)
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    p = tl.program_id(1)
    rn, rm, mask_n, mask_m = _ws_tile_of(tile, N, M, BN, BM, GROUP_N)
    acc = _ws_chunk(w_ptr, x_ptr, rn, rm, N, M, p * K_CHUNK, (p + 1) * K_CHUNK, K, stride_wn, stride_wk,
                    stride_xm, stride_xk, BN, BM, BK, DOT_F32, EVEN_K, EVEN_N, EVEN_M)
    if ONE_PART:  # one chunk (gate_up): every program is its tile's only arrival; +0.0 + acc as _sum_parts adds it
        b = _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, HAS_LORA, BN, BR)
        _ticket_finish(tl.zeros((BN, BM), dtype=tl.float32) + acc, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr,
                       xa_ptr, bias_ptr, R, lora_scale, stride_ym, stride_yn, stride_xam, stride_xar,
                       DOWN, HAS_W_SCALE, HAS_LORA, HAS_BIAS, DOT_F32, BM, BR, WAIT_PDL)
    else:
        offs = rm[None, :].to(tl.int64) * N + rn[:, None]
        mask = mask_n[:, None] & mask_m[None, :]
        tl.store(part_ptr + p.to(tl.int64) * M * N + offs, acc, mask=mask)
        if _is_last_arrival(cnt_ptr, tile, N_PARTS):
            # B's rows first: their DRAM round trip then overlaps the partials' reads instead of following them in the
            # launch's tail (only the last arrival loads them: no program reads B twice)
            b = _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, HAS_LORA, BN, BR)
            # .cg: the other programs' partials are read from L2, never from a line this SM's L1 may hold
            total = _sum_parts(part_ptr, M * N, offs, mask, N_PARTS, BN, BM, True)
            _ticket_finish(total, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, xa_ptr, bias_ptr, R, lora_scale,
                           stride_ym, stride_yn, stride_xam, stride_xar, DOWN, HAS_W_SCALE, HAS_LORA, HAS_BIAS,
                           DOT_F32, BM, BR, WAIT_PDL)


@triton.jit
def _ticket_finish(total, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, xa_ptr, bias_ptr, R, lora_scale,
                   stride_ym, stride_yn, stride_xam, stride_xar, DOWN: tl.constexpr,
                   HAS_W_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr,
                   DOT_F32: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr, WAIT_PDL: tl.constexpr):
    """The reduce kernel's work on a tile's sum: DOWN, xa = bf16(Σ) (what `_xa_reduce_kernel` stores); else the
    epilogue of `_ws_reduce_kernel` with B's rows b (`_lora_b_tile`, loaded by the caller): PDL wait for xa, scale,
    σ·LoRA, bias, round."""
    if DOWN:
        tl.store(xa_ptr + rm[None, :].to(tl.int64) * stride_xam + rn[:, None] * stride_xar,
                 total.to(xa_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
    else:
        if WAIT_PDL:
            tl.extra.cuda.gdc_wait()
        # xa itself, not its partials (XA_PARTS False): _load_xa's M and chunk count go unused
        xa_t = _load_xa(xa_ptr, xa_ptr, rm, mask_m, 0, R, 1, stride_xam, stride_xar, HAS_LORA, False, BR, BM)
        _ws_epilogue(total, xa_t, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, bias_ptr, lora_scale,
                     stride_ym, stride_yn, HAS_W_SCALE, HAS_LORA, HAS_BIAS, DOT_F32)


def launch_ticket(x, w, out, n_rows, k_chunk, n_parts, cfg, *, down=False, w_scale=None, xa=None, lora_b=None,
                  lora_scale=1.0, bias=None, br=16, launch_dependents=False, wait_pdl=False, dot_f32=False,
                  even_k=False):
    """One launch of `_ws_ticket_kernel` over `[n_rows, K]` rows of w (codes, or A with down=True, in row tiles
    of `cfg["BN"]` rows) and x `[M, K]`: out is y `[M, n_rows]` (base) or xa `[M, r]` (down)."""
    M, K = x.shape
    BN, BM = cfg["BN"], cfg["BM"]
    tiles = cdiv(n_rows, BN) * cdiv(M, BM)
    one = n_parts == 1  # no partial, no ticket: the single pass with this kernel's epilogue (and PDL wait)
    part = out if one else torch.empty(n_parts, M, n_rows, device=x.device, dtype=torch.float32)
    cnt = out if one else _counters(x.device, "down" if down else "base", tiles)
    has_lora = lora_b is not None
    R = xa.shape[1] if has_lora else 0
    xa_ = out if down else (xa if has_lora else out)
    lora_strides = (lora_b.stride(0), lora_b.stride(1)) if has_lora else (0, 0)
    _ws_ticket_kernel[(tiles, n_parts)](
        x, w, part, cnt, out, w_scale if w_scale is not None else out, xa_, lora_b if has_lora else out,
        bias if bias is not None else out, M, n_rows, K, R, k_chunk, n_parts, float(lora_scale),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        xa_.stride(0), xa_.stride(1), *lora_strides,
        DOWN=down, HAS_W_SCALE=w_scale is not None, HAS_LORA=has_lora, HAS_BIAS=bias is not None,
        DOT_F32=dot_f32, BN=BN, BM=BM, BK=cfg["BK"], BR=br, GROUP_N=cfg.get("GROUP_N", 8),
        LAUNCH_DEPENDENTS=launch_dependents, WAIT_PDL=wait_pdl, EVEN_K=even_k, EVEN_N=n_rows % BN == 0,
        EVEN_M=M % BM == 0, ONE_PART=one, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"launch_pdl": True} if wait_pdl else {}))
    return out


@triton.jit(do_not_specialize=["M"])
def _ws_fused_down_kernel(
    x_ptr, w_ptr, a_ptr, part_ptr, xa_part_ptr, cnt_ptr, y_ptr, w_scale_ptr, xa_ptr, b_ptr, bias_ptr,
    M, N, K, R, K_CHUNK, N_PARTS, XA_CHUNK, N_XA, lora_scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ar, stride_ak, stride_ym, stride_yn, stride_bn, stride_br,
    HAS_W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr, BR: tl.constexpr, BRT: tl.constexpr, BK_DOWN: tl.constexpr, GROUP_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_R: tl.constexpr, EVEN_M: tl.constexpr,
):
    """Programs [0, n_down): down (rank tile d, sub-chunk q), as `_ws_ticket_kernel` with DOWN over A; the last
    arrival of rank tile d stores bf16 xa and counts it stored. Programs after: base (tile, chunk p), as
    `_ws_ticket_kernel`; the last arrival of a tile waits until every xa tile is stored, then the epilogue. Counter
    slots: base tiles, then xa tiles, then 'xa tiles stored' and 'base tiles done' (the last base tile zeroes both)."""
    pid = tl.program_id(0)
    base_tiles = tl.cdiv(N, BN) * tl.cdiv(M, BM)
    xa_tiles = tl.cdiv(R, BRT) * tl.cdiv(M, BM)
    n_down = xa_tiles * N_XA
    xa_stored = cnt_ptr + base_tiles + xa_tiles
    # the branches are functions: Triton types a variable set in both branches of an if once (the tiles differ)
    if pid < n_down:
        _fused_down_program(x_ptr, a_ptr, xa_part_ptr, cnt_ptr, xa_ptr, xa_stored, pid, xa_tiles, base_tiles, M, K, R,
                            XA_CHUNK, N_XA, stride_xm, stride_xk, stride_ar, stride_ak, DOT_F32, BM, BRT, BK_DOWN,
                            GROUP_N, EVEN_K, EVEN_R, EVEN_M)
    else:
        _fused_base_program(x_ptr, w_ptr, part_ptr, cnt_ptr, y_ptr, w_scale_ptr, xa_ptr, b_ptr, bias_ptr, xa_stored,
                            pid - n_down, base_tiles, xa_tiles, M, N, K, R, K_CHUNK, N_PARTS, lora_scale,
                            stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_bn, stride_br,
                            HAS_W_SCALE, HAS_BIAS, DOT_F32, BN, BM, BK, BR, GROUP_N, EVEN_K, EVEN_N, EVEN_M)


@triton.jit
def _fused_down_program(x_ptr, a_ptr, xa_part_ptr, cnt_ptr, xa_ptr, xa_stored, pid, xa_tiles, base_tiles, M, K, R,
                        XA_CHUNK, N_XA, stride_xm, stride_xk, stride_ar, stride_ak, DOT_F32: tl.constexpr,
                        BM: tl.constexpr, BRT: tl.constexpr, BK: tl.constexpr, GROUP_N: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_R: tl.constexpr, EVEN_M: tl.constexpr):
    """Down program (xa tile pid % xa_tiles, sub-chunk pid // xa_tiles): `_ws_ticket_kernel` with DOWN; the tile's
    last arrival stores bf16 xa, then counts the tile stored (release: after every thread's stores)."""
    tile = pid % xa_tiles
    q = pid // xa_tiles
    rr, rm, mask_r, mask_m = _ws_tile_of(tile, R, M, BRT, BM, GROUP_N)
    acc = _ws_chunk(a_ptr, x_ptr, rr, rm, R, M, q * XA_CHUNK, (q + 1) * XA_CHUNK, K, stride_ar, stride_ak,
                    stride_xm, stride_xk, BRT, BM, BK, DOT_F32, EVEN_K, EVEN_R, EVEN_M)
    offs = rm[None, :].to(tl.int64) * R + rr[:, None]
    mask = mask_r[:, None] & mask_m[None, :]
    tl.store(xa_part_ptr + q.to(tl.int64) * M * R + offs, acc, mask=mask)
    if _is_last_arrival(cnt_ptr, base_tiles + tile, N_XA):
        total = _sum_parts(xa_part_ptr, M * R, offs, mask, N_XA, BRT, BM, True)
        tl.store(xa_ptr + offs, total.to(xa_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # every thread's xa stores before the one release below
        tl.atomic_add(xa_stored, 1, sem="release", scope="gpu")


@triton.jit
def _fused_base_program(x_ptr, w_ptr, part_ptr, cnt_ptr, y_ptr, w_scale_ptr, xa_ptr, b_ptr, bias_ptr, xa_stored, u,
                        base_tiles, xa_tiles, M, N, K, R, K_CHUNK, N_PARTS, lora_scale,
                        stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, stride_bn, stride_br,
                        HAS_W_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, BN: tl.constexpr,
                        BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_M: tl.constexpr):
    """Base program u = (tile u % base_tiles, chunk u // base_tiles): `_ws_ticket_kernel`'s; the tile's last arrival
    waits for every xa tile (acquire), reads xa through L2 and runs the epilogue; the last tile done zeroes the two
    launch-wide counters for the next launch."""
    tile = u % base_tiles
    p = u // base_tiles
    rn, rm, mask_n, mask_m = _ws_tile_of(tile, N, M, BN, BM, GROUP_N)
    acc = _ws_chunk(w_ptr, x_ptr, rn, rm, N, M, p * K_CHUNK, (p + 1) * K_CHUNK, K, stride_wn, stride_wk,
                    stride_xm, stride_xk, BN, BM, BK, DOT_F32, EVEN_K, EVEN_N, EVEN_M)
    offs = rm[None, :].to(tl.int64) * N + rn[:, None]
    mask = mask_n[:, None] & mask_m[None, :]
    tl.store(part_ptr + p.to(tl.int64) * M * N + offs, acc, mask=mask)
    if _is_last_arrival(cnt_ptr, tile, N_PARTS):
        b = _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, True, BN, BR)
        total = _sum_parts(part_ptr, M * N, offs, mask, N_PARTS, BN, BM, True)
        stored = tl.atomic_add(xa_stored, 0, sem="acquire", scope="gpu")
        while stored < xa_tiles:  # the down programs wait on nothing: see fused_down_fits
            stored = tl.atomic_add(xa_stored, 0, sem="acquire", scope="gpu")
        rr = tl.arange(0, BR)
        xa_t = tl.load(xa_ptr + rm[None, :].to(tl.int64) * R + rr[:, None], mask=(rr < R)[:, None] & mask_m[None, :],
                       other=0.0, cache_modifier=".cg")
        _ws_epilogue(total, xa_t, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, bias_ptr, lora_scale,
                     stride_ym, stride_yn, HAS_W_SCALE, True, HAS_BIAS, DOT_F32)
        tiles_done = xa_stored + 1
        if tl.atomic_add(tiles_done, 1, sem="acq_rel", scope="gpu") == base_tiles - 1:
            tl.store(xa_stored, 0)  # every tile is past its wait: ready for the next launch
            tl.store(tiles_done, 0)


def launch_fused_down(x, w, lora_a, out, k_chunk, n_parts, xa_chunk, n_xa, cfg, down_rows, *, w_scale=None,
                      lora_b=None, lora_scale=1.0, bias=None, br=16, dot_f32=False, even_k=False):
    """y = w8a16(x, w) with LoRA (A `[r, K]`, B) in one launch of `_ws_fused_down_kernel`: returns xa `[M, r]`, the
    bf16 intermediate the epilogue used (the bits of `lora_down`). out: y `[M, N]`."""
    M, K = x.shape
    N, R = w.shape[0], lora_a.shape[0]
    BN, BM = cfg["BN"], cfg["BM"]
    base_tiles = cdiv(N, BN) * cdiv(M, BM)
    xa_tiles = cdiv(R, down_rows) * cdiv(M, BM)
    xa = torch.empty(M, R, device=x.device, dtype=x.dtype)
    part = torch.empty(n_parts, M, N, device=x.device, dtype=torch.float32)
    xa_part = torch.empty(n_xa, M, R, device=x.device, dtype=torch.float32)
    cnt = _counters(x.device, "fused", base_tiles + xa_tiles + 2)
    _ws_fused_down_kernel[(xa_tiles * n_xa + base_tiles * n_parts,)](
        x, w, lora_a, part, xa_part, cnt, out, w_scale if w_scale is not None else out, xa, lora_b,
        bias if bias is not None else out, M, N, K, R, k_chunk, n_parts, xa_chunk, n_xa, float(lora_scale),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), lora_a.stride(0), lora_a.stride(1),
        out.stride(0), out.stride(1), lora_b.stride(0), lora_b.stride(1),
        HAS_W_SCALE=w_scale is not None, HAS_BIAS=bias is not None, DOT_F32=dot_f32, BN=BN, BM=BM, BK=cfg["BK"],
        BR=br, BRT=down_rows, BK_DOWN=FUSED_DOWN_BK, GROUP_N=cfg.get("GROUP_N", 8), EVEN_K=even_k,
        EVEN_N=N % BN == 0, EVEN_R=R % down_rows == 0, EVEN_M=M % BM == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return xa
