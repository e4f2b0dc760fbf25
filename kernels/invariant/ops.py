"""The invariant ops as both sides of the bitwise pairing call them: Triton kernels on CUDA tensors (triton_rows.py,
attention_triton.py), the float64 references elsewhere (reference.py), chosen per call by `kernels._dispatch` from the
tensors' device. The engine and the trainer of one run hold their tensors on the same device, so they run the same
kernels with the same fixed configs, and a row's bits do not depend on the rest of the call: the same numbers on both
sides.

The trainer differentiates through them. The references are torch float64 code, which autograd differentiates as it
stands; a Triton forward gets its gradient from `_TritonForward`: the backward recomputes the op with a plain
differentiable torch formula (fp32, or torch's SDPA for attention) and backpropagates through that. The gradient thus
belongs to a function within rounding of the forward's, which is all a gradient needs: only the forward's bits are
shared with the engine.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from epirl.kernels._dispatch import use_triton
from . import reference


def _triton_rows():
    from . import triton_rows
    return triton_rows


def _triton_attention():
    from . import attention_triton
    return attention_triton


class _TritonForward(torch.autograd.Function):
    """forward: `kernel(*args)`; backward: the gradient of `differentiable(*args)`, recomputed from the saved inputs.
    Non-tensor arguments pass through to both."""

    @staticmethod
    def forward(ctx, kernel: Callable, differentiable: Callable, *args):
        ctx.differentiable = differentiable
        ctx.slots = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.constants = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.slots))
        return kernel(*args)

    @staticmethod
    def backward(ctx, *grads_out):
        args = list(ctx.constants)
        needs = ctx.needs_input_grad[2:]
        wrt = []
        with torch.enable_grad():
            for i, saved in zip(ctx.slots, ctx.saved_tensors):
                args[i] = saved.detach().requires_grad_(bool(needs[i]) and saved.is_floating_point())
                if args[i].requires_grad:
                    wrt.append(i)
            outputs = ctx.differentiable(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads_out) if g is not None and o.requires_grad]
        grads = [None] * len(args)
        if wrt and pairs:
            found = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wrt], [g for _, g in pairs],
                                        allow_unused=True)
            for i, g in zip(wrt, found):
                grads[i] = g
        return (None, None, *grads)


def _run(name: str, triton_module: Callable, differentiable: Callable, *args):
    """`reference.<name>(*args)` unless args[0] is a CUDA tensor; else `<triton module>.<name>(*args)`, through
    `_TritonForward` when a gradient may flow."""
    if not use_triton(args[0], None):
        return getattr(reference, name)(*args)
    kernel = getattr(triton_module(), name)
    if _needs_grad(*args):
        return _TritonForward.apply(kernel, differentiable, *args)
    return kernel(*args)


# The backward's stand-ins for the Triton forwards: the references' formulas in float32, and torch's SDPA.

_rms_norm_fp32 = functools.partial(reference.rms_norm, compute=torch.float32)
_rotary_fp32 = functools.partial(reference.rotary, compute=torch.float32)
_silu_mul_fp32 = functools.partial(reference.silu_mul, compute=torch.float32)


def _attention_sdpa(q, k, v, scale):
    """q `[B, T, H, D]`, k, v `[B, T, G, D]` -> `[B, T, H, D]` through torch's SDPA (flash / efficient kernels)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


class _LogitsFn(torch.autograd.Function):
    """The Triton LM head with the linear map's own backward (no recomputed logits): d hidden = d logits · W in the
    weight's dtype, d W = d logitsᵀ · hidden when the weight trains."""

    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return _triton_rows().logits(hidden, weight)

    @staticmethod
    def backward(ctx, grad_N_V):
        hidden, weight = ctx.saved_tensors
        grad = grad_N_V.to(weight.dtype)
        d_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        d_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        return d_hidden, d_weight


class _LogSoftmaxFn(torch.autograd.Function):
    """The Triton log-softmax with its closed-form backward from the output: d x = g - softmax(x) · sum(g)."""

    @staticmethod
    def forward(ctx, logits_N_V):
        out = _triton_rows().log_softmax(logits_N_V)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad_N_V):
        (out,) = ctx.saved_tensors
        return grad_N_V - out.exp() * grad_N_V.sum(dim=-1, keepdim=True)


def _needs_grad(*args) -> bool:
    return torch.is_grad_enabled() and any(torch.is_tensor(a) and a.requires_grad for a in args)


# The ops.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`reference.rms_norm`'s contract: y, or (y, x + residual) with a residual."""
    return _run("rms_norm", _triton_rows, _rms_norm_fp32, x, weight, eps, residual)


def rotary(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`reference.rotary`'s contract: x `[T, heads, D]` or `[B, T, heads, D]`, Neox-style over table's width."""
    return _run("rotary", _triton_rows, _rotary_fp32, x, positions, table)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(silu(gate) · up), elementwise."""
    return _run("silu_mul", _triton_rows, _silu_mul_fp32, gate, up)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LM head: hidden `[N, H]`, weight `[V, H]` -> fp32 `[N, V]`."""
    if not use_triton(hidden, None):
        return reference.logits(hidden, weight)
    return _LogitsFn.apply(hidden, weight) if _needs_grad(hidden, weight) else _triton_rows().logits(hidden, weight)


def log_softmax(logits_N_V: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs of fp32 logits, row by row."""
    if not use_triton(logits_N_V, None):
        return reference.log_softmax(logits_N_V)
    return _LogSoftmaxFn.apply(logits_N_V) if _needs_grad(logits_N_V) else _triton_rows().log_softmax(logits_N_V)


def token_logprobs(logits_N_V: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)` at `token_ids` `[N, K]`, its bits exactly (the engine's sampler; no gradient)."""
    if not use_triton(logits_N_V, None):
        return reference.token_logprobs(logits_N_V, token_ids)
    return _triton_rows().token_logprobs(logits_N_V, token_ids)


def attention_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The trainer's attention: q `[B, T, H, D]`, k, v `[B, T, G, D]`, right-padded causal sequences from position 0."""
    return _run("attention_batched", _triton_attention, _attention_sdpa, q, k, v, scale)


def paged_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, block_table: torch.Tensor,
                    block_size: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's attention over its paged keys (`reference.paged_attention`'s contract; no gradient)."""
    if not use_triton(q, None):
        return reference.paged_attention(q, k_store, v_store, block_table, block_size, query_start_loc, seq_lens,
                                         max_query_len, scale, out)
    return _triton_attention().paged_attention(q, k_store, v_store, block_table, block_size, query_start_loc,
                                               seq_lens, max_query_len, scale, out=out)
