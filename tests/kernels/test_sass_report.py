"""scripts/sass_report.py compiles the W8A16 kernel for sm_90a without a GPU: its K loop reaches Hopper's wgmma
(HGMMA), in the forward and the dX, and the report reads registers and spills."""

import os
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def _have_tools() -> bool:
    import sass_report
    return all(os.access(sass_report._tool(t), os.X_OK) for t in ("cuobjdump", "ptxas"))


@pytest.mark.parametrize("dx", [False, True])
def test_kernel_compiles_for_sm90_with_wgmma_in_the_k_loop(dx):
    import sass_report
    if not _have_tools():
        pytest.skip("this triton ships no ptxas/cuobjdump")
    r = sass_report.report(sass_report.compile_cubin("128/128/64/8/3", False, dx))
    assert r["HGMMA"] >= 1 and 0 < r["regs"] <= 255 and r["loop"] > 0, r
    assert r["LDL"] == 0 and r["STL"] == 0, f"spill traffic inside the K loop: {r}"


@pytest.mark.parametrize("tile,dx", [("64/16/128/4/4", False), ("128/256/64/8/3", False), ("128/256/64/8/3", True)])
def test_k_loops_widen_without_conversion_instructions(tile, dx):
    """The decode and training K loops widen e4m3 -> bf16 with `widen.py`'s PRMT/SHL/AND/bf16x2 FMA (one of each per
    two codes), no F2F / F2FP: sm_90 issues those at a quarter of the integer rate (with them the decode tile's loop
    held 64 F2F + 32 F2FP per trip, triton 3.9)."""
    import sass_report
    if not _have_tools():
        pytest.skip("this triton ships no ptxas/cuobjdump")
    r = sass_report.report(sass_report.compile_cubin(tile, False, dx))
    BN, _, BK, warps, _ = map(int, tile.split("/"))
    pairs = BN * BK // (2 * 32 * warps)  # code pairs per thread per trip
    assert r["F2F"] == 0 and r["F2FP"] == 0, r
    assert r["HMUL2"] == pairs and r["PRMT"] >= pairs, r


@pytest.mark.parametrize("dx", [False, True])
def test_tma_kernel_keeps_wgmma_in_its_loops_without_spills(dx):
    """The TMA-load kernel (the table's `"tma": true`) compiles for sm_90a, forward and dX, with wgmma in its loops
    and no spill instruction in them at 128x128."""
    import sass_report
    if not _have_tools():
        pytest.skip("this triton ships no ptxas/cuobjdump")
    loops = sass_report.loop_report(sass_report.compile_tma_cubin("128/128/64/8/4", dx=dx))
    assert loops and all(d["HGMMA"] >= 1 and d["spill"] == 0 for d in loops), loops


@pytest.mark.parametrize("dx", [False, True])
def test_fused_slices_epilogue_fits_the_training_tile(dx):
    """One call per fused layer (kernels/w8a16/slices.py) gives a rank-64 qkv a block-diagonal LoRA of rank 192,
    padded to 256 in the epilogue: the training TMA tile (128 x 256 x 64, 3 stages) still compiles for sm_90a within
    the 227 KiB of shared memory a block may have, without spills in its K loop."""
    import sass_report
    if not _have_tools():
        pytest.skip("this triton ships no ptxas/cuobjdump")
    kernel = sass_report.compile_tma("128/256/64/8/3", dx=dx, br=256)
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
    notes = sass_report.ptxas_notes(kernel.asm["ptx"])
    assert notes["loop_spill"] == 0 and notes["serialized"] == "", notes


def _ptx(fn, const: dict, ptr_types: dict, warps: int, stages: int) -> str:
    from conftest import ptx_for

    sig = {n: ptr_types.get(n, "*bf16") if n.endswith("_ptr") else "fp32" if n == "lora_scale" else "i32"
           for n in fn.arg_names if n not in const}
    return ptx_for(fn, sig, const, num_warps=warps, num_stages=stages)


