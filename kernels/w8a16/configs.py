"""Tile configurations of the weight-stationary W8A16 GEMM and its fixed K chunking.

Configs come from `ws_configs_tma.json` (committed; written by scripts/tune_w8a16.py from timings on the H200),
per op ("fwd": y = x·Wᵀ, "dx": dX = dY·W), per shape `"N×K"` (or "default") and per M bucket (the first
bucket bound ≥ M). No autotuning at run time. Configs may differ between buckets only in what does not
change a single output element's arithmetic: tokens are wgmma's N dimension and weight rows its M dimension,
so BM, BN, warps and stages change which elements a program owns, never the k-steps one element is summed
over. That sequence is fixed by `k_chunking(N, K)` (never M) and by the 16-deep bf16 wgmma k-step; BK only
groups k-steps into loop trips (it must divide the chunk). The GPU tests check this bitwise at
M ∈ {1, 3, 16, 17, 64, 257, 4096, 16384}, i.e. across every bucket.
"""

from __future__ import annotations

import bisect
import functools
import json
from pathlib import Path

from .._dispatch import check_reduction
from .._host import cdiv

TMA_TABLE_PATH = Path(__file__).with_name("ws_configs_tma.json")  # the tuned table (pointer, TMA and Gluon entries)
TABLE_PATH = TMA_TABLE_PATH  # (the one table)
CONFIG_KEYS = ("BN", "BM", "BK", "num_warps", "num_stages", "split")
# Tiles whose TMA-load twins (x and the codes through descriptors: `ws_tma.py`) the tuner offers.
# Triton 3.6 miscompiles the twin for some compiles: wrong values in 0.1-84 % of the outputs (BENCHMARKS.md § Triton
# race and wgmma drain; the cases are listed in ws_tma.py). The tuner keeps a twin only where it gave the pointer
# kernel's bits (twice), and every table TMA call is checked against the pointer kernel on its first call per key and
# again every `ws_tma.RECHECK_EVERY` calls. The 4-stage 128x256x64 twin is no longer offered: it gave wrong tiles far
# more often than the 3-stage one (a probe: 0.5-3.3 M wrong outputs on every one-chunk forward against
# 0-4096, and a first-call fallback on the Qwen3-8B down forward in a training step), for 1-4 % of speed; its two
# table rows now use 3 stages.
TMA_TUNER_TILES = frozenset({(128, 256, 64, 8, 3), (128, 256, 32, 8, 4), (128, 128, 64, 8, 4)})


def tile_of(cfg: dict) -> tuple:
    return tuple(cfg[k] for k in ("BN", "BM", "BK", "num_warps", "num_stages"))


# The fixed K chunking: enough chunks that N/128 weight tiles x chunks give about one wave of 132 SMs (two of the
# 64-row decode tiles), and at least MIN_CHUNKS. A function of (N, K) only; chunks are multiples of CHUNK_ALIGN so
# every BK in the table divides them. Each chunk end costs a training tile a pipeline drain and refill and the round
# trip of its spilled running total, and a chunk feeds one more program per weight tile at decode: at 264 programs
# (before the current kernels, 8 chunks for the 4096-row layers) the trainer's o forward was 1.19x cuBLAS's and q3_o's
# fwd + bwd 1.08x bf16; at 132, 1.05x and 1.01x, with q3_o faster at decode too (12.9 -> 11.8 µs at one token;
# scripts/probe_k_chunking.py, BENCHMARKS.md). MIN_CHUNKS: one chunk is where Triton 3.6 miscompiles the TMA
# training tile (a race; the first-call check then falls back to the pointer kernel: q3_gate 1.02 -> 1.14x bf16).
TARGET_PROGRAMS = 132
MIN_CHUNKS = 2
CHUNK_REF_BN = 128
CHUNK_ALIGN = 256


def k_chunking(N: int, K: int) -> tuple[int, int]:
    """(K_CHUNK, N_CHUNKS): each chunk is accumulated from zero and the chunks are added in order."""
    return _k_chunking(N, K, TARGET_PROGRAMS, MIN_CHUNKS)


