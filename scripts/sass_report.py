"""Registers, spills and the inner K loop's instruction mix of the W8A16 GEMM kernels, compiled for sm_90a on
any machine (no GPU: Triton's compiler, its bundled ptxas and cuobjdump). A profile of the code the compiler
emits, not of a run: the installed Triton may differ from the device's (the H200's image has 3.6), and the
device specializes integer arguments the same way (`tt.divisibility` 16 on pointers, N, K, row strides).

    python scripts/sass_report.py [--tiles 128/256/64/8/3 ...] [--one-chunk] [--dx] [--masked]

Per tile (BN weight rows / BM tokens / BK / warps / stages): registers, stack bytes (spills), and per trip of the
innermost loop: HGMMA (wgmma), LDS/STS (shared-memory loads/stores), LDGSTS (cp.async), BAR, the e4m3 → bf16
widening (F2FP, F2F: Triton's own conversions; PRMT, LOP3, HMUL2: `kernels/w8a16/widen.py`'s) and
LDL/STL (spill traffic). kernels/README.md reads them.

    python scripts/sass_report.py --tma [--dx] [--tiles ...]

the TMA-load kernel's loops (instructions, HGMMA, spill instructions per body, innermost first), as the table's
`"tma": true` entries compile it.

    python scripts/sass_report.py --gluon [256/64/4 ...]

the warp-specialized Gluon forward (`kernels/w8a16/ws_gluon.py`) in table configs: registers, whether ptxas serialized
its wgmmas, its loops, and the instructions that write an in-flight register-A wgmma's operand
(`wgmma_register_hazards`: how that kernel first went wrong on the H200).

    python scripts/sass_report.py --wgmma

compiles every wgmma kernel of epirl.kernels in the configs the committed tables select and says, per kernel,
whether ptxas **serialized its wgmmas** (its note C7515: every wgmma then waits for the one before, so the tensor
core stalls on whatever the warps do between them - for the W8A16 kernels, the e4m3 → bf16 widening of the next
k-step), with registers and spill bytes. tests/kernels/test_sass_report.py holds every case to "not serialized".
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

KEYS = ["HGMMA", "LDS", "STS", "LDGSTS", "BAR", "F2FP", "F2F", "PRMT", "LOP3", "HMUL2", "LDL", "STL"]
DIVISIBLE = {"x_ptr", "w_ptr", "y_ptr", "w_scale_ptr", "xa_ptr", "b_ptr", "bias_ptr", "N", "K", "K_CHUNK",
             "stride_xm", "stride_wn", "stride_wk", "stride_ym", "stride_xam", "stride_bn"}


def compile_cubin(tile: str, one_chunk: bool, dx: bool, even: bool = True) -> bytes:
    """The weight-stationary single-pass kernel for sm_90a; even: the K loop without load masks, as every Qwen
    shape runs it at training sizes (`_ws_chunk`'s EVEN_K / EVEN_N / EVEN_M)."""
    from epirl.kernels.w8a16.weight_stationary import _ws_single_kernel as fn
    BN, BM, BK, warps, stages = map(int, tile.split("/"))
    const = dict(HAS_W_SCALE=True, HAS_LORA=False, HAS_BIAS=False, DOT_F32=False, BN=BN, BM=BM, BK=BK, BR=16,
                 GROUP_N=8, WAIT_PDL=False, EVEN_K=even, EVEN_N=even, EVEN_M=even, stride_xk=1, stride_yn=1)
    const.update({"stride_wn": 1} if dx else {"stride_wk": 1})  # the contiguous dimension of w
    if one_chunk:
        const["N_CHUNKS"] = 1
    ptr_types = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"}
    return _compile(fn, const, ptr_types, warps, stages, DIVISIBLE).asm["cubin"]


def compile_tma_cubin(tile: str, dx: bool = False) -> bytes:
    """`ws_tma._ws_tma_kernel` for sm_90a with LoRA, chunked (x and the codes through descriptors)."""
    return compile_tma(tile, dx).asm["cubin"]


def compile_tma(tile: str, dx: bool = False, br: int = 64):
    """`compile_tma_cubin`'s compiled kernel (its `metadata.shared` is the shared memory a launch needs); br: the
    epilogue's padded LoRA rank (64 for rank 64; 256 for a fused qkv's block-diagonal rank 192)."""
    from epirl.kernels.w8a16.ws_tma import _ws_tma_kernel as fn
    BN, BM, BK, warps, stages = map(int, tile.split("/"))
    const = dict(W_TRANSPOSED=dx, HAS_W_SCALE=True, HAS_LORA=True, HAS_BIAS=False, DOT_F32=False, BN=BN, BM=BM, BK=BK,
                 BR=br, GROUP_N=8, stride_yn=1)
    x_block = f"tensordesc<bf16[{BM}, {BK}]>"
    w_block = f"tensordesc<fp8e4nv[{BK}, {BN}]>" if dx else f"tensordesc<fp8e4nv[{BN}, {BK}]>"
    types = {"x_desc": x_block, "w_desc": w_block, "w_scale_ptr": "*fp32"}
    return _compile(fn, const, types, warps, stages, DIVISIBLE)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _sass(cubin: bytes) -> tuple[str, list, list]:
    """(resource usage text, [(address, instruction)], [(loop start, loop end)] of every backward branch)."""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    ops = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line) for line in sass.splitlines()) if m]
    loops = [(int(m.group(1), 16), a) for a, t in ops
             for m in [re.search(r"BRA.*?0x([0-9a-f]+)", t)] if m and int(m.group(1), 16) < a]
    return usage, ops, loops


