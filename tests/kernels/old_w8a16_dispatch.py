"""A frozen copy of the W8A16 dispatch as `w8a16/weight_stationary.py` decided it before `kernels/plan.py` existed (its
branches read from `weight_stationary_gemm`, `lora_down`, `_gluon_gemm`, `ws_gluon.fitting_config` / `gluon_ok` /
`runs_persistent` and `configs.ws_config`, with every switch at its default: PDL, one-launch split-K, Gluon, the TMA
table, `lora_down` grouping by device). `tests/kernels/test_plan.py` checks that `plan()` chooses the same. Tensor facts
the old code read at launch are taken as the engine's and trainer's operands have them: row-major, 16-byte aligned,
bf16 x and e4m3 codes."""

from __future__ import annotations

import bisect
import json
from pathlib import Path

TMA_TABLE = Path(__file__).resolve().parents[2] / "kernels" / "w8a16" / "ws_configs_tma.json"
SMEM_LIMIT = 232448
GLUON_BN = 128


def cdiv(a, b):
    return -(-a // b)


def npow2(n):
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def ws_config(op, N, K, M):
    table = json.loads(TMA_TABLE.read_text())
    row = table[op].get(f"{N}x{K}", table[op]["default"])
    pairs = sorted(((int(b), c) for b, c in row.items()), key=lambda bc: bc[0])
    bounds = [b for b, _ in pairs]
    return pairs[min(bisect.bisect_left(bounds, M), len(pairs) - 1)][1]


def k_chunking(N, K, target=132, min_chunks=2):
    k_units = cdiv(K, 256)
    want = max(1, min(k_units, max(min_chunks, target // max(1, cdiv(N, 128)))))
    units = cdiv(k_units, want)
    return units * 256, cdiv(k_units, units)


def xa_chunking(N, K):
    k_chunk, n_chunks = k_chunking(N, K)
    units = k_chunk // 256
    subs = next(s for s in range(1, units + 1) if units % s == 0 and units // s <= 2)
    return k_chunk // subs, subs, subs * n_chunks


def down_tile_rows(R):
    return max(64, npow2(R)) if R <= 128 else 64


def epilogue_rows(R):
    return max(16, npow2(R)) if R else 16


def down_parts_per_program(cfg, K, k_chunk, n_chunks, rows, xa_chunk, x_bytes, device_groups):
    if not device_groups or cfg["num_warps"] < 8:
        return 1
    base_depth = k_chunk if cfg.get("split", True) and n_chunks > 1 else K
    return max(1, (cfg["BN"] * base_depth) // (rows * xa_chunk * x_bytes))


def lora_down(M, K, R, chunk_n, op, pdl, groups_down):
    k_chunk, n_chunks = k_chunking(chunk_n or R, K)
    xa_chunk, _, _ = xa_chunking(chunk_n or R, K)
    rows = down_tile_rows(R)
    if not pdl and cdiv(M, 32) * cdiv(R, rows) >= 128:
        return {"kernel": "ws_down_single"}
    cfg = ws_config(op, chunk_n or R, K, M)
    group = down_parts_per_program(cfg, K, k_chunk, n_chunks, rows, xa_chunk, 2, groups_down) if pdl else 1
    return {"kernel": "ws_ticket", "group": group, "config": dict(cfg, BN=rows)}


def shared_bytes(cfg, br, ring):
    BM, BK, stages = cfg["BM"], cfg["BK"], cfg["num_stages"]
    lora = stages * GLUON_BN * 64 * 2 if ring else (BM + GLUON_BN) * br * 2
    return stages * (GLUON_BN * BK + BM * BK * 2) + lora + 1024


def ring_of(cfg, has_xa, br):
    return bool(cfg.get("LORA_RING")) and has_xa and br % 64 == 0


def gluon_ok(K, k_chunk, n_chunks, cfg, br, has_xa):
    BM, BK = cfg["BM"], cfg["BK"]
    ring = ring_of(cfg, has_xa, br)
    if ring and BK != 64:
        return False
    return (k_chunk * n_chunks == K and k_chunk % (2 * BK) == 0 and BM in (128, 256)
            and shared_bytes(cfg, br, ring) <= SMEM_LIMIT)


def fitting_config(K, k_chunk, n_chunks, cfg, br, has_xa, dx):
    if gluon_ok(K, k_chunk, n_chunks, cfg, br, has_xa):
        return cfg
    if cfg["BM"] != 256 or dx:
        return None
    narrow = dict(cfg, BM=128)
    return narrow if gluon_ok(K, k_chunk, n_chunks, narrow, br, has_xa) else None


def weight_stationary_gemm(op, N, K, M, R, xa_given, return_xa, cuda, pdl_supported, groups_down):
    """What `weight_stationary_gemm(x, w, ...)` ran: a dict with the base kernel and the `lora_down` call before it."""
    cfg = dict(ws_config(op, N, K, M))
    k_chunk, n_chunks = k_chunking(N, K) if op == "fwd" else (cdiv(K, 256) * 256, 1)
    has_lora = R > 0
    fuse_down = not xa_given and has_lora and op == "fwd"
    pdl = cuda and pdl_supported
    down_first = fuse_down and pdl and M <= 64
    down = None
    if down_first:
        down = lora_down(M, K, R, N, op, True, groups_down)
        fuse_down = False
    elif return_xa and fuse_down:
        down = lora_down(M, K, R, N, op, False, groups_down)
        fuse_down = False
    split = cfg.get("split", M <= 64) and (n_chunks > 1 or fuse_down)
    out = {"config": cfg, "pdl": down_first}
    if split and not fuse_down:
        return dict(out, kernel="ws_ticket", down=down, fused_down=False)
    if split:  # the reduce launched as the partial kernel's PDL dependent where PDL works
        return dict(out, kernel="ws_split", down=down, fused_down=True, pdl=pdl)
    if down is None and has_lora and not xa_given:
        down = lora_down(M, K, R, N, op, False, groups_down)
    out["down"] = down
    gluon_cfg = cfg.get("gluon") if not down_first else None
    br = epilogue_rows(R)
    has_xa = has_lora
    if gluon_cfg and cuda:
        fit = fitting_config(K, k_chunk, n_chunks, gluon_cfg, br, has_xa, op == "dx")
        if fit is not None:
            ring = ring_of(fit, has_xa, br)
            lr = br // 64 if ring else 0
            persistent = (bool(fit.get("PERSISTENT")) and (not has_xa or lr > 0)
                          and n_chunks * (k_chunk // fit["BK"]) + lr >= fit["num_stages"] - 1)
            return dict(out, kernel="ws_gluon", gluon=fit, ring=ring, persistent=persistent)
    if cfg.get("tma") and cuda and not down_first:
        return dict(out, kernel="ws_tma")
    return dict(out, kernel="ws_single")
