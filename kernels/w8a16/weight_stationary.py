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
  Split-K without the fused down-projection, and `lora_down` at decode sizes, are one launch each (`ws_splitk`): the
  last-arriving program of a tile does the reduce kernel's work. Which path a call takes: `plan.plan`.
The σ·LoRA + y step is an explicit `tl.fma` (no compiler-chosen contraction).
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .. import plan as kplan
from .._dispatch import interpreting
from .._host import cdiv
from .._tiles import _sum_parts
from ..plan import DEFAULT_SETTINGS, Device, KernelPlan, KernelSettings, describe, down_tile_rows, epilogue_rows, \
    plan, plan_lora_down
from . import wgmma_drain
from .configs import tile_of, whole_k, xa_chunking  # noqa: F401  (whole_k: the name dX callers import from here)
from .ws_epilogue import _load_xa, _lora_b_tile, _ws_chunk, _ws_epilogue, _ws_tile, _ws_tile_of
from .ws_splitk import launch_ticket
from .ws_tma import checked_tma_single, launch_tma_single, tma_ok

# "module": ws_gluon once imported; "broken": why it cannot run in this process (a Triton whose Gluon API moved: a
# fact about the installed Triton found at the first launch, not a setting)
_GLUON: dict = {}
_down_tile_rows = down_tile_rows  # (the names the tests and scripts import)
_epilogue_rows = epilogue_rows


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
def _ws_single_kernel(
    x_ptr, w_ptr, y_ptr, w_scale_ptr, xa_ptr, b_ptr, bias_ptr, M, N, K, R, K_CHUNK, N_CHUNKS, lora_scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    stride_xam, stride_xar, stride_bn, stride_br,
    HAS_W_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
    WAIT_PDL: tl.constexpr = False, EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False,
    EVEN_M: tl.constexpr = False,
):
    """One program per output tile: every chunk from zero, added in chunk order, then the epilogue. WAIT_PDL:
    launched as the programmatic dependent of the kernel that writes xa (`lora_down`), so the weights stream
    while the down-projection runs; it waits for xa only before its epilogue."""
    rn, rm, mask_n, mask_m = _ws_tile(N, M, BN, BM, GROUP_N)
    total = tl.zeros((BN, BM), dtype=tl.float32)
    tl.assume(N_CHUNKS > 0)
    for c in tl.range(0, N_CHUNKS):
        total += _ws_chunk(w_ptr, x_ptr, rn, rm, N, M, c * K_CHUNK, (c + 1) * K_CHUNK, K,
                           stride_wn, stride_wk, stride_xm, stride_xk, BN, BM, BK, DOT_F32, EVEN_K, EVEN_N, EVEN_M)
    b = _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, HAS_LORA, BN, BR)
    if WAIT_PDL:
        tl.extra.cuda.gdc_wait()
    xa_t = _load_xa(xa_ptr, xa_ptr, rm, mask_m, M, R, 1, stride_xam, stride_xar, HAS_LORA, False, BR, BM)
    _ws_epilogue(total, xa_t, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, bias_ptr, lora_scale,
                 stride_ym, stride_yn, HAS_W_SCALE, HAS_LORA, HAS_BIAS, DOT_F32)


def even_k(K: int, k_chunk: int, n_chunks: int) -> bool:
    """Whether the chunks tile K exactly (every real Qwen shape): the K loops then load without masks."""
    return k_chunk * n_chunks == K


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


