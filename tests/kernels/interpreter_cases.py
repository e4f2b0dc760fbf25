"""Triton kernels on tiny shapes in Triton's CPU interpreter (run by test_triton_interpreter.py in a
subprocess with TRITON_INTERPRET=1 set before triton is imported). Prints one JSON line per case.

Interpreter limits seen with triton 3.9 (so the interpreter kernels widen dot operands to fp32, and
fp8 down-conversion is checked on the GPU only): bf16 `tl.dot` returns garbage, fp32 -> e4m3
conversion rounds wrongly when rounding carries into the next binade (e.g. 31.85 -> 16 instead of 32),
and fp32 -> bf16 truncates instead of rounding to nearest (one ulp on about half the values) - hence
4 ulps here where the GPU tests use 2.
"""

import contextlib
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from epirl.kernels import quantize_activation_fp8, quantize_weight_fp8, w8a8_lora, w8a16_lora  # noqa: E402
from epirl.kernels.lora_linear.reference import lora_linear_backward as ref_backward  # noqa: E402
from epirl.kernels.lora_linear.triton import lora_linear_backward as tri_backward  # noqa: E402
from epirl.kernels.w8a16.configs import k_chunking  # noqa: E402
from epirl.kernels.w8a8.scaled import lora_down_split, scaled_gemm_lora  # noqa: E402
from epirl.kernels.w8a16.weight_stationary import lora_down, weight_stationary_gemm  # noqa: E402


@contextlib.contextmanager
def one_chunk_layers(**more):
    """k_chunking gives one chunk wherever K allows (TARGET_PROGRAMS and MIN_CHUNKS patched to 1: the one-chunk
    code paths, which the committed constants keep for K <= 256 only), plus any other configs constants given."""
    from epirl.kernels.w8a16 import configs
    patch = dict(TARGET_PROGRAMS=1, MIN_CHUNKS=1, **more)
    saved = {name: getattr(configs, name) for name in patch}
    for name, value in patch.items():
        setattr(configs, name, value)
    try:
        yield configs
    finally:
        for name, value in saved.items():
            setattr(configs, name, value)


def problem(M, K, N, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g) * 0.05, backend="reference")
    a = (torch.randn(r, K, generator=g) * 0.1).bfloat16()
    b = (torch.randn(N, r, generator=g) * 0.1).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    return x, codes, scale, a, b, bias


def close_bf16(got, want, ulps=4.0):
    """Within a few bf16 ulps of the reference, plus a floor of a few ulps of the typical magnitude:
    fp32 (vs exact) accumulation can flip the bf16 rounding of the LoRA intermediate by one ulp, which
    moves small outputs by a fraction of an ulp of the large ones."""
    tol = (want.float().abs() + want.float().abs().mean()) * (ulps * 2 ** -8)
    return bool(torch.all((got.float() - want.float()).abs() <= tol)) and not torch.isnan(got).any()


def case_w8a16_masks_epilogue():
    for M, K, N, r in [(5, 40, 70, 8), (67, 200, 130, 16)]:
        x, codes, scale, a, b, bias = problem(M, K, N, r)
        got = w8a16_lora(x, codes, scale, a, b, 0.5, bias, backend="triton")
        want = w8a16_lora(x, codes, scale, a, b, 0.5, bias, backend="reference")
        assert got.shape == want.shape and close_bf16(got, want), (M, K, N, r)
        plain = w8a16_lora(x, codes, scale, backend="triton")
        assert close_bf16(plain, w8a16_lora(x, codes, scale, backend="reference"))


def case_out_view_equals_fresh_output():
    # the matched engine writes each slice of a fused layer into its columns of one output (`out=`, row stride of
    # the whole layer): the bits of a call with its own output, split-K (5 tokens) and single pass (70)
    for M in (5, 70):
        x, codes, scale, a, b, bias = problem(M, 200, 130, 8, seed=14)
        y = torch.full((M, 200), float("nan"), dtype=torch.bfloat16)
        got = w8a16_lora(x, codes, scale, a, b, 0.5, bias, backend="triton", out=y[:, 40:170])
        assert got.data_ptr() == y[:, 40:170].data_ptr()
        assert torch.equal(y[:, 40:170], w8a16_lora(x, codes, scale, a, b, 0.5, bias, backend="triton"))
        assert torch.isnan(y[:, :40].float()).all() and torch.isnan(y[:, 170:].float()).all()


