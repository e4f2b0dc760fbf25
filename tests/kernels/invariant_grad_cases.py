"""The trainer's gradients through the Triton forwards of the invariant ops (`kernels/invariant/ops.py`), in Triton's
CPU interpreter: each op's gradient with the Triton forward (backward through the fp32 / SDPA stand-in) against
autograd through the float64 reference. Run by test_invariant_grad.py in a subprocess with TRITON_INTERPRET=1 (read
at import); prints one JSON line per case."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
os.environ["EPIRL_KERNELS"] = "triton"  # the Triton path on CPU tensors (the interpreter)

import torch  # noqa: E402

from epirl.kernels.invariant import ops, reference  # noqa: E402

BF16 = torch.bfloat16


def _grads(fn, inputs, seed):
    """fn's outputs and the gradients of a fixed random projection of them w.r.t. inputs."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in out)
    loss.backward()
    return out, [t.grad for t in leaves if t.requires_grad]


def _check(name, triton_fn, ref_fn, inputs, rtol):
    out_t, grads_t = _grads(triton_fn, inputs, 1)
    out_r, grads_r = _grads(ref_fn, inputs, 1)
    for a, b in zip(out_t, out_r):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    assert len(grads_t) == len(grads_r) > 0, name
    for a, b in zip(grads_t, grads_r):
        assert a is not None and torch.isfinite(a).all(), name
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < rtol, f"{name}: relative gradient error {err:.3g} >= {rtol}"


def case_rms_norm():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 40, generator=g) * 2).to(BF16)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(BF16)
    _check("rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6),
           [x, w], 2e-2)


def case_rotary():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 3, 16, generator=g).to(BF16)
    table = reference.rotary_table(16, 10000.0, 32, "cpu")
    pos = torch.arange(9)
    _check("rotary", lambda x: ops.rotary(x, pos, table), lambda x: reference.rotary(x, pos, table), [x], 2e-2)


def case_silu_mul():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(5, 24, generator=g).to(BF16), torch.randn(5, 24, generator=g).to(BF16)
    _check("silu_mul", ops.silu_mul, reference.silu_mul, [gate, up], 2e-2)


def case_attention():
    g = torch.Generator().manual_seed(0)
    B, T, H, G, D = 2, 11, 4, 2, 16
    q = torch.randn(B, T, H, D, generator=g).to(BF16)
    k = torch.randn(B, T, G, D, generator=g).to(BF16)
    v = torch.randn(B, T, G, D, generator=g).to(BF16)
    _check("attention", lambda q, k, v: ops.attention_batched(q, k, v, D ** -0.5),
           lambda q, k, v: reference.attention_batched(q, k, v, D ** -0.5), [q, k, v], 3e-2)


def case_head():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 32, generator=g).to(BF16)
    weight = (torch.randn(50, 32, generator=g) * 0.2).to(BF16)
    _check("head", lambda h, w: ops.log_softmax(ops.logits(h, w)),
           lambda h, w: reference.log_softmax(reference.logits(h, w)), [hidden, weight], 2e-2)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    from case_runner import run_cases

    run_cases(CASES, sys.argv[1:])
