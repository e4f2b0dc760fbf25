"""The TMA descriptor cache (kernels/w8a16/tma_desc_cache.py): a hit only where a fresh encode would give the same
CUtensorMap (same address, shape, strides, flags and the same kernel metadata object)."""

import pytest
import torch

from epirl.kernels.w8a16 import tma_desc_cache

TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor


def _meta():
    return {"swizzle": 3, "elem_size": 2, "elem_type": 1, "block_size": [128, 64], "fp4_padded": False}


def _counting_encoder():
    calls = []

    def encode(arg, metadata, *rest):
        calls.append((arg.base.data_ptr(), tuple(arg.shape), tuple(arg.strides)))
        return [object(), *arg.shape, *arg.strides]
    return encode, calls


def test_same_descriptor_is_encoded_once_and_differences_are_encoded_again():
    encode, calls = _counting_encoder()
    cached = tma_desc_cache.cached_encoder(encode)
    buf = torch.empty(4096, dtype=torch.bfloat16)
    meta = _meta()
    x = buf[:2048].view(32, 64)
    first = cached(TensorDescriptor.from_tensor(x, [16, 64]), meta)
    again = cached(TensorDescriptor.from_tensor(buf[:2048].view(32, 64), [16, 64]), meta)  # a new view, same bytes
    assert again is first and len(calls) == 1
    variants = [
        (buf[64:2112].view(32, 64), meta),  # another address
        (buf[:2048].view(16, 128), meta),  # another shape at the same address
        (buf[:4096].view(32, 128)[:, :64], meta),  # the same shape, another row stride
        (x, _meta()),  # equal metadata of another kernel: compared by identity
    ]
    for tensor, metadata in variants:
        out = cached(TensorDescriptor.from_tensor(tensor, [16, 64]), metadata)
        assert out is not first
    assert len(calls) == 1 + len(variants)
    assert cached(TensorDescriptor.from_tensor(x, [16, 64], padding="nan"), meta) is not first  # the padding flag
    assert len(calls) == 2 + len(variants)


def test_uncached_kinds_and_the_size_bound(monkeypatch):
    encode, calls = _counting_encoder()
    cached = tma_desc_cache.cached_encoder(encode)
    x = torch.empty(32, 64, dtype=torch.bfloat16)
    desc = TensorDescriptor.from_tensor(x, [16, 64])
    cached(desc, None)
    cached(desc, None)  # no metadata: Triton decomposes the descriptor, nothing to reuse
    im2col = dict(_meta(), is_im2col=True)
    cached(desc, im2col)
    cached(desc, im2col)
    assert len(calls) == 4 and not cached.cache
    monkeypatch.setattr(tma_desc_cache, "MAX_ENTRIES", 2)
    metas = [_meta() for _ in range(3)]
    for meta in metas:
        cached(desc, meta)
    assert len(cached.cache) == 1  # cleared when full, then the newest entry
    cached(desc, metas[2])
    assert len(calls) == 7


def test_install_wraps_tritons_encoder_once(monkeypatch):
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    original = driver.make_tensordesc_arg
    monkeypatch.setattr(driver, "make_tensordesc_arg", original)  # restored after the test
    monkeypatch.setattr(tma_desc_cache, "_installed", False)
    assert tma_desc_cache.install()
    wrapped = driver.make_tensordesc_arg
    assert wrapped is not original and wrapped.encode is getattr(original, "encode", original)
    monkeypatch.setattr(tma_desc_cache, "_installed", False)
    assert tma_desc_cache.install() and driver.make_tensordesc_arg is wrapped  # never wrapped twice