@pytest.mark.parametrize("pdl", [False, True])
def test_split_k_decode_kernels_compile_for_sm90(pdl):
    """The decode path's two kernels as the GPU builds them (base tiles + fused LoRA down sub-chunks; the ordered
    reduce with the down partials), with and without the PDL launch pair: compile errors show here, not on the
    device. (A single-pass compile is the test above; griddepcontrol is PDL's instruction.)"""
    from epirl.kernels.w8a16.weight_stationary import _ws_partial_kernel, _ws_reduce_kernel
    fp32 = {"part_ptr": "*fp32", "xa_part_ptr": "*fp32", "w_scale_ptr": "*fp32"}
    partial = _ptx(_ws_partial_kernel, dict(HAS_BASE=True, HAS_DOWN=True, DOT_F32=False, BN=64, BM=16,
                                                    BK=128, BRT=64, GROUP_N=8, LAUNCH_DEPENDENTS=pdl,
                                                    WAIT_AT_END=False),
                           dict(fp32, w_ptr="*fp8e4nv"), 4, 4)
    reduce = _ptx(_ws_reduce_kernel, dict(HAS_W_SCALE=True, HAS_LORA=True, XA_PARTS=True, HAS_BIAS=True,
                                                  DOT_F32=False, BN=64, BM=16, BR=64, GROUP_N=8, WAIT_PDL=pdl),
                          fp32, 4, 1)
    assert partial.count("wgmma.mma_async") >= 2  # base tile and down-projection branches both on wgmma
    assert ("griddepcontrol" in partial) == pdl and ("griddepcontrol" in reduce) == pdl


def test_down_first_decode_chain_compiles_for_sm90():
    """The decode path with PDL when the down-projection is to compute: a single pass (the base GEMM as lora_down's
    dependent) waits for xa only after its K loop. (The one-launch split-K's wait: the ticket test below.)"""
    from epirl.kernels.w8a16.weight_stationary import _ws_single_kernel
    fp32 = {"part_ptr": "*fp32", "xa_part_ptr": "*fp32", "w_scale_ptr": "*fp32"}
    single = _ptx(_ws_single_kernel, dict(HAS_W_SCALE=True, HAS_LORA=True, HAS_BIAS=False, DOT_F32=False, BN=64,
                                          BM=16, BK=128, BR=64, GROUP_N=8, WAIT_PDL=True),
                  dict(fp32, w_ptr="*fp8e4nv"), 4, 4)
    assert "griddepcontrol.wait" in single and single.rindex("griddepcontrol.wait") > single.index("wgmma.mma_async")


@pytest.mark.parametrize("down,one_part", [(False, False), (True, False), (False, True)],
                         ids=["base", "down", "base-one-chunk"])
def test_one_launch_split_k_compiles_for_sm90(down, one_part):
    """`ws_splitk`'s kernel as the decode path builds it: the base tile behind PDL (its last programs wait for xa
    before the epilogue) and the down-projection that lets it launch; one acq_rel ticket atomic at GPU scope, the
    partials summed through L2 (ld.global.cg) after B's rows are fetched, wgmma in the K loop and in the base
    epilogue's LoRA dot. A one-chunk layer (gate_up) compiles without partials and ticket."""
    from epirl.kernels.w8a16.ws_splitk import _ws_ticket_kernel
    types = {"part_ptr": "*fp32", "w_scale_ptr": "*fp32", "cnt_ptr": "*i32"}
    if not down:
        types["w_ptr"] = "*fp8e4nv"
    ptx = _ptx(_ws_ticket_kernel, dict(DOWN=down, HAS_W_SCALE=not down, HAS_LORA=not down, HAS_BIAS=False,
                                       DOT_F32=False, BN=64, BM=16, BK=128, BR=64, GROUP_N=8, LAUNCH_DEPENDENTS=down,
                                       WAIT_PDL=not down, EVEN_K=True, EVEN_N=True, EVEN_M=False,
                                       ONE_PART=one_part),
               types, 4, 4)
    atomics = [line for line in ptx.splitlines() if "atom." in line]
    assert ptx.count("wgmma.mma_async") >= (1 if down else 2)
    if one_part:
        assert not atomics and "ld.global.cg" not in ptx
    else:
        assert len(atomics) == 1 and "acq_rel" in atomics[0] and ".gpu" in atomics[0], atomics
        assert "ld.global.cg" in ptx
        if not down:  # the last arrival fetches B's rows before it reads the partials (their latencies overlap)
            lines = ptx.splitlines()
            ticket = next(i for i, line in enumerate(lines) if "atom." in line)
            first_part = next(i for i, line in enumerate(lines) if "ld.global.cg" in line)
            assert any("ld.global" in line and ".cg" not in line for line in lines[ticket:first_part])
    assert ("griddepcontrol.launch_dependents" in ptx) == down and ("griddepcontrol.wait" in ptx) == (not down)