def case_w8a16_batch_invariant_rows():
    x, codes, scale, a, b, bias = problem(67, 72, 33, 8, seed=1)
    full = w8a16_lora(x, codes, scale, a, b, 1.0, bias, backend="triton")
    for rows in (slice(0, 1), slice(3, 6), slice(60, 67)):
        assert torch.equal(w8a16_lora(x[rows], codes, scale, a, b, 1.0, bias, backend="triton"), full[rows])


def case_split_k_equals_single_pass():
    x, codes, scale, a, b, bias = problem(21, 330, 150, 8, seed=5)
    xa = lora_down(x, a, chunk_n=150)
    args = dict(w_scale=scale, xa=xa, lora_b=b, lora_scale=0.7, bias=bias)
    split = weight_stationary_gemm(x, codes, torch.bfloat16, **args)
    single = weight_stationary_gemm(x, codes, torch.bfloat16, allow_split=False, **args)
    assert torch.equal(split, single)
    assert close_bf16(single, w8a16_lora(x, codes, scale, a, b, 0.7, bias, backend="reference"))


def case_one_launch_split_k_equals_single_pass():
    # ws_splitk: each tile's last-arriving program adds the chunk partials in chunk order and runs the epilogue; the
    # same bits as the single pass, for the base GEMM (ragged: 3 chunks, the last short; 21 tokens over two token
    # tiles; with and without LoRA / bias) and for lora_down (against its one pass per token tile); counters left at
    # zero
    from epirl.kernels.w8a16 import weight_stationary as ws, ws_splitk
    from epirl.kernels.w8a16.configs import xa_chunking
    x, codes, scale, a, b, bias = problem(21, 600, 90, 8, seed=12)
    assert k_chunking(90, 600)[1] == 3
    cfg = dict(BN=64, BM=16, BK=128, num_warps=4, num_stages=2, split=True)
    calls = [dict(w_scale=scale), dict(w_scale=scale, xa=lora_down(x, a, chunk_n=90), lora_b=b, lora_scale=0.7,
                                       bias=bias)]
    got = [weight_stationary_gemm(x, codes, torch.bfloat16, config=cfg, **kw) for kw in calls]
    got.append(lora_down(x, a, chunk_n=90))
    x_train = torch.randn(130, 600, dtype=torch.bfloat16)  # above the decode buckets: lora_down is one launch there too
    got.append(lora_down(x_train, a, chunk_n=90))
    want = [weight_stationary_gemm(x, codes, torch.bfloat16, config=cfg, allow_split=False, **kw) for kw in calls]
    xa_chunk, _, n_xa = xa_chunking(90, 600)
    for xi in (x, x_train):
        want.append(ws._down_single_pass(xi, a, torch.empty(xi.shape[0], 8, dtype=xi.dtype), xa_chunk, n_xa, 64))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), i
    assert close_bf16(got[1], w8a16_lora(x, codes, scale, a, b, 0.7, bias, backend="reference"))
    assert ws_splitk._COUNTERS and all(int(c.abs().sum()) == 0 for c in ws_splitk._COUNTERS.values())
    # one chunk (one_chunk_layers) and one down sub-chunk (K = 300): no partial, no ticket
    with one_chunk_layers() as configs:
        x, codes, scale, a, b, bias = problem(21, 300, 90, 8, seed=13)
        assert configs.k_chunking(90, 300)[1] == 1 and configs.xa_chunking(90, 300)[2] == 1
        xa = lora_down(x, a, chunk_n=90)  # the one-part down launch
        assert torch.equal(xa, weight_stationary_gemm(x, a, torch.bfloat16, config=cfg, allow_split=False))
        kw = dict(w_scale=scale, xa=xa, lora_b=b, lora_scale=0.7, bias=bias)
        want = weight_stationary_gemm(x, codes, torch.bfloat16, config=cfg, allow_split=False, **kw)
        # the base launch as the GPU's PDL decode path makes it for a one-chunk layer (without the PDL wait here)
        got = ws_splitk.launch_ticket(x, codes, torch.empty_like(want), 90, 512, 1, cfg, br=16, dot_f32=True, **kw)
        assert torch.equal(got, want)