@functools.lru_cache(maxsize=None)  # (the module constants are arguments: tests patch them)
def _k_chunking(N: int, K: int, target_programs: int, min_chunks: int = 1) -> tuple[int, int]:
    check_reduction(K)
    k_units = cdiv(K, CHUNK_ALIGN)
    want = max(1, min(k_units, max(min_chunks, target_programs // max(1, cdiv(N, CHUNK_REF_BN)))))
    units = cdiv(k_units, want)
    return units * CHUNK_ALIGN, cdiv(k_units, units)


# The LoRA down-projection xa = x·Aᵀ (r rows of A) splits each base chunk into sub-chunks of at most this many K
# columns, each accumulated from zero and all added in order: at decode its split-K programs then read no more than
# a base tile's program (r x 512 bf16 = 64 KiB at rank 64, a 64-row fp8 tile of a 1024-deep chunk), instead of one
# program per chunk (or, for a one-chunk layer such as gate_up, one program for all of K) trailing the launch.
XA_CHUNK_MAX = 512


def xa_chunking(N: int, K: int) -> tuple[int, int, int]:
    """(XA_CHUNK, SUBS, N_XA) of the LoRA down-projection of a layer `[N, K]`: SUBS sub-chunks of XA_CHUNK per
    base chunk of `k_chunking(N, K)`, N_XA = SUBS x base chunks in all (the trailing ones may lie past K)."""
    return _xa_chunking(N, K, TARGET_PROGRAMS, MIN_CHUNKS, XA_CHUNK_MAX)


@functools.lru_cache(maxsize=None)
def _xa_chunking(N: int, K: int, target_programs: int, min_chunks: int, xa_chunk_max: int) -> tuple[int, int, int]:
    k_chunk, n_chunks = _k_chunking(N, K, target_programs, min_chunks)
    units = k_chunk // CHUNK_ALIGN
    max_units = max(1, xa_chunk_max // CHUNK_ALIGN)
    subs = next(s for s in range(1, units + 1) if units % s == 0 and units // s <= max_units)
    return k_chunk // subs, subs, subs * n_chunks


def _gluon_config_ok(g) -> bool:
    """A table entry's "gluon" (the warp-specialized forward or dX, `ws_gluon.py`): its tokens per tile, k-step depth
    and ring depth; the entry's other fields stay the config of the Triton kernels that run where Gluon cannot."""
    flags = ("LORA_RING", "PERSISTENT")
    return (isinstance(g, dict) and set(g) <= {"BM", "BK", "num_stages", "GROUP_N", *flags}
            and g.get("BM") in (128, 256) and g.get("BK") in (32, 64, 128) and isinstance(g.get("num_stages"), int)
            and 2 <= g["num_stages"] <= 8 and isinstance(g.get("GROUP_N", 8), int) and g.get("GROUP_N", 8) >= 1
            and all(isinstance(g.get(f, False), bool) for f in flags))


def table_path(table: str | None = None) -> str:
    """The tile table a call uses: `table` if given (the tuner's output before it is committed), else the committed
    one."""
    return str(table or TMA_TABLE_PATH)


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict:
    """The table at `path` (default: the committed one), validated."""
    path = str(path or TMA_TABLE_PATH)
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise RuntimeError(f"W8A16 tile table {path}: {err}") from err
    for op in ("fwd", "dx"):
        if "default" not in table.get(op, {}):
            raise RuntimeError(f"W8A16 tile table {path}: missing {op}.default")
    bad = [f"{op}.{shape}.{bound}" for op in ("fwd", "dx") for shape, row in table[op].items()
           for bound, cfg in row.items() if not isinstance(cfg.get("tma", False), bool)]
    if bad:
        raise RuntimeError(f"W8A16 tile table {path}: {bad[0]}: tma must be true or false")
    bad = [f"{op}.{shape}.{bound}" for op in ("fwd", "dx") for shape, row in table[op].items()
           for bound, cfg in row.items() if "gluon" in cfg and not _gluon_config_ok(cfg["gluon"])]
    if bad:
        raise RuntimeError(f"W8A16 tile table {path}: {bad[0]}.gluon: an entry's Gluon config is "
                           f"{{\"BM\": 128 or 256, \"BK\": 32, 64 or 128, \"num_stages\": 2-8}} (and optionally "
                           f"\"GROUP_N\" ≥ 1, \"LORA_RING\", \"PERSISTENT\" true or false)")
    return table


# id(table) -> (table, {(op, shape key): (bounds ascending, their configs)}): each row sorted once per loaded table (the
# table is held, so its id cannot be reused by another while the entry lives)
_SORTED_ROWS: dict[int, tuple[dict, dict]] = {}


def _sorted_row(table: dict, op: str, shape: str) -> tuple[list[int], list[dict]]:
    entry = _SORTED_ROWS.get(id(table))
    if entry is None or entry[0] is not table:
        entry = _SORTED_ROWS[id(table)] = (table, {})
    rows = entry[1]
    row = rows.get((op, shape))
    if row is None:
        row_dict = table[op].get(shape, table[op]["default"])
        pairs = sorted(((int(b), c) for b, c in row_dict.items()), key=lambda bc: bc[0])
        row = rows[(op, shape)] = ([b for b, _ in pairs], [c for _, c in pairs])
    return row


def lookup(path: str, op: str, N: int, K: int, M: int) -> dict:
    """The tile config of the table at `path` for this call: the (op, shape) row (else the op's default), first bucket
    ≥ M (beyond the last bound, the largest bucket's)."""
    bounds, cfgs = _sorted_row(load_table(path), op, f"{N}x{K}")
    return cfgs[min(bisect.bisect_left(bounds, M), len(cfgs) - 1)]


def ws_config(op: str, N: int, K: int, M: int, table: str | None = None) -> dict:
    """The config of this call in the committed table (or in `table`, `plan.KernelSettings.table`)."""
    return lookup(table_path(table), op, N, K, M)


def buckets(path: str | None = None) -> list[int]:
    """Every bucket bound used anywhere in the table (tests run one M in each)."""
    table = load_table(path)
    return sorted({int(b) for op in ("fwd", "dx") for row in table[op].values() for b in row})


def whole_k(K: int) -> tuple[int, int]:
    """One chunk (one accumulator): for dX, which need not be batch invariant (measured 1.3-1.45x faster
    than the forward's chunking at 4096 tokens on the H200, scripts/tune_w8a16.py)."""
    check_reduction(K)
    return cdiv(K, CHUNK_ALIGN) * CHUNK_ALIGN, 1


GLUON_BN = 128  # weight rows of a Gluon tile: two consumer warpgroups of 64 (`ws_gluon.BN`)
SMEM_LIMIT = 232448  # bytes of shared memory one H100 / H200 CTA may use


def shared_bytes(cfg: dict, br: int, ring: bool) -> int:
    """Shared memory the Gluon kernel allocates in config cfg (bf16 x) with a LoRA of padded rank br, its tiles or
    (ring) its B ring, plus 1 KiB for the barriers and alignment: at least what ptxas reports (a CPU test compiles
    it)."""
    BM, BK, stages = cfg["BM"], cfg["BK"], cfg["num_stages"]
    lora = stages * GLUON_BN * 64 * 2 if ring else (BM + GLUON_BN) * br * 2
    return stages * (GLUON_BN * BK + BM * BK * 2) + lora + 1024
