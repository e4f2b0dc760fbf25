"""The GPU tuning/measurement scripts' own logic on CPU (run by test_gpu_scripts_on_cpu.py with
TRITON_INTERPRET=1): scripts/tune_w8a16.py, bench_one_chunk.py, ws_bits_report.py and bench_kernels.py's forward
table end to end on a tiny shape, their kernels in Triton's interpreter and only the clock replaced (CUDA-graph
timing -> wall time of one call; the numbers mean nothing, the tables, the bitwise checks and the table they write
do). A Python error here would otherwise cost a device call. Prints one JSON line per case.
"""

import contextlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

_randn = torch.randn


_Generator = torch.Generator


def _cpu_randn(*args, device=None, **kw):  # the scripts ask for "cuda"; here everything is CPU
    return _randn(*args, **kw)


def wall_us(fn, **_):
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def wall_us_many(fns, **_):  # graph_us_interleaved's CPU stand-in: the same list of times, one per fn
    return [wall_us(fn) for fn in fns]


def patch_cuda():
    torch.randn = _cpu_randn
    torch.Generator = lambda device=None: _Generator()
    torch.cuda.get_device_name = lambda *a: "cpu (interpreter)"
    torch.cuda.empty_cache = lambda: None
    torch.cuda.synchronize = lambda *a: None


def tiny_layer(K, N, r=8):
    from epirl.kernels import quantize_weight_fp8
    codes, scale = quantize_weight_fp8(_randn(N, K) * 0.02, backend="reference")
    return None, codes, scale, (_randn(r, K) / K ** 0.5).bfloat16(), (_randn(N, r) * 0.05).bfloat16()


def case_tune_writes_a_bitwise_checked_table(tmp):
    import tune_w8a16 as tune
    tune.graph_us, tune.graph_us_interleaved = wall_us, wall_us_many
    tune.make_layer = tiny_layer
    small = [tune.cfg(64, 16, 64, 4, 2, False), tune.cfg(64, 32, 64, 4, 2, False)]
    tune.FWD_BUCKETS = {256: ([20], small), tune.BIG: ([40], small)}
    tune.DX_BUCKETS = {tune.BIG: ([40], small)}
    tune.SHAPES, tune.EXTRA_SHAPES = [("tiny", 512, 96)], []
    out = tmp / "ws.json"
    # twins of these tiny tiles too; the many-token bucket timed at 32 tokens instead of its 40 (not 24: there the
    # interpreter's fp32 numpy dots of a zero-padded 32-row tile and of two 16-row tiles round differently, so the
    # tuner's bit check drops the BM 32 tiles; on the GPU every tile gives the same bits, test_gpu_kernels.py)
    sys.argv = ["tune_w8a16.py", "--tma", "--tma-all", "--gluon", "--big-tokens", "32", "--out", str(out),
                "--start", str(tmp / "start.json")]
    # the table in effect gives the shape's many-token entry a Gluon forward; --gluon cannot time it here (no GPU), so
    # it stays
    from epirl.kernels.gemm import configs
    start = json.loads(configs.TMA_TABLE_PATH.read_text())
    gluon = {"BM": 256, "BK": 64, "num_stages": 4}
    start["fwd"]["96x512"] = {str(tune.BIG): dict(small[0], gluon=gluon)}
    (tmp / "start.json").write_text(json.dumps(start))
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        tune.main()
    table = json.loads(out.read_text())
    row = table["fwd"]["96x512"]
    assert set(row) == {"256", str(tune.BIG)} and "512x96" in table["dx"], table
    assert row[str(tune.BIG)]["gluon"] == gluon and "gluon" not in row["256"], row
    assert not any("gluon" in c for c in small), small  # the candidates themselves untouched
    log = json.loads((tmp / "ws_log.json").read_text())["log"]
    # 3 (op, bucket) x 4 candidates (2 tiles x pointer / TMA)
    timed = [e["config"] for e in log if "us" in e and "config" in e]
    assert len(timed) == 3 * 4, log
    assert {e["tokens"] for e in log if "us" in e and e.get("bucket") == tune.BIG} == {32}, log
    assert sum(c.get("tma") is True for c in timed) == 3 * 2, log
    assert "BITS DIFFER" not in text.getvalue() and "| tiny | dx |" in text.getvalue(), text.getvalue()
    # where --gluon timed the Gluon kernel: its winner replaces the entry's, None drops it, no key keeps the old one
    old, base = {"BN": 1, "gluon": gluon}, {"BN": 2}
    assert tune.merged_entry(old, dict(base, gluon={"BM": 128})) == dict(base, gluon={"BM": 128})
    assert tune.merged_entry(old, dict(base, gluon=None)) == base
    assert tune.merged_entry(old, base) == dict(base, gluon=gluon) and tune.merged_entry({}, base) == base