def case_nan_poisoned_out_fully_written():
    for M in (3, 70):
        x, codes, scale, a, b, bias = problem(M, 100, 90, 8, seed=M)
        want = w8a16_lora(x, codes, scale, a, b, 2.0, bias, backend="reference")
        xa = lora_down(x, a)
        for gemm in (scaled_gemm_lora, weight_stationary_gemm):
            out = torch.full((M, 90), float("nan"), dtype=torch.bfloat16)
            gemm(x, codes, torch.bfloat16, w_scale=scale, xa=xa, lora_b=b, lora_scale=2.0, bias=bias, out=out)
            assert close_bf16(out, want), gemm.__name__


def case_lora_down_split_chunks():
    x, _, _, a, _, _ = problem(9, 300, 8, 24, seed=2)  # 300 = 16 splits of 64-aligned chunks, ragged end
    want = (x.double() @ a.double().t()).bfloat16()
    assert close_bf16(lora_down_split(x, a), want)
    assert close_bf16(lora_down(x, a, chunk_n=40), want)  # weight-stationary, 2 chunks of 256


def case_fused_down_split_equals_single_pass():
    # K = 600: 3 chunks; the split path fuses x·Aᵀ into the partial kernel, the single pass runs lora_down
    x, codes, scale, a, b, bias = problem(13, 600, 90, 8, seed=8)
    assert k_chunking(90, 600)[1] == 3
    args = dict(w_scale=scale, lora_a=a, lora_b=b, lora_scale=0.7, bias=bias)
    small = dict(BN=64, BM=16, BK=128, num_warps=4, num_stages=2, split=True)
    large = dict(BN=128, BM=32, BK=64, num_warps=4, num_stages=2, split=True)
    split = weight_stationary_gemm(x, codes, torch.bfloat16, config=small, **args)
    single = weight_stationary_gemm(x, codes, torch.bfloat16, config=large, allow_split=False, **args)
    assert torch.equal(split, single)
    assert torch.equal(split, w8a16_lora(x, codes, scale, a, b, 0.7, bias, backend="triton"))
    assert close_bf16(split, w8a16_lora(x, codes, scale, a, b, 0.7, bias, backend="reference"))


def case_rank_tiled_down_projection():
    # r = 192 (> 128: one call per qkv layer, rank 3 x 64) is taken in 64-row tiles of A by every down-projection path:
    # lora_down in one launch (ws_splitk) and the down partials fused into the split-K launch; each rank tile equals
    # that slice of A computed alone, and the split path the single pass, bitwise
    from epirl.kernels.w8a16.weight_stationary import _down_tile_rows
    x, codes, scale, a, b, bias = problem(13, 600, 90, 192, seed=14)
    assert _down_tile_rows(192) == 64 and _down_tile_rows(128) == 128 and k_chunking(90, 600)[1] == 3
    xa = lora_down(x, a, chunk_n=90)
    for lo in (0, 64, 128):
        assert torch.equal(xa[:, lo:lo + 64], lora_down(x, a[lo:lo + 64].contiguous(), chunk_n=90)), lo
    assert close_bf16(xa, (x.float() @ a.float().t()).bfloat16())
    args = dict(w_scale=scale, lora_b=b, lora_scale=0.7, bias=bias)
    small = dict(BN=64, BM=16, BK=128, num_warps=4, num_stages=2, split=True)
    split = weight_stationary_gemm(x, codes, torch.bfloat16, config=small, lora_a=a, **args)  # down fused, 3 tiles
    single = weight_stationary_gemm(x, codes, torch.bfloat16, config=dict(small, split=False), xa=xa, **args)
    assert torch.equal(split, single)
    assert close_bf16(split, w8a16_lora(x, codes, scale, a, b, 0.7, bias, backend="reference"))


