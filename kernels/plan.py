"""Which kernel runs a call: one pure function, `plan(op, shape, tokens, device) -> KernelPlan`.

Every launch path of the W8A16 GEMM (`w8a16/weight_stationary.py`) asks `plan` what to run instead of reading
environment variables or module globals, and `epirl kernels explain` prints the same plans as a table. The inputs are
values only - the op, the layer's `(N, K)`, the token count, a `Device` (capability, SM count, shared memory, whether
programmatic dependent launch works) and `KernelSettings` (another tile table; the reference) - so a plan for an H100
or H200 can be computed, printed and tested on a CPU. Facts that only the tensors know (alignment of a TMA operand,
a Triton whose Gluon API moved) are checked at launch, which then runs the pointer kernel with the same bits.

Ops: "w8a16" (the forward y = x·Wᵀ with its LoRA epilogue), "w8a16_dx" (the trainer's dX = dY·W) and "lora_down"
(xa = bf16(x·Aᵀ) with the base layer's K chunking). Their kernels:

- `ws_ticket`: split-K in one launch, each tile reduced by its last-arriving program (`w8a16/ws_splitk.py`);
- `ws_split`: split-K as a partial kernel and a reduce kernel, the LoRA down-projection's partials fused into the
  first one (only without PDL: off Hopper and in the interpreter);
- `ws_single` / `ws_tma` / `ws_gluon`: one program per output tile - pointer loads, TMA loads, or the
  warp-specialized Gluon kernel (`w8a16/ws_gluon.py`), as the table entry says;
- `ws_down_single`: `lora_down` as one pass per (token tile, rank tile), for many tokens;
- `reference`: the plain-torch reference (a CPU device, or `KernelSettings.reference`; `EPIRL_KERNELS=reference`
  chooses it before any plan, in `_dispatch.use_triton`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ._dispatch import interpreting, pdl_supported
from ._host import cdiv, next_power_of_2
from .w8a16 import configs as _configs
from .w8a16.configs import k_chunking, shared_bytes, whole_k, ws_config, xa_chunking

OPS = ("w8a16", "w8a16_dx", "lora_down")

# `lora_down` as one pass per (token tile, rank tile) from this many programs of DOWN_SINGLE_BM tokens
DOWN_SINGLE_MIN_PROGRAMS = 128
DOWN_SINGLE_BM = 32
DOWN_FIRST_MAX_M = 64  # decode buckets: `lora_down` first, the base GEMM its PDL dependent (above: not worth it)
LORA_TILE_MIN = 64  # rows of a LoRA-down program: >= 64 keeps it on wgmma like the base tiles


@dataclass(frozen=True)
class Device:
    """What the choice of kernel depends on about a GPU. `pdl`: programmatic dependent launch works (Triton with
    gdc_* on sm_90+). `groups_down`: `lora_down` programs take several sub-chunks behind 8-warp base tiles at decode
    (measured a gain on the H200 and a loss on the H100, `down_parts_per_program`). `interpreter`: Triton's CPU
    interpreter (the Triton kernels run, TMA loads included; no Gluon, no PDL)."""

    name: str
    capability: tuple[int, int] = (9, 0)
    sm_count: int = 132
    smem_bytes: int = 232448  # shared memory one CTA may use
    pdl: bool = True
    groups_down: bool = True
    interpreter: bool = False

    def __hash__(self) -> int:  # hashed at every memoized `plan` call: computed once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.name, self.capability, self.sm_count, self.smem_bytes, self.pdl, self.groups_down,
                           self.interpreter))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def triton(self) -> bool:
        return self.interpreter or self.capability >= (8, 0)

    @property
    def hopper(self) -> bool:
        return not self.interpreter and self.capability >= (9, 0)


H100 = Device("h100", groups_down=False)
H200 = Device("h200")
CPU = Device("cpu", capability=(0, 0), sm_count=0, smem_bytes=0, pdl=False, groups_down=False)
INTERPRETER = Device("interpreter", capability=(0, 0), sm_count=1, pdl=False, interpreter=True)
NAMED = {"h100": H100, "h200": H200, "cpu": CPU, "interpreter": INTERPRETER}


@dataclass(frozen=True)
class KernelSettings:
    """What a caller may change about the choice: `table`, another tile table file than the committed
    `w8a16/ws_configs_tma.json` (the tuner's output before it is committed; tiles never change the bits, only the
    speed); `reference`, the plain-torch reference everywhere (debugging; `EPIRL_KERNELS=reference` for a process)."""

    table: str | None = None
    reference: bool = False


DEFAULT_SETTINGS = KernelSettings()


@dataclass(frozen=True)
class KernelPlan:
    """What one call runs. `config`: the table entry (tile, warps, stages, split, tma, gluon) or the explicit one;
    `k_chunk` x `n_chunks`: the K chunking (fixed by (N, K) in the forward, one chunk in dX); `pdl`: this launch is the
    programmatic dependent of the plan's `down` launch (`ws_split`: the reduce is the partial kernel's); `down`: the
    plan of the LoRA down-projection that runs first (None: no LoRA, xa given, or fused into this launch:
    `fused_down`); `group`: sub-chunks per `lora_down` program; `tma`: TMA loads (for `ws_gluon`: what runs where the
    tensors do not suit Gluon); `gluon`: the Gluon config run (its BM narrowed to 128 where the LoRA tiles overflow),
    `ring` / `persistent` its LoRA-through-the-ring and program-per-SM forms."""

    op: str
    kernel: str
    tokens: int
    shape: tuple[int, int]
    config: dict = field(default_factory=dict, hash=False)
    k_chunk: int = 0
    n_chunks: int = 0
    split: bool = False
    pdl: bool = False
    fused_down: bool = False
    down: KernelPlan | None = None
    group: int = 1
    tma: bool = False
    gluon: dict | None = field(default=None, hash=False)
    ring: bool = False
    persistent: bool = False

    @property
    def tile(self) -> tuple:
        """(BN, BM, BK, num_warps, num_stages): the Triton config's, or the Gluon config's where one runs."""
        if not self.config:
            return ()
        g = self.gluon or {}
        return (self.config["BN"] if not g else 128, g.get("BM", self.config["BM"]), g.get("BK", self.config["BK"]),
                self.config["num_warps"] if not g else 4, g.get("num_stages", self.config["num_stages"]))

    @property
    def launches(self) -> int:
        own = {"ws_split": 2, "reference": 0}.get(self.kernel, 1)
        return own + (self.down.launches if self.down is not None else 0)


def down_tile_rows(R: int) -> int:
    """Rows of A per down-projection program: all r rows up to 128; above (the block-diagonal rank S·r of one call per
    fused layer) 64-row tiles side by side, since one 256-row tile's pipeline overflows shared memory. Each xa column
    is its own dot over K in the same BK steps whatever the tile's height, so the bits do not depend on this."""
    return max(LORA_TILE_MIN, next_power_of_2(R)) if R <= 128 else LORA_TILE_MIN