def _gluon_gemm(x, w, y, w_scale, xa, lora_b, lora_scale, bias, k_chunk, n_chunks, gluon_cfg, br, pointer,
                checked, op="fwd") -> bool:
    """y from the Gluon kernel (`ws_gluon`: forward, or dX with w = `codes.t()`) in the plan's config `gluon_cfg`, if
    these tensors allow it (`ws_gluon.gluon_ok`: alignment, layouts): checked against the pointer kernel
    (`pointer(out)`) on its first call per key and every RECHECK_EVERY calls, as a table TMA entry is (`checked`; an
    explicit config runs it as it is). False: the caller runs its Triton kernels."""
    gluon_mod = _gluon() if x.is_cuda else None
    if gluon_mod is None or not gluon_mod.gluon_ok(x, w, y, xa, lora_b, k_chunk, n_chunks, gluon_cfg, br):
        return False

    def gluon(out):
        try:
            return gluon_mod.launch_gluon_fwd(x, w, out, w_scale, xa, lora_b, lora_scale, bias, k_chunk, n_chunks,
                                              gluon_cfg, br)
        except Exception as err:  # Gluon is experimental: an API this Triton moved fails here, not silently
            _GLUON["broken"] = f"{type(err).__name__}: {str(err)[:200]}"
            warnings.warn(f"W8A16 Gluon kernel unavailable on this Triton ({_GLUON['broken']}); the table's Triton "
                          f"kernels run instead")
            return pointer(out)

    if checked:
        M, N = y.shape
        key = (f"{op}-gluon", N, x.shape[1], tuple(sorted(gluon_cfg.items())), xa is not None, bias is not None,
               M.bit_length())
        checked_tma_single(key, y, gluon, pointer, kernel=f"Gluon {op}")
    else:
        gluon(y)
    return True


def _gluon():
    """`ws_gluon` (the warp-specialized Gluon kernel a plan may choose), or None: a Triton without Gluon's Hopper API,
    or one whose first launch failed here."""
    if "broken" in _GLUON:
        return None
    if "module" not in _GLUON:
        try:
            from . import ws_gluon  # deferred: Gluon's experimental API may be missing from this Triton (below)
        except (ImportError, AttributeError) as err:
            _GLUON["broken"] = f"{type(err).__name__}: {err}"
            return None
        _GLUON["module"] = ws_gluon
    return _GLUON["module"]


def lora_down(x, lora_a, chunk_n: int | None = None, op: str = "fwd", pdl: bool = False, keep: list | None = None,
              down_plan: KernelPlan | None = None, settings: KernelSettings | None = None,
              device: Device | None = None):
    """xa `[M, r]` = bf16(x · Aᵀ), batch invariant: the sub-chunks of `configs.xa_chunking` for the base layer
    `[chunk_n, K]` (default r), each from zero, added in order - the same bits as the down-projection fused into
    the split-K path. pdl: both launches let their dependents launch at once (the next kernel launched with
    launch_pdl must gdc_wait before it reads xa). down_plan: `plan.plan_lora_down`'s choice (computed here if None, for
    `device`, by default x's device as `plan.describe` sees it)."""
    M, K = x.shape
    R = lora_a.shape[0]
    out = torch.empty(M, R, device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    if x.is_cuda:
        wgmma_drain.install()  # (a no-op unless the pass is wanted and something replaced Triton's hook)
    p = down_plan or plan_lora_down(chunk_n or R, K, M, R, device or describe(x.device),
                                    op="w8a16" if op == "fwd" else "w8a16_dx", pdl=pdl,
                                    settings=settings or DEFAULT_SETTINGS, x_bytes=x.element_size())
    xa_chunk, _, n_xa = xa_chunking(chunk_n or R, K)
    if p.kernel == "ws_down_single":
        return _down_single_pass(x, lora_a, out, xa_chunk, n_xa, down_tile_rows(R))
    # one launch (ws_splitk): at decode the launch pair's tail, in training a launch's host time
    return launch_ticket(x, lora_a, out, R, xa_chunk, n_xa, p.config, down=True, launch_dependents=pdl,
                         dot_f32=interpreting(), even_k=even_k(K, p.k_chunk, p.n_chunks), parts_per_program=p.group,
                         keep=keep)


def _split_two_launches(x, w, y, ws, fused_a, b_, bias_, R, k_chunk, n_chunks, lora_scale, lora_strides, cfg, flags,
                        pdl):
    """Split-K with the down-projection's partials (A = fused_a) fused into the partial kernel, then the reduce kernel,
    its PDL dependent where the device has PDL: the path without PDL's down-first pair (`plan`'s `ws_split`)."""
    M, K = x.shape
    N = w.shape[0]
    xa_chunk, xa_subs, n_xa = xa_chunking(N, K)
    part, xa_part = _launch_partials(x, w, fused_a, M, N, K, R, k_chunk, n_chunks, cfg, xa_chunk, xa_subs,
                                     launch_dependents=pdl)
    tiles = cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"])
    _ws_reduce_kernel[(tiles,)](
        part, xa_part, y, y, ws, b_, bias_, M, N, R, n_chunks, n_xa, float(lora_scale), y.stride(0), y.stride(1),
        0, 0, *lora_strides, XA_PARTS=True, WAIT_PDL=pdl, num_warps=4, **flags,
        **({"launch_pdl": True} if pdl else {}))


def _down_single_pass(x, lora_a, out, xa_chunk, n_xa, rows):
    """`lora_down` for many tokens: one program per (token tile, rank tile) runs every sub-chunk of xa's K chunking
    (each from zero, added in order: `_ws_single_kernel` with A as the weight) and rounds once. The split-K paths
    sum the same sub-chunk partials in the same order from +0.0, so the bits are theirs; but no fp32 partial goes
    through memory, which made a training `lora_down` 2.6-2.9x its HBM floor (Qwen3-8B at 8192 tokens: 40 µs for
    K = 4096, 134 µs for down's K = 12288, against cuBLAS's ~50 µs for the latter; scripts/probe_k_chunking.py
    --kernels). A pass streams x once; 32-64-token tiles keep >= DOWN_SINGLE_MIN_PROGRAMS programs."""
    M, K = x.shape
    R = lora_a.shape[0]
    BM = 64 if cdiv(M, 64) * cdiv(R, rows) >= kplan.DOWN_SINGLE_MIN_PROGRAMS else kplan.DOWN_SINGLE_BM
    tiles = cdiv(M, BM) * cdiv(R, rows)
    _ws_single_kernel[(tiles,)](
        x, lora_a, out, out, out, out, out, M, R, K, 0, xa_chunk, n_xa, 1.0,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), out.stride(0), out.stride(1), 0, 0, 0, 0,
        HAS_W_SCALE=False, HAS_LORA=False, HAS_BIAS=False, DOT_F32=interpreting(), BN=rows, BM=BM, BK=128, BR=16,
        GROUP_N=8, EVEN_K=even_k(K, xa_chunk, n_xa), EVEN_N=R % rows == 0, EVEN_M=M % BM == 0,
        num_warps=4, num_stages=4)
    return out


