"""The invariant ops (`epirl.kernels.invariant`) of the bitwise pairing: a row's result does not depend on the other
rows of the call, a decode step's attention row equals the same row of the whole sequence's call, the engine's custom
ops return the functions' bits, and each op computes what its plain formula does (to bf16 rounding)."""

import pytest
import torch
import torch.nn.functional as F

from epirl.kernels import invariant

BF16 = torch.bfloat16


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16) if a.dtype == BF16 else
                                                                      a.view(torch.int32),
                                                                      b.view(torch.int16) if b.dtype == BF16 else
                                                                      b.view(torch.int32))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def test_rms_norm_rows_do_not_depend_on_the_batch(gen):
    x = (torch.randn(37, 67, generator=gen) * 3).to(BF16)
    res = torch.randn(37, 67, generator=gen).to(BF16)
    w = (1 + 0.1 * torch.randn(67, generator=gen)).to(BF16)
    full = invariant.rms_norm(x, w, 1e-5)
    full_y, full_r = invariant.rms_norm(x, w, 1e-5, res)
    for i in (0, 5, 36):
        assert _bits_equal(invariant.rms_norm(x[i:i + 1], w, 1e-5), full[i:i + 1])
        y, r = invariant.rms_norm(x[i:i + 1], w, 1e-5, res[i:i + 1])
        assert _bits_equal(y, full_y[i:i + 1]) and _bits_equal(r, full_r[i:i + 1])
    assert _bits_equal(full_r, x + res)  # the residual sum is the bf16 add the trainer's decoder layer computes
    plain = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    assert torch.allclose(full.float(), plain, rtol=1e-2, atol=1e-2)


def test_rotary_rows_do_not_depend_on_the_batch_and_rotate_like_transformers(gen):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half  # noqa: F401

    T, H, D = 29, 3, 64
    table = invariant.rotary_table(D, 10000.0, 128, "cpu")
    q = torch.randn(T, H, D, generator=gen).to(BF16)
    positions = torch.arange(T) + 7
    full = invariant.rotary(q, positions, table)
    for t in (0, 13, 28):
        assert _bits_equal(invariant.rotary(q[t:t + 1], positions[t:t + 1], table), full[t:t + 1])
    angles = positions[:, None].double() * (10000.0 ** (-torch.arange(0, D, 2).double() / D))
    cos = torch.cat([angles.cos(), angles.cos()], -1).float()[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1).float()[:, None, :]
    expected = q.float() * cos + rotate_half(q.float()) * sin
    assert torch.allclose(full.float(), expected, atol=2e-2)
    partial = invariant.rotary(q, positions, invariant.rotary_table(32, 10000.0, 128, "cpu"))
    assert torch.equal(partial[..., 32:], q[..., 32:])  # features past rotary_dim pass through


def test_silu_mul_is_elementwise_and_matches_the_formula(gen):
    g, u = (torch.randn(2, 19, 45, generator=gen) * 4).to(BF16).unbind(0)
    y = invariant.silu_mul(g, u)
    assert _bits_equal(invariant.silu_mul(g[3:4], u[3:4]), y[3:4])
    assert torch.allclose(y.float(), F.silu(g.float()) * u.float(), rtol=1e-2, atol=1e-2)
    assert _bits_equal(torch.ops.epirl.invariant_silu_mul(torch.cat([g, u], -1)), y)


