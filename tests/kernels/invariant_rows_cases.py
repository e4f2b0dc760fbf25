"""The invariant row kernels (epirl.kernels.invariant.triton_rows) in Triton's CPU interpreter, on small odd shapes (run
by test_invariant_triton_rows.py in a subprocess with TRITON_INTERPRET=1 set before triton is imported). Prints one
JSON line per case.

Every case checks an op three ways: close to the float64 reference (reference.py) within the tolerance its docstring
states; batch invariance, bitwise (each row alone, the batch shuffled, the rows as a strided or misaligned slice of a
bigger tensor, extra leading dims); and outputs fully written (every torch.empty the op allocates is poisoned with
NaN). The kernels round bf16 to nearest by hand in the interpreter (whose own conversion truncates), so bf16 outputs
here are the GPU's values: the tolerances are the GPU's.
"""

import contextlib
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from epirl.kernels.invariant import reference as ref  # noqa: E402
from epirl.kernels.invariant import triton_rows as tr  # noqa: E402

BF16 = torch.bfloat16
NEG_INF = float("-inf")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bits (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.contiguous()), bits(b.contiguous()))


def max_bf16_ulps(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """Largest |got - want| in bf16 ulps (the spacing of bf16 values at |want|, 2^-7 of its binade) of |want| + floor ·
    mean|want|: the floor covers results that cancel (a - b of two fp32-rounded products), whose fp32 error is
    relative to the terms, not to the result."""
    mag = want.float().abs() + floor * want.float().abs().mean()
    ulp = torch.ldexp(torch.ones_like(mag), torch.frexp(mag.clamp_min(2.0 ** -126)).exponent - 8)
    return float(((got.float() - want.float()).abs() / ulp).max())


@contextlib.contextmanager
def poisoned_outputs():
    """Every floating torch.empty is filled with NaN: an element a kernel leaves unwritten shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty
    try:
        yield
    finally:
        torch.empty = empty


def slices_of_bigger(t: torch.Tensor, offset: int) -> torch.Tensor:
    """t's values as a view into a bigger buffer: every other row of a `[2N, W + 2·offset]` tensor, starting `offset`
    features in (offset 3: a start that is not 16-byte aligned, which the op copies; 8: an aligned strided view)."""
    n, w = t.shape
    big = torch.randn(2 * n, w + 2 * offset).to(t.dtype)
    view = big[::2, offset:offset + w]
    view.copy_(t)
    return view


def check_rows_invariant(fn, inputs, rows=(0, 1)):
    """fn(*row_tensors) (each `[N, ...]`) row by row: the batch's rows equal each row computed alone, the shuffled
    batch, and the batch read through strided / misaligned views, bit for bit."""
    full = fn(*inputs)
    full = full if isinstance(full, tuple) else (full,)
    n = inputs[0].shape[0]
    for i in rows:
        alone = fn(*(x[i:i + 1] for x in inputs))
        alone = alone if isinstance(alone, tuple) else (alone,)
        assert all(bits_equal(a, f[i:i + 1]) for a, f in zip(alone, full)), f"row {i} alone"
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    shuffled = fn(*(x[perm] for x in inputs))
    shuffled = shuffled if isinstance(shuffled, tuple) else (shuffled,)
    assert all(bits_equal(s, f[perm]) for s, f in zip(shuffled, full)), "shuffled batch"
    for offset in (3, 8):
        viewed = fn(*(slices_of_bigger(x.reshape(n, -1), offset).view(x.shape) if x.dim() == 2 else x
                      for x in inputs))
        viewed = viewed if isinstance(viewed, tuple) else (viewed,)
        assert all(bits_equal(v, f) for v, f in zip(viewed, full)), f"strided view, offset {offset}"
    return full


def case_rms_norm():
    # y within 1 bf16 ulp of the reference (fp32 vs float64 before the one rounding), the residual sum bit-equal to
    # torch's bf16 add (what the reference computes), rows invariant, one and two chunks (H = 9000 > MAX_NORM_BLOCK)
    g = torch.Generator().manual_seed(0)
    for H, N in ((72, 21), (100, 5), (9000, 3)):
        x = (torch.randn(N, H, generator=g) * 3).to(BF16)
        res = torch.randn(N, H, generator=g).to(BF16)
        w = (1 + 0.1 * torch.randn(H, generator=g)).to(BF16)
        y_ref, s_ref = ref.rms_norm(x, w, 1e-6, res)
        with poisoned_outputs():
            y, s = check_rows_invariant(lambda a, b: tr.rms_norm(a, w, 1e-6, b), (x, res), rows=(0, N - 1))
            plain = check_rows_invariant(lambda a: tr.rms_norm(a, w, 1e-6), (x,), rows=(N - 1,))[0]
        assert bits_equal(s, x + res) and bits_equal(s, s_ref), H
        assert max_bf16_ulps(y, y_ref) <= 1.0 and max_bf16_ulps(plain, ref.rms_norm(x, w, 1e-6)) <= 1.0, H
        assert not torch.isnan(y.float()).any() and not torch.isnan(plain.float()).any()
        # leading dims: [2, N, H] rows are the same rows
        y3, s3 = tr.rms_norm(torch.stack([x, x]), w, 1e-6, torch.stack([res, res]))
        assert bits_equal(y3[1], y) and bits_equal(s3[0], s)


def case_rotary():
    # every rotated value is its fp32 formula bf16(x1·c - x2·s) bit for bit (no FMA contraction) and within 1 ulp of
    # the reference (of |ref| + 2^-8 mean|ref|: a cancelling difference carries the terms' fp32 error); full and
    # partial rotary (rot 40 of D 80: half 20, not a power of two); [B, T, heads, D] too
    g = torch.Generator().manual_seed(1)
    for D, rot in ((64, 64), (80, 40)):
        T, heads = 19, 3
        table = ref.rotary_table(rot, 10000.0, 256, "cpu")
        q = (torch.randn(T, heads, D, generator=g) * 2).to(BF16)
        pos = torch.randint(0, 256, (T,), generator=g)
        with poisoned_outputs():
            out = check_rows_invariant(lambda a, p: tr.rotary(a.view(-1, heads, D), p, table).view(a.shape[0], -1),
                                       (q.view(T, -1), pos), rows=(0, T - 1))[0].view(T, heads, D)
        want = ref.rotary(q, pos, table)
        assert max_bf16_ulps(out, want, floor=2.0 ** -8) <= 1.0
        half = rot // 2
        cs = table[pos][:, None, :]
        x1, x2 = q[..., :half].float(), q[..., half:rot].float()
        formula = torch.cat([x1 * cs[..., :half] - x2 * cs[..., half:], x2 * cs[..., :half] + x1 * cs[..., half:]],
                            -1).to(BF16)
        assert bits_equal(out[..., :rot], formula) and bits_equal(out[..., rot:], q[..., rot:])
        # 4-D with positions [T]; a q slice of a fused [T, (heads + 2) · D] qkv tensor (vLLM's layout)
        out4 = tr.rotary(torch.stack([q, q.flip(0)]), pos, table)
        assert bits_equal(out4[0], out) and bits_equal(out4[1], tr.rotary(q.flip(0), pos, table))
        qkv = torch.cat([q.view(T, -1), torch.randn(T, 2 * D, generator=g).to(BF16)], -1)
        assert bits_equal(tr.rotary(qkv[:, :heads * D].view(T, heads, D), pos, table), out)


def case_silu_mul():
    # within 1 ulp of the reference (approximate exp and division on the GPU: ~2^-21, far below a bf16 ulp); gate
    # and up as the halves of one [T, 2I] tensor (row stride 2I), rows invariant, [B, T, I] too
    g = torch.Generator().manual_seed(2)
    for T, I in ((37, 100), (5, 1500)):
        gu = (torch.randn(T, 2 * I, generator=g) * 4).to(BF16)
        gu[0, :4] = torch.tensor([-100.0, 90.0, 0.0, -0.0])  # exp overflow, saturation, zeros: no NaN
        gate, up = gu[:, :I], gu[:, I:]
        with poisoned_outputs():
            out = check_rows_invariant(tr.silu_mul, (gate, up), rows=(0, T - 1))[0]
        assert max_bf16_ulps(out, ref.silu_mul(gate, up)) <= 1.0 and not torch.isnan(out.float()).any()
        assert bits_equal(tr.silu_mul(gate.contiguous(), up.contiguous()), out)
        out3 = tr.silu_mul(torch.stack([gate, gate]), torch.stack([up, up]))
        assert bits_equal(out3[1], out)


def case_logits():
    # |got - ref| <= 1e-5 · |h|·|w| (fp32 accumulation of exact products over K <= 100); rows invariant whatever
    # their slot in the 128-row tile and the number of row tiles; V not a multiple of the 256-column tile. (Here the
    # K loop is the interpreter's rank-1 form; the GPU's BK loop and its K masks run in the GPU tests.)
    g = torch.Generator().manual_seed(3)
    for N, H, V in ((37, 72, 300), (70, 100, 520)):
        h = torch.randn(N, H, generator=g).to(BF16)
        w = (torch.randn(V, H, generator=g) * 0.05).to(BF16)
        with poisoned_outputs():
            got = check_rows_invariant(lambda a: tr.logits(a, w), (h,), rows=(0, 1, N - 1))[0]
        want = ref.logits(h, w)
        scale = h.float().norm(dim=1)[:, None] * w.float().norm(dim=1)[None, :]
        assert got.dtype == torch.float32 and bool(((got - want).abs() <= 1e-5 * scale).all())
        tail = tr.logits(h[-7:], w)  # rows N-7.. in another tile slot (and another tile count)
        assert bits_equal(tail, got[-7:])


def case_log_softmax_and_token_logprobs():
    # |got - ref| <= 1e-5 for logits of magnitude <= ~30 (fp32 lse and subtraction); token_logprobs bit-equal to
    # log_softmax gathered; -inf entries, a whole tile of -inf (V = 9000: tiles of 4096), a row of -inf only (NaN,
    # as the reference), rows invariant
    g = torch.Generator().manual_seed(4)
    for N, V in ((37, 777), (5, 9000)):
        x = torch.randn(N, V, generator=g) * 8
        x[1, ::3] = NEG_INF
        x[2, :min(V, 4096)] = NEG_INF
        x[2, -1] = 30.0
        with poisoned_outputs():
            ls = check_rows_invariant(tr.log_softmax, (x,), rows=(0, 1, 2, N - 1))[0]
        want = ref.log_softmax(x)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(ls)) and bool(((ls - want)[finite].abs() <= 1e-5).all())
        ids = torch.randint(0, V, (N, 5), generator=g)
        ids[1, 0] = 0  # a -inf logit
        with poisoned_outputs():
            tok = check_rows_invariant(tr.token_logprobs, (x, ids), rows=(0, 1, 2, N - 1))[0]
        assert bits_equal(tok, ls.gather(-1, ids)) and tok[1, 0] == NEG_INF
        assert bits_equal(tr.token_logprobs(x, ids[:, 2:3].int()), ls.gather(-1, ids[:, 2:3]))
        assert bits_equal(tr.token_logprobs(x, ids.t().contiguous().t()), tok)  # ids with a column stride
        dead = x.clone()
        dead[0] = NEG_INF  # a row of -inf only: NaN everywhere, as the reference
        assert torch.isnan(tr.log_softmax(dead)[0]).all() and torch.isnan(ref.log_softmax(dead)[0]).all()
        assert bits_equal(tr.log_softmax(dead)[1:], ls[1:])
    big = torch.randn(3, 777, generator=g) * 5 + 1000.0  # large offsets: no overflow in exp
    assert bool(((tr.log_softmax(big) - ref.log_softmax(big)).abs() <= 1e-4).all())
    assert torch.isnan(tr.token_logprobs(big, torch.tensor([[777], [-1], [5]])).flatten()[:2]).all()


def case_empty_and_tiny():
    # zero rows: empty outputs of the right shape and dtype, nothing launched; one-feature rows
    w = torch.ones(72, dtype=BF16)
    e = torch.empty(0, 72, dtype=BF16)
    assert tr.rms_norm(e, w, 1e-6).shape == (0, 72)
    y, s = tr.rms_norm(e, w, 1e-6, e)
    assert y.shape == s.shape == (0, 72)
    table = ref.rotary_table(16, 10000.0, 8, "cpu")
    assert tr.rotary(torch.empty(0, 2, 16, dtype=BF16), torch.empty(0, dtype=torch.long), table).shape == (0, 2, 16)
    assert tr.silu_mul(e, e).shape == (0, 72)
    out = tr.logits(e, torch.ones(33, 72, dtype=BF16))
    assert out.shape == (0, 33) and out.dtype == torch.float32
    assert tr.log_softmax(torch.empty(0, 50)).shape == (0, 50)
    assert tr.token_logprobs(torch.empty(0, 50), torch.empty(0, 1, dtype=torch.long)).shape == (0, 1)
    one = torch.tensor([[3.0], [-2.0]])
    assert bits_equal(tr.log_softmax(one), torch.zeros(2, 1))
    x = torch.randn(3, 1).to(BF16)
    assert max_bf16_ulps(tr.rms_norm(x, torch.ones(1, dtype=BF16), 1e-6), ref.rms_norm(x, torch.ones(1, dtype=BF16),
                                                                                         1e-6)) <= 1.0


if __name__ == "__main__":
    from case_runner import run_cases

    run_cases({name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}, sys.argv[1:])
