"""w8a8_multi_lora's Triton kernels (K1 shrink, K2 GEMM + multi-adapter epilogue) on tiny shapes in Triton's CPU
interpreter: one subprocess runs this file as a script with TRITON_INTERPRET=1 (it must be set before triton
decorates the kernels) and prints one JSON line per case.

The interpreter rounds fp32 -> e4m3 wrongly when rounding carries into the next binade (see
interpreter_cases.py), so cases that quantize in K1 use activations whose codes need no rounding: e4m3
values / 8 with one ±56 per row, i.e. s_x = 1/8 exactly. The other cases feed K2 the reference's codes.
"""

import json
import os
import sys
import traceback

import pytest

CASES = ["decode_mixed_vs_reference", "decode_mixed_equals_groups_bitwise", "sorted_tiles_vs_reference",
         "sorted_tiles_equal_groups_bitwise", "expand_into_vendor_output", "per_adapter_sigma_and_bias",
         "several_k1_chunks", "fused_slices_one_launch_pair", "grouped_shrink_vs_exact_and_groups_bitwise",
         "segmented_expand_equals_grouped_bitwise", "even_shape_equals_padded_ragged"]
ADAPTERS = [0, 1, -1, 2, 3, 0, -1, 3, 1, 2, 2, 0, 3, -1, 1, 0, 2, 3, -1, 0]


def exact_activations(M, K, g):
    import torch

    v = (torch.randn(M, K, generator=g) * 60).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    v[:, 0] = 448.0 * torch.sign(torch.randn(M, generator=g)).clamp_min(0).mul(2).sub(1)
    return (v / 8).bfloat16()  # per-token scale 56/448 = 1/8 exactly: the codes are v, no rounding