def test_attention_decode_rows_equal_the_whole_sequence_rows(gen):
    S, H, G, D = 23, 6, 2, 32
    q, k, v = ((torch.randn(S, n, D, generator=gen)).to(BF16) for n in (H, G, G))
    scale = D ** -0.5
    whole = invariant.attention(q, k, v, scale)
    for t in (0, 1, 11, 22):  # decode: one query at position t over the keys 0..t
        assert _bits_equal(invariant.attention(q[t:t + 1], k[:t + 1], v[:t + 1], scale, q_start=t), whole[t:t + 1])
    chunk = invariant.attention(q[9:17], k[:17], v[:17], scale, q_start=9)  # a prefill chunk after a cached prefix
    assert _bits_equal(chunk, whole[9:17])
    expected = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().repeat_interleave(H // G, 1)
                                              .transpose(0, 1), v.float().repeat_interleave(H // G, 1).transpose(0, 1),
                                              is_causal=True, scale=scale).transpose(0, 1)
    assert torch.allclose(whole.float(), expected, atol=2e-2)


def test_decode_attention_of_many_requests_equals_each_requests_rows(gen):
    """A decode step's requests at once (keys padded to the longest, the padding NaN-poisoned) give each request's
    row of its whole-sequence attention."""
    H, G, D, lengths = 6, 2, 32, [1, 17, 5, 30]
    seqs = [tuple(torch.randn(n, heads, D, generator=gen).to(BF16) for heads in (H, G, G)) for n in lengths]
    L = max(lengths)
    k_pad = torch.full((len(seqs), L, G, D), float("nan"), dtype=BF16)
    v_pad = k_pad.clone()
    for r, (_, k, v) in enumerate(seqs):
        k_pad[r, :len(k)], v_pad[r, :len(v)] = k, v
    q_last = torch.stack([q[-1] for q, _, _ in seqs])
    out = invariant.decode_attention(q_last, k_pad, v_pad, torch.tensor(lengths), D ** -0.5)
    assert torch.isfinite(out).all()
    for r, (q, k, v) in enumerate(seqs):
        assert _bits_equal(out[r:r + 1], invariant.attention(q, k, v, D ** -0.5)[-1:]), r


def test_attention_ignores_keys_past_the_query(gen):
    S, H, D = 9, 2, 16
    q, k, v = (torch.randn(S, H, D, generator=gen).to(BF16) for _ in range(3))
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[5:], poisoned_v[5:] = float("nan"), float("nan")  # keys after position 4: never read by rows 0..4
    out = invariant.attention(q[:5], poisoned_k, poisoned_v, 0.25)
    assert torch.isfinite(out).all() and _bits_equal(out, invariant.attention(q[:5], k, v, 0.25)[:5])


def test_logits_rows_do_not_depend_on_the_batch(gen):
    h = torch.randn(33, 96, generator=gen).to(BF16)
    w = torch.randn(211, 96, generator=gen).to(BF16)
    full = invariant.logits(h, w)
    assert full.dtype == torch.float32
    for i in (0, 17, 32):
        assert _bits_equal(invariant.logits(h[i:i + 1], w), full[i:i + 1])
    assert torch.allclose(full, h.float() @ w.float().t(), rtol=1e-4, atol=1e-3)


def test_log_softmax_rows_do_not_depend_on_the_batch_and_token_logprobs_are_its_bits(gen):
    logits = torch.randn(29, 1000, generator=gen) * 6.0
    full = invariant.log_softmax(logits)
    assert full.dtype == torch.float32
    for i in (0, 13, 28):
        assert _bits_equal(invariant.log_softmax(logits[i:i + 1]), full[i:i + 1])
    ids = torch.randint(0, 1000, (29, 3), generator=gen)
    assert _bits_equal(invariant.token_logprobs(logits, ids), full.gather(-1, ids))
    assert torch.allclose(full, torch.log_softmax(logits, dim=-1), rtol=1e-6, atol=1e-6)
    want = (logits.double() - torch.logsumexp(logits.double(), -1, keepdim=True)).float()  # one rounding
    assert _bits_equal(full, want)


def test_engine_custom_ops_return_the_functions_bits(gen):
    x = torch.randn(7, 64, generator=gen).to(BF16)
    r = torch.randn(7, 64, generator=gen).to(BF16)
    w = torch.randn(64, generator=gen).to(BF16)
    assert _bits_equal(torch.ops.epirl.invariant_rms_norm(x, w, 1e-6), invariant.rms_norm(x, w, 1e-6))
    y, res = torch.ops.epirl.invariant_add_rms_norm(x, r, w, 1e-6)
    y2, res2 = invariant.rms_norm(x, w, 1e-6, r)
    assert _bits_equal(y, y2) and _bits_equal(res, res2)
    table = invariant.rotary_table(32, 10000.0, 64, "cpu")
    positions = torch.tensor([3, 0, 9, 1, 2, 8, 5])
    q = torch.randn(7, 4 * 32, generator=gen).to(BF16)  # vLLM's [tokens, heads · head_size]
    k = torch.randn(7, 2 * 32, generator=gen).to(BF16)
    q_rot, k_rot = torch.ops.epirl.invariant_rotary(positions, q, k, table, 32)
    assert _bits_equal(q_rot, invariant.rotary(q.view(7, 4, 32), positions, table).view(7, -1))
    assert _bits_equal(k_rot, invariant.rotary(k.view(7, 2, 32), positions, table).view(7, -1))
