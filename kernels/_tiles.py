"""Triton building blocks of every GEMM of epirl.kernels (W8A16, W8A8, multi-adapter W8A8): the grouped tile
order, the K-loop tile load, and partials summed in a fixed order. No op of its own."""

from __future__ import annotations

import triton
import triton.language as tl

# Partials (split-K chunks, LoRA-down sub-chunks) loaded at once when summed: the sum is a chain of dependent adds,
# but the loads need not be; with one load per add, every partial paid a full L2 round trip in turn (decode).
PART_UNROLL = tl.constexpr(4)


@triton.jit
def _grouped_tile_ids(num_outer, num_inner, GROUP: tl.constexpr):
    """(outer, inner) tile of this program in grouped order: GROUP outer tiles are swept over every inner
    tile while they sit in L2 (the same order for the row-major and the weight-transposed kernels)."""
    return _grouped_tile_ids_of(tl.program_id(0), num_outer, num_inner, GROUP)


@triton.jit
def _grouped_tile_ids_of(pid, num_outer, num_inner, GROUP: tl.constexpr):
    """`_grouped_tile_ids` for tile number pid (kernels whose first programs do other work)."""
    group = pid // (GROUP * num_inner)
    first = group * GROUP
    size = tl.minimum(num_outer - first, GROUP)
    outer = first + (pid % (GROUP * num_inner)) % size
    inner = (pid % (GROUP * num_inner)) // size
    return outer, inner


@triton.jit
def _load_tile(ptrs, mask_rows, mask_cols, EVEN_ROWS: tl.constexpr, EVEN_COLS: tl.constexpr):
    """A K-loop tile `[rows, cols]`, zeros outside mask_rows[:, None] & mask_cols[None, :]; a dimension whose EVEN
    flag says it lies inside the tensor loads without its mask (no predicates: every GEMM loop of epirl.kernels
    takes its loads through here). Same values either way."""
    if EVEN_ROWS and EVEN_COLS:
        tile = tl.load(ptrs)
    elif EVEN_ROWS:
        tile = tl.load(ptrs, mask=mask_cols[None, :], other=0.0)
    elif EVEN_COLS:
        tile = tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=mask_rows[:, None] & mask_cols[None, :], other=0.0)
    return tile


@triton.jit
def _sum_parts(ptr, part_stride, offs, mask, n_parts, BA: tl.constexpr, BB: tl.constexpr, CG: tl.constexpr):
    """fp32 [BA, BB]: partials ptr[c * part_stride + offs] for c < n_parts added in c order from +0.0, PART_UNROLL
    loads in flight. A partial past the last adds +0.0, which leaves every sum unchanged (a sum started at +0.0 is
    never -0.0): the same bits as one add per partial. CG: load with .cg (L2 only)."""
    total = tl.zeros((BA, BB), dtype=tl.float32)
    for c0 in range(0, n_parts, PART_UNROLL):
        for j in tl.static_range(PART_UNROLL):
            in_parts = (offs * 0 + c0 + j) < n_parts  # a tensor (the interpreter masks by tensors)
            if CG:  # through L2 only (partials other programs of the same launch wrote)
                total += tl.load(ptr + offs + (c0 + j) * part_stride, mask=mask & in_parts, other=0.0,
                                 cache_modifier=".cg")
            else:
                total += tl.load(ptr + offs + (c0 + j) * part_stride, mask=mask & in_parts, other=0.0)
    return total