def case_tune_gluon_only_keeps_the_tables_tiles(tmp):
    """--gluon-only times nothing but the table's own many-token entry (and the Gluon configs, on a GPU), per op, and
    writes that entry back with its Triton tile unchanged; the other buckets stay as the table had them."""
    import tune_w8a16 as tune
    tune.graph_us, tune.graph_us_interleaved = wall_us, wall_us_many
    tune.make_layer = tiny_layer
    small = [tune.cfg(64, 16, 64, 4, 2, False), tune.cfg(64, 32, 64, 4, 2, False)]
    tune.FWD_BUCKETS = {256: ([20], small), tune.BIG: ([40], small)}
    tune.DX_BUCKETS = {tune.BIG: ([40], small)}
    tune.SHAPES, tune.EXTRA_SHAPES = [("tiny", 512, 96)], []
    from epirl.kernels.gemm import configs
    start = json.loads(configs.TMA_TABLE_PATH.read_text())
    gluon = {"BM": 256, "BK": 64, "num_stages": 3, "LORA_RING": True}
    start["fwd"]["96x512"] = {"256": small[0], str(tune.BIG): dict(small[1], gluon=gluon)}
    start["dx"]["512x96"] = {str(tune.BIG): small[0]}
    (tmp / "start.json").write_text(json.dumps(start))
    out = tmp / "ws.json"
    sys.argv = ["tune_w8a16.py", "--gluon-only", "--big-tokens", "32", "--out", str(out), "--start",
                str(tmp / "start.json")]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        tune.main()
    table = json.loads(out.read_text())
    # no GPU here: the Gluon configs cannot run, so each entry keeps its "gluon" (or its absence)
    assert table["fwd"]["96x512"] == start["fwd"]["96x512"], table["fwd"]["96x512"]
    assert table["dx"]["512x96"] == start["dx"]["512x96"], table["dx"]["512x96"]
    log = json.loads((tmp / "ws_log.json").read_text())["log"]
    timed = [(e["op"], e["config"]) for e in log if "us" in e and "config" in e]
    assert timed == [("fwd", small[1]), ("dx", small[0])], timed
    assert "BITS DIFFER" not in text.getvalue(), text.getvalue()


