"""Split-K in one launch: the W8A16 decode GEMM and the LoRA down-projection reduce in their last-arriving program.

The two-launch split-K of `weight_stationary.py` (a partial kernel, then a reduce kernel that adds the chunk partials
in chunk order and runs the epilogue) pays a second kernel's launch and its wait for the first one's completion in
the tail of every decode call: 2.5 µs of q3_o's 11.3 µs at one token on the H200 (a profile of
the decode call). Here each program (output tile t, chunk p) stores its fp32 partial as before and then takes a ticket, an
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
Counters live in a per-(device, role) int32 workspace that starts zeroed and that every use leaves zeroed
(CUDA-graph replays included). Two kernels of one role never run at once on a device: only the base kernel is launched
as a PDL dependent, and of the down kernel, which has the other role; the engine runs one forward at a time and the
trainer one stream. The workspace is zeroed by work that runs, never by a memset captured into a graph: vLLM captures
its decode graphs on a fresh stream without an eager warmup, so a workspace first made inside a capture would hold
whatever its memory held until that one graph replays (a counter left non-zero skips its tile's reduce; the matched
engine then serves NaN). `reserve_counters` makes the workspace before any capture (the serving plugin calls it when
its weights load); a capture that still finds none gets a zeroed workspace inside the graph for that call only. A
workspace that grows keeps the old one alive, since captured graphs hold its address. The two-launch path remains only
for the down-projection fused into split-K, where no PDL pair runs it first (`plan`'s `ws_split`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from .._tiles import _sum_parts
from .ws_epilogue import _load_xa, _lora_b_tile, _ws_chunk, _ws_epilogue, _ws_tile_of

COUNTER_SLOTS = 1 << 16  # tiles per launch the workspace holds before it grows (decode: <= 1536 base tiles)
ROLES = ("base", "down")
_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown workspaces: graphs captured before the growth still point at them


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _indexed(device: torch.device | str) -> torch.device:
    """`cuda` as the tensors on it name it (`cuda:<current>`), so that a reservation and a launch share one key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def reserve_counters(device: torch.device | str, slots: int = COUNTER_SLOTS) -> None:
    """Make both roles' zeroed counter workspaces on `device` now, outside any CUDA-graph capture."""
    device = _indexed(device)
    if _capturing(device):
        raise RuntimeError("reserve_counters runs before CUDA-graph capture, not inside one")
    for role in ROLES:
        _counters(device, role, slots)


