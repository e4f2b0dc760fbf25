"""The GPU tuning/measurement scripts' own logic on CPU (run by test_gpu_scripts_on_cpu.py with
TRITON_INTERPRET=1): scripts/tune_w8a16.py, bench_kernels.py, bench_fused_slices.py and bench_serving_tenants.py
end to end on a tiny shape, their kernels in Triton's interpreter and only the clock replaced (CUDA-graph
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
    from epirl.kernels.w8a16 import configs
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
    from epirl.kernels.w8a16 import configs
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


def case_bench_invariant_table(tmp):
    # every row of bench_invariant.py on a tiny model shape, the invariant kernels in the interpreter, and the table
    import bench_invariant as bench
    bench.bench_us = bench.step_us = wall_us
    bench.SHAPE = dict(heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=96, vocab=300)
    os.environ["EPIRL_KERNELS"] = "triton"
    try:
        rows = [*bench.attention_rows(2, 20, "cpu"), bench.decode_row(2, 32, "cpu", 3.35),
                *bench.head_rows([1, 3], "cpu", 3.35), *bench.row_op_rows(3, "cpu")]
    finally:
        os.environ.pop("EPIRL_KERNELS")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        bench.print_table(rows)
    lines = [line for line in text.getvalue().splitlines() if line.startswith("| ") and not line.startswith("| op |")]
    assert len(lines) == len(rows) == 9 and all(r["invariant_us"] > 0 for r in rows), text.getvalue()


def case_tenants_bench_rows_and_table(tmp):
    # bench_serving_tenants on a tiny two-projection layer (q/k/v slices and one plain), 40 tokens over 1 and 4
    # adapters: every variant runs (epirl's kernels in the interpreter, the vendor GEMM on CPU), matches the
    # reference, and the table prints with one row per (tenants, tokens)
    import bench_serving_tenants as tenants

    from epirl.kernels.fp8_quant import triton as quant_triton
    from epirl.kernels.fp8_quant.reference import quantize_per_token
    from epirl.kernels.w8a8_multi import triton as multi
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


def case_bench_fused_slices_rows_and_tables(tmp):
    # one call per fused layer against one per slice (and bf16 per slice in training) on a tiny q/k/v layer, the
    # kernels in the interpreter: every row runs, the switch is restored, the tables print
    import bench_fused_slices as fused
    fused.bench.graph_us = fused.bench.bench_us = wall_us
    fused.bench.kernel_us_per_step = lambda step, steps, params=(): (step(), ({"k": 1.0}, 1))[1]
    os.environ["EPIRL_KERNELS"] = "triton"
    try:
        decode = [fused.decode_row("tiny", 256, [64, 32, 32], M, dev="cpu") for M in (1, 3)]
        train = [fused.train_row("tiny", 256, [64, 32, 32], 40, dev="cpu")]
    finally:
        os.environ.pop("EPIRL_KERNELS")
    assert all(r["per_slice_us"] > 0 and r["one_call_us"] > 0 for r in decode), decode
    assert train[0]["one_call_kernel_us"] == train[0]["bf16_kernel_us"] == 1.0, train
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        fused.print_tables(decode, train)
    lines = [line for line in text.getvalue().splitlines() if line.startswith("| tiny |")]
    assert len(lines) == 3 and lines[2].split(" | ")[2] == "1 / 1 / 1", text.getvalue()


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