def case_one_chunk_study_prints_both_tables(tmp):
    import bench_one_chunk as one
    import tune_w8a16 as tune
    one.graph_us = tune.graph_us = wall_us
    tune.graph_us_interleaved = wall_us_many
    one.make_layer = tiny_layer
    one.SHAPES, one.TRAIN_M = [("tiny", 512, 192)], 40
    one.ws_config = lambda op, N, K, M: dict(BN=64, BM=32, BK=64, num_warps=4, num_stages=2, split=False)
    sys.argv = ["bench_one_chunk.py", "--shapes", "tiny"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        one.main()
    rows = [line for line in text.getvalue().splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 3, text.getvalue()  # 1 and 16 tokens, then the training row


def case_bits_report_finds_every_config_equal(tmp):
    import ws_bits_report as rep
    import tune_w8a16 as tune
    # configs that differ in BM only: the interpreter's tl.dot sums a whole BK-deep block in one numpy matmul, not in
    # wgmma's 16-deep k-steps, so there another BK may round differently (a 64/32/32 dX differed in one element
    # by one ulp, depending on the random codes); BM and BN never change an element's sum on any backend
    small = [tune.cfg(64, 16, 64, 4, 2, False), tune.cfg(64, 32, 64, 4, 2, False)]
    rep.FWD_BUCKETS = {256: ([20], small), rep.BIG: ([40], small[:1])}
    rep.REF = dict(BN=64, BM=16, BK=64, num_warps=4, num_stages=2, split=False)
    rep.quantize_weight_fp8 = lambda w: tiny_layer(w.shape[1], w.shape[0])[1:3]
    sys.argv = ["ws_bits_report.py", "--shape", "192", "64", "--tokens", "21"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rep.main()
    rows = [line.split(" | ") for line in text.getvalue().splitlines() if line.startswith("| fwd |")
            or line.startswith("| dx |")]
    # 3 configs x (pointer, TMA) x 2 ops, all with the reference config's bits
    assert len(rows) == 2 * 6 and all(r[3] == "True" for r in rows), text.getvalue()


def case_bench_kernels_forward_table(tmp):
    # the forward rows (our kernels in the interpreter, both settings of the split-K reduce's PDL launch) and
    # the printed table; the vendor columns run on CPU where torch has them
    import bench_kernels as bench
    bench.graph_us = bench.bench_us = wall_us
    os.environ["EPIRL_KERNELS"] = "triton"
    try:
        w16, codes, scale, a, b = bench.make_layer(256, 96, dev="cpu")
        rows = [bench.forward_row("tiny", 256, 96, M, w16, codes, scale, a, b) for M in (1, 3)]
    finally:
        os.environ.pop("EPIRL_KERNELS")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        bench.print_tables(rows, [])
    lines = [line for line in text.getvalue().splitlines() if line.startswith("| tiny |")]
    assert len(lines) == 2 and all(" / " in line.split("|")[-2] for line in lines), text.getvalue()


def case_bench_kernels_trainer_row_and_table(tmp):
    # a trainer row (both sides' forward + backward, the FP8 side's kernels in the interpreter) and its table line:
    # wall, kernel sum (torch.profiler has no CUDA activity on CPU: patched to the step's own run, 0 µs) and memory
    import bench_kernels as bench
    bench.bench_us = wall_us
    bench.kernel_us_per_step = lambda step, steps, params=(): (step(), ({"k": 1.0}, 1))[1]
    for name in ("memory_allocated", "max_memory_allocated"):
        setattr(torch.cuda, name, lambda *a: 0)
    torch.cuda.reset_peak_memory_stats = lambda *a: None
    os.environ["EPIRL_KERNELS"] = "triton"
    try:
        w16, codes, scale, a, b = bench.make_layer(256, 96, dev="cpu")
        row = bench.trainer_row("tiny", 256, 96, 40, w16, codes, scale, a, b)
    finally:
        os.environ.pop("EPIRL_KERNELS")
    assert row["fp8_kernel_us"] == row["bf16_kernel_us"] == 1.0 and row["fp8_us"] > 0, row
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        bench.print_tables([], [row])
    line = next(line for line in text.getvalue().splitlines() if line.startswith("| tiny | 40 |"))
    assert line.split(" | ")[5:7] == ["1 / 1", "1.00"], line


def case_tenants_bench_rows_and_table(tmp):
    # bench_serving_tenants on a tiny two-projection layer (q/k/v slices and one plain), 40 tokens over 1 and 4
    # adapters: every variant runs (epirl's kernels in the interpreter, the vendor GEMM on CPU), matches the
    # reference, and the table prints with one row per (tenants, tokens)
    import bench_serving_tenants as tenants

    import importlib

    from epirl.kernels.fp8_quant.reference import quantize_per_token
    quant_triton = importlib.import_module("epirl.kernels.fp8_quant.triton")
    multi = importlib.import_module("epirl.kernels.w8a8_multi_lora.triton")  # the package name is also a function
    # the interpreter rounds some fp32 -> e4m3 casts wrongly (interpreter_cases.py): quantize with the reference
    quant_triton.quantize_per_token = multi.quantize_per_token = quantize_per_token
    tenants.DEV, tenants.RANK = "cpu", 8
    tenants.LAYER, tenants.SLICES = [("qkv", 64, 48), ("o", 48, 64)], {"qkv": [32, 8, 8], "o": [64]}
    multi.PREFILL_VARIANTS = {"bt16": dict(BN=32, BT=16, BK=64, num_warps=4, num_stages=2)}  # tiny tiles here
    tenants.SWEEP = {"shrink-bt16": (None, dict(BT=16, BK=64, num_warps=4, num_stages=2))}
    rows = tenants.run([40], [1, 4], timer=wall_us, sweep=True)
    assert [(r["T"], r["M"]) for r in rows] == [(1, 40), (4, 40)]
    for r in rows:
        errs = {k: v for k, v in r.items() if k.endswith("_err")}
        # max |Δ| / mean |y|: a couple of bf16 ulps of the largest outputs (vendor+epirl rounds twice); a wrong
        # adapter or tile is O(1)
        assert set(errs) == {"fused_err", "fused-k1_err", "vendor+epirl_err", "vendor+seg_err", "fused[k2-bt16]_err",
                             "fused[shrink-bt16]_err"}, r
        assert max(errs.values()) < 0.1, r
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        tenants.print_table(rows)
    lines = [line for line in text.getvalue().splitlines() if line.startswith("| 40 |")]
    assert len(lines) == 2 and "(×base)" in text.getvalue() and "fused[shrink-bt16]" in text.getvalue(), text.getvalue()


def case_trainer_profile_prints_wall_kernels_and_host(tmp):
    # profile_trainer_linear on a tiny shape: both sides' forward + backward run (the FP8 side's kernels in the
    # interpreter), and the summary table has one wall / kernel-sum / host-enqueue row per side (torch.profiler has no
    # CUDA activity to record on CPU: the steps run without it and the kernel columns read 0 here)
    import importlib

    import bench_kernels as bench
    import profile_trainer_linear as prof
    patched, torch.Generator = torch.Generator, _Generator  # torch.profiler imports dynamo, which needs the class
    try:
        importlib.import_module("torch._dynamo")
    finally:
        torch.Generator = patched
    torch.cuda._sleep = lambda cycles: None
    prof.bench_us = wall_us
    prof.kernel_us_per_step = lambda step, steps, params=(): (step(), ({}, 0))[1]
    prof.make_layer = lambda K, N: bench.make_layer(K, N, dev="cpu")
    os.environ["EPIRL_KERNELS"] = "triton"
    try:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            lines = prof.profile_shape("tiny", 256, 96, 40, steps=1)
            prof.host_profile("tiny", 256, 96, 40, reps=2, top=5)
    finally:
        os.environ.pop("EPIRL_KERNELS")
    assert [line.split(" | ")[2] for line in lines] == ["fp8", "bf16"], lines
    assert all(float(line.split(" | ")[5]) > 0 for line in lines), lines  # host enqueue time
    assert "### host profile: tiny M=40 fp8, 2 steps" in text.getvalue() and "tottime" in text.getvalue()


def case_chunk_probe_row_restores_the_chunking(tmp):
    # probe_k_chunking.py's row on a tiny layer at another program target (kernels in the interpreter): the chunking
    # it reports is that target's, the committed constant and the TMA verdicts are restored, the table line prints
    import probe_k_chunking as probe
    from epirl.kernels.gemm import configs, ws_tma
    probe.graph_us = wall_us
    probe.bench.kernel_us_per_step = lambda step, steps, params=(): (step(), ({"k": 1.0}, 1))[1]
    probe.SHAPES["tiny"] = (1100, 96)
    committed = configs.TARGET_PROGRAMS
    os.environ["EPIRL_KERNELS"] = "triton"
    try:
        row = probe.probe_row("tiny", 1, probe.bench.make_layer(1100, 96, dev="cpu"), 40, 2.0, xa_chunk_max=256)
    finally:
        os.environ.pop("EPIRL_KERNELS")
    assert (row["k_chunk"], row["n_chunks"]) == configs._k_chunking(96, 1100, 1, configs.MIN_CHUNKS) == (768, 2), row
    assert (row["xa_subs"], row["xa_chunk"]) == (3, 256), row  # LoRA sub-chunks of at most 256 (the probed depth)
    assert configs.TARGET_PROGRAMS == committed and configs.XA_CHUNK_MAX == 512 and not ws_tma._CHECKED
    assert row["train_vs_bf16"] == 0.5 and row["lora_1_us"] > 0 and row["tma_fallbacks"] == [], row
    line = probe.format_row(dict(row, bf16_kernel_us=2.0, bf16_fwd_us=1.0))
    assert line.startswith("| tiny | 1 | 2 × 768 | 3 × 256 |") and line.endswith("| 0.500 | 0 |"), line


def case_race_count_finds_no_wrong_call(tmp):
    # race_count.py on a tiny layer in the interpreter (the pointer kernels only: TMA and Gluon need a GPU): every
    # kernel row, no call with a wrong element, and a kernel made to race on its second call is counted
    import race_count as rc
    rc.SHAPES = {"tiny": (512, 96)}
    # (--gluon: its configs parse here; their rows need a GPU)
    sys.argv = ["race_count.py", "--calls", "2", "--tokens", "40", "--decode-tokens", "3", "--gluon", "128/64/4/16/s"]
    os.environ["EPIRL_KERNELS"] = "triton"
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            rc.main()
        calls = iter(range(3))

        def flaky(out):  # the reference, then a clean call, then one with a wrong element
            out.fill_(1.0)
            if next(calls) == 2:
                out[0, 0] = 3.0
        counted = rc.count(flaky, flaky, 2, (4, 8), "cpu")
    finally:
        os.environ.pop("EPIRL_KERNELS")
    rows = [line for line in text.getvalue().splitlines() if line.startswith("| tiny |")]
    assert [r.split(" | ")[1] for r in rows] == ["fwd pointer", "dx pointer", "decode 3 tok"], text.getvalue()
    assert all(" | 0 / 2 | 0 | " in r for r in rows), rows
    assert counted == (1, 1, 2.0), counted  # one call, one element, |3 - 1| / max |y| = 2


def case_read_floor_kernel_reads_every_word(tmp):
    # bench_read_floor.py's read kernel through read_once (the launch the benchmark times): 7 programs of whole
    # BLOCKs over 10 000 words, the last one short; out[p] is the xor of exactly program p's slice
    import numpy as np

    import bench_read_floor as rf
    n, programs, block = 10_000, 7, 256
    buf = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32)
    out = torch.full((programs + 1,), 12345, dtype=torch.int32)
    rf.read_once(buf, out, programs, block, num_warps=4)
    wpp = rf.words_per_prog(n, programs, block)
    assert wpp % block == 0 and (programs - 1) * wpp < n < programs * wpp, wpp  # ragged last program
    want = [int(np.bitwise_xor.reduce(buf[p * wpp:(p + 1) * wpp].numpy())) for p in range(programs)]
    assert out[:programs].tolist() == want and out[programs].item() == 12345, (out.tolist(), want)


def case_read_floor_bench_prints_its_tables(tmp):
    # the benchmark end to end on a tiny shape (read kernel and w8a16_lora in the interpreter, wall-clock timer):
    # the sweep, the layer columns, the empty-kernel rows, the tables and the JSON
    import bench_kernels as bench
    import bench_read_floor as rf
    rf.graph_us = wall_us
    rf.make_layer = lambda K, N: bench.make_layer(K, N, dev="cpu")
    rf.SHAPES = [("tiny", 256, 96)]  # rebound, not mutated: bench_kernels.SHAPES is the same list
    rf.QUICK = dict(programs=[3, 5], blocks=[64], warps=[4])
    sys.argv = ["bench_read_floor.py", "--quick", "--shapes", "tiny", "--json", str(tmp / "rf.json")]
    os.environ["EPIRL_KERNELS"] = "triton"
    try:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            rf.main()
    finally:
        os.environ.pop("EPIRL_KERNELS")
    out = json.loads((tmp / "rf.json").read_text())
    assert len(out["sweep"]) == 2 and [r["programs"] for r in out["empty"]] == rf.EMPTY_PROGRAMS, out
    lines = [line for line in text.getvalue().splitlines() if line.startswith("| tiny |")]
    assert len(lines) == 1 and len(lines[0].split(" | ")) == 12, text.getvalue()


def main(names):
    import tempfile
    patch_cuda()
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                globals()[f"case_{name}"](Path(tmp))
                print(json.dumps(dict(case=name, ok=True)), flush=True)
            except Exception:
                print(json.dumps(dict(case=name, ok=False, error=traceback.format_exc()[-3000:])), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