@pytest.mark.parametrize("dx", [False, True], ids=["fwd", "dx"])
def test_even_shapes_run_the_k_loop_without_load_masks(dx):
    """Every Qwen projection tiles evenly, and its K loop then loads without predicates (`_ws_chunk`: EVEN_K /
    EVEN_N / EVEN_M, a full token tile): at the 128 x 256 training tile that loop must stay >= 5 % shorter than the
    masked one (measured with triton 3.9: 216 vs 234 instructions per trip forward, 246 vs 272 dX), with no more spills."""
    import sass_report
    even, masked = (sass_report.report(sass_report.compile_cubin("128/256/64/8/3", dx, dx, even=e))
                    for e in (True, False))
    assert even["loop"] <= 0.95 * masked["loop"], (even, masked)
    assert even["stack"] <= masked["stack"] and even["HGMMA"] == masked["HGMMA"]


def _wgmma_case_names() -> list[str]:
    import sass_report
    return [name for name, _ in sass_report.wgmma_cases()]


# Serializations ptxas may keep, by kernel: the one-chunk 128 x 256 training forward (C7515; letting its wgmmas stay
# in flight spills inside the K loop, C7512 - see weight_stationary._ws_chunk) and the W8A8 kernels, whose precise
# FP8 accumulation (max_num_imprecise_acc) adds each wgmma's partial into the accumulator between wgmmas (C7514).
ALLOWED_SERIALIZED = {"w8a16 fwd 24576x4096 M<=1000000000 128/256/32/8/4": "C7515",
                      "w8a8 scaled_gemm_lora": "C7514", "w8a8_multi_lora K2 decode": "C7514"}


@pytest.mark.parametrize("name", _wgmma_case_names())
def test_wgmma_kernels_keep_their_wgmmas_in_flight(name):
    """Every wgmma kernel in the configs it runs with: ptxas does not serialize its wgmmas (each waiting for the
    one before, the tensor core idle while the warps widen the next k-step's codes), except where listed, no
    W8A16 kernel spills inside its K loop, and no instruction writes an in-flight wgmma's register operand. The decode tiles were serialized until the K loops said they run."""
    import sass_report
    if not _have_tools():
        pytest.skip("this triton ships no ptxas/cuobjdump")
    build = dict(sass_report.wgmma_cases())[name]
    notes = sass_report.ptxas_notes(build())
    assert notes["serialized"] in ("", ALLOWED_SERIALIZED.get(name, "")), notes
    if name.startswith("w8a16"):
        assert notes["loop_spill"] == 0, notes
    # nothing writes the registers of an in-flight register-A wgmma: Triton 3.6 and 3.7.1 do, in every W8A16 loop
    # (triton-lang/triton#9433; 3.9 does not), the likely cause of the W8A16 TMA kernel's races on the H200
    # (BENCHMARKS.md § Triton race and wgmma drain)
    assert notes["operand_races"] == 0, notes


def _gluon_configs() -> list[str]:
    """op:BM/BK/STAGES[/r][/p] of every "gluon" config the table gives, and the dX form at its two tile widths."""
    from epirl.kernels.w8a16.configs import TMA_TABLE_PATH
    import json
    table = json.loads(TMA_TABLE_PATH.read_text())

    def label(op: str, g: dict) -> str:
        flags = "".join(f"/{f}" for f, key in (("r", "LORA_RING"), ("p", "PERSISTENT")) if g.get(key))
        return f"{op}:{g['BM']}/{g['BK']}/{g['num_stages']}{flags}"
    table_cfgs = {label(op, c["gluon"]) for op in ("fwd", "dx") for row in table[op].values() for c in row.values()
                  if "gluon" in c}
    # the dX form, the LoRA through the ring (LORA_RING: "/r", compiled at the fused qkv's padded rank 256) and the
    # persistent kernel ("/p", with the ring), whether the table uses them or not
    return sorted(table_cfgs | {"dx:256/64/4", "dx:128/64/4", "fwd:256/64/4/r", "dx:256/64/4/r", "dx:256/64/3/r",
                                "fwd:256/64/4/r/p", "dx:256/64/4/r/p"})


def _compile_gluon_config(cfg: str):
    """`sass_report.compile_gluon` of an `_gluon_configs` entry (a "/r" config at LoRA rank 256, others at 64)."""
    import sass_report
    op, tile = cfg.split(":")
    fields = tile.split("/")
    bm, bk, stages = map(int, fields[:3])
    ring = "r" in fields
    return sass_report.compile_gluon(dict(BM=bm, BK=bk, num_stages=stages), br=256 if ring else 64, dx=op == "dx",
                                     lora_ring=ring, persistent="p" in fields)


