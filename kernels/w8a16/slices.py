"""The slices of a fused layer (q, k, v) in one W8A16 call: every slice's rank-r LoRA as one rank-S·r term with a
block-diagonal B.

vLLM fuses q, k, v (and gate, up) into one layer; the trainer holds them as separate Hugging Face modules over row
views of the same codes and scale. One GEMM over the fused layer costs less than one per slice at both ends (H200,
Qwen3-8B, BENCHMARKS.md: q + k + v at one token 41 µs with LoRA against 14.8 for the fused qkv; k / v
at 8192 training tokens 1.23x bf16 against the fused shape's 0.97x), but the K chunking, hence the bits, depends on
the layer's N (kernels/w8a16/configs.py `k_chunking`), so the engine and the trainer must make the same call. It is
`w8a16_lora(x, codes, scale, A_cat, B_bd, σ, bias)` with

    A_cat = [A_1; …; A_S]            `[S·r, K]`
    B_bd  = B_i in slice i's rows and in columns i·r … (i+1)·r, exact zeros elsewhere   `[N, S·r]`

so that y[:, slice i] = bf16(x W_iᵀ s + σ (x A_iᵀ) B_iᵀ + bias_i): the off-diagonal products are exact zeros. A slice
without an adapter (a projection outside lora.targets) has zero blocks. Cost: the epilogue's LoRA product runs over
S·r columns (padded to a power of two: 256 for a rank-64 qkv) instead of r, ~5 % of the forward GEMM's flops for qkv
at K = 4096, and the backward's gB and dB run over the whole block matrix (~1 % each); against that, one launch
instead of S and the fused layer's better-shaped GEMM.

Measured on the H200 (BENCHMARKS.md), for the layers of `epirl.model.loading.ONE_CALL_LAYERS`
(qkv_proj only: gate_up_proj as one call was slower): the qkv layer at one token 19.6 µs against 29.9 per slice; in
training 0.92x bf16 against 1.15x; the matched engine's TPOT 4.80 / 5.95 ms at batch 1 / 32 against 5.24 / 6.82. So
it is the default; `kernels.fused_slices: false` runs one call per slice. The engine gets the setting through its
`EngineSpec` (epirl/engine/spec.py) and the trainer where it groups its modules (`epirl.model.loading`); both must make
the same call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import w8a16_lora


def sliced_lora_shapes(lora_a: Sequence, lora_b: Sequence, widths: Sequence[int]) -> tuple[int, int] | None:
    """(r, K) shared by the slices' adapters (None when no slice has one); a clear error on a mismatch."""
    if not (len(lora_a) == len(lora_b) == len(widths)):
        raise ValueError(f"sliced LoRA: {len(lora_a)} A, {len(lora_b)} B for {len(widths)} slices")
    shapes = set()
    for i, (a, b, width) in enumerate(zip(lora_a, lora_b, widths)):
        if (a is None) != (b is None):
            raise ValueError(f"sliced LoRA: slice {i} has only one of A and B")
        if a is None:
            continue
        if a.dim() != 2 or b.dim() != 2 or b.shape != (width, a.shape[0]):
            raise ValueError(f"sliced LoRA: slice {i} has A {tuple(a.shape)}, B {tuple(b.shape)}; want [r, K] and "
                             f"[{width}, r]")
        shapes.add((a.shape[0], a.shape[1]))
    if len(shapes) > 1:
        raise ValueError(f"sliced LoRA: the slices' adapters differ in (rank, K): {sorted(shapes)}")
    return shapes.pop() if shapes else None


def sliced_lora_operands(lora_a: Sequence, lora_b: Sequence, widths: Sequence[int], dtype: torch.dtype
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(A_cat `[S·r, K]`, B_bd `[N, S·r]`) in dtype from per-slice A_i `[r, K]` and B_i `[N_i, r]` (None for a slice
    without adapter); (None, None) when no slice has one. New tensors: callers with fixed buffers (the engine) keep
    `block_views` of their own instead."""
    shape = sliced_lora_shapes(lora_a, lora_b, widths)
    if shape is None:
        return None, None
    r, k = shape
    device = next(a.device for a in lora_a if a is not None)
    a_cat = torch.zeros(len(widths) * r, k, dtype=dtype, device=device)
    b_bd = torch.zeros(sum(widths), len(widths) * r, dtype=dtype, device=device)
    a_views, b_views = block_views(a_cat, b_bd, widths, r)
    for a, b, a_view, b_view in zip(lora_a, lora_b, a_views, b_views):
        if a is not None:
            a_view.copy_(a)
            b_view.copy_(b)
    return a_cat, b_bd


def block_views(a_cat: torch.Tensor, b_bd: torch.Tensor, widths: Sequence[int], r: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Slice i's A rows `[r, K]` of A_cat and its diagonal block `[N_i, r]` of B_bd, as views (writes go through)."""
    a_views, b_views, row = [], [], 0
    for i, width in enumerate(widths):
        a_views.append(a_cat[i * r:(i + 1) * r])
        b_views.append(b_bd[row:row + width, i * r:(i + 1) * r])
        row += width
    return a_views, b_views


def per_slice_call(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, lora_a: Sequence, lora_b: Sequence,
                   widths: Sequence[int], lora_scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A fused layer `[N, K]` (codes of its slices stacked) as one `w8a16_lora` per slice (`kernels.fused_slices:
    false`), each written into its columns of the layer's output `[M, N]`: no concatenation kernel. x is 2-D."""
    y = x.new_empty((x.shape[0], codes.shape[0]))
    start = 0
    for width, a, b in zip(widths, lora_a, lora_b):
        part_bias = None if bias is None else bias[start:start + width]
        w8a16_lora(x, codes[start:start + width], scale, a, b, lora_scale, bias=part_bias,
                   out=y[:, start:start + width])
        start += width
    return y


def fused_layer_call(x: torch.Tensor, codes: Sequence[torch.Tensor], scale: torch.Tensor, lora_a: Sequence,
                     lora_b: Sequence, lora_scale: float, *, one_call: bool) -> torch.Tensor:
    """A fused layer's output from its slices' codes `[N_i, K]` and adapters as the matched engine computes it:
    one call with the block operands when `one_call` (the engine's rule: `epirl.model.loading.runs_as_one_call`),
    else one `w8a16_lora` per slice, concatenated. For checks (engine == kernel); the codes are copied."""
    if not one_call:
        return torch.cat([w8a16_lora(x, c, scale, a, b, lora_scale) for c, a, b in zip(codes, lora_a, lora_b)], -1)
    widths = [c.shape[0] for c in codes]
    a_cat, b_bd = sliced_lora_operands(lora_a, lora_b, widths, x.dtype)
    return w8a16_lora(x, torch.cat(list(codes)), scale, a_cat, b_bd, lora_scale)