def _opname(text: str) -> str:
    words = text.split(";")[0].split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def loop_report(cubin: bytes, min_instructions: int = 32) -> list[dict]:
    """Every loop of at least min_instructions (the TMA kernels also hold a few-instruction mbarrier wait loop, which
    `report`'s innermost-loop rule would pick), outermost last: instructions, HGMMA and spill (LDL + STL) counts of
    its body as compiled (a predicated or branched-over block counts whether it runs per trip or not)."""
    _, ops, loops = _sass(cubin)
    rows = []
    for lo, hi in sorted(loops, key=lambda lh: lh[1] - lh[0]):
        body = Counter(_opname(t) for a, t in ops if lo <= a <= hi)
        if sum(body.values()) >= min_instructions:
            rows.append(dict(instructions=sum(body.values()), HGMMA=body["HGMMA"], spill=body["LDL"] + body["STL"]))
    return rows


def report(cubin: bytes) -> dict:
    usage, ops, loops = _sass(cubin)
    lo, hi = min(loops, key=lambda lh: lh[1] - lh[0]) if loops else (0, -1)
    body = Counter(_opname(t) for a, t in ops if lo <= a <= hi)
    return dict(regs=int(re.search(r"REG:(\d+)", usage).group(1)), stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                loop=sum(body.values()), **{k: body.get(k, 0) for k in KEYS})