def _counters(device: torch.device, role: str, slots: int) -> torch.Tensor:
    """A zeroed int32 workspace of at least `slots` counters for this device and role (kept zeroed by use)."""
    key = (device, role)  # a tensor's device: `cuda:<index>`, as `reserve_counters` keys it
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= slots:
        return buf
    fresh = torch.zeros(max(COUNTER_SLOTS, slots), dtype=torch.int32, device=device)
    if _capturing(device):
        return fresh  # its memset is a node of this graph, before this call's kernel on every replay; not kept
    if buf is not None:
        _RETIRED.append(buf)
    _COUNTERS[key] = fresh
    return fresh


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
    EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, ONE_PART: tl.constexpr = False, PARTS_PER_PROGRAM=1,
    GROUPED: tl.constexpr = False,
):
    """Program (tile, part p): the fp32 partial of w[tile rows] · x[tile tokens]ᵀ over K[p·K_CHUNK, (p+1)·K_CHUNK)
    into part[p], then, in the tile's last arrival, Σ_p part[p] in p order and the epilogue (DOWN: xa = bf16(Σ)).
    GROUPED: program (tile, g) stores the partials of parts g·PARTS_PER_PROGRAM ... (g+1)·PARTS_PER_PROGRAM - 1, one
    by one (each from zero, as its own program would), and the last of the tile's programs adds all N_PARTS in order:
    the same partials and the same chain of adds, so the same bits, from fewer, longer programs."""
    if LAUNCH_DEPENDENTS:  # PDL: the base GEMM behind the down-projection may launch now (it waits before xa)
        tl.extra.cuda.gdc_launch_dependents()
    tile = tl.program_id(0)
    p = tl.program_id(1)
    rn, rm, mask_n, mask_m = _ws_tile_of(tile, N, M, BN, BM, GROUP_N)
    if GROUPED:
        offs = rm[None, :].to(tl.int64) * N + rn[:, None]
        mask = mask_n[:, None] & mask_m[None, :]
        for j in range(0, PARTS_PER_PROGRAM):
            q = p * PARTS_PER_PROGRAM + j
            if q < N_PARTS:
                acc = _ws_chunk(w_ptr, x_ptr, rn, rm, N, M, q * K_CHUNK, (q + 1) * K_CHUNK, K, stride_wn, stride_wk,
                                stride_xm, stride_xk, BN, BM, BK, DOT_F32, EVEN_K, EVEN_N, EVEN_M)
                tl.store(part_ptr + q.to(tl.int64) * M * N + offs, acc, mask=mask)
        if _is_last_arrival(cnt_ptr, tile, tl.num_programs(1)):
            b = _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, HAS_LORA, BN, BR)
            total = _sum_parts(part_ptr, M * N, offs, mask, N_PARTS, BN, BM, True)
            _ticket_finish(total, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, xa_ptr, bias_ptr, R, lora_scale,
                           stride_ym, stride_yn, stride_xam, stride_xar, DOWN, HAS_W_SCALE, HAS_LORA, HAS_BIAS,
                           DOT_F32, BM, BR, WAIT_PDL)
        return
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
                  even_k=False, parts_per_program=1, keep=None):
    """One launch of `_ws_ticket_kernel` over `[n_rows, K]` rows of w (codes, or A with down=True, in row tiles
    of `cfg["BN"]` rows) and x `[M, K]`: out is y `[M, n_rows]` (base) or xa `[M, r]` (down). parts_per_program > 1:
    each program computes that many consecutive parts (GROUPED; same bits). keep: a list the fp32 partials' workspace
    is appended to, for a caller that must hold it while a PDL dependent may still overlap this kernel."""
    M, K = x.shape
    BN, BM = cfg["BN"], cfg["BM"]
    tiles = cdiv(n_rows, BN) * cdiv(M, BM)
    one = n_parts == 1  # no partial, no ticket: the single pass with this kernel's epilogue (and PDL wait)
    grouped = parts_per_program > 1 and not one
    part = out if one else torch.empty(n_parts, M, n_rows, device=x.device, dtype=torch.float32)
    if keep is not None:
        keep.append(part)
    cnt = out if one else _counters(x.device, "down" if down else "base", tiles)
    if keep is not None and not one:
        keep.append(cnt)  # a workspace made for this call alone is held with the partials while a dependent overlaps
    has_lora = lora_b is not None
    R = xa.shape[1] if has_lora else 0
    xa_ = out if down else (xa if has_lora else out)
    lora_strides = (lora_b.stride(0), lora_b.stride(1)) if has_lora else (0, 0)
    _ws_ticket_kernel[(tiles, cdiv(n_parts, parts_per_program) if grouped else n_parts)](
        x, w, part, cnt, out, w_scale if w_scale is not None else out, xa_, lora_b if has_lora else out,
        bias if bias is not None else out, M, n_rows, K, R, k_chunk, n_parts, float(lora_scale),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        xa_.stride(0), xa_.stride(1), *lora_strides,
        DOWN=down, HAS_W_SCALE=w_scale is not None, HAS_LORA=has_lora, HAS_BIAS=bias is not None,
        DOT_F32=dot_f32, BN=BN, BM=BM, BK=cfg["BK"], BR=br, GROUP_N=cfg.get("GROUP_N", 8),
        LAUNCH_DEPENDENTS=launch_dependents, WAIT_PDL=wait_pdl, EVEN_K=even_k, EVEN_N=n_rows % BN == 0,
        EVEN_M=M % BM == 0, ONE_PART=one, PARTS_PER_PROGRAM=parts_per_program if grouped else 1, GROUPED=grouped,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"launch_pdl": True} if wait_pdl else {}))
    return out