def problem(M, K, N, L=4, r=8, seed=0, exact=True):
    import torch

    from epirl.kernels import quantize_weight_fp8

    g = torch.Generator().manual_seed(seed)
    x = exact_activations(M, K, g) if exact else torch.randn(M, K, generator=g).bfloat16()
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g) * 0.05, backend="reference")
    a = (torch.randn(L, r, K, generator=g) * 0.05).bfloat16()
    b = (torch.randn(L, N, r, generator=g) * 0.1).bfloat16()
    ids = torch.tensor((ADAPTERS * (M // len(ADAPTERS) + 1))[:M])
    return x, codes, scale, a, b, ids


def close_bf16(got, want, ulps=4.0):
    import torch

    tol = (want.float().abs() + want.float().abs().mean()) * (ulps * 2 ** -8)
    return bool(torch.all((got.float() - want.float()).abs() <= tol)) and not torch.isnan(got).any()


def reference(*args, **kw):
    from epirl.kernels import w8a8_multi_lora

    return w8a8_multi_lora(*args, backend="reference", **kw)


def groups_alone(fn, x, ids):
    """Each adapter group (and the no-adapter rows) run on its own, scattered back to token order."""
    import torch

    out = None
    for adapter in torch.unique(ids).tolist():
        rows = (ids == adapter).nonzero().reshape(-1)
        part = fn(x[rows].clone(), ids[rows].clone())
        out = part.new_empty(x.shape[0], part.shape[1]) if out is None else out
        out[rows] = part
    return out


SMALL_TILES = dict(BN=64, BT=16, BK=64, num_warps=4, num_stages=2)


def case_decode_mixed_vs_reference():
    from epirl.kernels import w8a8_multi_lora

    for M, K, N in [(20, 100, 72), (3, 64, 40)]:
        x, codes, scale, a, b, ids = problem(M, K, N, seed=M)
        got = w8a8_multi_lora(x, codes, scale, a, b, ids, 0.5, backend="triton", path="decode")
        assert close_bf16(got, reference(x, codes, scale, a, b, ids, 0.5)), (M, K, N)


def case_decode_mixed_equals_groups_bitwise():
    from epirl.kernels import w8a8_multi_lora

    x, codes, scale, a, b, ids = problem(20, 100, 72, seed=1)

    def run(xs, ts):
        return w8a8_multi_lora(xs, codes, scale, a, b, ts, 2.0, backend="triton", path="decode")

    assert torch_equal(run(x, ids), groups_alone(run, x, ids))


def case_even_shape_equals_padded_ragged():
    """K2's loop loads without predicates on even shapes (K a multiple of BK, N of BN, M of the token tile; a
    partial token tile is masked): the bits of the masked loop, which runs on the same problem padded into ragged
    shapes (K = 256 vs 250 with zero columns, N = 128 vs 130), decode (20 tokens) and prefill tiles."""
    from epirl.kernels import w8a8_multi_lora

    x, codes, scale, a, b, ids = problem(20, 256, 130, seed=12)
    x[:, 250:] = 0
    a[:, :, 250:] = 0
    codes[:, 250:] = 0
    for path in ("decode", "prefill"):
        def run(k, n, path=path):
            return w8a8_multi_lora(x[:, :k].contiguous(), codes[:n, :k], scale, a[:, :, :k].contiguous(),
                                   b[:, :n].contiguous(), ids, 0.5, backend="triton", path=path)

        even = run(256, 128)
        assert torch_equal(even, run(250, 128)) and torch_equal(even, run(256, 130)[:, :128]), path
        assert close_bf16(even, reference(x, codes[:128], scale, a, b[:, :128], ids, 0.5)), path


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def sorted_gemm(x, codes, scale, a, b, ids, sigma, bias=None):
    """K1 + K2 on the reference's fp8 codes, tokens sorted by adapter, 16-token tiles (several tiles)."""
    import torch

    from epirl.kernels import quantize_activation_fp8
    from epirl.kernels.w8a8_multi.triton import Slices, adapter_order, multi_lora_gemm, quant_shrink

    q, s = quantize_activation_fp8(x, backend="reference")
    slices = Slices([a], [b], [codes.shape[0]])
    _, _, part = quant_shrink(x, slices, ids, quant=False)
    y = torch.empty(x.shape[0], codes.shape[0], dtype=torch.bfloat16)
    order = adapter_order(ids, SMALL_TILES["BT"])
    return multi_lora_gemm(q, codes, scale, y, ids, part, slices, sigma, x_scale=s.reshape(-1), order=order,
                           bias=bias, config=SMALL_TILES)


def case_sorted_tiles_vs_reference():
    x, codes, scale, a, b, ids = problem(40, 100, 72, seed=2, exact=False)
    assert close_bf16(sorted_gemm(x, codes, scale, a, b, ids, 0.7), reference(x, codes, scale, a, b, ids, 0.7))


def case_sorted_tiles_equal_groups_bitwise():
    x, codes, scale, a, b, ids = problem(40, 100, 72, seed=3, exact=False)

    def run(xs, ts):
        return sorted_gemm(xs, codes, scale, a, b, ts, 0.7)

    assert torch_equal(run(x, ids), groups_alone(run, x, ids))


def case_expand_into_vendor_output():
    import torch

    from epirl.kernels.w8a8_multi.triton import expand_into

    x, codes, scale, a, b, ids = problem(20, 100, 72, seed=4, exact=False)
    base = reference(x, codes, scale, a, b, torch.full_like(ids, -1), 1.0)
    got = expand_into(base.clone(), x, a, b, ids, 1.5)
    assert close_bf16(got, reference(x, codes, scale, a, b, ids, 1.5))
    assert torch.equal(got[ids < 0], base[ids < 0])


def case_per_adapter_sigma_and_bias():
    import torch

    from epirl.kernels import w8a8_multi_lora

    x, codes, scale, a, b, ids = problem(20, 100, 72, seed=5)
    sigma = torch.tensor([0.5, 1.0, 2.0, 4.0])
    bias = torch.randn(72).bfloat16()
    want = reference(x, codes, scale, a, b, ids, sigma, bias)
    got = w8a8_multi_lora(x, codes, scale, a, b, ids, sigma, bias, backend="triton", path="decode")
    assert close_bf16(got, want)
    assert close_bf16(sorted_gemm(x, codes, scale, a, b, ids, sigma, bias), want)


def case_several_k1_chunks():
    """K = 1100: three K1 chunks (the last ragged) summed by K2 in chunk order; K1's scales vs the reference."""
    import torch

    from epirl.kernels import quantize_activation_fp8, w8a8_multi_lora
    from epirl.kernels.w8a8_multi.triton import Slices, quant_shrink, shrink_chunking

    assert shrink_chunking(1100)[1] == 3
    x, codes, scale, a, b, ids = problem(6, 1100, 40, seed=6)
    got = w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0, backend="triton", path="decode")
    assert close_bf16(got, reference(x, codes, scale, a, b, ids, 2.0))
    _, s, part = quant_shrink(x, Slices([a], [b], [40]), ids)
    assert torch.equal(s, quantize_activation_fp8(x, backend="reference")[1].reshape(-1))
    rows = ids >= 0
    h = part[0][:, rows, :8].sum(0)  # fp32 partials of the adapter tokens, in chunk order
    exact = torch.stack([x[t].double() @ a[ids[t]].double().t() for t in rows.nonzero().reshape(-1)])
    assert torch.allclose(h.double(), exact, rtol=1e-5, atol=1e-5)


def case_fused_slices_one_launch_pair():
    """A q/k/v-like layer: slices of 48, 16, 16 rows (a 64-row tile straddles q and k), each slice with its own
    A/B slot buffers in vLLM's [L, 1, rows, cols] layout: one K1 + K2 == per-slice w8a8_multi_lora, bitwise
    vs the Triton single-slice call on the same tile rows and close to the reference."""
    import torch

    from epirl.kernels.w8a8_multi.triton import w8a8_multi_lora, w8a8_multi_lora_slices

    widths = [48, 16, 16]
    x, codes, scale, _, _, ids = problem(20, 100, sum(widths), seed=8)
    g = torch.Generator().manual_seed(9)
    a = [(torch.randn(4, 1, 8, 100, generator=g) * 0.05).bfloat16()[:, 0] for _ in widths]
    b = [(torch.randn(4, 1, w, 8, generator=g) * 0.1).bfloat16()[:, 0] for w in widths]
    for path, config in (("decode", None), ("prefill", SMALL_TILES)):
        fused = w8a8_multi_lora_slices(x, codes, scale, a, b, widths, ids, 2.0, path=path, config=config)
        start = 0
        for w, a_s, b_s in zip(widths, a, b):
            rows = slice(start, start + w)
            want = reference(x, codes[rows], scale, a_s, b_s, ids, 2.0)
            assert close_bf16(fused[:, rows], want), (path, start)
            alone = w8a8_multi_lora(x, codes[rows].contiguous(), scale, a_s, b_s, ids, 2.0, path=path, config=config)
            assert torch.equal(fused[:, rows], alone), (path, start)
            start += w


def case_grouped_shrink_vs_exact_and_groups_bitwise():
    """The tensor-core shrink over tiles in adapter order: K1's partial layout and K chunks (K = 1100: three,
    the last ragged), each token's h within fp32 rounding of the exact x_t A_lᵀ, -1 rows untouched, and a
    mixed batch's partials equal to each adapter group's alone, bitwise; K2 on the chunk-summed partials equal to
    K2 on the raw ones, bitwise; then the prefill path and expand_into above DECODE_MAX_TOKENS (which use both)
    against the reference."""
    import torch

    from epirl.kernels import w8a8_multi_lora
    from epirl.kernels.w8a8_multi.triton import (DECODE_MAX_TOKENS, Slices, adapter_order, expand_into,
                                                      grouped_shrink, shrink_chunking)

    tiles = dict(BT=16, BK=64, num_warps=4, num_stages=2)
    x, codes, scale, a, b, ids = problem(45, 1100, 40, r=5, seed=10, exact=False)
    slices = Slices([a], [b], [40])
    part = grouped_shrink(x, slices, ids, adapter_order(ids, tiles["BT"]), config=tiles)
    assert part.shape == (1, shrink_chunking(1100)[1], 45, 16)
    rows = (ids >= 0).nonzero().reshape(-1)
    exact = torch.stack([x[t].double() @ a[ids[t]].double().t() for t in rows])
    assert torch.allclose(part[0][:, rows, :5].sum(0).double(), exact, rtol=1e-5, atol=1e-6)
    for adapter in (0, 1, 2, 3):
        mine = (ids == adapter).nonzero().reshape(-1)
        alone = grouped_shrink(x[mine].clone(), slices, ids[mine].clone(), None, config=tiles)
        assert torch.equal(alone[..., :5], part[:, :, mine, :5]), adapter
    # K2 on the partials summed once (sum_chunks, what the prefill path does) == K2 summing them itself, bitwise
    from epirl.kernels import quantize_activation_fp8
    from epirl.kernels.w8a8_multi.triton import multi_lora_gemm, sum_chunks

    q, s = quantize_activation_fp8(x, backend="reference")

    def k2(partials):
        y = torch.empty(45, 40, dtype=torch.bfloat16)
        return multi_lora_gemm(q, codes, scale, y, ids, partials, slices, 0.5, x_scale=s.reshape(-1),
                               order=adapter_order(ids, SMALL_TILES["BT"]), config=SMALL_TILES)

    summed = sum_chunks(part)
    assert summed.shape == (1, 1, 45, 16) and torch.equal(k2(summed), k2(part))
    assert DECODE_MAX_TOKENS < 45
    got = w8a8_multi_lora(x, codes, scale, a, b, ids, 0.5, path="prefill", config=SMALL_TILES)
    assert close_bf16(got, reference(x, codes, scale, a, b, ids, 0.5))
    base = reference(x, codes, scale, a, b, torch.full_like(ids, -1), 1.0)
    assert close_bf16(expand_into(base.clone(), x, a, b, ids, 1.5, order=adapter_order(ids, 16)),
                      reference(x, codes, scale, a, b, ids, 1.5))


def vllm_meta(ids):
    """The segments as vLLM's LoRAKernelMeta lays them out: only the ids present (sorted, -1 first), padded with
    unused (-1, 0 tokens) slots, stale entries past the batch in the sorted tokens."""
    import torch

    from epirl.kernels.w8a8_multi.segmented import Segments

    present, counts = torch.unique(ids, sorted=True, return_counts=True)
    slots = 6
    lora_ids = torch.full((slots,), -1, dtype=torch.int32)
    lora_ids[:present.numel()] = present.int()
    count = torch.zeros(slots, dtype=torch.int32)
    count[:counts.numel()] = counts.int()
    tokens = torch.cat([torch.sort(ids, stable=True).indices.int(), torch.tensor([3, 0, 7], dtype=torch.int32)])
    return Segments(tokens, lora_ids, count)


def case_segmented_expand_equals_grouped_bitwise():
    """The segment-tiled shrink + expand (one adapter per tile) against expand_into (grouped shrink, K2's expand on
    tiles in adapter order): bitwise, K = 1100 (three chunks, the last ragged), the chunks summed in the shrink or
    by the expand, with epirl's segments and with vLLM's metadata layout; -1 rows untouched; close to the
    reference; a mixed batch equals each group alone."""
    import torch

    from epirl.kernels.w8a8_multi.segmented import expand_segments, segments
    from epirl.kernels.w8a8_multi.triton import adapter_order, expand_into

    x, codes, scale, a, b, ids = problem(45, 1100, 40, r=5, seed=11, exact=False)
    base = reference(x, codes, scale, a, b, torch.full_like(ids, -1), 1.0)
    tiles = dict(BN=32, BT=16, BK=64, num_warps=4, num_stages=2)
    want = expand_into(base.clone(), x, a, b, ids, 1.5, order=adapter_order(ids, 16))
    for segs in (segments(ids, 4), vllm_meta(ids)):
        for summed, groups in ((True, None), (False, None), (False, 1)):  # groups 1: one program, both row tiles
            got = expand_segments(base.clone(), x, a, b, segs, 1.5, config=tiles, sum_in_shrink=summed,
                                  shrink_config=dict(BT=16, BK=64, num_warps=4, num_stages=2), groups=groups)
            assert torch.equal(got, want), (summed, groups)
    got = expand_segments(base.clone(), x, a, b, segments(ids, 4), 1.5)  # the default tiles
    assert torch.equal(got[ids < 0], base[ids < 0])
    assert close_bf16(got, reference(x, codes, scale, a, b, ids, 1.5))

    def run(xs, ts):
        return expand_segments(base[:0].new_zeros(xs.shape[0], 40), xs, a, b, segments(ts, 4), 1.5, config=tiles)

    assert torch_equal(run(x, ids), groups_alone(run, x, ids))


@pytest.fixture(scope="module")
def interpreter_results():
    pytest.importorskip("triton")
    from conftest import run_interpreter_cases  # not at the top: this file also runs as the interpreter's script

    return run_interpreter_cases(__file__, CASES)


@pytest.mark.parametrize("case", CASES)
def test_w8a8_multi_lora_in_interpreter(interpreter_results, case):
    from conftest import check_interpreter_case

    check_interpreter_case(interpreter_results, case)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for name in sys.argv[1:] or CASES:
        try:
            globals()["case_" + name]()
            print(json.dumps({"case": name, "ok": True}), flush=True)
        except Exception:
            print(json.dumps({"case": name, "ok": False, "error": traceback.format_exc()}), flush=True)
