"""The weight-stationary training forward, warp-specialized in Gluon (issue 12): same k-steps, same bits, and no
race by construction.

Why: the Triton TMA kernel (`ws_tma.py`) is miscompiled by Triton 3.6 for some compiles: wrong tiles that change from
run to run (two of the table's own 128x256 tiles gave 2048 and 4096 wrong outputs of up to 1e29 in probe
runs; likely triton-lang/triton#9433, the register-A hazard below, which Triton 3.6 builds into every W8A16 Triton
kernel), so each table TMA entry is checked against the pointer kernel on its first call
and every `ws_tma.RECHECK_EVERY` calls, and a race between checks goes unseen. Its k-loop also holds 6 CTA-wide
`BAR.SYNC`s per 64-deep step. Here the synchronization is explicit, the way CUTLASS splits a mixed-input GEMM:
- two consumer warpgroups (`gl.warp_specialize`), each owning 64 of the tile's 128 weight rows, wait only on the
  mbarriers of a ring of STAGES codes `[128, BK]` / x `[BM, BK]` buffers filled by TMA;
- warpgroup 0 also issues the loads: once its own wgmma of step i - 1 is done (`warpgroup_mma_wait(1)`) and warpgroup
  1 has freed that step's buffer (an mbarrier arrive after its own wait), step i + STAGES - 1 goes into it. (A
  separate one-warp loader partition makes the kernel three warpgroups, 168 registers a thread, and ptxas then
  serializes every wgmma: C7512.)
- a warpgroup loads its codes from shared memory into wgmma's register A layout, widens them (`widen.py`'s PTX) and
  issues the wgmma asynchronously, one in flight while it prepares the next. The wgmma reads those registers
  asynchronously: k-steps therefore go in pairs with A registers of their own (a one-step loop reused them in the
  PTX itself, and the next step's codes overwrote an in-flight wgmma's operand: wrong values on the H200;
  `scripts/sass_report.py --gluon` lists any instruction that writes an in-flight operand, and a CPU test holds it
  at none).

Bits: the K chunks of `configs.k_chunking`, each from zero in 16-deep bf16 wgmma k-steps in k order, added into the
running total in chunk order from +0.0, then `_ws_epilogue`'s op order (scale, explicit fma with σ·(B·xa) - B's rows
and xa through TMA, B as wgmma's shared-memory operand -, bias, round): the pointer kernel's bits
(tests/kernels/test_gpu_kernels.py, H200). Registers: a warpgroup holds its [64, BM] chunk accumulator and running
total; at BM = 256 the total spills at chunk ends only.

Used where a table entry carries "gluon" (the many-token bucket of the forward and of dX;
`weight_stationary._gluon_gemm`, checked per key like a TMA entry); on an API this Triton lacks it warns once and the
Triton kernels run. Gluon is Triton's experimental tile-level language: this module is
imported only on such a CUDA call.

dX (W_T; w = `codes.t()`, B = the LoRA Aᵀ): the same kernel with the codes and B read transposed - `[BK, 64]` TMA
boxes, one per warpgroup, loaded into wgmma's A layout with byte loads (the two codes of a bf16x2 register lie in
different rows) and B as an MN-major shared operand. Bitwise the Triton dX kernels' (H200, GPU tests). dX runs in one
K chunk (`whole_k`), and N_CHUNKS is therefore never specialized (the kernel compiled for the constant 1 ran 5x
slower, see the decorator): at BM 256 it is then the fastest dX on every Qwen shape but k/v (Triton 3.6,
8192 tokens: 0.86-0.97x the Triton TMA dX; `tune_w8a16.py --gluon-only`).

LORA_RING (a config's "LORA_RING": true; forward and dX, BK = 64): the LoRA ranks come through the k-step ring after
the last k-step, 64 a step (xa's columns into the x buffer, B's into a B ring), into one accumulator from zero - the
16-deep k-steps of the tiles' single wgmma in the same order, so the same bits - instead of xa and B tiles of their
own. Why: at the fused qkv's rank 192 (256 padded) those tiles do not fit beside a 256-token, 4-stage ring, so the
forward narrows to 128 tokens and dX falls back to the Triton kernel; with the ring both fit (229,588 B, sm_90a, no
spill in the k-step loop, no operand race: CPU tests). On an H100 at rank 192 and 8192 tokens: forward 0.93x, dX
1.03x cuBLAS bf16 + LoRA (narrowed forward 1.04x, Triton dX 1.16x); the tuned table carries it (BENCHMARKS.md).

PERSISTENT (a config's "PERSISTENT": true; with LORA_RING where there is a LoRA): a program per SM walks the tiles pid,
pid + programs, ... in the grouped order, one ring of k-steps running through all of them, so the loads of a tile's
first STAGES - 1 steps are issued during the last steps of the tile before and land while the warpgroups run its
epilogue (the non-persistent kernel starts each tile with an empty ring: its prologue and epilogue are not overlapped,
and its 7.75 waves of 256-token tiles at 8192 tokens leave the last one a quarter full). Same k-steps, same order, same
epilogue: same bits. `runs_persistent` says when it applies.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._host import cdiv
from .configs import SMEM_LIMIT, shared_bytes  # noqa: F401  (the pre-launch shared-memory check, also plan.py's)
from .tma_desc_cache import install as install_descriptor_cache
from .widen import _WIDEN_ASM
from .ws_tma import _aligned  # row-major, 16-byte aligned base and rows: TMA's rules

# Gluon is experimental and renames things between Triton releases: the TMA load is `async_copy_global_to_shared`
# in 3.6 (the H200 image) and `async_load` in 3.9 (CI's)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

ROWS_PER_WARPGROUP = 64  # wgmma's M: each consumer warpgroup owns 64 weight rows of the tile
CONSUMERS = 2
BN = ROWS_PER_WARPGROUP * CONSUMERS
# registers (setmaxnreg) of the worker partition, warpgroup 1: two warpgroups of 256 fill the register file
CONSUMER_REGS = gl.constexpr(256)


@gluon.jit
def _widen(codes):
    """bf16 of e4m3 codes, `widen.widen_e4m3`'s PTX (two codes per 32-bit register, as wgmma's A operand holds them)."""
    return gl.inline_asm_elementwise(_WIDEN_ASM, "=r,r", [codes.to(gl.uint8, bitcast=True)], dtype=gl.bfloat16,
                                     is_pure=True, pack=2)


@gluon.jit
def _load_step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m, t, n_steps, nxt,
               BK: gl.constexpr, STAGES: gl.constexpr, W_T: gl.constexpr, LR: gl.constexpr, PERSISTENT: gl.constexpr):
    """TMA loads of k-step t's codes and x tiles into buffer t % STAGES (nothing past the last step), once the
    other warpgroup has freed that buffer from step t - STAGES. W_T (dX): the codes come `[BK, 64]` from the
    row-major `[N, K]` codes, one box per warpgroup's 64 output rows (buffers 2·s and 2·s + 1). LR > 0 (the LoRA
    ring, `_lora_ring`): steps n_steps ... n_steps + LR - 1 are the LoRA term's, 64 ranks each: xa's columns into the
    x buffer, B's into the B ring, so that the pipeline prefetches them during the last k-steps. PERSISTENT: t counts
    the program's steps over all its tiles (the ring's barriers too), tile after tile of n_steps + LR steps, and
    nxt = (the current tile's first step, the next tile's index, M, N, BM, GROUP_N): a step past the current tile is the
    next tile's, if there is one (the loads run at most STAGES - 1 steps ahead, never past it: `runs_persistent`). Its
    offsets are worked out here, on those few steps, rather than carried through the k-loop in registers."""
    if PERSISTENT:
        g0, next_tile, M, N, BM, GROUP_N = nxt
        k = t - g0
        if k < n_steps + LR:
            _load_tile_step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m, t, k,
                            n_steps, BK, STAGES, W_T, LR)
        elif next_tile < gl.cdiv(N, 128) * gl.cdiv(M, BM):
            nxt_n, nxt_m = _tile_offsets(next_tile, M, N, BM, GROUP_N)
            _load_tile_step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, nxt_n, nxt_m, t,
                            k - n_steps - LR, n_steps, BK, STAGES, W_T, LR)
    elif t < n_steps + LR:
        _load_tile_step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m, t, t,
                        n_steps, BK, STAGES, W_T, LR)


@gluon.jit
def _load_tile_step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m, t, k, n_steps,
                    BK: gl.constexpr, STAGES: gl.constexpr, W_T: gl.constexpr, LR: gl.constexpr):
    """Step k (< n_steps + LR) of the tile at off_n, off_m into buffer t % STAGES (t: the step's place in the ring)."""
    if k < n_steps:
        _load_codes_and_x(x_desc, w_desc, w_smem, x_smem, ready, free, off_n, off_m, t, k, BK, STAGES, W_T)
    elif LR > 0:
        s = t % STAGES
        mbarrier.wait(free.index(s), ((t // STAGES) & 1) ^ 1)
        _load_lora_chunk(xa_desc, b_desc, x_smem, b_ring, ready, off_n, off_m, s, (k - n_steps) * 64, W_T)


@gluon.jit
def _load_codes_and_x(x_desc, w_desc, w_smem, x_smem, ready, free, off_n, off_m, t, k, BK: gl.constexpr,
                      STAGES: gl.constexpr, W_T: gl.constexpr):
    """k-step k's codes and x tiles into buffer t % STAGES, once that buffer is free."""
    s = t % STAGES
    # parity ^ 1: a fresh barrier counts as having completed the phase before its first, so the first STAGES
    # loads do not wait
    mbarrier.wait(free.index(s), ((t // STAGES) & 1) ^ 1)
    if W_T:
        mbarrier.expect(ready.index(s), 2 * w_desc.block_type.nbytes + x_desc.block_type.nbytes)
        _tma_load(w_desc, [k * BK, off_n], ready.index(s), w_smem.index(2 * s))
        _tma_load(w_desc, [k * BK, off_n + 64], ready.index(s), w_smem.index(2 * s + 1))
    else:
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes + x_desc.block_type.nbytes)
        _tma_load(w_desc, [off_n, k * BK], ready.index(s), w_smem.index(s))
    _tma_load(x_desc, [off_m, k * BK], ready.index(s), x_smem.index(s))


@gluon.jit
def _load_lora_chunk(xa_desc, b_desc, x_smem, b_ring, ready, off_n, off_m, s, r0, W_T: gl.constexpr):
    """Ranks r0 ... r0 + 63 of the LoRA term into buffer s: xa's `[BM, 64]` into the x ring (its layout: BK = 64),
    B's rows `[128, 64]` (dX: Bᵀ's `[64, 64]` box per warpgroup, buffers 2·s and 2·s + 1) into the B ring. Ranks past
    r come back as zeros, as the prefetched tiles' do."""
    if W_T:
        mbarrier.expect(ready.index(s), 2 * b_desc.block_type.nbytes + xa_desc.block_type.nbytes)
        _tma_load(b_desc, [r0, off_n], ready.index(s), b_ring.index(2 * s))
        _tma_load(b_desc, [r0, off_n + 64], ready.index(s), b_ring.index(2 * s + 1))
    else:
        mbarrier.expect(ready.index(s), b_desc.block_type.nbytes + xa_desc.block_type.nbytes)
        _tma_load(b_desc, [off_n, r0], ready.index(s), b_ring.index(s))
    _tma_load(xa_desc, [off_m, r0], ready.index(s), x_smem.index(s))


@gluon.jit
def _hold(a):
    """A use of registers a that the compiler must keep (an opaque copy). Placed after the wait that completes the
    wgmma reading them, it keeps them live until then, so that ptxas cannot hand them to the next step's codes while
    that wgmma is in flight. (With the k-steps in pairs ptxas keeps them apart now without it - the same SASS,
    the copies vanish -; the hold makes that a requirement, not a register allocator's choice.)"""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a], dtype=gl.bfloat16, is_pure=False, pack=2)


@gluon.jit
def _step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, acc, a_prev, i, n_steps,
          off_n, off_m, nxt, release, a_layout: gl.constexpr, WG: gl.constexpr, BK: gl.constexpr,
          STAGES: gl.constexpr, W_T: gl.constexpr, LR: gl.constexpr, PERSISTENT: gl.constexpr):
    """k-step i into acc: (acc, A registers of its wgmma, still in flight). Waits for step i - 1's wgmma, holds that
    step's A registers a_prev until then, and warpgroup 0 loads step i + STAGES - 1 into step i - 1's buffer,
    warpgroup 1 frees that buffer (if `release`)."""
    s = i % STAGES
    mbarrier.wait(ready.index(s), (i // STAGES) & 1)
    if W_T:  # this warpgroup's `[BK, 64]` box, read transposed (byte loads: the k pairs lie in different rows)
        codes = w_smem.index(2 * s + WG).permute((1, 0)).load(a_layout)
    else:
        codes = w_smem.index(s).slice(WG * 64, 64).load(a_layout)
    a = _widen(codes)
    acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, is_async=True)
    # at most this step's wgmma in flight: the previous step's is done, its buffer free for this warpgroup (its
    # codes were read into registers before its wgmma was issued, by every warp of the warpgroup)
    acc, a = warpgroup_mma_wait(1, deps=(acc, a))
    _hold(a_prev)
    _load_or_release(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m, i,
                     n_steps, nxt, release, WG, BK, STAGES, W_T, LR, PERSISTENT)
    return acc, a


@gluon.jit
def _load_or_release(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m, i, n_steps,
                     nxt, release, WG: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, W_T: gl.constexpr,
                     LR: gl.constexpr, PERSISTENT: gl.constexpr):
    """After step i's wgmma is issued and step i - 1's is done: warpgroup 0 loads step i + STAGES - 1 into step
    i - 1's buffer (once warpgroup 1 has freed it), warpgroup 1 frees that buffer (if `release`)."""
    if WG == 0:
        _load_step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m,
                   i + STAGES - 1, n_steps, nxt, BK, STAGES, W_T, LR, PERSISTENT)
    else:
        mbarrier.arrive(free.index((i + STAGES - 1) % STAGES), pred=release)


@gluon.jit
def _lora_ring(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m, n_steps, g0, nxt,
               acc_layout: gl.constexpr, WG: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
               W_T: gl.constexpr, LR: gl.constexpr, PERSISTENT: gl.constexpr):
    """The LoRA term B·xa of this warpgroup's 64 rows from zero, its ranks streamed through the k-step ring 64 at a
    time (steps n_steps ... n_steps + LR - 1, `_load_lora_chunk`), one wgmma of K = 64 each into one accumulator:
    the same 16-deep k-steps in the same order as the one wgmma of K = BR over prefetched tiles, so the same bits,
    with no shared memory for those tiles (the fused qkv's rank 192, padded to 256, fits beside a 256-token ring).
    g0: the tile's first step in the ring (0 but in a PERSISTENT kernel's later tiles)."""
    lora = gl.zeros([64, BM], gl.float32, acc_layout)
    for j in gl.static_range(LR):
        i = g0 + n_steps + j
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if W_T:  # Bᵀ's `[64 ranks, 64 rows]` box, MN-major
            b_rows = b_ring.index(2 * s + WG).permute((1, 0))
        else:
            b_rows = b_ring.index(s).slice(WG * 64, 64)
        lora = warpgroup_mma(b_rows, x_smem.index(s).permute((1, 0)), lora, is_async=True)
        lora = warpgroup_mma_wait(1, deps=(lora,))
        _load_or_release(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, off_n, off_m, i,
                         n_steps, nxt, True, WG, BK, STAGES, W_T, LR, PERSISTENT)
    return warpgroup_mma_wait(0, deps=(lora,))


@gluon.jit
def _mainloop(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, n_chunks, steps, off_n,
              off_m, g0, nxt, acc_layout: gl.constexpr, a_layout: gl.constexpr, WG: gl.constexpr, BM: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr, W_T: gl.constexpr, LR: gl.constexpr,
              PERSISTENT: gl.constexpr):
    """Σ over the K chunks in order (+0.0 first) of each chunk's k-steps from zero: the running total [64, BM].
    Steps go in pairs (`steps` is even) with A registers of their own, so that the in-flight wgmma's operand and the
    next step's are distinct registers in the PTX itself. g0: the tile's first step in the ring (`_lora_ring`)."""
    n_steps = n_chunks * steps
    total = gl.zeros([64, BM], gl.float32, acc_layout)
    a_odd = gl.zeros([64, BK], gl.bfloat16, a_layout)
    for c in range(n_chunks):
        acc = gl.zeros([64, BM], gl.float32, acc_layout)
        for j in range(0, steps, 2):
            i = g0 + c * steps + j
            acc, a_even = _step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, acc,
                                a_odd, i, n_steps, off_n, off_m, nxt, i > 0, a_layout, WG, BK, STAGES, W_T,
                                LR, PERSISTENT)
            acc, a_odd = _step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_ring, ready, free, acc,
                               a_even, i + 1, n_steps, off_n, off_m, nxt, True, a_layout, WG, BK, STAGES, W_T,
                               LR, PERSISTENT)
        acc, a_odd = warpgroup_mma_wait(0, deps=(acc, a_odd))
        total = total + acc
    return total


@gluon.jit
def _consumer(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
              w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, n_chunks, steps,
              WG: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, BR: gl.constexpr, STAGES: gl.constexpr,
              HAS_W_SCALE: gl.constexpr, HAS_LORA: gl.constexpr, HAS_BIAS: gl.constexpr, W_T: gl.constexpr,
              LR: gl.constexpr):
    """Warpgroup WG: weight rows off_n + 64·WG ... + 63 of the tile, every chunk, then the epilogue. Warpgroup 0
    issues the TMA loads (the LoRA tiles - xa's and B's rows - and the first STAGES - 1 k-steps first). LR > 0: the
    LoRA term's ranks come through the ring after the k-steps instead (`_lora_ring`; b_smem is then that B ring)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    n_steps = n_chunks * steps
    if WG == 0:
        if HAS_LORA and LR == 0:
            if W_T:  # Bᵀ `[r, N]` row-major (dX's B is the LoRA A): one `[BR, 64]` box per warpgroup's rows
                mbarrier.expect(xa_bar, xa_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
                _tma_load(b_desc, [0, off_n], xa_bar, b_smem.index(0))
                _tma_load(b_desc, [0, off_n + 64], xa_bar, b_smem.index(1))
            else:
                mbarrier.expect(xa_bar, xa_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(b_desc, [off_n, 0], xa_bar, b_smem)
            _tma_load(xa_desc, [off_m, 0], xa_bar, xa_smem)
        for t in gl.static_range(STAGES - 1):
            _load_step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_smem, ready, free, off_n, off_m, t, n_steps,
                       0, BK, STAGES, W_T, LR, False)
    total = _mainloop(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_smem, ready, free, n_chunks, steps,
                      off_n, off_m, 0, 0, acc_layout, a_layout, WG, BM, BK, STAGES, W_T, LR, False)
    _epilogue(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
              w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, n_steps, 0, 0, total, acc_layout, WG,
              BM, BK, STAGES, HAS_W_SCALE, HAS_LORA, HAS_BIAS, W_T, LR, False)


@gluon.jit
def _persistent_consumer(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_smem, ready, free, y_ptr,
                         w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, n_chunks, steps, WG: gl.constexpr,
                         BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, GROUP_N: gl.constexpr,
                         HAS_W_SCALE: gl.constexpr, HAS_LORA: gl.constexpr, HAS_BIAS: gl.constexpr,
                         W_T: gl.constexpr, LR: gl.constexpr):
    """`_consumer` over tiles pid, pid + programs, ... (PERSISTENT; the LoRA, if any, through the ring): one ring of
    steps runs through all of them, so warpgroup 0's loads of a tile's first STAGES - 1 steps are issued during the
    last steps of the tile before, and land while both warpgroups run that tile's epilogue."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    n_steps = n_chunks * steps
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    tiles = gl.cdiv(N, 128) * gl.cdiv(M, BM)
    off_n, off_m = _tile_offsets(pid, M, N, BM, GROUP_N)
    if WG == 0:
        for t in gl.static_range(STAGES - 1):
            _load_step(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_smem, ready, free, off_n, off_m, t, n_steps,
                       (0, pid + programs, M, N, BM, GROUP_N), BK, STAGES, W_T, LR, True)
    g0 = pid * 0  # the tile's first step in the ring
    for tile in range(pid, tiles, programs):
        nxt = (g0, tile + programs, M, N, BM, GROUP_N)
        total = _mainloop(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_smem, ready, free, n_chunks,
                          steps, off_n, off_m, g0, nxt, acc_layout, a_layout, WG, BM, BK, STAGES, W_T, LR, True)
        _epilogue(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, None, b_smem, ready, free, None, y_ptr,
                  w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, n_steps, g0, nxt, total,
                  acc_layout, WG, BM, BK, STAGES, HAS_W_SCALE, HAS_LORA, HAS_BIAS, W_T, LR, True)
        g0 += n_steps + LR
        off_n, off_m = _tile_offsets(tile + programs, M, N, BM, GROUP_N)


@gluon.jit
def _epilogue(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
              w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, n_steps, g0, nxt, total,
              acc_layout: gl.constexpr, WG: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              HAS_W_SCALE: gl.constexpr, HAS_LORA: gl.constexpr, HAS_BIAS: gl.constexpr, W_T: gl.constexpr,
              LR: gl.constexpr, PERSISTENT: gl.constexpr):
    """This warpgroup's 64 rows of the tile: the running total times the weight scale, plus σ·(B·xa) (the LoRA tiles
    or `_lora_ring`), plus the bias, rounded and stored."""
    rn = off_n + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    rm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
    mask_n = rn < N
    if HAS_W_SCALE:
        total = total * gl.load(w_scale_ptr)
    if HAS_LORA and LR > 0:
        lora = _lora_ring(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_smem, ready, free, off_n, off_m,
                          n_steps, g0, nxt, acc_layout, WG, BM, BK, STAGES, W_T, LR, PERSISTENT)
        total = gl.fma(lora, lora_scale, total)  # explicit FMA, as `_ws_epilogue`
    elif HAS_LORA:
        # B's rows as wgmma's shared-memory A operand (TMA zero-fills rows past N and columns past r, as the Triton
        # kernels' masked loads): no register layout conversion, whose scratch buffer the two warpgroups would
        # share while their epilogues overlap
        mbarrier.wait(xa_bar, 0)
        if W_T:  # B's rows, MN-major in shared memory (wgmma transposes a 16-bit shared A operand itself)
            b_rows = b_smem.index(WG).permute((1, 0))
        else:
            b_rows = b_smem.slice(WG * 64, 64)
        lora = warpgroup_mma(b_rows, xa_smem.permute((1, 0)), gl.zeros([64, BM], gl.float32, acc_layout),
                             is_async=True)
        lora = warpgroup_mma_wait(0, deps=(lora,))
        total = gl.fma(lora, lora_scale, total)  # explicit FMA, as `_ws_epilogue`
    if HAS_BIAS:
        total = total + gl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(gl.float32)[:, None]
    y_ptrs = y_ptr + rm[None, :].to(gl.int64) * stride_ym + rn[:, None]
    gl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & (rm < M)[None, :])