def ptxas_notes(ptx: str) -> dict:
    """What Triton's own ptxas makes of this PTX for sm_90a: whether it serialized the wgmmas and why (C7515: a
    non-wgmma instruction defines an accumulator inside a pipeline stage; C7512: too few registers), registers,
    spill bytes, the spill instructions (LDL/STL) inside the innermost loop, and the instructions that write an
    in-flight register-A wgmma's operand (`wgmma_register_hazards`)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", src + ".o"],
                             capture_output=True, text=True, check=False)
        log = out.stdout + out.stderr
        if out.returncode != 0:
            raise RuntimeError(f"ptxas failed: {log[-500:]}")
        with open(src + ".o", "rb") as f:
            cubin = f.read()
        loop = report(cubin)
    why = [code for code in ("C7515", "C7512", "C7510", "C7514") if code in log]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    return dict(serialized=",".join(why), regs=int(re.search(r"Used (\d+) registers", log).group(1)),
                spill=sum(spills), loop_spill=loop["LDL"] + loop["STL"],
                operand_races=len(wgmma_register_hazards(cubin)))


def _compile(fn, const: dict, ptr_types: dict, warps: int, stages: int, divisible=()):
    """A Triton kernel compiled for sm_90a; `ptr_types` types the arguments it names (pointers, tensor descriptors),
    other pointers default to bf16, other runtime arguments to i32 (fp32 for the LoRA scales); `divisible` names the arguments Triton would see as multiples of 16 on the device."""
    # constexpr parameters with defaults left out of `const` take their defaults, as a launch would
    const = dict({p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **const)
    sig = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n in ptr_types:
            sig[n] = ptr_types[n]
        elif n.endswith("_ptr") or n.endswith("_tab"):
            sig[n] = "*bf16"
        else:
            sig[n] = "fp32" if n in ("lora_scale", "sigma_const") else "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible if sig.get(n, "constexpr") != "constexpr"}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def compile_ptx(fn, const: dict, ptr_types: dict, warps: int, stages: int, divisible=()) -> str:
    """PTX of `_compile`."""
    return _compile(fn, const, ptr_types, warps, stages, divisible).asm["ptx"]


def _tile_consts(cfg: dict, keys=("BN", "BM", "BK")) -> dict:
    return {k: cfg[k] for k in keys}


def wgmma_cases() -> list[tuple[str, callable]]:
    """(name, () -> PTX) for each wgmma kernel of epirl.kernels in the configs it runs with: the W8A16 forward and
    dX over every row of the committed tile table (one chunk where `k_chunking` gives one, as Triton specializes
    it), its split-K decode kernels, the W8A8 GEMM, and the serving kernels (K1's shrink, K2, segmented shrink)."""
    from epirl.kernels.w8a8 import scaled
    from epirl.kernels.w8a16 import configs, weight_stationary as ws
    from epirl.kernels.w8a8_multi import segmented, triton as multi

    fp8 = {"w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "part_ptr": "*fp32", "xa_part_ptr": "*fp32"}
    div = ("x_ptr", "w_ptr", "y_ptr", "xa_ptr", "b_ptr", "a_ptr", "part_ptr", "xa_part_ptr", "N", "K", "K_CHUNK",
           "XA_CHUNK", "stride_xm", "stride_wn", "stride_wk", "stride_ym", "stride_xam", "stride_bn", "stride_ar")
    cases = []
    table = configs.load_table()
    for op in ("fwd", "dx"):
        for shape, row in table[op].items():
            N, K = (4096, 4096) if shape == "default" else map(int, shape.split("x"))
            k_chunk, n_chunks = configs.k_chunking(N, K) if op == "fwd" else ws.whole_k(K)
            one = n_chunks == 1
            for bound, cfg in row.items():
                # token tiles: full at training sizes; a decode call (split) has fewer tokens than its tile
                even = dict(EVEN_K=ws.even_k(K, k_chunk, n_chunks), EVEN_N=N % cfg["BN"] == 0,
                            EVEN_M=not cfg.get("split"))
                if cfg.get("split") and op == "fwd":
                    const = dict(HAS_BASE=True, HAS_DOWN=False, DOT_F32=False, BRT=64, GROUP_N=8,
                                 LAUNCH_DEPENDENTS=True, WAIT_AT_END=True, stride_xk=1, stride_wk=1, stride_ak=1,
                                 **even, **_tile_consts(cfg))
                    kernel = ws._ws_partial_kernel
                else:
                    const = dict(HAS_W_SCALE=True, HAS_LORA=True, HAS_BIAS=False, DOT_F32=False, BR=64, GROUP_N=8,
                                 WAIT_PDL=False, stride_xk=1, stride_yn=1, **even, **_tile_consts(cfg))
                    const.update({"stride_wn": 1} if op == "dx" else {"stride_wk": 1})
                    if one:
                        const["N_CHUNKS"] = 1
                    kernel = ws._ws_single_kernel
                cases.append((f"w8a16 {op} {shape} M<={bound} {cfg['BN']}/{cfg['BM']}/{cfg['BK']}/"
                              f"{cfg['num_warps']}/{cfg['num_stages']}",
                              lambda k=kernel, c=const, g=cfg: compile_ptx(k, c, fp8, g["num_warps"], g["num_stages"],
                                                                           div)))
    w8a8 = scaled.FWD_CONFIG
    cases.append(("w8a8 scaled_gemm_lora", lambda: compile_ptx(
        scaled._scaled_gemm_lora_kernel, dict(HAS_W_SCALE=True, HAS_X_SCALE=True, HAS_LORA=True, HAS_BIAS=False,
                                              FP8_DOT=True, DOT_F32=False, BR=64, GROUP_M=8, stride_xk=1,
                                              stride_wk=1, stride_yn=1, **_tile_consts(w8a8, ("BM", "BN", "BK"))),
        {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "x_scale_ptr": "*fp32"},
        w8a8["num_warps"], w8a8["num_stages"], div)))
    k2_ptrs = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "order_ptr": "*i64",
               "ids_ptr": "*i64", "part_ptr": "*fp32", "b_tab": "*i64", "bl_tab": "*i64", "starts_ptr": "*i32",
               "sigma_ptr": "*fp32"}
    for name, cfg in (("decode", multi.DECODE_CONFIG), ("prefill", multi.PREFILL_CONFIG)):
        cases.append((f"w8a8_multi_lora K2 {name}", lambda c=cfg: compile_ptx(
            multi._multi_lora_gemm_kernel, dict(HAS_BASE=True, HAS_ORDER=False, HAS_LORA=True, SIGMA_PER_ADAPTER=True,
                                                HAS_BIAS=False, WAIT_PDL=True, DOT_F32=False, BR=64, GROUP_N=8,
                                                **_tile_consts(c, ("BN", "BT", "BK"))),
            k2_ptrs, c["num_warps"], c["num_stages"], div + ("xs_ptr",))))
    seg = segmented.SEG_SHRINK_CONFIG
    cases.append(("w8a8_multi_lora segmented shrink", lambda: compile_ptx(
        segmented._seg_shrink_kernel, dict(SUM_CHUNKS=False, DOT_F32=False, BR=64, BS=64, BT=seg["BT"], BK=seg["BK"]),
        {"a_tab": "*i64", "tokens_ptr": "*i32", "lora_ids_ptr": "*i32", "counts_ptr": "*i32", "part_ptr": "*fp32"},
        seg["num_warps"], seg["num_stages"], div)))
    return cases


def compile_gluon(cfg: dict, br: int = 64, dx: bool = False, lora_ring: bool = False, persistent: bool = False):
    """`ws_gluon._ws_gluon_kernel` (the warp-specialized forward; dx: its dX form, codes and B read transposed;
    lora_ring: the LoRA ranks streamed through the k-step ring 64 at a time, `_lora_ring`; persistent: a program per
    SM over many tiles, with lora_ring) for
    sm_90a with LoRA, in a table "gluon" config (BM / BK / num_stages):
    the compiled kernel (`.asm["ptx"]`, `["cubin"]`)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from epirl.kernels.w8a16 import ws_gluon
    fn = ws_gluon._ws_gluon_kernel
    BM, BK = cfg["BM"], cfg["BK"]

    def desc(dtype: str, shape: list, gdtype) -> str:
        return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{gl.NVMMASharedLayout.get_default_for(shape, gdtype)!r}>"
    w_block = [BK, 64] if dx else [ws_gluon.BN, BK]
    chunk = 64 if lora_ring else br  # the LoRA boxes' rank columns
    b_block = [chunk, 64] if dx else [ws_gluon.BN, chunk]
    sig = dict(x_desc=desc("bf16", [BM, BK], gl.bfloat16), w_desc=desc("fp8e4nv", w_block, gl.float8e4nv),
               xa_desc=desc("bf16", [BM, chunk], gl.bfloat16), b_desc=desc("bf16", b_block, gl.bfloat16),
               y_ptr="*bf16", w_scale_ptr="*fp32", bias_ptr="*bf16", M="i32", N="i32", K_CHUNK="i32",
               N_CHUNKS="i32", lora_scale="fp32", stride_ym="i32")
    const = dict(HAS_W_SCALE=True, HAS_LORA=True, HAS_BIAS=False, BM=BM, BK=BK, BR=br, STAGES=cfg["num_stages"],
                 GROUP_N=8, W_T=dx, LORA_STEPS=br // 64 if lora_ring else 0,
                 PERSISTENT=persistent)
    sig.update({k: "constexpr" for k in const})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("y_ptr", "N", "K_CHUNK", "stride_ym")}
    return triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4))


def _written_registers(text: str) -> set[int]:
    """Registers an instruction writes: its first operand where that is a destination (not a store, barrier,
    branch, wgmma or synchronization), widened by the load width (.64: 2 registers, .128: 4)."""
    op = _opname(text)
    if op.startswith(("ST", "BAR", "BRA", "HGMMA", "SYNCS", "WARPGROUP", "EXIT", "RET", "UTMA", "MEMBAR", "FENCE",
                      "DEPBAR", "NOP", "CALL", "ARRIVES", "RED", "ATOM")):
        return set()
    words = text.split(";")[0].split()
    at = 1 if words[0].startswith("@") else 0  # a predicate guard comes first
    m = re.match(r"R(\d+)\b", " ".join(words[at + 1:]))
    if not m:
        return set()
    width = 4 if ".128" in words[at] else 2 if ".64" in words[at] else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def wgmma_register_hazards(cubin: bytes) -> list[str]:
    """Instructions that write a register a register-A wgmma still in flight reads (its A fragment, 4 registers
    from the HGMMA's second operand): the wgmma reads its A operand asynchronously, so such a write races with it.
    Each loop body is walked twice (the second pass sees what the loop carries around), tracking the HGMMA groups
    (closed by `gsb0`) that `WARPGROUP.DEPBAR.LE gsb0, N` leaves pending."""
    _, ops, loops = _sass(cubin)
    hazards = []
    for lo, hi in loops:
        body = [(a, t) for a, t in ops if lo <= a <= hi]
        if not any(_opname(t) == "HGMMA" for _, t in body):
            continue
        pending: list[set] = []
        group: set = set()
        for sweep in range(2):
            for addr, text in body:
                op = _opname(text)
                if op == "HGMMA":
                    m = re.search(r"HGMMA\S*\s+R\d+,\s+R(\d+),", text)
                    if m:
                        group |= set(range(int(m.group(1)), int(m.group(1)) + 4))
                    if "gsb0" in text:
                        pending.append(group)
                        group = set()
                elif op == "WARPGROUP" and "DEPBAR" in text:
                    keep = int(re.search(r"gsb0,\s*0x([0-9a-f]+)", text).group(1), 16)
                    pending = pending[len(pending) - keep:] if keep else []
                else:
                    hit = _written_registers(text) & set().union(*pending) if pending else set()
                    if hit and sweep == 1:
                        hazards.append(f"{addr:#06x} {text.split(';')[0].strip()} writes R{min(hit)} of an "
                                       f"in-flight wgmma's A operand")
    return hazards


def wgmma_report() -> list[dict]:
    rows = []
    for name, build in wgmma_cases():
        r = dict(kernel=name, **ptxas_notes(build()))
        rows.append(r)
        print(f"| {name} | {('**' + r['serialized'] + '**') if r['serialized'] else 'no'} | {r['regs']} | "
              f"{r['spill']} | {r['loop_spill']} | {r['operand_races']} |", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", nargs="+", default=["128/256/64/8/3", "128/128/64/8/4", "256/128/64/8/3"])
    ap.add_argument("--one-chunk", action="store_true", help="N_CHUNKS = 1 (as Triton specializes it)")
    ap.add_argument("--dx", action="store_true", help="dX operand strides (codes read transposed)")
    ap.add_argument("--masked", action="store_true", help="the K loop with its load masks (ragged shapes)")
    ap.add_argument("--wgmma", action="store_true", help="every wgmma kernel: serialized by ptxas (C7515)?")
    ap.add_argument("--tma", action="store_true", help="the TMA-load kernel (ws_tma.py), chunked: its loops")
    ap.add_argument("--gluon", nargs="*", metavar="BM/BK/STAGES",
                    help="the warp-specialized Gluon forward (ws_gluon.py): loops, serialization, A-register races")
    args = ap.parse_args()
    if args.gluon is not None:
        print(f"triton {triton.__version__}, sm_90a, Gluon forward\n\n| BM/BK/stages | regs | stack B | wgmma "
              f"serialized | loops, innermost first: instructions / HGMMA / LDL+STL | A-register races |\n"
              f"|---|---|---|---|---|---|")
        for text in args.gluon or ["256/64/4", "128/64/4"]:
            bm, bk, stages = map(int, text.split("/"))
            k = compile_gluon(dict(BM=bm, BK=bk, num_stages=stages))
            r, notes = report(k.asm["cubin"]), ptxas_notes(k.asm["ptx"])
            loops = ", ".join(f"{d['instructions']} / {d['HGMMA']} / {d['spill']}" for d in loop_report(k.asm["cubin"]))
            print(f"| {text} | {r['regs']} | {r['stack']} | {notes['serialized'] or 'no'} | {loops} | "
                  f"{len(wgmma_register_hazards(k.asm['cubin']))} |", flush=True)
        return
    if args.tma:
        print(f"triton {triton.__version__}, sm_90a, TMA kernel, {'dX' if args.dx else 'forward'}"
              f"\n\n| BN/BM/BK/warps/stages | regs | stack B | "
              f"loops, innermost first: instructions / HGMMA / LDL+STL |\n|---|---|---|---|")
        for tile in args.tiles:
            cubin = compile_tma_cubin(tile, args.dx)
            r = report(cubin)
            loops = ", ".join(f"{d['instructions']} / {d['HGMMA']} / {d['spill']}" for d in loop_report(cubin))
            print(f"| {tile} | {r['regs']} | {r['stack']} | {loops} |", flush=True)
        return
    if args.wgmma:
        print(f"triton {triton.__version__}, sm_90a\n\n| kernel, config | wgmma serialized | regs | spill B | LDL+STL in "
              f"the K loop | writes to an in-flight wgmma operand |\n|---|---|---|---|---|---|")
        wgmma_report()
        return
    print(f"triton {triton.__version__}, sm_90a, {'dX' if args.dx else 'forward'}, "
          f"{'one chunk' if args.one_chunk else 'chunked'}, {'masked' if args.masked else 'unmasked'} loads\n")
    print("| BN/BM/BK/warps/stages | regs | stack B | loop instr | " + " | ".join(KEYS) + " |")
    print("|---|---|---|---|" + "---|" * len(KEYS))
    for tile in args.tiles:
        r = report(compile_cubin(tile, args.one_chunk, args.dx, even=not args.masked))
        print(f"| {tile} | {r['regs']} | {r['stack']} | {r['loop']} | "
              + " | ".join(str(r[k]) for k in KEYS) + " |", flush=True)


if __name__ == "__main__":
    main()
