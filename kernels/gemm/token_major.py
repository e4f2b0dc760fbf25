"""Token-major twin of the weight-stationary single pass (issue 12, experimental): y = x · bf16(W)ᵀ with the
tokens as wgmma's M dimension and the widened weight as its B operand.

Why: in the weight-stationary kernel the widened e4m3 tile is wgmma's register A operand, and Triton loads
8-bit A fragments from shared memory two bytes at a time (`scripts/sass_report.py`, sm_90a: 27 `LDS.U16` per
64-deep K step of a 128×256 tile, 235 instructions per trip; 43 and 286 in dX). With the weight as the B operand it
is widened once in registers and stored to shared memory as bf16 (`STS`), and both wgmma operands come from shared
memory: 9 `LDS` + 4 `STS` and 212 instructions for the same tile work (210 in dX). BENCHMARKS.md § Kernels.

What it keeps: the K chunks of `configs.k_chunking` (each from zero, added in order), 16-deep bf16 k-steps, and
`_ws_epilogue` itself (the total is transposed into its [weight rows, tokens] orientation, so the LoRA term is
computed exactly as there). What it changes: which wgmma operand carries which matrix. Whether the tensor core
sums an element's 16 products in the same order with the roles swapped is a hardware question: this kernel may
enter the tile table only after `scripts/ws_bits_report.py` / `tune_w8a16.py --xw` show its bits equal to the
weight-stationary kernel's on the GPU (not yet run; not in the table).

Operands as in `weight_stationary_gemm`: w is codes `[N, K]` (forward) or the `[K, N]` view with N the reduction
(dX); both are read as [BK, BN] blocks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ws_epilogue import _load_xa, _ws_epilogue, _ws_tile


@triton.jit(do_not_specialize=["M"])
def _token_major_kernel(
    x_ptr, w_ptr, y_ptr, w_scale_ptr, xa_ptr, b_ptr, bias_ptr, M, N, K, R, K_CHUNK, N_CHUNKS, lora_scale,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    stride_xam, stride_xar, stride_bn, stride_br,
    HAS_W_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_N: tl.constexpr,
):
    """One program per output tile [BM tokens, BN weight rows]: every chunk from zero, added in chunk order."""
    rn, rm, mask_n, mask_m = _ws_tile(N, M, BN, BM, GROUP_N)
    rk = tl.arange(0, BK)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for c in range(0, N_CHUNKS):
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(c * K_CHUNK, (c + 1) * K_CHUNK, BK):
            mask_k = (k0 + rk) < K
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :] * stride_xk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w_t = tl.load(w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None].to(tl.int64) * stride_wk,
                          mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if DOT_F32:  # Triton's CPU interpreter mis-computes bf16 dots; widen (tests only)
                acc += tl.dot(x.to(tl.float32), w_t.to(tl.float32))
            else:
                acc = tl.dot(x, w_t.to(tl.bfloat16), acc)  # e4m3 -> bf16 is exact
        total += acc
    xa_t = _load_xa(xa_ptr, xa_ptr, rm, mask_m, M, R, 1, stride_xam, stride_xar, HAS_LORA, False, BR, BM)
    _ws_epilogue(tl.trans(total), xa_t, rn, rm, mask_n, mask_m, y_ptr, w_scale_ptr, b_ptr, bias_ptr, R, lora_scale,
                 stride_ym, stride_yn, stride_bn, stride_br, HAS_W_SCALE, HAS_LORA, HAS_BIAS, DOT_F32, BR)


def launch_token_major(x, w, y, ws, xa, b_, bias_, M, N, K, R, k_chunk, n_chunks, lora_scale, lora_strides,
                       cfg, flags):
    """`_ws_single_kernel`'s launch, token-major (same arguments; cfg's BM = tokens, BN = weight rows)."""
    has_lora = flags["HAS_LORA"]
    tiles = triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"])
    _token_major_kernel[(tiles,)](
        x, w, y, ws, xa if has_lora else y, b_, bias_, M, N, K, R, k_chunk, n_chunks, float(lora_scale),
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        xa.stride(0) if has_lora else 0, xa.stride(1) if has_lora else 0, *lora_strides,
        BK=cfg["BK"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **flags)
    return y