@gluon.jit
def _tile_offsets(tile, M, N, BM: gl.constexpr, GROUP_N: gl.constexpr):
    """(off_n, off_m) of output tile `tile` [128 weight rows, BM tokens] in grouped order (`_grouped_tile_ids_of`)."""
    BN: gl.constexpr = 128  # the module's BN (a jit function reads only constexpr globals)
    tiles_m = gl.cdiv(M, BM)
    group = tile // (GROUP_N * tiles_m)
    first = group * GROUP_N
    size = gl.minimum(gl.cdiv(N, BN) - first, GROUP_N)
    off_n = (first + (tile % (GROUP_N * tiles_m)) % size) * BN
    off_m = ((tile % (GROUP_N * tiles_m)) // size) * BM
    return off_n, off_m


# N_CHUNKS is never specialized: Triton makes an integer argument equal to 1 a constant, and dX runs in one chunk
# (`whole_k`); the kernel compiled for N_CHUNKS = 1 has its wgmmas serialized by ptxas (C7515) and 864 B of spills,
# and ran 5x slower on the H200 (q3_o dX at BM 256: 2396 µs against 493 µs for the same kernel over 4 chunks)
@gluon.jit(do_not_specialize=["N_CHUNKS"])
def _ws_gluon_kernel(x_desc, w_desc, xa_desc, b_desc, y_ptr, w_scale_ptr, bias_ptr, M, N, K_CHUNK, N_CHUNKS,
                     lora_scale, stride_ym, HAS_W_SCALE: gl.constexpr, HAS_LORA: gl.constexpr,
                     HAS_BIAS: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, BR: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_N: gl.constexpr, W_T: gl.constexpr = False,
                     LORA_STEPS: gl.constexpr = 0, PERSISTENT: gl.constexpr = False):
    """One program per output tile [128 weight rows, BM tokens] (grouped order, `_tile_offsets`), or PERSISTENT: a
    program per SM, tiles pid, pid + programs, ... (`_persistent_consumer`). LORA_STEPS > 0: the LoRA ranks streamed
    through the ring that many 64 at a time (`_lora_ring`; BK = 64)."""
    BN: gl.constexpr = 128  # the module's BN (a jit function reads only constexpr globals)
    gl.static_assert(not (PERSISTENT and HAS_LORA and LORA_STEPS == 0), "a persistent kernel takes its LoRA by ring")
    off_n, off_m = _tile_offsets(gl.program_id(0), M, N, BM, GROUP_N)  # (the first tile's, if PERSISTENT)

    # b_smem: B's tile (Bᵀ's two `[BR, 64]` boxes in dX), or with LORA_STEPS its ring: per stage B's `[128, 64]`
    # (dX: two `[64, 64]` boxes); xa's chunks then go into the x ring, and xa_smem is not allocated
    if W_T:  # dX: per stage one `[BK, 64]` codes box per warpgroup
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [2 * STAGES, BK, 64], w_desc.layout)
        if LORA_STEPS:
            b_smem = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES, 64, 64], b_desc.layout)
        else:
            b_smem = gl.allocate_shared_memory(b_desc.dtype, [2, BR, 64], b_desc.layout)
    else:
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
        if LORA_STEPS:
            b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, 64], b_desc.layout)
        else:
            b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    if LORA_STEPS:
        xa_smem = x_smem  # (unused)
    else:
        xa_smem = gl.allocate_shared_memory(xa_desc.dtype, xa_desc.block_type.shape, xa_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xa_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=1)  # warpgroup 1's release; warpgroup 0 loads after its own wait
    mbarrier.init(xa_bar, count=1)
    steps = K_CHUNK // BK
    if PERSISTENT:
        gl.warp_specialize([
            (_persistent_consumer, (x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, b_smem, ready, free,
                                    y_ptr, w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, N_CHUNKS, steps, 0, BM,
                                    BK, STAGES, GROUP_N, HAS_W_SCALE, HAS_LORA, HAS_BIAS, W_T, LORA_STEPS)),
            (_persistent_consumer, (None, None, None, None, w_smem, x_smem, b_smem, ready, free, y_ptr,
                                    w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, N_CHUNKS, steps, 1, BM, BK,
                                    STAGES, GROUP_N, HAS_W_SCALE, HAS_LORA, HAS_BIAS, W_T, LORA_STEPS)),
        ], [4], [CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar,
                         y_ptr, w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, N_CHUNKS, steps, 0, BM,
                         BK, BR, STAGES, HAS_W_SCALE, HAS_LORA, HAS_BIAS, W_T, LORA_STEPS)),
            # (warpgroup 1 issues no load: no descriptor is passed to its partition)
            (_consumer, (None, None, None, None, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
                         w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, N_CHUNKS, steps, 1, BM, BK,
                         BR, STAGES, HAS_W_SCALE, HAS_LORA, HAS_BIAS, W_T, LORA_STEPS)),
        ], [4], [CONSUMER_REGS])


