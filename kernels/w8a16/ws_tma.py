"""The weight-stationary single pass with TMA tile loads (issue 12): same k-steps, same bits, other loads.

`_ws_single_kernel` loads its tiles with pointer arithmetic (cp.async, masks); this kernel loads them through
tensor descriptors (the Hopper bulk tensor copy engine: one thread issues a whole tile, out-of-bounds elements
come back as zeros, which is what the masked loads give). Everything that decides an output element's bits is
unchanged: the K chunks of `configs.k_chunking`, each accumulated from zero in 16-deep bf16 wgmma k-steps, the
chunks added in order, the e4m3 → bf16 widening in registers (wgmma's A operand), and `_ws_epilogue`. So a
table row may pick this kernel for one M bucket and the pointer kernels for another, and the rows stay bitwise
equal (tests/kernels/test_gpu_kernels.py runs every table config).

- forward: w = codes `[N, K]` (row-major) → descriptor blocks [BN, BK]; x `[M, K]` → [BM, BK], fed as xᵀ.
- dX: w = codes read `[K, N]` with N the reduction (strides (1, K)): the descriptor is over the codes as
  stored, `[N, K]`, with blocks [BK, BN] transposed in registers.

TMA needs 16-byte aligned base addresses and row strides: `tma_ok` says when a call qualifies; the caller
falls back to the pointer kernel otherwise (same bits).

Status (H200, triton 3.6; BENCHMARKS.md § Triton race and wgmma drain): 1.03-1.42x faster than the pointer kernel at
4096 tokens (it holds no per-element address or mask tensors; q3_qkv forward 590 -> 409 µs at 128x256 tiles; Qwen3-8B
trainer step 1.12-1.14x a bf16 trainer's instead of 1.31x), but Triton 3.6 miscompiles it for some compiles, and no
rule found so far says which:
- wrong on one-chunk forwards (gate_up's 4096-deep chunk; q3_qkv forced to one chunk) at 128x256x64, on every
  one-chunk 64x128 call; flaky at 4 stages (a q35 forward wrong in one tuner run, exact in the next). A CTA barrier
  every k-step (a diagnostic, since removed) removed every wrong value, which points to a race on the codes' stage
  buffers (a lagging warp still copying a stage into registers when the next TMA load overwrites it), at 1.1-10x the
  time.
- a variant with x alone through its descriptor (since removed) was exact on every forward probed, those above
  included, yet wrong on dX at 128x256x64 (every run) and on the gate_up forward at 128x256x64 / 4 stages once
  compiled with a bias (84 % of the outputs).
So the kernel runs where the tuner found it exact (`ws_configs_tma.json`), and every table TMA call is verified at run
time on the user's own Triton and GPU: bitwise against the pointer kernel on its first call per (op, shape, tile, LoRA,
bias, M's power of two), and again every RECHECK_EVERY calls (`checked_tma_single`); a difference warns and moves that key to the
pointer kernel for the process.
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl

from .._dispatch import interpreting
from .._host import cdiv
from .._tiles import _grouped_tile_ids
from .tma_desc_cache import install as install_descriptor_cache
from .widen import widen_e4m3
from .ws_epilogue import _load_xa, _lora_b_tile, _ws_epilogue


def tma_available() -> bool:
    """Host-side tensor descriptors (Triton >= 3.4) and a GPU of compute capability >= 9 (or the interpreter)."""
    return _tma_available(interpreting())


@functools.lru_cache(maxsize=2)
def _tma_available(interpret: bool) -> bool:
    """(Cached: an import and a device query per call cost ~10 µs of host time per training GEMM on the H200's CPU.)"""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return interpret or (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)


def _aligned(t: torch.Tensor) -> bool:
    """Row-major 2-D with 16-byte aligned base and row stride (TMA's rule for the outer stride)."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether (x, w) of `weight_stationary_gemm` can be read through descriptors: x row-major, and w either
    row-major `[N, K]` (forward) or the transposed view of a row-major `[K, N]` buffer (dX)."""
    w_stored = w if w.stride(1) == 1 else w.t()
    return tma_available() and _aligned(x) and _aligned(w_stored)


@triton.jit
def _tile_dot(w, x, acc, DOT_F32: tl.constexpr):
    """acc + w[BN, BK] · x[BM, BK]ᵀ; e4m3 -> bf16 is exact. Under Triton's CPU interpreter, which mis-computes
    bf16 dots, the operands are widened to fp32 (tests only)."""
    if DOT_F32:
        return acc + tl.dot(w.to(tl.float32), x.T.to(tl.float32))
    return tl.dot(widen_e4m3(w), x.T, acc)


@triton.jit(do_not_specialize=["M"])
def _ws_tma_kernel(
    x_desc, w_desc, y_ptr, w_scale_ptr, xa_ptr, b_ptr, bias_ptr, M, N, R, K_CHUNK, N_CHUNKS, lora_scale,
    stride_ym, stride_yn, stride_xam, stride_xar, stride_bn, stride_br,
    W_TRANSPOSED: tl.constexpr,
    HAS_W_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
):
    """One program per output tile [BN weight rows, BM tokens]: every chunk from zero, added in chunk order.
    (Triton 3.6's Hopper warp specialization of the k loop, `tl.range(..., warp_specialize=True)`, gave the same
    times within ±2 % and the same wrong tiles: BENCHMARKS.md.)"""
    pid_n, pid_m = _grouped_tile_ids(tl.cdiv(N, BN), tl.cdiv(M, BM), GROUP_N)
    off_n = pid_n * BN
    off_m = pid_m * BM
    rn = off_n + tl.arange(0, BN)
    in_n = rn < N
    total = tl.zeros((BN, BM), dtype=tl.float32)
    tl.assume(K_CHUNK > 0)  # (a non-empty loop: see `_ws_chunk`; without it ptxas serializes every wgmma, C7515)
    tl.assume(N_CHUNKS > 0)
    for c in tl.range(0, N_CHUNKS):
        acc = tl.zeros_like(total)
        k_lo = c * K_CHUNK
        k_hi = k_lo + K_CHUNK
        for k0 in range(k_lo, k_hi, BK):
            if W_TRANSPOSED:
                # codes stored [N_red, K_out]: block [BK, BN] -> [BN, BK], widened before the transpose (exact):
                # a tl.trans of an 8-bit tile is miscompiled by Triton 3.7.1 / the bundled ptxas 12.9 (public
                # reports: corrupted fp8 transposes on Hopper), the likely cause of this kernel's wrong dX tiles
                w = widen_e4m3(w_desc.load([k0, off_n])).T
            else:
                w = w_desc.load([off_n, k0])
            x = x_desc.load([off_m, k0])
            acc = _tile_dot(w, x, acc, DOT_F32)
        total += acc
    rm = off_m + tl.arange(0, BM)
    mask_n = in_n
    mask_m = rm < M
    xa_t = _load_xa(xa_ptr, xa_ptr, rm, mask_m, M, R, 1, stride_xam, stride_xar, HAS_LORA, False, BR, BM)
    b = _lora_b_tile(b_ptr, rn, mask_n, R, stride_bn, stride_br, HAS_LORA, BN, BR)
    _ws_epilogue(total, xa_t, b, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, bias_ptr, lora_scale,
                 stride_ym, stride_yn, HAS_W_SCALE, HAS_LORA, HAS_BIAS, DOT_F32)


# (op, N, K, tile, LoRA, bias, M's power-of-two bucket) -> whether the TMA kernel gave the pointer kernel's bits on
# every check of that key in this process, and how many calls the key has had
_CHECKED: dict[tuple, bool] = {}
_CALLS: dict[tuple, int] = {}
# A verified key is compared with the pointer kernel again every this many calls: a kernel that races rarely (none
# has been seen to) is caught in a long run, for one more GEMM (the pointer kernel, ~1.4x the TMA one) and a host
# sync per this many calls (~0.1 %).
RECHECK_EVERY = 1024


def checked_tma_single(key: tuple, y: torch.Tensor, run_tma, run_pointer,
                       kernel: str = "TMA kernel") -> torch.Tensor:
    """y from the TMA kernel (`run_tma(out)`) while it gives the pointer kernel's bits (`run_pointer(out)`), else from
    the pointer kernel. A key's first call runs the pointer kernel once and the TMA kernel twice (the miscompiles
    seen were races: a different count each run) and compares their bits; every RECHECK_EVERY-th call runs the
    pointer kernel beside it again. A difference warns, returns the pointer kernel's result and keeps the pointer
    kernel for the key (outputs of the calls since the last check cannot be recalled: the warning says so). A first
    check whose output is all zeros verifies nothing and is repeated on the next call. Inside
    a CUDA graph capture nothing is compared: an unchecked key runs the pointer kernel (same bits) and a verified
    one the TMA kernel, its calls uncounted."""
    verdict = _CHECKED.get(key)
    capturing = y.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or verdict is False:
        (run_tma if verdict else run_pointer)(y)
        return y
    calls = _CALLS[key] = _CALLS.get(key, 0) + 1
    if verdict and calls % RECHECK_EVERY:
        return run_tma(y)
    want = run_pointer(torch.empty(y.shape, device=y.device, dtype=y.dtype))
    runs = [run_tma(y)] if verdict else [run_tma(torch.empty(y.shape, device=y.device, dtype=y.dtype)), run_tma(y)]
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[y.element_size()]  # bitwise: NaN == NaN, -0 != +0
    differ = torch.zeros(y.shape, device=y.device, dtype=torch.bool)
    for got in runs:
        differ |= got.view(bits) != want.view(bits)
    same = not bool(differ.any())
    if same and verdict is None and not bool(want.view(bits).any()):
        del _CALLS[key]  # an all-zero output (e.g. an engine's dummy run on zeros) proves nothing: check the next call
        return y
    _CHECKED[key] = same
    if not _CHECKED[key]:
        bad = int(differ.sum())
        worst = float((y.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
        since = ("on its first call" if verdict is None
                 else f"at call {calls}, after passing at call {calls - RECHECK_EVERY or 1}")
        warnings.warn(f"W8A16 {kernel.split(' (')[0]} {key}: {bad} of {y.numel()} elements differ from the pointer "
                      f"kernel {since} (max |diff| {worst:.2e} of max |y|: a miscompile of this tile); using the "
                      f"pointer kernel for it from now on (the {kernel})")
        y.copy_(want)
    return y


def launch_tma_single(x, w, y, ws, xa, b_, bias_, M, N, R, k_chunk, n_chunks, lora_scale, lora_strides,
                      cfg, flags):
    """`_ws_single_kernel`'s launch with descriptors (`tma_ok(x, w)` must hold; same arguments otherwise)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    install_descriptor_cache()  # before the kernel's first launch builds its launcher (tma_desc_cache.py)
    BN, BM, BK = cfg["BN"], cfg["BM"], cfg["BK"]
    transposed = w.stride(1) != 1
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK])
    w_desc = (TensorDescriptor.from_tensor(w.t(), [BK, BN]) if transposed
              else TensorDescriptor.from_tensor(w, [BN, BK]))
    tiles = cdiv(M, BM) * cdiv(N, BN)
    has_lora = flags["HAS_LORA"]
    _ws_tma_kernel[(tiles,)](
        x_desc, w_desc, y, ws, xa if has_lora else y, b_, bias_, M, N, R, k_chunk, n_chunks, float(lora_scale),
        y.stride(0), y.stride(1), xa.stride(0) if has_lora else 0, xa.stride(1) if has_lora else 0, *lora_strides,
        W_TRANSPOSED=transposed, BK=BK, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags)
    return y
