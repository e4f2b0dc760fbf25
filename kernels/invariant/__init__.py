"""Batch-invariant forward ops beside the projections (RMSNorm with residual, rotary, SiLU-and-multiply, causal
attention, the LM head's logits and log-probs) for the bitwise pairing. reference.py defines them (float64 between
named rounding points); triton_rows.py and attention_triton.py are the Triton kernels (fp32, one fixed reduction order
per op, configs from the op's widths only); ops.py picks one per call by the tensors' device and gives the Triton
forwards their gradients. Both the matched engine (epirl/engine/vllm_compat/invariant_layers.py) and the trainer
(epirl/model/bitwise.py) call the functions below, so the two run the same kernels on the same numbers.

The engine calls them through the custom ops below, which torch.compile keeps whole (a compiler that fused or
reordered their arithmetic would change bits the trainer's eager forward does not); the trainer calls the functions
directly, so that autograd differentiates them.
"""

from __future__ import annotations

import torch

from . import reference
from .ops import (attention_batched, log_softmax, logits, paged_attention, rms_norm, rotary, silu_mul,
                  token_logprobs)
from .reference import attention, decode_attention, rotary_table

__all__ = ["attention", "attention_batched", "decode_attention", "log_softmax", "logits", "paged_attention",
           "rms_norm", "rotary", "rotary_table", "silu_mul", "token_logprobs", "reference"]


@torch.library.custom_op("epirl::invariant_rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("epirl::invariant_add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm(x, weight, eps, residual)


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("epirl::invariant_rotary", mutates_args=())
def rotary_op(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, table: torch.Tensor,
              head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's layout: query / key `[T, heads · head_size]` (or `[T, heads, head_size]`), positions `[T]`."""
    def apply(x):
        heads = x.reshape(x.shape[0], -1, head_size)
        return rotary(heads, positions, table).reshape(x.shape)
    return apply(query), apply(key)


@rotary_op.register_fake
def _(positions, query, key, table, head_size):
    return torch.empty_like(query), torch.empty_like(key)


@torch.library.custom_op("epirl::invariant_silu_mul", mutates_args=())
def silu_mul_op(x: torch.Tensor) -> torch.Tensor:
    """vLLM's layout: x `[..., 2 I]` = gate then up -> `[..., I]`."""
    half = x.shape[-1] // 2
    return silu_mul(x[..., :half], x[..., half:])


@silu_mul_op.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
