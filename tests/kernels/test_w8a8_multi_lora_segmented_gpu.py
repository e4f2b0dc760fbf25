"""GPU tests (H200) of the segment-tiled LoRA shrink + expand (kernels/w8a8_multi/segmented.py): bitwise equal to
expand_into on the same tokens (both chunk-sum modes, q/k/v-like slices, 4-32 adapters), with vLLM's own
LoRAKernelMeta as the segments (also for a padded batch: rows past vLLM's token map untouched), and under CUDA-graph
replay with the segment buffers refilled between replays, as vLLM refills its metadata every step."""

import pytest
import torch

from epirl.kernels import quantize_weight_fp8
from epirl.kernels.w8a8_multi.segmented import Segments, expand_segments, segments
from epirl.kernels.w8a8_multi.timing import vendor_base
from epirl.kernels.w8a8_multi.triton import adapter_order, expand_into

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
WIDTHS = [1024, 256, 256]  # q, k, v-like slices, each with its own slot buffers


def layer(M, L, K=4096, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    codes, scale = quantize_weight_fp8(torch.randn(sum(WIDTHS), K, generator=g, device=DEV) * 0.02,
                                       backend="reference")
    a = [(torch.randn(L, 64, K, generator=g, device=DEV) / 64).bfloat16() for _ in WIDTHS]
    b = [(torch.randn(L, w, 64, generator=g, device=DEV) * 0.05).bfloat16() for w in WIDTHS]
    ids = torch.randint(-1, L, (M,), generator=g, device=DEV)
    base = vendor_base(x, codes, scale.float().reshape(1, 1).expand(1, sum(WIDTHS)).contiguous())
    return x, a, b, ids, base


def grouped(base, x, a, b, ids, sigma=1.5):
    return expand_into(base.clone(), x, a, b, ids, sigma, order=adapter_order(ids, 128), widths=WIDTHS)


@pytest.mark.parametrize("M,L", [(33, 4), (64, 32), (300, 32), (4096, 32), (4096, 1)])
def test_segmented_equals_expand_into_bitwise(M, L):
    x, a, b, ids, base = layer(M, L, seed=M + L)
    want = grouped(base, x, a, b, ids)
    for summed, groups in ((True, None), (False, None), (False, 1)):  # groups 1: each program loops over a slice
        got = expand_segments(base.clone(), x, a, b, segments(ids, L), 1.5, widths=WIDTHS, sum_in_shrink=summed,
                              groups=groups)
        assert torch.equal(got, want), (summed, groups, (got.float() - want.float()).abs().max().item())
    assert torch.equal(got[ids < 0], base[ids < 0])


def vllm_segments(ids, L, extra_tokens=0):
    """vLLM's own per-step metadata for this token map (its buffers sized for more tokens than the batch)."""
    meta_cls = pytest.importorskip("vllm.lora.ops.triton_ops.lora_kernel_metadata").LoRAKernelMeta
    meta = meta_cls.make(max_loras=L, max_num_tokens=ids.numel() + extra_tokens + 64, device=DEV)
    meta.prepare_tensors(ids.to(torch.int32))
    return Segments(meta.token_indices_sorted_by_lora_ids, meta.active_lora_ids, meta.num_tokens_per_lora)


@pytest.mark.parametrize("M,L", [(64, 8), (300, 32)])
def test_vllms_metadata_as_segments(M, L):
    x, a, b, ids, base = layer(M, L, seed=7)
    want = grouped(base, x, a, b, ids)
    assert torch.equal(expand_segments(base.clone(), x, a, b, vllm_segments(ids, L), 1.5, widths=WIDTHS), want)
    # a padded batch: vLLM maps only the first M - 5 tokens; the rest get no adapter (their rows stay the base's)
    short = vllm_segments(ids[:M - 5], L, extra_tokens=5)
    got = expand_segments(base.clone(), x, a, b, short, 1.5, widths=WIDTHS)
    assert torch.equal(got[:M - 5], grouped(base[:M - 5], x[:M - 5], a, b, ids[:M - 5]))
    assert torch.equal(got[M - 5:], base[M - 5:])


def test_under_cuda_graph_with_segments_refilled():
    M, L = 256, 32
    x, a, b, ids, base = layer(M, L, seed=3)
    segs = segments(ids, L)
    y = base.clone()
    graph = torch.cuda.CUDAGraph()
    expand_segments(y, x, a, b, segs, 1.5, widths=WIDTHS)  # compile outside the capture
    with torch.cuda.graph(graph):
        y.copy_(base)
        expand_segments(y, x, a, b, segs, 1.5, widths=WIDTHS)
    new_ids = torch.randint(-1, L, (M,), device=DEV)
    for buf, fresh in zip(segs, segments(new_ids, L)):  # the step's metadata into the captured buffers
        buf.copy_(fresh)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, grouped(base, x, a, b, new_ids))
