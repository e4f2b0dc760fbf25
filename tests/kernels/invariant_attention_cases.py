"""The invariant Triton attention (kernels/invariant/attention_triton.py) on tiny shapes in Triton's CPU interpreter
(run by test_invariant_attention_triton.py in a subprocess with TRITON_INTERPRET=1 set before triton is imported).
Prints one JSON line per case. The helpers take a device: test_invariant_attention_triton_gpu.py runs the same
checks on CUDA at model sizes.

Bitwise means equal int16 bit patterns (so -0 and +0 differ, as they would not under torch.equal).
"""

import os
import random
import sys

import torch

from epirl.kernels.invariant.attention_triton import attention_batched, attention_config, paged_attention
from epirl.kernels.invariant.reference import attention as reference_attention

CONFIGS = [(6, 2, 16), (9, 3, 32), (4, 4, 32)]  # (H, G, D): group 3 (padded to 4 head rows), 3 kv heads, no GQA
LENGTHS = (1, 7, 33, 70)


def bits(t):
    return t.contiguous().view(torch.int16)


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def sequences(lengths, H, G, D, seed=0, device="cpu"):
    """Per sequence (q `[L, H, D]`, k `[L, G, D]`, v `[L, G, D]`) bf16; q scaled up so the softmax is peaky."""
    g = torch.Generator(device=device).manual_seed(seed)
    def randn(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device) * s).bfloat16()
    return [(randn(L, H, D, s=2.0), randn(L, G, D), randn(L, G, D)) for L in lengths]


def batched(seqs, scale, order=None, pad=0, seed=1):
    """attention_batched over the sequences (in `order`), right-padded with finite junk to the longest + pad;
    returns each sequence's `[L, H, D]` rows, in the sequences' own order."""
    order = list(range(len(seqs))) if order is None else order
    T = max(seqs[i][0].shape[0] for i in order) + pad
    H, D = seqs[0][0].shape[1:]
    G = seqs[0][1].shape[1]
    device = seqs[0][0].device
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = []
    for t, heads in ((0, H), (1, G), (2, G)):
        x = torch.randn(len(order), T, heads, D, generator=g, device=device).bfloat16()
        for b, i in enumerate(order):
            x[b, :seqs[i][t].shape[0]] = seqs[i][t]
        tensors.append(x)
    out = attention_batched(*tensors, scale)
    got = [None] * len(seqs)
    for b, i in enumerate(order):
        got[i] = out[b, :seqs[i][0].shape[0]]
    return got


