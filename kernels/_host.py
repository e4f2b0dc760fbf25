"""Host-side helpers for kernel launches: integer arithmetic and the operands every Triton op prepares alike.

`triton.cdiv` and `triton.next_power_of_2` are Triton constexpr functions: a call from host code goes through
`ConstexprFunction.__call__` (argument unwrapping, ~3 µs on a fast CPU, ~10 µs on the H200 machine's), and a
training linear's forward + backward made ~17 of them (scripts/profile_host_launch.py). These are the plain
integer versions.
"""

from __future__ import annotations

import torch

from .w8a16.reference import check_lora_args


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n for n ≥ 1 (and 0 for 0), as `triton.next_power_of_2`."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def prepare_operands(x, codes, lora_a, lora_b, bias):
    """Flatten x, cast LoRA/bias operands to x.dtype (the documented rounding), validate shapes."""
    N, K = codes.shape
    check_lora_args(K, N, lora_a, lora_b)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"Triton kernels take bf16 activations, got {x.dtype}")
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    a = None if lora_a is None else lora_a.to(x.dtype).contiguous()
    b = None if lora_b is None else lora_b.to(x.dtype)
    return x2, a, b, None if bias is None else bias.to(x.dtype)
