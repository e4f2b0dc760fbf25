"""The weight-stationary training forward, warp-specialized in Gluon (issue 12): same k-steps, same bits — measured
slower than the Triton TMA kernel on the H200 and removed right after this commit (BENCHMARKS.md § Kernels,
2026-12-04 nineteenth session); kept in history with `scripts/probe_gluon_fwd.py` for whoever takes it up.

Why it was tried: the Triton TMA kernel (`ws_tma.py`) runs the 8192-token Qwen3-8B down forward at ~620 TFLOP/s
against cuBLAS bf16's ~720; its k-loop holds 6 CTA-wide `BAR.SYNC`s per 64-deep step (sm_90a SASS). Here two consumer
warpgroups, each owning 64 of the tile's 128 weight rows, wait only on mbarriers: warpgroup 0 also issues the TMA loads
of a ring of STAGES codes / x buffers (after its own wgmma of the step before is done), warpgroup 1 frees each buffer
once its wgmma has read it. (A separate one-warp loader partition made the kernel three warpgroups, 168 registers a
thread, and ptxas serialized every wgmma: C7512.)

Bits: the K chunks of `configs.k_chunking`, each from zero in 16-deep bf16 wgmma k-steps, added into the running total
in chunk order from +0.0, then `_ws_epilogue`'s op order (scale, explicit fma with σ·(B·xa), bias, round): the pointer
kernel's bits on every shape probed. One loop over all k-steps with the chunk end as a branch: the nested chunk loop
gave warpgroup 1 wrong values from the second chunk on (Triton 3.6).
"""

from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._host import cdiv
from .widen import _WIDEN_ASM

ROWS_PER_WARPGROUP = 64  # wgmma's M: each consumer warpgroup owns 64 weight rows of the tile
CONSUMERS = 2
BN = ROWS_PER_WARPGROUP * CONSUMERS
# setmaxnreg budgets of the worker partitions (the second consumer warpgroup, the loader warp): the loader needs few
CONSUMER_REGS = gl.constexpr(int(os.environ.get("EPIRL_GLUON_REGS", "256")))
LOAD_SYNC = gl.constexpr(os.environ.get("EPIRL_GLUON_SYNC", "0") == "1")


@gluon.jit
def _widen(codes):
    """bf16 of e4m3 codes, `widen.widen_e4m3`'s PTX (two codes per 32-bit register, as wgmma's A operand holds them)."""
    return gl.inline_asm_elementwise(_WIDEN_ASM, "=r,r", [codes.to(gl.uint8, bitcast=True)], dtype=gl.bfloat16,
                                     is_pure=True, pack=2)