def cancelling_down_problem(M, r, seed, K=600):
    """x `[M, K]`, A `[r, K]` whose products cancel: columns K/2.. repeat x's first K/2 and A's negated, so
    x·Aᵀ is 0 exactly and an fp32 sum ends on its rounding residue, which depends on the order of the adds (a bf16
    output shows it; on random data the bf16 rounding hides a different order)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K // 2, generator=g) * 30).bfloat16()
    a = (torch.randn(r, K // 2, generator=g) * 30).bfloat16()
    return torch.cat([x, x], 1), torch.cat([a, -a], 1)


def case_single_pass_lora_down_equals_split():
    # many tokens: lora_down runs one pass per (token tile, rank tile) over every sub-chunk (no fp32 partials); the bits
    # equal the split-K path's (one launch), at 64- and 32-token tiles, rank 8 and 192 (three 64-row tiles),
    # K = 600 (3 sub-chunks, the last ragged, past K) and K = 2600 (11: the split paths sum them in three rounds of
    # loads, `_sum_parts`); on random inputs and on cancelling ones, where a different order of the sub-chunk adds
    # shows in the bits
    from epirl.kernels import plan as kplan
    from epirl.kernels.w8a16 import weight_stationary as ws
    saved = kplan.DOWN_SINGLE_MIN_PROGRAMS
    try:
        for M, r, min_programs, tile, K in ((70, 8, 1, 64, 600), (70, 8, 3, 32, 600), (45, 192, 1, 64, 600),
                                            (5, 8, 1, 64, 2600)):
            x, codes, scale, a, b, bias = problem(M, K, 90, r, seed=15)
            for xi, ai in ((x, a), cancelling_down_problem(M, r, seed=16, K=K)):
                kplan.DOWN_SINGLE_MIN_PROGRAMS = 10 ** 9
                split = lora_down(xi, ai, chunk_n=90)
                kplan.DOWN_SINGLE_MIN_PROGRAMS = min_programs
                launched = []
                real = ws._down_single_pass
                ws._down_single_pass = lambda *args: launched.append(args) or real(*args)
                try:
                    single = lora_down(xi, ai, chunk_n=90)
                finally:
                    ws._down_single_pass = real
                assert len(launched) == 1, (M, r)  # the single pass ran
                assert torch.equal(single, split), (M, r)
            bm = 64 if -(-M // 64) * -(-r // ws._down_tile_rows(r)) >= min_programs else kplan.DOWN_SINGLE_BM
            assert bm == tile, (M, r, bm)  # the tile rule as documented
            assert close_bf16(lora_down(x, a, chunk_n=90), (x.float() @ a.float().t()).bfloat16())
    finally:
        kplan.DOWN_SINGLE_MIN_PROGRAMS = saved


def case_grouped_down_programs_equal_one_part_each():
    # decode `lora_down` with several sub-chunks per program (ws_splitk GROUPED: each partial stored on its own, the
    # last program adds all in order) gives the one-part-per-program bits: K = 2600 (11 sub-chunks, the last ragged),
    # 1-11 parts a program (11 = one program), on random and on cancelling inputs, rank 8 and 192 (three row tiles)
    from epirl.kernels.w8a16 import weight_stationary as ws
    from epirl.kernels.w8a16.configs import k_chunking, xa_chunking, ws_config
    from epirl.kernels.w8a16.ws_splitk import launch_ticket
    for M, r in ((5, 8), (3, 192)):
        x, _, _, a, _, _ = problem(M, 2600, 90, r, seed=21)
        for xi, ai in ((x, a), cancelling_down_problem(M, r, seed=22, K=2600)):
            k_chunk, n_chunks = k_chunking(90, 2600)
            xa_chunk, _, n_xa = xa_chunking(90, 2600)
            assert n_xa == 11, n_xa
            cfg = dict(ws_config("fwd", 90, 2600, M), BN=ws._down_tile_rows(r))
            outs = [launch_ticket(xi, ai, torch.empty(M, r, dtype=xi.dtype), r, xa_chunk, n_xa, cfg, down=True,
                                  dot_f32=True, even_k=False, parts_per_program=g) for g in (1, 2, 3, 4, 11)]
            for g, out in zip((2, 3, 4, 11), outs[1:]):
                assert torch.equal(out, outs[0]), (M, r, g)
            assert torch.equal(outs[0], lora_down(xi, ai, chunk_n=90)), (M, r)  # the split path lora_down takes
    # the rule: behind one-CTA-an-SM base tiles (8 warps) a down program reads about what a base program reads (bf16
    # A rows x sub-chunk vs fp8 codes); behind 4-warp tiles one sub-chunk a program
    from epirl.kernels.plan import down_parts_per_program as rule
    big = dict(BN=128, split=True, num_warps=8)
    assert rule(big, 12288, 3072, 4, 64, 512, 2) == 6  # q3_down: 24 sub-chunks -> 4 programs
    assert rule(dict(big, BN=64), 4096, 1024, 4, 64, 512, 2) == 1  # as long already
    assert rule(dict(big, split=False), 4096, 2048, 2, 64, 512, 2) == 8  # a single pass reads all of K
    assert rule(dict(big, num_warps=4), 12288, 3072, 4, 64, 512, 2) == 1  # q3_qkv's 4-warp tiles: as before
    assert rule(big, 12288, 3072, 4, 64, 512, 2, groups_down=False) == 1  # a device that loses by it (H100)


def case_one_chunk_layer_fuses_down_in_sub_chunks():
    # one base chunk (one_chunk_layers) with LoRA: split-K computes the down-projection in its first programs, over
    # 5 sub-chunks of 256 (K = 1100: one 1280-deep chunk, the last sub-chunk ragged, and XA_CHUNK_MAX patched to
    # 256), and equals the single pass with lora_down, bitwise
    with one_chunk_layers(XA_CHUNK_MAX=256) as configs:
        x, codes, scale, a, b, bias = problem(13, 1100, 40, 8, seed=11)
        assert configs.k_chunking(40, 1100) == (1280, 1) and configs.xa_chunking(40, 1100) == (256, 5, 5)
        args = dict(w_scale=scale, lora_b=b, lora_scale=0.7, bias=bias)
        small = dict(BN=64, BM=16, BK=128, num_warps=4, num_stages=2, split=True)
        large = dict(BN=128, BM=32, BK=64, num_warps=4, num_stages=2, split=False)
        split = weight_stationary_gemm(x, codes, torch.bfloat16, config=small, lora_a=a, **args)
        xa = lora_down(x, a, chunk_n=40)
        single = weight_stationary_gemm(x, codes, torch.bfloat16, config=large, xa=xa, **args)
        assert torch.equal(split, single)
        assert close_bf16(split, w8a16_lora(x, codes, scale, a, b, 0.7, bias, backend="reference"))
        parts = [x[:, k:k + 256].float() @ a[:, k:k + 256].float().t() for k in range(0, 1100, 256)]
        assert close_bf16(xa, sum(parts).bfloat16())  # the sub-chunks cover K exactly once


def case_tma_single_pass_equals_pointer_kernel():
    # descriptor loads (zero-filled edges: M, N and K ragged against the tiles) give the pointer kernel's bits,
    # forward (codes [N, K]) and dX (codes read [K, N], transposed blocks), with and without LoRA
    from epirl.kernels.w8a16.ws_tma import tma_ok
    x, codes, scale, a, b, bias = problem(21, 592, 88, 8, seed=9)  # K = 592: 3 chunks of 256, last ragged
    xa = lora_down(x, a, chunk_n=88)
    cfg = dict(BN=64, BM=16, BK=64, num_warps=4, num_stages=2, split=False)
    for args in (dict(w_scale=scale), dict(w_scale=scale, xa=xa, lora_b=b, lora_scale=0.7, bias=bias)):
        ptr = weight_stationary_gemm(x, codes, torch.bfloat16, config=cfg, allow_split=False, **args)
        assert tma_ok(x, codes)
        tma = weight_stationary_gemm(x, codes, torch.bfloat16, config=dict(cfg, tma=True), allow_split=False,
                                     **args)
        assert torch.equal(tma, ptr)
    g = torch.randn(21, 88).bfloat16()
    cfg_dx = dict(BN=64, BM=16, BK=32, num_warps=4, num_stages=2, split=False)
    ptr = weight_stationary_gemm(g, codes.t(), torch.bfloat16, w_scale=scale, config=cfg_dx, op="dx")
    assert tma_ok(g, codes.t())
    tma = weight_stationary_gemm(g, codes.t(), torch.bfloat16, w_scale=scale, config=dict(cfg_dx, tma=True), op="dx")
    assert torch.equal(tma, ptr)
    assert not tma_ok(x[:, 1:], codes[:, 1:])  # unaligned rows: the caller falls back to the pointer kernel
    # a one-chunk forward (one K loop over the whole ragged K), same bits
    with one_chunk_layers() as configs:
        assert configs.k_chunking(88, 592) == (768, 1)
        ptr = weight_stationary_gemm(x, codes, torch.bfloat16, config=cfg, allow_split=False, **args)
        tma = weight_stationary_gemm(x, codes, torch.bfloat16, config=dict(cfg, tma=True), allow_split=False, **args)
        assert torch.equal(tma, ptr)
    # a table selecting TMA: the call is checked against the pointer kernel on its first call, then kept
    from epirl.kernels.w8a16 import ws_tma
    table = json.loads(json.dumps(configs.load_table()))
    big = dict(BN=128, BM=256, BK=64, num_warps=8, num_stages=3, split=False)
    table["fwd"]["default"]["1000000000"] = dict(big, tma=True)
    path = f"/tmp/ws_tma_case_{os.getpid()}.json"
    with open(path, "w") as f:
        json.dump(table, f)
    from epirl.kernels.plan import KernelSettings
    table_run = KernelSettings(table=path)  # the settings' table (a recipe's `kernels.table`)
    try:
        x, codes, scale, a, b, bias = problem(300, 512, 136, 8, seed=4)  # 300 tokens: the many-token bucket
        args = dict(w_scale=scale, xa=lora_down(x, a, chunk_n=136), lora_b=b, lora_scale=0.7, bias=bias)
        ws_tma._CHECKED.clear()  # whatever earlier cases verified
        ws_tma._CALLS.clear()
        got = weight_stationary_gemm(x, codes, torch.bfloat16, settings=table_run, **args)
        want = weight_stationary_gemm(x, codes, torch.bfloat16, config=big, allow_split=False, **args)
        assert torch.equal(got, want)
        key = ("fwd", 136, 512, (128, 256, 64, 8, 3), True, True, 9)  # LoRA, bias
        assert ws_tma._CHECKED == {key: True}, ws_tma._CHECKED
    finally:
        os.remove(path)


def case_unmasked_loops_equal_masked():
    # The K loops drop their load masks where the shape allows (`_ws_chunk`: EVEN_K when the chunks tile K, EVEN_N
    # when N is a multiple of BN, EVEN_M when M is a multiple of BM; a partial token tile is masked). Each even shape
    # must give the bits of the masked loops, run here on the same problem padded into ragged shapes: K = 500 inside
    # the same two 256-deep chunks (zero columns 500..511), and N = 128 -> 130 (two more weight rows). Forward split-K
    # (5 tokens) and single pass (70), with LoRA, and dX, whose weight rows are the contiguous dimension.
    from epirl.kernels.w8a16.weight_stationary import even_k
    x, codes, scale, a, b, bias = problem(70, 512, 130, 8, seed=12)
    x[:, 500:] = 0
    a[:, 500:] = 0
    codes[:, 500:] = 0
    assert k_chunking(128, 512) == k_chunking(128, 500) == (256, 2)
    assert even_k(512, 256, 2) and not even_k(500, 256, 2)
    split = dict(BN=64, BM=16, BK=128, num_warps=4, num_stages=2, split=True)
    single = dict(BN=64, BM=32, BK=64, num_warps=4, num_stages=2, split=False)
    for M, cfg in ((5, split), (70, single)):
        for k in (512, 500):
            args = dict(w_scale=scale, lora_a=a[:, :k].contiguous(), lora_b=b[:128], lora_scale=0.7, bias=bias[:128])
            even = weight_stationary_gemm(x[:M, :k], codes[:128, :k], torch.bfloat16, config=cfg, **args)
            args.update(lora_b=b, bias=bias)
            ragged_n = weight_stationary_gemm(x[:M, :k], codes[:, :k], torch.bfloat16, config=cfg, **args)
            assert torch.equal(even, ragged_n[:, :128]), (M, k)
            if k == 512:
                even_512 = even
        assert torch.equal(even_512, even), M  # K = 512 (no column masks) == K = 500 (masked)
    # EVEN_M: full token tiles (64 tokens: 2 x 32, 4 x 16) load without row masks; the same rows in a call with a
    # partial tile (70 / 5 tokens above) have the same bits
    args = dict(w_scale=scale, lora_a=a, lora_b=b, lora_scale=0.7, bias=bias)
    full = weight_stationary_gemm(x[:64], codes, torch.bfloat16, config=single, **args)
    assert torch.equal(full, weight_stationary_gemm(x, codes, torch.bfloat16, config=single, **args)[:64])
    full = weight_stationary_gemm(x[:16], codes, torch.bfloat16, config=split, **args)
    assert torch.equal(full[:5], weight_stationary_gemm(x[:5], codes, torch.bfloat16, config=split, **args))
    w_rows = codes[:, :256]
    full = scaled_gemm_lora(x[:64, :256].contiguous(), w_rows, torch.bfloat16, w_scale=scale)  # 64-row tiles
    assert torch.equal(full, scaled_gemm_lora(x[:, :256].contiguous(), w_rows, torch.bfloat16, w_scale=scale)[:64])
    # dX: codes [256, 512] read transposed; reduction over the 256 rows (one chunk: EVEN_K), 512 output columns
    # (EVEN_N); ragged: 500 output columns (masked weight rows), and a 250-deep reduction zero-padded to 256
    _, codes_t, scale_t, *_ = problem(1, 512, 256, 8, seed=13)
    codes_t[250:] = 0
    g = torch.randn(70, 256).bfloat16()
    g[:, 250:] = 0
    dx_cfg = dict(BN=64, BM=32, BK=64, num_warps=4, num_stages=2, split=False)

    def dx(g_, codes_):
        return weight_stationary_gemm(g_, codes_.t(), torch.bfloat16, w_scale=scale_t, config=dx_cfg, op="dx")

    dx_even = dx(g, codes_t)
    assert torch.equal(dx_even[:, :500], dx(g, codes_t[:, :500]))
    assert torch.equal(dx_even, dx(g[:, :250].contiguous(), codes_t[:250]))
    # the row-major scaled GEMM (W8A8's; and a w whose rows are the contiguous dimension, as a transposed view gives,
    # like the column-major copy here): K = 256 (two 128-deep trips) vs 250 zero-padded, N = 128 vs 130
    for w in (codes[:, :256], codes[:, :256].t().contiguous().t()):
        x2 = x[:, :256].contiguous()
        x2[:, 250:] = 0
        even = scaled_gemm_lora(x2, w[:128], torch.bfloat16, w_scale=scale)
        assert torch.equal(even, scaled_gemm_lora(x2[:, :250].contiguous(), w[:128, :250], torch.bfloat16,
                                                  w_scale=scale))
        assert torch.equal(even, scaled_gemm_lora(x2, w, torch.bfloat16, w_scale=scale)[:, :128])


def case_w8a8_gemm_on_reference_codes():
    # fp8 activation codes come from the reference (interpreter e4m3 rounding is broken), the GEMM,
    # per-row scale and epilogue are the Triton kernel's
    x, codes, scale, a, b, bias = problem(19, 96, 50, 8, seed=3)
    q, s = quantize_activation_fp8(x, backend="reference")
    got = scaled_gemm_lora(q, codes, torch.bfloat16, w_scale=scale, x_scale=s.reshape(-1))
    want = w8a8_lora(x, codes, scale, backend="reference")
    assert close_bf16(got, want)


def case_quant_scales():
    x = torch.randn(7, 300).bfloat16() * 3
    x[2] = 0
    x[3, 5] = float("nan")
    _, s = quantize_activation_fp8(x, backend="triton")
    _, s_ref = quantize_activation_fp8(x, backend="reference")
    assert torch.equal(s, s_ref)
    w = torch.randn(40, 33)
    _, sw = quantize_weight_fp8(w, backend="triton")
    assert torch.equal(sw, quantize_weight_fp8(w, backend="reference")[1])


def case_backward():
    for M, K, N, r in [(6, 48, 40, 8), (70, 130, 72, 16)]:
        x, codes, scale, a, b, _ = problem(M, K, N, r, seed=4)
        gy = torch.randn(M, N).bfloat16()
        got = tri_backward(gy, x, codes, scale, a, b, 2.0, True)
        want = ref_backward(gy, x, codes, scale, a, b, 2.0, True)
        assert close_bf16(got[0], want[0], ulps=6), "dX"
        for g, w in zip(got[1:], want[1:]):  # dA, dB go through bf16 cuBLAS-style mm
            assert g.dtype == torch.bfloat16  # the parameters' dtype, rounded once
            assert ((g.float() - w).norm() / w.norm()).item() < 1e-2
        # the forward's xa (return_xa), as Fp8LoRAFunction saves it: the same gradients as recomputing it;
        # fp32 parameters get fp32 gradients
        _, xa = w8a16_lora(x, codes, scale, a, b, 2.0, backend="triton", return_xa=True)
        with_xa = tri_backward(gy, x, codes, scale, a, b, 2.0, True, xa=xa)
        assert all(torch.equal(u, v) for u, v in zip(with_xa, got))
        fp32 = tri_backward(gy, x, codes, scale, a.float(), b.float(), 2.0, True, xa=xa)
        assert fp32[1].dtype == fp32[2].dtype == torch.float32 and torch.equal(fp32[1].bfloat16(), got[1])
    # no LoRA, 300 tokens: the single-pass bucket (dX: one K chunk)
    x, codes, scale, *_ = problem(300, 70, 40, 8, seed=6)
    gy = torch.randn(300, 40).bfloat16()
    dx, da, db = tri_backward(gy, x, codes, scale, None, None, 0.0, True)
    assert da is None and db is None
    assert close_bf16(dx, ref_backward(gy, x, codes, scale, None, None, 0.0, True)[0], ulps=6)


def case_fused_slices_group_equals_one_call():
    # the trainer's q / k / v group (kernels/lora_linear/sliced.py) through the Triton kernels: bitwise the one
    # block-diagonal call the matched engine makes for the fused layer, split-K (3 tokens) and single pass (70), rows
    # independent of M; its gradients close to each slice's own backward (the reference)
    from epirl.kernels import Fp8LoRALinear, split_fused
    from epirl.kernels.lora_linear.sliced import attach_slice_group
    from epirl.kernels.w8a16.slices import sliced_lora_operands

    widths, K, r = [64, 32, 32], 160, 8
    g = torch.Generator().manual_seed(21)
    codes, scale = quantize_weight_fp8([torch.randn(w, K, generator=g) * 0.05 for w in widths], backend="reference")
    members = [Fp8LoRALinear(view, scale, torch.nn.Parameter(torch.randn(r, K, generator=g) * 0.1),
                             torch.nn.Parameter(torch.randn(w, r, generator=g) * 0.1), 2.0, backend="triton")
               for w, view in zip(widths, split_fused(codes, widths))]
    attach_slice_group(members)
    a_cat, b_bd = sliced_lora_operands([m.lora_A.detach() for m in members], [m.lora_B.detach() for m in members],
                                       widths, torch.bfloat16)
    x70 = torch.randn(70, K, generator=g).bfloat16()
    one_call_70 = w8a16_lora(x70, codes, scale, a_cat, b_bd, 2.0, backend="triton")
    for M in (3, 70):
        x = x70[:M].clone().requires_grad_()
        outs = [m(x) for m in members]
        one_call = w8a16_lora(x.detach(), codes, scale, a_cat, b_bd, 2.0, backend="triton")
        assert torch.equal(torch.cat(outs, dim=-1), one_call), M
        assert torch.equal(one_call, one_call_70[:M]), M  # batch invariant
        gys = [torch.randn(M, w, generator=g).bfloat16() for w in widths]
        sum((o.float() * gy.float()).sum() for o, gy in zip(outs, gys)).backward()
        dx_want = sum(ref_backward(gy, x.detach(), m.codes, scale, m.lora_A.detach().bfloat16(),
                                   m.lora_B.detach().bfloat16(), 2.0, True)[0] for gy, m in zip(gys, members))
        assert ((x.grad.float() - dx_want).norm() / dx_want.norm()).item() < 2e-2, M
        for gy, m in zip(gys, members):
            _, da, db = ref_backward(gy, x.detach(), m.codes, scale, m.lora_A.detach().bfloat16(),
                                     m.lora_B.detach().bfloat16(), 2.0, True)
            assert ((m.lora_A.grad - da).norm() / da.norm()).item() < 2e-2, M
            assert ((m.lora_B.grad - db).norm() / db.norm()).item() < 2e-2, M
            m.lora_A.grad = m.lora_B.grad = None


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    from case_runner import run_cases

    run_cases(CASES, sys.argv[1:])