@functools.lru_cache(maxsize=64)
def _shared_layout(block: tuple, dtype) -> gl.NVMMASharedLayout:
    """The descriptors' shared layout for a block shape and element type (host time: building one costs ~5 µs, and a
    launch needs four)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)




@functools.lru_cache(maxsize=8)
def _sm_count(device_index) -> int:
    """Streaming multiprocessors of the device (the PERSISTENT kernel's program count), looked up once."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _codes_transposed(w) -> bool:
    """Whether w is dX's view of the codes: `codes.t()` of row-major `[N, K]` codes (the dX call's `[K, N]`, read with
    N as the reduction)."""
    return w.dim() == 2 and w.stride(0) == 1 and w.stride(1) == w.shape[0] and w.shape[1] > 1


def lora_through_ring(cfg: dict, xa, br: int) -> bool:
    """Whether this call streams its LoRA ranks through the k-step ring (`_lora_ring`): the config says so (its
    "LORA_RING", a table field the tuner sets where it measured faster) and there is a LoRA whose padded rank br is a
    whole number of 64-rank steps (smaller ranks take the LoRA tiles as without it: the same bits)."""
    return bool(cfg.get("LORA_RING")) and xa is not None and br % 64 == 0


def runs_persistent(cfg: dict, xa, br: int, n_steps: int) -> bool:
    """Whether this call runs the PERSISTENT kernel (a program per SM over many tiles, `_persistent_consumer`): the
    config says so, the LoRA (if any) comes through the ring (the persistent kernel has no LoRA tiles), and a tile has
    at least STAGES - 1 steps, so that the loads, STAGES - 1 steps ahead, never reach past the next tile."""
    lr = br // 64 if lora_through_ring(cfg, xa, br) else 0
    return (bool(cfg.get("PERSISTENT")) and (xa is None or lr > 0)
            and n_steps + lr >= cfg["num_stages"] - 1)


def gluon_ok(x, w, y, xa, lora_b, k_chunk: int, n_chunks: int, cfg: dict, br: int) -> bool:
    """Whether `launch_gluon_fwd` can run this call: CUDA bf16 x and e4m3 codes, x and xa row-major, the codes and B
    row-major (forward) or both the transposed views of row-major tensors (dX: `codes.t()`, B = the LoRA Aᵀ), all
    TMA-aligned, y with unit column stride, the chunks tiling K in an even number of BK steps each (`_mainloop` takes
    them in pairs), and the ring plus the LoRA tiles within a CTA's shared memory - or, where the LoRA goes through
    the ring (`lora_through_ring`, which needs BK = 64), the ring plus its B ring `[STAGES, 128, 64]`."""
    BM, BK = cfg["BM"], cfg["BK"]
    ring = lora_through_ring(cfg, xa, br)
    if ring and BK != 64:
        return False
    w_t = _codes_transposed(w)
    row_major = (lambda t: _aligned(t.t())) if w_t else _aligned
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == torch.float8_e4m3fn and _aligned(x)
            and row_major(w) and y.stride(1) == 1 and (xa is None or (_aligned(xa) and row_major(lora_b)))
            and k_chunk * n_chunks == x.shape[1] and k_chunk % (2 * BK) == 0 and BM in (128, 256)
            and shared_bytes(cfg, br, ring) <= SMEM_LIMIT)