@gluon.jit
def _load_step(x_desc, w_desc, w_smem, x_smem, ready, free, off_n, off_m, t, n_steps, BK: gl.constexpr,
               STAGES: gl.constexpr):
    """TMA loads of k-step t's codes and x tiles into buffer t % STAGES (nothing past the last step), once the
    other warpgroup has freed that buffer from step t - STAGES."""
    if t < n_steps:
        s = t % STAGES
        # parity ^ 1: a fresh barrier counts as having completed the phase before its first, so the first STAGES
        # loads do not wait
        mbarrier.wait(free.index(s), ((t // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes + x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [off_n, t * BK], ready.index(s), w_smem.index(s))
        tma.async_copy_global_to_shared(x_desc, [off_m, t * BK], ready.index(s), x_smem.index(s))


@gluon.jit
def _mainloop(x_desc, w_desc, w_smem, x_smem, ready, free, n_steps, steps, off_n, off_m, acc_layout: gl.constexpr,
              a_layout: gl.constexpr, WG: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """Σ over the K chunks in order (+0.0 first) of each chunk's k-steps from zero: the running total [64, BM].
    One loop over every k-step; a chunk ends every `steps` steps. a_prev: the A registers of the wgmma still in
    flight, passed through each wait so that the compiler keeps them until it completes. Warpgroup 0 also loads:
    after step i - 1's wgmma is done, step i + STAGES - 1 into that step's buffer; warpgroup 1 frees it."""
    total = gl.zeros([64, BM], gl.float32, acc_layout)
    acc = gl.zeros([64, BM], gl.float32, acc_layout)
    a_prev = gl.zeros([64, BK], gl.bfloat16, a_layout)
    for i in range(n_steps):
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        codes = w_smem.index(s).slice(WG * 64, 64).load(a_layout)
        a = _widen(codes)
        acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, is_async=True)
        # at most this step's wgmma in flight: the previous step's is done, its buffer free for this warpgroup (its
        # codes were read into registers before its wgmma was issued, by every warp of the warpgroup)
        acc, a, a_prev = warpgroup_mma_wait(1, deps=(acc, a, a_prev))
        if WG == 0:
            _load_step(x_desc, w_desc, w_smem, x_smem, ready, free, off_n, off_m, i + STAGES - 1, n_steps, BK,
                       STAGES)
        else:
            mbarrier.arrive(free.index((i + STAGES - 1) % STAGES), pred=i > 0)
        a_prev = a
        if (i + 1) % steps == 0:  # the chunk's last step: its sum joins the total, the next chunk starts from zero
            acc, a_prev = warpgroup_mma_wait(0, deps=(acc, a_prev))
            total = total + acc
            acc = gl.zeros([64, BM], gl.float32, acc_layout)
    return total


@gluon.jit
def _consumer(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
              w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, n_chunks, steps,
              WG: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, BR: gl.constexpr, STAGES: gl.constexpr,
              HAS_W_SCALE: gl.constexpr, HAS_LORA: gl.constexpr, HAS_BIAS: gl.constexpr):
    """Warpgroup WG: weight rows off_n + 64·WG ... + 63 of the tile, every chunk, then the epilogue. Warpgroup 0
    issues the TMA loads (the LoRA tiles - xa's and B's rows - and the first STAGES - 1 k-steps first)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    n_steps = n_chunks * steps
    if WG == 0:
        if HAS_LORA:
            mbarrier.expect(xa_bar, xa_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(xa_desc, [off_m, 0], xa_bar, xa_smem)
            tma.async_copy_global_to_shared(b_desc, [off_n, 0], xa_bar, b_smem)
        for t in gl.static_range(STAGES - 1):
            _load_step(x_desc, w_desc, w_smem, x_smem, ready, free, off_n, off_m, t, n_steps, BK, STAGES)
    total = _mainloop(x_desc, w_desc, w_smem, x_smem, ready, free, n_steps, steps, off_n, off_m, acc_layout, a_layout,
                      WG, BM, BK, STAGES)
    rn = off_n + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    rm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
    mask_n = rn < N
    if HAS_W_SCALE:
        total = total * gl.load(w_scale_ptr)
    if HAS_LORA:
        # B's rows as wgmma's shared-memory A operand (TMA zero-fills rows past N and columns past r, as the Triton
        # kernels' masked loads): no register layout conversion, whose scratch buffer the two warpgroups would
        # share while their epilogues overlap
        mbarrier.wait(xa_bar, 0)
        lora = warpgroup_mma(b_smem.slice(WG * 64, 64), xa_smem.permute((1, 0)),
                             gl.zeros([64, BM], gl.float32, acc_layout), is_async=True)
        lora = warpgroup_mma_wait(0, deps=(lora,))
        total = gl.fma(lora, lora_scale, total)  # explicit FMA, as `_ws_epilogue`
    if HAS_BIAS:
        total = total + gl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(gl.float32)[:, None]
    y_ptrs = y_ptr + rm[None, :].to(gl.int64) * stride_ym + rn[:, None]
    gl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & (rm < M)[None, :])


@gluon.jit
def _ws_gluon_kernel(x_desc, w_desc, xa_desc, b_desc, y_ptr, w_scale_ptr, bias_ptr, M, N, K_CHUNK, N_CHUNKS,
                     lora_scale, stride_ym, HAS_W_SCALE: gl.constexpr, HAS_LORA: gl.constexpr,
                     HAS_BIAS: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, BR: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_N: gl.constexpr):
    """One program per output tile [128 weight rows, BM tokens] (grouped order, as `_grouped_tile_ids_of`)."""
    BN: gl.constexpr = 128
    pid = gl.program_id(0)
    tiles_n = gl.cdiv(N, BN)
    tiles_m = gl.cdiv(M, BM)
    group = pid // (GROUP_N * tiles_m)
    first = group * GROUP_N
    size = gl.minimum(tiles_n - first, GROUP_N)
    off_n = (first + (pid % (GROUP_N * tiles_m)) % size) * BN
    off_m = ((pid % (GROUP_N * tiles_m)) // size) * BM

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    xa_smem = gl.allocate_shared_memory(xa_desc.dtype, xa_desc.block_type.shape, xa_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xa_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=1)  # warpgroup 1's release; warpgroup 0 loads after its own wait
    mbarrier.init(xa_bar, count=1)
    steps = K_CHUNK // BK
    gl.warp_specialize([
        (_consumer, (x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
                     w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, N_CHUNKS, steps, 0, BM, BK,
                     BR, STAGES, HAS_W_SCALE, HAS_LORA, HAS_BIAS)),
        # (warpgroup 1 issues no load: no descriptor is passed to its partition)
        (_consumer, (None, None, None, None, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
                     w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, N_CHUNKS, steps, 1, BM, BK,
                     BR, STAGES, HAS_W_SCALE, HAS_LORA, HAS_BIAS)),
    ], [4], [CONSUMER_REGS])


def gluon_ok(x: torch.Tensor, w: torch.Tensor, xa: torch.Tensor | None, lora_b: torch.Tensor | None, k_chunk: int,
             bk: int) -> bool:
    """Whether the Gluon forward can run this call: x, codes, xa and B row-major with 16-byte aligned rows (TMA), BK
    dividing the chunk."""
    def aligned(t):
        return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
                and t.data_ptr() % 16 == 0)
    return (x.is_cuda and aligned(x) and aligned(w) and (xa is None or (aligned(xa) and aligned(lora_b)))
            and k_chunk % bk == 0)


def launch_gluon_fwd(x, w, y, w_scale, xa, lora_b, lora_scale, bias, k_chunk, n_chunks, cfg, br):
    """y `[M, N]` = the W8A16 forward of x `[M, K]` and codes w `[N, K]` with xa (bf16 `[M, r]`, given) and B
    `[N, r]`; cfg: BM (tokens per tile, ≤ 192), BK, num_stages, GROUP_N. Same bits as `weight_stationary_gemm`."""
    M, K = x.shape
    N = w.shape[0]
    BM, BK, stages = cfg["BM"], cfg["BK"], cfg["num_stages"]
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(w, [BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK],
                                                                                            gl.float8e4nv))
    has_lora = xa is not None
    # (without LoRA: valid descriptors that no load uses)
    xa_src, b_src = (xa, lora_b) if has_lora else (x, x)
    xa_block, b_block = ([BM, br], [BN, br]) if has_lora else ([BM, 16], [BN, 16])
    xa_desc = TensorDescriptor.from_tensor(xa_src, xa_block, gl.NVMMASharedLayout.get_default_for(xa_block,
                                                                                                  gl.bfloat16))
    b_desc = TensorDescriptor.from_tensor(b_src, b_block, gl.NVMMASharedLayout.get_default_for(b_block, gl.bfloat16))
    tiles = cdiv(M, BM) * cdiv(N, BN)
    _ws_gluon_kernel[(tiles,)](
        x_desc, w_desc, xa_desc, b_desc, y, w_scale if w_scale is not None else y, bias if bias is not None else y,
        M, N, k_chunk, n_chunks, float(lora_scale), y.stride(0),
        HAS_W_SCALE=w_scale is not None, HAS_LORA=has_lora, HAS_BIAS=bias is not None, BM=BM, BK=BK, BR=br,
        STAGES=stages, GROUP_N=cfg.get("GROUP_N", 8), num_warps=4)
    return y