@pytest.mark.parametrize("cfg", _gluon_configs())
def test_gluon_forward_keeps_its_wgmmas_in_flight_without_touching_their_operands(cfg):
    """The warp-specialized Gluon kernel (forward and dX; codes widened in registers) in each
    config the table gives it and the variants: ptxas does not serialize its wgmmas, its k-step loop (two steps a
    trip) does not spill, and no instruction writes a register of an in-flight wgmma's A operand - the race that
    gave its first version wrong values on the H200 (one step a trip: the next step's codes were loaded into the
    registers the previous step's wgmma was still reading)."""
    import sass_report
    pytest.importorskip("triton.experimental.gluon")
    if not _have_tools():
        pytest.skip("this triton ships no ptxas/cuobjdump")
    k = _compile_gluon_config(cfg)
    assert sass_report.ptxas_notes(k.asm["ptx"])["serialized"] == "", cfg
    loops = sass_report.loop_report(k.asm["cubin"])
    assert loops[0]["HGMMA"] == 8 and loops[0]["spill"] == 0, loops[0]
    assert sass_report.wgmma_register_hazards(k.asm["cubin"]) == []


@pytest.mark.parametrize("cfg", ["fwd:256/64/4", "fwd:256/64/4/r", "fwd:128/64/4", "dx:256/64/4/r", "dx:256/64/3/r"])
def test_gluon_shared_memory_estimate_covers_the_compiled_kernel(cfg):
    """`ws_gluon.shared_bytes` (what `gluon_ok` checks against a CTA's limit before a launch) is at least the shared
    memory of the compiled kernel and within its 1 KiB margin of it - at rank 256, the LoRA tiles that overflow at 256
    tokens (360,700 B) and the ring that fits in their place."""
    import sass_report
    pytest.importorskip("triton.experimental.gluon")
    if not _have_tools():
        pytest.skip("this triton ships no ptxas/cuobjdump")
    from epirl.kernels.w8a16 import ws_gluon
    fields = cfg.split(":")[1].split("/")
    bm, bk, stages = map(int, fields[:3])
    ring = "r" in fields
    estimate = ws_gluon.shared_bytes(dict(BM=bm, BK=bk, num_stages=stages), 256, ring)
    k = sass_report.compile_gluon(dict(BM=bm, BK=bk, num_stages=stages), br=256, dx=cfg.startswith("dx"),
                                  lora_ring=ring)
    assert 0 <= estimate - k.metadata.shared <= 1024, (estimate, k.metadata.shared)
    assert (estimate <= ws_gluon.SMEM_LIMIT) == (ring or bm == 128), estimate


def test_gluon_kernel_never_specializes_its_chunk_count():
    """dX runs in one K chunk (`whole_k`): were N_CHUNKS = 1 specialized into a constant (Triton's default for an
    integer argument equal to 1), ptxas would serialize the kernel's wgmmas (C7515, 864 B of spills under Triton 3.6)
    and dX would run 5x slower on the H200; the chunk loop compiled for a runtime count is the one the SASS tests
    above check."""
    pytest.importorskip("triton.experimental.gluon")
    from epirl.kernels.w8a16 import ws_gluon
    flags = {p.name: p.do_not_specialize for p in ws_gluon._ws_gluon_kernel.params}
    assert flags["N_CHUNKS"], flags


def test_register_hazard_check_flags_a_write_to_an_in_flight_operand(monkeypatch):
    """`wgmma_register_hazards` on SASS text: a load into R88 while the wgmma reading R88-R91 is still pending (the
    DEPBAR keeps one group in flight) is flagged once; after `DEPBAR.LE gsb0, 0x0` it is not."""
    import sass_report

    def body(wait):
        return [(0x10, "LDS.U16 R88, [R10+0x100] ;"), (0x20, "WARPGROUP.ARRIVE ;"),
                (0x30, "HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR8], R24, gsb0 ;"),
                (0x40, f"WARPGROUP.DEPBAR.LE gsb0, 0x{wait} ;"), (0x50, "@P0 BRA 0x10 ;")]
    for wait, flagged in ((1, 1), (0, 0)):
        monkeypatch.setattr(sass_report, "_sass", lambda cubin, b=body(wait): ("", b, [(0x10, 0x50)]))
        assert len(sass_report.wgmma_register_hazards(b"")) == flagged, wait