def epilogue_rows(R: int) -> int:
    """The LoRA rank padded as the epilogue's dot holds it (≥ 16, a power of two)."""
    return max(16, next_power_of_2(R)) if R else 16


def _chunking(op: str, N: int, K: int) -> tuple[int, int]:
    return k_chunking(N, K) if op == "w8a16" else whole_k(K)


def _table_config(op: str, N: int, K: int, M: int, settings: KernelSettings) -> dict:
    return ws_config("fwd" if op != "w8a16_dx" else "dx", N, K, M, settings.table)


def down_parts_per_program(cfg: dict, K: int, k_chunk: int, n_chunks: int, rows: int, xa_chunk: int,
                           x_bytes: int, groups_down: bool = True) -> int:
    """Sub-chunks of xa per `lora_down` program at decode, where the base GEMM (config `cfg`) runs as its PDL
    dependent. Behind an 8-warp base tile (one CTA an SM) the down programs, which start first, each hold an SM a base
    program then waits for: 24 one-sub-chunk programs beside q3_down's 128 base programs. There a down program takes as
    many sub-chunks as make it read about what a base program reads (its BN rows of codes over a chunk, or over all of
    K for a single pass): q3_down 4 programs of 6, LoRA +14 -> +10 % at 16 tokens (24.2 -> 23.2 µs, H200). Behind
    4-warp tiles, two or three CTAs an SM, a down CTA finds room and longer programs only lengthen xa's chain: one
    sub-chunk each. Same partials, same order, same bits. groups_down: whether the device gains from it at all (an
    H100 does not: q3_down 26.1 / 28.0 µs ungrouped against 30.1 / 31.8 grouped at 1 / 16 tokens)."""
    if not groups_down or cfg["num_warps"] < 8:
        return 1
    base_depth = k_chunk if cfg.get("split", True) and n_chunks > 1 else K
    return max(1, (cfg["BN"] * base_depth) // (rows * xa_chunk * x_bytes))


def plan_lora_down(N: int, K: int, tokens: int, rank: int, device: Device, *, op: str = "w8a16", pdl: bool = False,
                   settings: KernelSettings = DEFAULT_SETTINGS, x_bytes: int = 2) -> KernelPlan:
    """`lora_down` for the base layer `[N, K]` (its K chunking; N = rank for A alone): one pass per (token tile, rank
    tile) for many tokens unless it is a PDL pair's first launch, else one ticket launch whose programs take `group`
    sub-chunks each (only behind an 8-warp base tile at decode, on a device that gains from it)."""
    k_chunk, n_chunks = k_chunking(N, K)
    rows = down_tile_rows(rank)
    common = dict(op="lora_down", tokens=tokens, shape=(rank, K), k_chunk=k_chunk, n_chunks=n_chunks)
    if not pdl and cdiv(tokens, DOWN_SINGLE_BM) * cdiv(rank, rows) >= DOWN_SINGLE_MIN_PROGRAMS:
        return KernelPlan(kernel="ws_down_single", **common)
    cfg = _table_config(op, N, K, tokens, settings)
    xa_chunk = xa_chunking(N, K)[0]
    group = (down_parts_per_program(cfg, K, k_chunk, n_chunks, rows, xa_chunk, x_bytes, device.groups_down)
             if pdl else 1)
    return KernelPlan(kernel="ws_ticket", config=dict(cfg, BN=rows), group=group, **common)


def _gluon_fit(op: str, cfg: dict, K: int, k_chunk: int, n_chunks: int, br: int, has_lora: bool,
               device: Device) -> dict | None:
    """The Gluon config that can run (`ws_gluon.fitting_config` for aligned row-major operands): the entry's where the
    chunks tile K in pairs of k-steps and its ring and LoRA tiles fit in shared memory; a BM = 256 forward whose LoRA
    tiles overflow at BM = 128 (same bits: token tiles never change an element's arithmetic); else None."""
    def ok(g):
        ring = bool(g.get("LORA_RING")) and has_lora and br % 64 == 0
        return ((not ring or g["BK"] == 64) and k_chunk * n_chunks == K and k_chunk % (2 * g["BK"]) == 0
                and g["BM"] in (128, 256) and shared_bytes(g, br, ring) <= device.smem_bytes)

    if ok(cfg):
        return cfg
    if cfg["BM"] != 256 or op == "w8a16_dx":
        return None
    narrow = dict(cfg, BM=128)
    return narrow if ok(narrow) else None


def plan(op: str, shape: tuple[int, int], tokens: int, device: Device, *, rank: int = 0, xa_given: bool = False,
         return_xa: bool = False, settings: KernelSettings = DEFAULT_SETTINGS, config: dict | None = None,
         allow_split: bool = True, x_bytes: int = 2) -> KernelPlan:
    """The kernel(s) a call of `op` on a layer `shape` = (N, K) with `tokens` rows runs on `device`. rank: the LoRA
    rank (0: none); xa_given: the caller passes xa (dX passes gB); return_xa: the caller keeps xa (the trainer);
    config: an explicit tile config instead of the table's (tuner, tests); allow_split: False forces one pass;
    x_bytes: the activations' element size (bf16: 2), which sizes `lora_down`'s grouped programs.
    Memoized (the plan is a pure function of these and of the table and chunking constants, which the key holds): a
    training step plans a few hundred calls, and the host time of its backward is on the critical path. A plan's
    `config` and `gluon` are shared between the calls that get it: read them, never change them."""
    if config is not None:
        return _plan(op, tuple(shape), tokens, device, rank, xa_given, return_xa, settings, config, allow_split,
                     x_bytes)
    return _memo_plan(op, tuple(shape), tokens, device, rank, xa_given, return_xa, settings, allow_split, x_bytes,
                      _constants(settings))


def _constants(settings: KernelSettings) -> tuple:
    """What a plan depends on besides its arguments: the loaded table (its identity changes when the table is
    reloaded) and the chunking and `lora_down` constants (tests patch them)."""
    table = _configs.load_table(settings.table or _TABLE)
    return (id(table), _configs.TARGET_PROGRAMS, _configs.MIN_CHUNKS, _configs.XA_CHUNK_MAX, DOWN_SINGLE_MIN_PROGRAMS,
            DOWN_FIRST_MAX_M)


_TABLE = str(_configs.TMA_TABLE_PATH)


@functools.lru_cache(maxsize=8192)
def _memo_plan(op, shape, tokens, device, rank, xa_given, return_xa, settings, allow_split, x_bytes, _constants):
    return _plan(op, shape, tokens, device, rank, xa_given, return_xa, settings, None, allow_split, x_bytes)


def _plan(op, shape, tokens, device, rank, xa_given, return_xa, settings, config, allow_split, x_bytes) -> KernelPlan:
    """`plan` without the memo."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    N, K = shape
    if settings.reference or not device.triton:
        return KernelPlan(op=op, kernel="reference", tokens=tokens, shape=(N, K))
    if op == "lora_down":
        return plan_lora_down(N, K, tokens, rank, device, settings=settings, x_bytes=x_bytes)
    cfg = dict(_table_config(op, N, K, tokens, settings) if config is None else config)
    k_chunk, n_chunks = _chunking(op, N, K)
    common = dict(op=op, tokens=tokens, shape=(N, K), config=cfg, k_chunk=k_chunk, n_chunks=n_chunks)
    has_lora = rank > 0
    fuse_down = has_lora and not xa_given and op == "w8a16"
    # Decode with PDL: `lora_down` first, the base GEMM its dependent, streaming the weights while xa is computed.
    # Without PDL the down-projection rides in the split-K launch (two launches), unless the caller keeps xa.
    pdl = fuse_down and device.pdl and tokens <= DOWN_FIRST_MAX_M
    down = None
    if pdl or (return_xa and fuse_down):
        down = plan_lora_down(N, K, tokens, rank, device, op=op, pdl=pdl, settings=settings, x_bytes=x_bytes)
        fuse_down = False
    split = allow_split and cfg.get("split", tokens <= 64) and (n_chunks > 1 or fuse_down)
    if split and fuse_down:  # the reduce kernel is the partial kernel's programmatic dependent where PDL works
        return KernelPlan(kernel="ws_split", split=True, pdl=device.pdl, fused_down=True, **common)
    if split:
        return KernelPlan(kernel="ws_ticket", split=True, pdl=pdl, down=down, **common)
    if down is None and fuse_down:
        down = plan_lora_down(N, K, tokens, rank, device, op=op, settings=settings, x_bytes=x_bytes)
    gluon = cfg.get("gluon") if not pdl and device.hopper else None
    br = epilogue_rows(rank)
    if gluon:
        gluon = _gluon_fit(op, gluon, K, k_chunk, n_chunks, br, has_lora, device)
    if gluon:
        ring = bool(gluon.get("LORA_RING")) and has_lora and br % 64 == 0
        lr = br // 64 if ring else 0
        persistent = (bool(gluon.get("PERSISTENT")) and (not has_lora or lr > 0)
                      and n_chunks * (k_chunk // gluon["BK"]) + lr >= gluon["num_stages"] - 1)
        # tma: what runs where these tensors do not suit the Gluon kernel (alignment, layouts: checked at launch)
        return KernelPlan(kernel="ws_gluon", pdl=pdl, down=down, tma=bool(cfg.get("tma")), gluon=gluon, ring=ring,
                          persistent=persistent, **common)
    tma = bool(cfg.get("tma")) and (device.hopper or device.interpreter) and not pdl
    return KernelPlan(kernel="ws_tma" if tma else "ws_single", pdl=pdl, down=down, tma=tma, **common)


@functools.lru_cache(maxsize=8)
def _cuda_device(index: int) -> Device:
    import torch

    props = torch.cuda.get_device_properties(index)
    name = props.name
    short = "h100" if "H100" in name else "h200" if "H200" in name else name.lower().replace(" ", "-")
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 232448
    return Device(short, (props.major, props.minor), props.multi_processor_count, smem, pdl_supported(index),
                  groups_down="H100" not in name)


def describe(device) -> Device:
    """The `Device` of a torch device, looked up once per device (every GEMM call asks): a CUDA GPU's properties, the
    interpreter under TRITON_INTERPRET=1 (read once, as the kernels read it at import), else the CPU."""
    found = _DESCRIBED.get(device)
    if found is None:
        found = _DESCRIBED[device] = _describe(device)
    return found


_DESCRIBED: dict = {}


def _describe(device) -> Device:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_device(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER if interpreting() else CPU
