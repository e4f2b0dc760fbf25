"""Host-side integer helpers for kernel launches.

`triton.cdiv` and `triton.next_power_of_2` are Triton constexpr functions: a call from host code goes through
`ConstexprFunction.__call__` (argument unwrapping, ~3 µs on a fast CPU, ~10 µs on the H200 machine's), and a
training linear's forward + backward made ~17 of them (scripts/profile_host_launch.py). These are the plain
integer versions.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n for n ≥ 1 (and 0 for 0), as `triton.next_power_of_2`."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()