def fitting_config(x, w, y, xa, lora_b, k_chunk: int, n_chunks: int, cfg: dict, br: int) -> dict | None:
    """The config `launch_gluon_fwd` runs for this call: `cfg` where `gluon_ok` holds; where its shared memory
    overflows at BM = 256 (a LoRA rank whose tiles do not fit beside that ring: the fused qkv's block-diagonal rank
    192, padded to 256), in the forward the same config at BM = 128; else None (the Triton kernels run). Token tiles
    never change an element's arithmetic, so both give the same bits. Measured on the H200 (8192 tokens,
    BENCHMARKS.md): the narrowed forward beats the Triton TMA kernel (q3_qkv at rank 192: 1.14x against 1.24x
    cuBLAS); the narrowed dX does not (813 against 768 µs), so dX keeps the Triton kernel there. (A config with
    "LORA_RING" fits at rank 192 without narrowing: the table's qkv entries carry it.)"""
    if gluon_ok(x, w, y, xa, lora_b, k_chunk, n_chunks, cfg, br):
        return cfg
    if cfg["BM"] != 256 or _codes_transposed(w):
        return None
    narrow = dict(cfg, BM=128)
    return narrow if gluon_ok(x, w, y, xa, lora_b, k_chunk, n_chunks, narrow, br) else None


