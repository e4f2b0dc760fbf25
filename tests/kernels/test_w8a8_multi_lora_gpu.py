"""GPU tests (H200) of w8a8_multi_lora: Triton vs reference on every path, bit-exact in-kernel quantization,
mixed adapters == each group alone (bitwise), vs torch._scaled_mm, PDL path == plain path bitwise."""

import pytest
import torch

from epirl.kernels import quantize_activation_fp8, quantize_weight_fp8, w8a8_multi_lora
from epirl.kernels.w8a8_multi.triton import DECODE_MAX_TOKENS, expand_into, pdl_supported, quant_shrink

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
K_ODD, N_ODD = 1000, 1304  # neither a multiple of 128
PATTERN = [0, 1, -1, 2, 3, 0, -1, 3, 1, 2, 2, 0, 3, -1, 1, 0, 2, 3, -1, 0]


def problem(M, K=K_ODD, N=N_ODD, L=4, r=64, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g, device=DEV) * 0.02, backend="reference")
    a = (torch.randn(L, r, K, generator=g, device=DEV) / K ** 0.5).bfloat16()
    b = (torch.randn(L, N, r, generator=g, device=DEV) * 0.05).bfloat16()
    ids = torch.tensor((PATTERN * (M // len(PATTERN) + 1))[:M], device=DEV)
    return x, codes, scale, a, b, ids


def assert_close_bf16(got, want, ulps=2.0):
    assert not torch.isnan(got).any(), "NaN in output (unwritten element)"
    w = want.float()
    bad = (got.float() - w).abs() > (w.abs() + w.abs().mean()) * (ulps * 2 ** -8)
    assert not bad.any(), f"{int(bad.sum())} elements off; max err {(got.float() - w).abs().max().item()}"


def paths(M):
    if M > DECODE_MAX_TOKENS:
        return ["prefill"]
    return ["decode", "prefill"] + (["pdl"] if pdl_supported() else [])


def poison(nbytes):
    blob = torch.full((nbytes // 2 + 1024,), float("nan"), device=DEV, dtype=torch.bfloat16)
    del blob


@pytest.mark.parametrize("M", [1, 3, 16, 20, 32, 33, 257, 2048])
def test_vs_reference_every_path(M):
    """Also: K1's codes and scales are bit-exact with the quantization kernel (= vLLM's)."""
    x, codes, scale, a, b, ids = problem(M, seed=M)
    bias = torch.randn(N_ODD, device=DEV).bfloat16()
    sigma = torch.tensor([0.5, 1.0, 2.0, 4.0], device=DEV)
    want = w8a8_multi_lora(x.cpu(), codes.cpu(), scale.cpu(), a.cpu(), b.cpu(), ids.cpu(), sigma.cpu(),
                           bias.cpu(), backend="reference")
    for path in paths(M):
        poison(M * N_ODD * 2 * 4)
        got = w8a8_multi_lora(x, codes, scale, a, b, ids, sigma, bias, path=path)
        assert_close_bf16(got.cpu(), want)
    x[0, 5] = float("nan")
    x[M // 2] = 0
    x[M - 1, 3] = float("inf")
    q, s, _ = quant_shrink(x, None, ids)
    q_ref, s_ref = quantize_activation_fp8(x.cpu(), backend="reference")
    assert torch.equal(s.cpu(), s_ref.reshape(-1)) and torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


ALT_DECODE = dict(BN=128, BT=16, BK=256, num_warps=8, num_stages=3)  # the other decode tile the bench sweeps


@pytest.mark.parametrize("M,config", [(20, None), (20, ALT_DECODE), (300, None)])
def test_mixed_batch_equals_each_group_alone_bitwise(M, config):
    x, codes, scale, a, b, ids = problem(M, seed=7)
    for path in paths(M) if config is None else ["decode"]:
        mixed = w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0, path=path, config=config)
        for adapter in (-1, 0, 1, 2, 3):
            rows = (ids == adapter).nonzero().reshape(-1)
            alone = w8a8_multi_lora(x[rows].clone(), codes, scale, a, b, ids[rows].clone(), 2.0, path=path,
                                    config=config)
            assert torch.equal(alone, mixed[rows]), (path, adapter)
        if config is not None:
            assert_close_bf16(mixed, w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0, path="decode"))


def test_pdl_equals_plain_decode_bitwise():
    if not pdl_supported():
        pytest.skip("no PDL on this GPU/Triton")
    x, codes, scale, a, b, ids = problem(16, K=4096, N=6144, seed=3)
    assert torch.equal(w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0, path="pdl"),
                       w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0, path="decode"))


@pytest.mark.parametrize("M", [1, 16, 64, 4096])
def test_no_adapter_rows_vs_scaled_mm(M):
    """vLLM's W8A8 (per-token x, per-tensor w through torch._scaled_mm) vs our no-adapter rows."""
    K, N = 4096, 6144
    x, codes, scale, a, b, _ = problem(M, K=K, N=N, seed=M)
    q, s = quantize_activation_fp8(x)
    vendor = torch._scaled_mm(q, codes.t(), scale_a=s, scale_b=scale.reshape(1, 1).expand(1, N).contiguous(),
                              out_dtype=torch.bfloat16).float()
    got = w8a8_multi_lora(x, codes, scale, a, b, torch.full((M,), -1, device=DEV), 2.0).float()
    assert ((got - vendor).norm() / vendor.norm()).item() < 5e-3


def test_expand_into_after_scaled_mm():
    x, codes, scale, a, b, ids = problem(16, seed=11)
    base = w8a8_multi_lora(x, codes, scale, a, b, torch.full_like(ids, -1), 1.0)
    want = w8a8_multi_lora(x, codes, scale, a, b, ids, 1.5)
    assert_close_bf16(expand_into(base.clone(), x, a, b, ids, 1.5), want)


def test_under_cuda_graph_replay():
    x, codes, scale, a, b, ids = problem(8, K=4096, N=4096, seed=5)
    want = w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0)
    x.copy_(torch.randn_like(x))
    ids.copy_(ids.flip(0))
    graph.replay()
    assert torch.equal(out, w8a8_multi_lora(x, codes, scale, a, b, ids, 2.0))
    assert not torch.equal(out, want)


@pytest.mark.parametrize("M", [1, 16, 300])
def test_fused_qkv_slices_equal_per_slice_calls_bitwise(M):
    """One K1 + K2 over q/k/v slices (each with its own slot buffers, vLLM's [L, 1, rows, r] layout) == the
    single-slice op on each slice's rows, bitwise, on every path; and close to the reference."""
    from epirl.kernels.w8a8_multi.triton import w8a8_multi_lora_slices

    widths = [2048, 512, 512]
    x, codes, scale, _, _, ids = problem(M, K=2048, N=sum(widths), seed=13)
    g = torch.Generator(device=DEV).manual_seed(14)
    a = [(torch.randn(4, 1, 64, 2048, generator=g, device=DEV) / 45).bfloat16()[:, 0] for _ in widths]
    b = [(torch.randn(4, 1, w, 64, generator=g, device=DEV) * 0.05).bfloat16()[:, 0] for w in widths]
    for path in paths(M):
        fused = w8a8_multi_lora_slices(x, codes, scale, a, b, widths, ids, 2.0, path=path)
        start = 0
        for w, a_s, b_s in zip(widths, a, b):
            rows = slice(start, start + w)
            alone = w8a8_multi_lora(x, codes[rows].contiguous(), scale, a_s, b_s, ids, 2.0, path=path)
            assert torch.equal(fused[:, rows], alone), (path, start)
            start += w
        want = w8a8_multi_lora(x.cpu(), codes[:2048].cpu(), scale.cpu(), a[0].cpu(), b[0].cpu(), ids.cpu(), 2.0,
                               backend="reference")
        assert_close_bf16(fused[:, :2048].cpu(), want)


@pytest.mark.parametrize("M,L", [(33, 4), (300, 32), (4096, 32)])
def test_grouped_shrink_vs_per_token_and_groups_alone_bitwise(M, L):
    """The tensor-core shrink (prefill, and expand_into above DECODE_MAX_TOKENS): each token's h within fp32
    rounding of K1's per-token partials, a 32-tenant batch's partials == each adapter group's alone, bitwise
    (tiles in adapter order, groups of every size), K2 on the chunk-summed partials == on the raw ones, bitwise,
    and expand_into of such a batch vs the reference."""
    from epirl.kernels.w8a8_multi.triton import Slices, adapter_order, grouped_shrink

    K, N = 4096, 1024
    g = torch.Generator(device=DEV).manual_seed(M)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    a = (torch.randn(L, 64, K, generator=g, device=DEV) / 64).bfloat16()
    b = (torch.randn(L, N, 64, generator=g, device=DEV) * 0.05).bfloat16()
    ids = torch.randint(-1, L, (M,), generator=g, device=DEV)
    slices = Slices([a], [b], [N])
    part = grouped_shrink(x, slices, ids, adapter_order(ids, 64))
    _, _, per_token = quant_shrink(x, slices, ids, quant=False)
    rows = ids >= 0
    h, h_k1 = part[0][:, rows].sum(0), per_token[0][:, rows].sum(0)
    assert torch.allclose(h, h_k1, rtol=1e-5, atol=1e-5), (h - h_k1).abs().max().item()
    for adapter in torch.unique(ids[rows]).tolist()[:8]:
        mine = (ids == adapter).nonzero().reshape(-1)
        alone = grouped_shrink(x[mine].clone(), slices, ids[mine].clone())
        assert torch.equal(alone, part[:, :, mine]), adapter
    codes, scale = quantize_weight_fp8(torch.randn(N, K, generator=g, device=DEV) * 0.02, backend="reference")
    from epirl.kernels.w8a8_multi.triton import multi_lora_gemm, sum_chunks

    q, s = quantize_activation_fp8(x)

    def k2(partials):  # the prefill K2 on given partials; the chunk-summed ones must give the same bits
        return multi_lora_gemm(q, codes, scale.float().reshape(1), torch.empty(M, N, device=DEV, dtype=torch.bfloat16),
                               ids, partials, slices, 1.5, x_scale=s.reshape(-1), order=adapter_order(ids, 128))

    assert torch.equal(k2(sum_chunks(part)), k2(part))
    base = w8a8_multi_lora(x, codes, scale, a, b, torch.full_like(ids, -1), 1.0)
    want = w8a8_multi_lora(x.cpu(), codes.cpu(), scale.cpu(), a.cpu(), b.cpu(), ids.cpu(), 1.5, backend="reference")
    assert_close_bf16(expand_into(base, x, a, b, ids, 1.5, order=adapter_order(ids, 128)).cpu(), want)


def test_vllm_lora_kernels_adder_adds_each_tokens_adapter():
    """The benchmark's `vendor+vllm` candidate (vLLM's lora_shrink + lora_expand through epirl's compat layer) adds
    σ (x A_lᵀ) B_lᵀ per token into each slice's columns, -1 rows untouched."""
    pytest.importorskip("vllm")
    from epirl.engine.vllm_compat.punica import punica_lora_adder

    M, K, L, widths = 300, 1024, 8, [512, 128, 128]
    g = torch.Generator(device=DEV).manual_seed(21)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    a = [(torch.randn(L, 64, K, generator=g, device=DEV) / 32).bfloat16() for _ in widths]
    b = [(torch.randn(L, w, 64, generator=g, device=DEV) * 0.05).bfloat16() for w in widths]
    ids = torch.randint(-1, L, (M,), generator=g, device=DEV)
    base = torch.randn(M, sum(widths), generator=g, device=DEV).bfloat16()
    got = punica_lora_adder(x, a, b, ids, 2.0)(base.clone())
    want, start = base.float(), 0
    for a_s, b_s, w in zip(a, b, widths):
        for t in (ids >= 0).nonzero().reshape(-1).tolist():
            h = x[t].float() @ a_s[ids[t]].float().t()
            want[t, start:start + w] += 2.0 * (h @ b_s[ids[t]].float().t())
        start += w
    assert_close_bf16(got, want, ulps=4.0)
    assert torch.equal(got[ids < 0], base[ids < 0])


@pytest.mark.parametrize("M", [1, 16, 300])
def test_dispatch_candidates_agree_on_batches_spread_over_the_slots(M):
    """What the engine's timed dispatch chooses between computes the same layer: fused, vendor + epirl's
    adapter kernels and (with vLLM) vendor + vLLM's own LoRA kernels, on a batch spread over 8 adapters."""
    import importlib.util

    from epirl.kernels.w8a8_multi.dispatch import Shape
    from epirl.kernels.w8a8_multi.timing import gpu_candidates

    has_vllm = importlib.util.find_spec("vllm") is not None
    extra = None
    if has_vllm:  # the engine package (pydantic etc.) comes with the vLLM kit on the device, not without it
        from epirl.engine import serving_lora

        extra = serving_lora.vllm_candidate
    outs = {name: fn() for name, fn in gpu_candidates(Shape("t", 1024, 1536, 64, adapters=8), M, extra=extra).items()}
    assert ("vllm" in outs) == has_vllm, sorted(outs)
    assert {"vendor+seg", "vendor+seg[bt16]", "vendor+seg[bn64]"} <= set(outs)
    for y in outs.values():
        assert_close_bf16(y.float(), outs["fused"].float(), ulps=4.0)
