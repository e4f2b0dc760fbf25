"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13)."""

from __future__ import annotations


def overlong_penalty(response_len: int, max_tokens: int, buffer: int, factor: float) -> float:
    """Length penalty added to the reward of one response.

    0 while ``response_len <= max_tokens - buffer``; then falls linearly to ``-factor`` at
    ``response_len == max_tokens`` (``-(len - (max - buffer)) / buffer * factor``), floored at ``-factor``
    so a response longer than ``max_tokens`` is not punished more than a truncated one.
    ``buffer == 0`` switches the shaping off (returns 0.0).
    """
    if max_tokens <= 0:
        raise ValueError(f"overlong_penalty: max_tokens must be > 0, got {max_tokens}")
    if not 0 <= buffer <= max_tokens:
        raise ValueError(f"overlong_penalty: buffer must be in [0, max_tokens={max_tokens}], got {buffer}")
    if factor < 0:
        raise ValueError(f"overlong_penalty: factor must be >= 0, got {factor}")
    if buffer == 0:
        return 0.0
    excess = response_len - (max_tokens - buffer)
    if excess <= 0:
        return 0.0
    return max(-excess / buffer * factor, -factor)