def weight_stationary_gemm(x, w, out_dtype=torch.bfloat16, w_scale=None, xa=None, lora_b=None, lora_scale=1.0,
                           bias=None, config=None, allow_split=True, out=None, lora_a=None, op="fwd", return_xa=False,
                           settings: KernelSettings | None = None, device: Device | None = None):
    """y `[M, N]` for bf16 x `[M, K]` and w `[N, K]` (any strides), LoRA from xa (given) or lora_a (computed
    here), the kernels `plan.plan` chooses for this call (config from the committed table unless given). return_xa:
    (y, xa), the bf16 LoRA intermediate the epilogue used (the trainer saves it for the backward instead of
    recomputing it). device: the `plan.Device` to plan for (default: x's device as `plan.describe` sees it; tests and
    benchmarks pass another description, e.g. without PDL, to run the other path on the same GPU)."""
    if x.is_cuda:
        wgmma_drain.install()  # (a no-op unless the pass is wanted and something replaced Triton's hook)
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=out_dtype) if out is None else out
    if return_xa and xa is None and lora_a is not None and (M == 0 or N == 0):
        xa = torch.empty(M, lora_a.shape[0], device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return (y, xa) if return_xa else y
    has_lora = xa is not None or lora_a is not None
    R = (xa.shape[1] if xa is not None else lora_a.shape[0]) if has_lora else 0
    p = plan("w8a16" if op == "fwd" else "w8a16_dx", (N, K), M, device or describe(x.device), rank=R,
             xa_given=xa is not None,
             return_xa=return_xa, settings=settings or DEFAULT_SETTINGS, config=config, allow_split=allow_split,
             x_bytes=x.element_size())
    # The down-projection's fp32 partials, held until the base GEMM is launched: that launch lets the base kernel run
    # beside lora_down's kernels (PDL), which the caching allocator does not know, so a workspace freed when lora_down
    # returns could be handed to the base GEMM's partials while lora_down still reads it (seen on the H200 in CUDA-graph
    # replays once the down programs ran as long as the base ones). Any later allocation is for a kernel that starts
    # after the base grid ends, which its last programs' gdc_wait puts after lora_down's.
    down_workspace: list = []
    if p.down is not None:
        xa = lora_down(x, lora_a, N, op, pdl=p.pdl, keep=down_workspace, down_plan=p.down)
    _run_base(p, x, w, y, w_scale, xa, lora_a, lora_b, lora_scale, bias, R, explicit=config is not None)
    return (y, xa) if return_xa else y


def _run_base(p: KernelPlan, x, w, y, w_scale, xa, lora_a, lora_b, lora_scale, bias, R, explicit):
    """The base GEMM's launch(es) of plan p (xa computed already unless the plan fuses the down-projection)."""
    M, K = x.shape
    N = w.shape[0]
    cfg, k_chunk, n_chunks = p.config, p.k_chunk, p.n_chunks
    has_lora = R > 0
    BR = epilogue_rows(R)
    ws = w_scale if w_scale is not None else y
    b_ = lora_b if has_lora else y
    bias_ = bias if bias is not None else y
    lora_strides = (lora_b.stride(0), lora_b.stride(1)) if has_lora else (0, 0)
    flags = dict(HAS_W_SCALE=w_scale is not None, HAS_LORA=has_lora, HAS_BIAS=bias is not None,
                 DOT_F32=interpreting(), BN=cfg["BN"], BM=cfg["BM"], BR=BR, GROUP_N=cfg.get("GROUP_N", 8))
    if p.kernel == "ws_ticket":  # one launch, reduced by each tile's last program (ws_splitk)
        launch_ticket(x, w, y, N, k_chunk, n_chunks, cfg, w_scale=w_scale, xa=xa, lora_b=lora_b if has_lora else None,
                      lora_scale=lora_scale, bias=bias, br=BR, wait_pdl=p.pdl, dot_f32=interpreting(),
                      even_k=even_k(K, k_chunk, n_chunks))
        return
    if p.kernel == "ws_split":
        _split_two_launches(x, w, y, ws, lora_a, b_, bias_, R, k_chunk, n_chunks, lora_scale, lora_strides, cfg,
                            flags, p.pdl)
        return

    def pointer(out):
        _ws_single_kernel[(cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"]),)](
            x, w, out, ws, xa if has_lora else out, b_, bias_, M, N, K, R, k_chunk, n_chunks, float(lora_scale),
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            xa.stride(0) if has_lora else 0, xa.stride(1) if has_lora else 0, *lora_strides,
            BK=cfg["BK"], WAIT_PDL=p.pdl, EVEN_K=even_k(K, k_chunk, n_chunks), EVEN_N=N % cfg["BN"] == 0,
            EVEN_M=M % cfg["BM"] == 0, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags,
            **({"launch_pdl": True} if p.pdl else {}))
        return out

    def tma(out):
        return launch_tma_single(x, w, out, ws, xa, b_, bias_, M, N, R, k_chunk, n_chunks, lora_scale,
                                 lora_strides, cfg, flags)

    op = "fwd" if p.op == "w8a16" else "dx"
    if p.kernel == "ws_gluon" and _gluon_gemm(x, w, y, w_scale, xa if has_lora else None, lora_b if has_lora else None,
                                              lora_scale, bias, k_chunk, n_chunks, p.gluon, BR, pointer,
                                              not explicit, op):
        return
    if not (p.tma and tma_ok(x, w)):
        pointer(y)
    elif not explicit:  # a table TMA entry, checked per key (ws_tma.checked_tma_single)
        key = (op, N, K, tile_of(cfg), has_lora, bias is not None, M.bit_length())
        checked_tma_single(key, y, tma, pointer)
    else:  # an explicit config (tuner, bits report, tests): the TMA kernel as it is, so a miscompile shows
        tma(y)