class PagedCache:
    """A paged key / value store for the sequences: each request's blocks a random permutation of the pool, spare
    blocks and table entries past a request's blocks garbage, every slot NaN until written (as the engine writes
    a step's keys before its attention). layout: "slots" `[slots, G, D]`, "blocks" `[blocks, block_size, G, D]`
    contiguous, or "flash": vLLM 0.26's FlashAttention cache `[blocks, G, block_size, 2 D]` read through its key
    and value views (strided, interleaved), as the engine reads it in place."""

    def __init__(self, seqs, block_size, seed=0, layout="slots"):
        self.seqs, self.bs, self.layout = seqs, block_size, layout
        rng = random.Random(seed)
        need = [-(-q.shape[0] // block_size) for q, _, _ in seqs]
        n_blocks = sum(need) + 3
        pool = list(range(n_blocks))
        rng.shuffle(pool)
        device = seqs[0][0].device
        self.table = torch.full((len(seqs), max(need) + 2), 10 ** 6, dtype=torch.int32)
        at = 0
        for r, n in enumerate(need):
            self.table[r, :n] = torch.tensor(pool[at:at + n], dtype=torch.int32)
            at += n
        self.table = self.table.to(device)
        G, D = seqs[0][1].shape[1:]
        if layout == "flash":
            cache = torch.full((n_blocks, G, block_size, 2 * D), float("nan"), dtype=torch.bfloat16, device=device)
            self.k, self.v = cache.transpose(1, 2).split(D, dim=-1)
        else:
            self.k = torch.full((n_blocks * block_size, G, D), float("nan"), dtype=torch.bfloat16, device=device)
            self.v = self.k.clone()
            if layout == "blocks":
                self.k, self.v = (t.view(-1, block_size, G, D) for t in (self.k, self.v))

    def slots(self, r, start, end):
        p = torch.arange(start, end, device=self.table.device)
        return self.table[r, p // self.bs].long() * self.bs + p % self.bs

    def step(self, parts, scale, extra_rows=2):
        """One engine step: parts = [(request, start, end)], rows for positions start .. end - 1, seq_len = end
        (start == end: a request with no rows this step). Writes their keys, runs paged_attention into a NaN
        output (a strided view, as the engine's output buffer), checks that exactly the owned rows were written,
        and returns {(request, position): row}."""
        H, D = self.seqs[0][0].shape[1:]
        device = self.k.device
        for r, start, end in parts:
            s = self.slots(r, start, end)
            at = (s // self.bs, s % self.bs) if self.k.dim() == 4 else s
            self.k[at], self.v[at] = self.seqs[r][1][start:end], self.seqs[r][2][start:end]
        rows = [self.seqs[r][0][start:end] for r, start, end in parts]
        n = sum(x.shape[0] for x in rows)
        q = torch.cat(rows + [torch.randn(extra_rows, H, D, device=device).bfloat16()])
        qsl = torch.tensor([0] + [e - s for _, s, e in parts], device=device).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([e for _, _, e in parts], dtype=torch.int32, device=device)
        table = self.table[[r for r, _, _ in parts]]
        buffer = torch.full((n + extra_rows, H * D + 3), float("nan"), dtype=torch.bfloat16, device=device)
        out = buffer[:, :H * D].view(n + extra_rows, H, D)
        k, v = self.k, self.v
        max_q = max([e - s for _, s, e in parts] + [0])
        got = paged_attention(q, k, v, table, self.bs, qsl, seq_lens, max_q, scale, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert not torch.isnan(buffer[:n, :H * D].float()).any(), "an owned row has NaN or was not written"
        assert torch.isnan(buffer[n:].float()).all() and torch.isnan(buffer[:, H * D:].float()).all(), \
            "wrote outside the owned rows"
        result, at = {}, 0
        for r, start, end in parts:
            for p in range(start, end):
                result[(r, p)] = out[at]
                at += 1
        return result


def check_rows(result, want):
    for (r, p), row in result.items():
        assert bits_equal(row, want[r][p]), f"request {r} position {p} differs from the batched row"


def schedule(lengths, rng, chunks, decode_tail=0):
    """Engine-like steps: each step a random subset of the unfinished requests in random order, each advancing
    by a chunk from `chunks` (1: a decode step); with decode_tail, the last positions go one token per step.
    Now and then a finished request sits in a step with no rows (q_len 0)."""
    done = [0] * len(lengths)
    steps = []
    while any(d < L for d, L in zip(done, lengths)):
        live = [r for r, (d, L) in enumerate(zip(done, lengths)) if d < L]
        rng.shuffle(live)
        picked = live[:rng.randint(1, len(live))]
        parts = []
        for r in picked:
            size = 1 if done[r] >= lengths[r] - decode_tail else rng.choice(chunks)
            end = min(lengths[r], done[r] + size)
            parts.append((r, done[r], end))
            done[r] = end
        idle = [r for r, (d, L) in enumerate(zip(done, lengths)) if d == L and d > 0 and r not in picked]
        if idle and rng.random() < 0.3:
            r = rng.choice(idle)
            parts.insert(rng.randint(0, len(parts)), (r, lengths[r], lengths[r]))
        steps.append(parts)
    return steps


def run_schedule(seqs, want, block_size, steps, scale, seed=0, layout="slots"):
    cache = PagedCache(seqs, block_size, seed=seed, layout=layout)
    seen = set()
    for parts in steps:
        result = cache.step(parts, scale)
        check_rows(result, want)
        seen |= set(result)
    assert seen == {(r, p) for r, (q, _, _) in enumerate(seqs) for p in range(q.shape[0])}


def close_bf16(got, want, ulps=6.0):
    """Within a few bf16 ulps of the float64 reference, with a floor of a few ulps of the mean magnitude: fp32
    accumulation, the bf16 probabilities of the second MMA and (here) the interpreter's truncating bf16 rounding."""
    tol = (want.float().abs() + want.float().abs().mean()) * (ulps * 2 ** -8)
    return bool(torch.all((got.float() - want.float()).abs() <= tol)) and not torch.isnan(got.float()).any()


# ---- cases -------------------------------------------------------------------------------------------------------

def case_matches_reference():
    for H, G, D in CONFIGS:
        seqs = sequences(LENGTHS, H, G, D, seed=H)
        scale = D ** -0.5
        for (q, k, v), got in zip(seqs, batched(seqs, scale)):
            assert close_bf16(got, reference_attention(q, k, v, scale)), (H, G, D, q.shape[0])
        # a chunk's rows against the reference's q_start (the last 20 positions of the 70)
        q, k, v = seqs[3]
        cache = PagedCache([seqs[3]], 16)
        cache.step([(0, 0, 50)], scale)
        chunk = cache.step([(0, 50, 70)], scale)
        want = reference_attention(q[50:], k, v, scale, q_start=50)
        assert close_bf16(torch.stack([chunk[(0, p)] for p in range(50, 70)]), want), (H, G, D)


def case_batched_rows_do_not_depend_on_the_batch():
    for H, G, D in CONFIGS:
        seqs = sequences(LENGTHS, H, G, D, seed=H + 1)
        scale = D ** -0.5
        want = batched(seqs, scale)
        for order, pad in (([3, 1, 0, 2], 5), ([1], 0)):
            for i, got in zip(order, [batched(seqs, scale, order=order, pad=pad, seed=pad)[i] for i in order]):
                assert bits_equal(got, want[i]), (H, G, D, order, i)


def case_whole_prefill_paged_equals_batched():
    for H, G, D in CONFIGS:
        seqs = sequences(LENGTHS, H, G, D, seed=H + 2)
        scale = D ** -0.5
        want = batched(seqs, scale)
        for block_size, layout in ((16, "slots"), (1, "slots"), (5, "blocks"), (16, "flash")):
            order = [2, 0, 3, 1]
            steps = [[(r, 0, seqs[r][0].shape[0]) for r in order]]
            run_schedule(seqs, want, block_size, steps, scale, seed=block_size, layout=layout)


def case_chunked_prefill_and_decode_mixed():
    rng = random.Random(0)
    for (H, G, D), block_size in zip(CONFIGS, (16, 5, 1)):
        seqs = sequences(LENGTHS, H, G, D, seed=H + 3)
        scale = D ** -0.5
        want = batched(seqs, scale)
        mixed = False
        while not mixed:  # a schedule with a step that holds a one-row request beside a longer chunk
            steps = schedule([q.shape[0] for q, _, _ in seqs], rng, chunks=(1, 3, 9, 24))
            mixed = any(1 in {e - s for _, s, e in p} and max(e - s for _, s, e in p) > 1 for p in steps)
        run_schedule(seqs, want, block_size, steps, scale, seed=H)


def case_decode_steps():
    # prefill to a few tokens before the end (whole or in chunks), then one token per step for every request
    rng = random.Random(1)
    for (H, G, D), block_size, layout in zip(CONFIGS, (5, 1, 16), ("slots", "blocks", "flash")):
        seqs = sequences(LENGTHS, H, G, D, seed=H + 4)
        scale = D ** -0.5
        want = batched(seqs, scale, order=[3, 2, 1, 0], pad=2)
        steps = schedule([q.shape[0] for q, _, _ in seqs], rng, chunks=(20, 70), decode_tail=6)
        run_schedule(seqs, want, block_size, steps, scale, seed=D, layout=layout)


def case_masked_key_blocks_are_noops():
    # rows of one tile that need fewer key blocks than the tile's last row (the tile straddles a key block
    # boundary) against the same rows as decode steps (one request each, in one call), whose programs stop at the
    # row's own block; one value feature is exactly -0 and one +0 for every key, so those outputs are exact zeros,
    # whose sign must not depend on the extra blocks either (+0 both ways)
    for H, G, D in CONFIGS:
        cfg = attention_config(D, H // G)
        bn, bp = cfg["BLOCK_N"], cfg["BLOCK_P"]
        L = bn + 4
        start = max(0, bn - bp // 2)
        seqs = sequences([L], H, G, D, seed=5)
        seqs[0][2][:, :, 0] = -0.0
        seqs[0][2][:, :, 1] = 0.0
        scale = D ** -0.5
        cache = PagedCache(seqs, 16)
        if start:
            cache.step([(0, 0, start)], scale)
        tile = cache.step([(0, start, L)], scale)
        rows = sorted({start, start + 1, bn - 2, bn - 1, bn, L - 1})
        decodes = cache.step([(0, p, p + 1) for p in rows], scale)
        for p in rows:
            assert bits_equal(tile[(0, p)], decodes[(0, p)]), (H, G, D, p)
            assert (bits(decodes[(0, p)][:, :2]) == 0).all(), "an exact zero is not +0"


def case_empty_requests_and_length_one():
    H, G, D = 9, 3, 32
    seqs = sequences([1, 1, 7, 1], H, G, D, seed=7)
    scale = D ** -0.5
    want = batched(seqs, scale)
    for i, (q, k, v) in enumerate(seqs):
        if q.shape[0] == 1:  # one key: the output is that key's value (per kv head), softmax weight exactly 1
            assert bits_equal(want[i][0], v[0].repeat_interleave(H // G, dim=0))
    cache = PagedCache(seqs, 5)
    # q_len 0 requests first, between and last; one of them before any of its keys exist (seq_len 0)
    check_rows(cache.step([(1, 0, 0), (0, 0, 1), (2, 0, 4), (3, 0, 0)], scale), want)
    check_rows(cache.step([(0, 1, 1), (2, 4, 7), (1, 0, 1), (3, 0, 1)], scale), want)
    # a call where no request has rows writes nothing (max_query_len 0 and max_query_len > 0)
    check_rows(cache.step([(0, 1, 1), (2, 7, 7)], scale), want)
    # without `out`: a fresh tensor, the same bits
    q, k, v = seqs[2]
    idx = torch.tensor([0, 7], dtype=torch.int32)
    fresh = paged_attention(q, k, v, torch.zeros(1, 1, dtype=torch.int32), 7, idx, idx[1:], 7, scale)
    assert bits_equal(fresh, want[2])


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    from case_runner import run_cases

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    run_cases(CASES, sys.argv[1:])
