"""The Gluon training GEMM in tall tiles (a table "gluon" config's "TALL": true): 256 weight rows x 128 tokens a CTA,
each consumer warpgroup 128 rows as two 64-row wgmma blocks - the same k-steps, the same bits, a fifth less operand
traffic per multiply.

Why: every W8A16 training kernel runs at ~590-620 TFLOP/s on every Qwen shape (H100 and H200, BENCHMARKS.md § Kernels),
whatever its K, while cuBLAS reaches ~705-719 on down's K = 12288. The standard Gluon tile (`ws_gluon.py`: 128 weight
rows x 256 tokens) reads 128 code bytes and 512 x bytes per unit of K for 32,768 multiply-adds; at 611 TFLOP/s that is
~6.0 TB/s from L2 into the SMs, about what an H100's L2 is measured to deliver. The tall tile reads 256 + 256 = 512
bytes for the same multiply-adds (the FP8 operand is the cheap one, so the tile is long on its side): if L2 is what
caps the kernel, this lifts the cap by 25 %; if the widening of the codes is (the other explanation on record), it
gets slower, since it widens twice the codes per multiply. Either way the measurement says which.

Layout: warpgroup WG owns weight rows off_n + 128·WG ... + 127 in two blocks of 64 (wgmma's M), each with its own
`[64, 128]` accumulator (the two are the standard tile's one `[64, 256]`: the same registers). A k-step widens block 0,
issues its wgmma, waits until only that one is in flight (block 1 of the step before is done), holds block 1's old
A registers until then, then the same for block 1: the A registers of an in-flight wgmma are never the ones being
written, with one step a loop trip (`scripts/sass_report.py --gluon` checks the SASS). Loads and releases are the
standard kernel's (warpgroup 0 issues the TMA loads of step i + STAGES - 1 once warpgroup 1 has freed step i - 1's
buffer). The LoRA term: B's 256 rows `[256, r]` and xa `[128, r]` resident, one wgmma per block from zero, the explicit
FMA of `_ws_epilogue`. No LoRA ring and no persistent form: at the fused qkv's rank 192 the tall tile's LoRA tiles
(192 KB) do not fit, and `ws_gluon.fitting_config` runs the standard tile with the ring there.

dX (W_T): the codes `codes.t()` come as four `[BK, 64]` boxes a stage (one per 64-row block), read transposed into
wgmma's A layout, as the standard kernel's dX; B (the LoRA Aᵀ) as four `[BR, 64]` MN-major boxes.

Bits: each output element gets the k-steps, chunk order and epilogue of the standard kernel (`ws_gluon.py`'s module
doc), which the pointer kernel's are: the CTA tile decides which elements a program owns, never an element's
arithmetic (GPU test `test_gluon_tall_tile_gives_the_pointer_kernels_bits`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .._host import cdiv
from .ws_gluon import CONSUMER_REGS, _codes_transposed, _hold, _tile_offsets, _tma_load, _widen, tma_desc

ROWS = 256  # weight rows of a tall tile: 2 warpgroups x 2 blocks of wgmma's 64
TOKENS = 128  # tokens of a tall tile: two [64, 128] fp32 accumulators a warpgroup, as the standard tile's one [64, 256]


@gluon.jit
def _tall_load(x_desc, w_desc, w_smem, x_smem, ready, free, off_n, off_m, t, n_steps, BK: gl.constexpr,
               STAGES: gl.constexpr, W_T: gl.constexpr):
    """k-step t's codes and x tiles into buffer t % STAGES once warpgroup 1 has freed it (nothing past the last
    step): the codes `[256, BK]`, or in dX four `[BK, 64]` boxes of `codes.t()`'s row-major `[K, N]`."""
    if t < n_steps:
        s = t % STAGES
        # parity ^ 1: a fresh barrier counts as having completed the phase before its first
        mbarrier.wait(free.index(s), ((t // STAGES) & 1) ^ 1)
        if W_T:
            mbarrier.expect(ready.index(s), 4 * w_desc.block_type.nbytes + x_desc.block_type.nbytes)
            for blk in gl.static_range(4):
                _tma_load(w_desc, [t * BK, off_n + 64 * blk], ready.index(s), w_smem.index(4 * s + blk))
        else:
            mbarrier.expect(ready.index(s), w_desc.block_type.nbytes + x_desc.block_type.nbytes)
            _tma_load(w_desc, [off_n, t * BK], ready.index(s), w_smem.index(s))
        _tma_load(x_desc, [off_m, t * BK], ready.index(s), x_smem.index(s))


@gluon.jit
def _tall_block(w_smem, x_smem, acc, a_prev, s, BLK: gl.constexpr, a_layout: gl.constexpr, W_T: gl.constexpr):
    """Block BLK (0-3: rows 64·BLK ... of the tile) of a k-step into acc: its codes widened into A registers, its
    wgmma issued, then a wait until only it is in flight - which completes the wgmma that read a_prev, held until
    then. Returns (acc, the A registers of the wgmma still in flight)."""
    if W_T:  # the block's `[BK, 64]` box, read transposed (byte loads: a bf16x2 register's two codes lie in two rows)
        codes = w_smem.index(4 * s + BLK).permute((1, 0)).load(a_layout)
    else:
        codes = w_smem.index(s).slice(BLK * 64, 64).load(a_layout)
    a = _widen(codes)
    acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, is_async=True)
    acc, a = warpgroup_mma_wait(1, deps=(acc, a))
    _hold(a_prev)
    return acc, a


@gluon.jit
def _tall_mainloop(x_desc, w_desc, w_smem, x_smem, ready, free, n_chunks, steps, off_n, off_m,
                   acc_layout: gl.constexpr, a_layout: gl.constexpr, WG: gl.constexpr, BM: gl.constexpr,
                   BK: gl.constexpr, STAGES: gl.constexpr, W_T: gl.constexpr):
    """Σ over the K chunks in order (+0.0 first) of each chunk's k-steps from zero, for this warpgroup's two blocks:
    the running totals ([64, BM] each)."""
    n_steps = n_chunks * steps
    total0 = gl.zeros([64, BM], gl.float32, acc_layout)
    total1 = gl.zeros([64, BM], gl.float32, acc_layout)
    a1 = gl.zeros([64, BK], gl.bfloat16, a_layout)
    for c in range(n_chunks):
        acc0 = gl.zeros([64, BM], gl.float32, acc_layout)
        acc1 = gl.zeros([64, BM], gl.float32, acc_layout)
        for j in range(steps):
            i = c * steps + j
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            acc0, a0 = _tall_block(w_smem, x_smem, acc0, a1, s, 2 * WG, a_layout, W_T)
            acc1, a1 = _tall_block(w_smem, x_smem, acc1, a0, s, 2 * WG + 1, a_layout, W_T)
            # both of step i - 1's wgmmas are done (and this step's block 0): warpgroup 0 loads step
            # i + STAGES - 1 into step i - 1's buffer once warpgroup 1 has freed it
            if WG == 0:
                _tall_load(x_desc, w_desc, w_smem, x_smem, ready, free, off_n, off_m, i + STAGES - 1, n_steps, BK,
                           STAGES, W_T)
            else:
                mbarrier.arrive(free.index((i + STAGES - 1) % STAGES), pred=i > 0)
        acc1, a1 = warpgroup_mma_wait(0, deps=(acc1, a1))
        total0 = total0 + acc0
        total1 = total1 + acc1
    return total0, total1


@gluon.jit
def _tall_store(total, lora_rows, xa_smem, xa_bar, y_ptr, w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, row0,
                off_m, acc_layout: gl.constexpr, BM: gl.constexpr, HAS_W_SCALE: gl.constexpr,
                HAS_LORA: gl.constexpr, HAS_BIAS: gl.constexpr):
    """One 64-row block's epilogue (`ws_gluon._epilogue`'s op order): the running total times the weight scale, plus
    σ·(B·xa) from zero (B's rows as wgmma's shared A operand), plus the bias, rounded and stored."""
    rn = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
    rm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
    mask_n = rn < N
    if HAS_W_SCALE:
        total = total * gl.load(w_scale_ptr)
    if HAS_LORA:
        mbarrier.wait(xa_bar, 0)
        lora = warpgroup_mma(lora_rows, xa_smem.permute((1, 0)), gl.zeros([64, BM], gl.float32, acc_layout),
                             is_async=True)
        lora = warpgroup_mma_wait(0, deps=(lora,))
        total = gl.fma(lora, lora_scale, total)  # explicit FMA, as `_ws_epilogue`
    if HAS_BIAS:
        total = total + gl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(gl.float32)[:, None]
    y_ptrs = y_ptr + rm[None, :].to(gl.int64) * stride_ym + rn[:, None]
    gl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & (rm < M)[None, :])


@gluon.jit
def _tall_consumer(x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
                   w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, n_chunks, steps,
                   WG: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                   HAS_W_SCALE: gl.constexpr, HAS_LORA: gl.constexpr, HAS_BIAS: gl.constexpr, W_T: gl.constexpr):
    """Warpgroup WG: rows off_n + 128·WG ... + 127 of the tile, every chunk, then both blocks' epilogues. Warpgroup 0
    issues the TMA loads (the LoRA tiles and the first STAGES - 1 k-steps first)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if WG == 0:
        if HAS_LORA:
            if W_T:  # Bᵀ `[r, N]` row-major (dX's B is the LoRA A): one `[BR, 64]` box per 64-row block
                mbarrier.expect(xa_bar, xa_desc.block_type.nbytes + 4 * b_desc.block_type.nbytes)
                for blk in gl.static_range(4):
                    _tma_load(b_desc, [0, off_n + 64 * blk], xa_bar, b_smem.index(blk))
            else:
                mbarrier.expect(xa_bar, xa_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(b_desc, [off_n, 0], xa_bar, b_smem)
            _tma_load(xa_desc, [off_m, 0], xa_bar, xa_smem)
        for t in gl.static_range(STAGES - 1):
            _tall_load(x_desc, w_desc, w_smem, x_smem, ready, free, off_n, off_m, t, n_chunks * steps, BK, STAGES,
                       W_T)
    total0, total1 = _tall_mainloop(x_desc, w_desc, w_smem, x_smem, ready, free, n_chunks, steps, off_n, off_m,
                                    acc_layout, a_layout, WG, BM, BK, STAGES, W_T)
    row0 = off_n + WG * 128
    if W_T:  # B's rows, MN-major in shared memory (wgmma transposes a 16-bit shared A operand itself)
        rows0 = b_smem.index(2 * WG).permute((1, 0))
        rows1 = b_smem.index(2 * WG + 1).permute((1, 0))
    else:
        rows0 = b_smem.slice(WG * 128, 64)
        rows1 = b_smem.slice(WG * 128 + 64, 64)
    _tall_store(total0, rows0, xa_smem, xa_bar, y_ptr, w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, row0,
                off_m, acc_layout, BM, HAS_W_SCALE, HAS_LORA, HAS_BIAS)
    _tall_store(total1, rows1, xa_smem, xa_bar, y_ptr, w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym,
                row0 + 64, off_m, acc_layout, BM, HAS_W_SCALE, HAS_LORA, HAS_BIAS)


# N_CHUNKS is never specialized, as in `ws_gluon._ws_gluon_kernel` (dX runs in one chunk; the kernel compiled for the
# constant 1 had its wgmmas serialized by ptxas and ran 5x slower)
@gluon.jit(do_not_specialize=["N_CHUNKS"])
def _ws_gluon_tall_kernel(x_desc, w_desc, xa_desc, b_desc, y_ptr, w_scale_ptr, bias_ptr, M, N, K_CHUNK, N_CHUNKS,
                          lora_scale, stride_ym, HAS_W_SCALE: gl.constexpr, HAS_LORA: gl.constexpr,
                          HAS_BIAS: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, BR: gl.constexpr,
                          STAGES: gl.constexpr, GROUP_N: gl.constexpr, W_T: gl.constexpr = False):
    """One program per output tile [256 weight rows, BM tokens] in grouped order (`ws_gluon._tile_offsets`)."""
    off_n, off_m = _tile_offsets(gl.program_id(0), M, N, BM, GROUP_N, 256)
    if W_T:  # per stage one `[BK, 64]` codes box per 64-row block; Bᵀ one `[BR, 64]` box per block
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [4 * STAGES, BK, 64], w_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [4, BR, 64], b_desc.layout)
    else:
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 256, BK], w_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    xa_smem = gl.allocate_shared_memory(xa_desc.dtype, xa_desc.block_type.shape, xa_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xa_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(free.index(s), count=1)  # warpgroup 1's release; warpgroup 0 loads after its own wait
    mbarrier.init(xa_bar, count=1)
    steps = K_CHUNK // BK
    gl.warp_specialize([
        (_tall_consumer, (x_desc, w_desc, xa_desc, b_desc, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
                          w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, N_CHUNKS, steps, 0, BM,
                          BK, STAGES, HAS_W_SCALE, HAS_LORA, HAS_BIAS, W_T)),
        # (warpgroup 1 issues no load: no descriptor is passed to its partition)
        (_tall_consumer, (None, None, None, None, w_smem, x_smem, xa_smem, b_smem, ready, free, xa_bar, y_ptr,
                          w_scale_ptr, bias_ptr, lora_scale, M, N, stride_ym, off_n, off_m, N_CHUNKS, steps, 1, BM,
                          BK, STAGES, HAS_W_SCALE, HAS_LORA, HAS_BIAS, W_T)),
    ], [4], [CONSUMER_REGS])


def launch_tall(x, w, y, w_scale, xa, lora_b, lora_scale, bias, k_chunk, n_chunks, cfg, br):
    """`ws_gluon.launch_gluon_fwd` for a "TALL" config (`ws_gluon.gluon_ok` must hold for it): y `[M, N]` from x
    `[M, K]` and codes w `[N, K]` (dX: w = `codes.t()`, lora_b = the LoRA Aᵀ, both transposed views), xa `[M, r]`
    given, B `[N, r]`; br: r padded as the Triton kernels' epilogue pads it."""
    M = x.shape[0]
    N = w.shape[0]
    BM, BK = cfg["BM"], cfg["BK"]
    w_t = _codes_transposed(w)
    x_desc = tma_desc(x, [BM, BK], gl.bfloat16)
    # dX: the row-major codes `[K, N]` in `[BK, 64]` boxes, one per 64-row block of the tile
    w_desc = tma_desc(w.t(), [BK, 64], gl.float8e4nv) if w_t else tma_desc(w, [ROWS, BK], gl.float8e4nv)
    has_lora = xa is not None
    if has_lora:
        xa_desc = tma_desc(xa, [BM, br], gl.bfloat16)
        b_desc = tma_desc(lora_b.t(), [br, 64], gl.bfloat16) if w_t else tma_desc(lora_b, [ROWS, br], gl.bfloat16)
    else:  # valid descriptors that no load uses
        xa_desc = tma_desc(x, [BM, 16], gl.bfloat16)
        b_desc = tma_desc(x, [16, 64], gl.bfloat16) if w_t else tma_desc(x, [ROWS, 16], gl.bfloat16)
    _ws_gluon_tall_kernel[(cdiv(M, BM) * cdiv(N, ROWS),)](
        x_desc, w_desc, xa_desc, b_desc, y, w_scale if w_scale is not None else y, bias if bias is not None else y,
        M, N, k_chunk, n_chunks, float(lora_scale), y.stride(0),
        HAS_W_SCALE=w_scale is not None, HAS_LORA=has_lora, HAS_BIAS=bias is not None, BM=BM, BK=BK,
        BR=br if has_lora else 16, STAGES=cfg["num_stages"], GROUP_N=cfg.get("GROUP_N", 8), W_T=w_t, num_warps=4)
    return y