def launch_gluon_fwd(x, w, y, w_scale, xa, lora_b, lora_scale, bias, k_chunk, n_chunks, cfg, br):
    """y `[M, N]` = the W8A16 GEMM of x `[M, K]` and codes w `[N, K]` (the forward; dX: w = `codes.t()`, B = the LoRA
    Aᵀ, both transposed views) with xa (bf16 `[M, r]`, given) and B `[N, r]` (`gluon_ok` must hold); cfg: BM (tokens
    per tile: 128 or 256), BK, num_stages, GROUP_N (default 8), LORA_RING (`lora_through_ring`); br: r padded as the
    Triton kernels' epilogue pads it. The bits of `weight_stationary_gemm`'s other kernels."""
    M, K = x.shape
    N = w.shape[0]
    BM, BK, stages = cfg["BM"], cfg["BK"], cfg["num_stages"]
    w_t = _codes_transposed(w)
    install_descriptor_cache()  # before this kernel's first launch builds its launcher (tma_desc_cache.py)

    def desc(t, block, dtype):
        return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), dtype))
    x_desc = desc(x, [BM, BK], gl.bfloat16)
    # dX: the row-major codes `[K, N]` in `[BK, 64]` boxes, one per warpgroup's 64 output rows
    w_desc = desc(w.t(), [BK, 64], gl.float8e4nv) if w_t else desc(w, [BN, BK], gl.float8e4nv)
    has_lora = xa is not None
    ring = lora_through_ring(cfg, xa, br)
    if ring:  # 64 ranks a step: xa `[BM, 64]` (the x ring's box), B `[128, 64]` (dX: Bᵀ `[64, 64]` per warpgroup)
        xa_desc = desc(xa, [BM, 64], gl.bfloat16)
        b_desc = desc(lora_b.t(), [64, 64], gl.bfloat16) if w_t else desc(lora_b, [BN, 64], gl.bfloat16)
    elif has_lora:
        xa_desc = desc(xa, [BM, br], gl.bfloat16)
        b_desc = desc(lora_b.t(), [br, 64], gl.bfloat16) if w_t else desc(lora_b, [BN, br], gl.bfloat16)
    else:  # valid descriptors that no load uses
        xa_desc = desc(x, [BM, 16], gl.bfloat16)
        b_desc = desc(x, [16, 64], gl.bfloat16) if w_t else desc(x, [BN, 16], gl.bfloat16)
    tiles = cdiv(M, BM) * cdiv(N, BN)
    persistent = runs_persistent(cfg, xa, br, n_chunks * (k_chunk // BK))
    programs = min(tiles, _sm_count(x.device.index)) if persistent else tiles
    _ws_gluon_kernel[(programs,)](
        x_desc, w_desc, xa_desc, b_desc, y, w_scale if w_scale is not None else y, bias if bias is not None else y,
        M, N, k_chunk, n_chunks, float(lora_scale), y.stride(0),
        HAS_W_SCALE=w_scale is not None, HAS_LORA=has_lora, HAS_BIAS=bias is not None, BM=BM, BK=BK,
        BR=br if has_lora else 16, STAGES=stages, GROUP_N=cfg.get("GROUP_N", 8), W_T=w_t,
        LORA_STEPS=br // 64 if ring else 0, PERSISTENT=persistent,
        num_warps=4)
    return y
