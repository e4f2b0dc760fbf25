"""The trainer's side of one call per fused layer (`w8a16/slices.py`): Hugging Face runs q, k, v (gate, up)
as separate modules on the same input; `SliceGroup` computes all of a group's outputs with one
`Fp8SlicedLoRAFunction` call — the matched engine's call for the fused layer — and hands each member its slice.

The first member called with an input runs the fused call and keeps the outputs until every member has taken its
own (a member called with another input, or twice, runs the call again: same bits, more work). Gradients flow through
the slices' views into the one call's backward, which gives each slice's A and B their own gradients.
"""

from __future__ import annotations

import torch

from ..w8a16.slices import sliced_lora_operands
from .module import _forward, lora_linear_backward


class Fp8SlicedLoRAFunction(torch.autograd.Function):
    """y `[..., ΣN_i]` = w8a16_lora(x, codes, scale, A_cat, B_bd, σ, bias) over the fused layer; gradients for x
    and every slice's A_i, B_i (None for slices without adapter). Arguments after `operands`: A_1 … A_S, B_1 … B_S."""

    @staticmethod
    def forward(ctx, x, codes, scale, bias, lora_scale, backend, widths, operands, *lora_ab):
        """operands: (A_cat, B_bd) of lora_ab in x's dtype (`sliced_lora_operands`), built by the caller from the
        parameters' current values."""
        slices = len(widths)
        lora_a, lora_b = lora_ab[:slices], lora_ab[slices:]
        a_cat, b_bd = operands
        y, xa = _forward(x, codes, scale, a_cat, b_bd, lora_scale, bias, backend)
        ctx.save_for_backward(x, a_cat, b_bd, codes, scale, xa)
        ctx.lora_scale, ctx.backend, ctx.widths = lora_scale, backend, list(widths)
        ctx.param_dtypes = [(a.dtype, b.dtype) if a is not None else None for a, b in zip(lora_a, lora_b)]
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, a_cat, b_bd, codes, scale, xa = ctx.saved_tensors
        slices = len(ctx.widths)
        grads_ab = [None] * (2 * slices)
        dx, d_a, d_b = lora_linear_backward(grad_y.contiguous(), x, codes, scale, a_cat, b_bd, ctx.lora_scale,
                                            ctx.needs_input_grad[0], ctx.backend, xa=xa,
                                            grad_dtypes=(torch.float32, torch.float32))
        if a_cat is not None:
            r, row = a_cat.shape[0] // slices, 0
            for i, (width, dtypes) in enumerate(zip(ctx.widths, ctx.param_dtypes)):
                if dtypes is not None and ctx.needs_input_grad[8 + i]:
                    grads_ab[i] = d_a[i * r:(i + 1) * r].to(dtypes[0], copy=True)
                if dtypes is not None and ctx.needs_input_grad[8 + slices + i]:
                    grads_ab[slices + i] = d_b[row:row + width, i * r:(i + 1) * r].to(dtypes[1], copy=True)
                row += width
        return (dx, None, None, None, None, None, None, None, *grads_ab)


def _fused_codes(codes_views: list[torch.Tensor]) -> torch.Tensor | None:
    """The `[ΣN_i, K]` codes the row views lie in, back to back in one buffer (None if they do not)."""
    first = codes_views[0]
    k, row_stride = first.shape[1], first.stride(0)
    expect = first.data_ptr()
    for view in codes_views:
        if view.shape[1] != k or view.stride() != first.stride() or view.data_ptr() != expect:
            return None
        expect += view.shape[0] * row_stride * view.element_size()
    if first.stride(1) != 1:
        return None
    return first.as_strided((sum(v.shape[0] for v in codes_views), k), first.stride())


class SliceGroup:
    """The FP8 modules of one fused layer (Fp8LoRALinear / Fp8Linear, in the engine's slice order)."""

    def __init__(self, members: list[torch.nn.Module]):
        self.members = members
        self.widths = [m.out_features for m in members]
        self.codes = _fused_codes([m.codes for m in members])
        biases = [m.bias for m in members]
        given = [b for b in biases if b is not None]
        # the engine's fused layer has one bias for all slices (none: zeros, which add nothing)
        self.bias = None if not given else torch.cat(
            [b if b is not None else given[0].new_zeros(w) for b, w in zip(biases, self.widths)])
        self._pending = None  # [x, x._version, slice outputs, indices taken]

    @staticmethod
    def why_not(members: list[torch.nn.Module]) -> str | None:
        """None if these modules can run as one call, else why not (one line)."""
        scales = {float(m.scale) for m in members}  # one per fused layer, as vLLM quantizes it
        lora_scales = {m.lora_scale for m in members if getattr(m, "lora_A", None) is not None}
        if len(scales) != 1:
            return f"their weight scales differ ({sorted(scales)})"
        if len(lora_scales) > 1:
            return f"their LoRA scales differ ({sorted(lora_scales)})"
        if _fused_codes([m.codes for m in members]) is None:
            return "their codes are not row views of one buffer"
        return None

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for x: its slice of the fused call."""
        pending = self._pending
        if pending is None or pending[0] is not x or pending[1] != x._version or index in pending[3]:
            pending = self._pending = [x, x._version, self._run(x), set()]
        pending[3].add(index)
        if len(pending[3]) == len(self.members):
            self._pending = None
        return pending[2][index]

    def _run(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lora_a = [getattr(m, "lora_A", None) for m in self.members]
        lora_b = [getattr(m, "lora_B", None) for m in self.members]
        lora_scale = next((m.lora_scale for m in self.members if getattr(m, "lora_A", None) is not None), 0.0)
        backend = next((m.backend for m in self.members if getattr(m, "backend", None) is not None), None)
        y = Fp8SlicedLoRAFunction.apply(x, self.codes, self.members[0].scale, self.bias, lora_scale, backend,
                                        self.widths, self._block_operands(lora_a, lora_b, x.dtype), *lora_a, *lora_b)
        return torch.split(y, self.widths, dim=-1)

    def _block_operands(self, lora_a, lora_b, dtype):
        """(A_cat, B_bd) from the adapter tensors as they are now, built on every call (two small copies per layer).

        Never cached across calls: nothing reliable says when an adapter changed. A fused optimizer step
        (`torch.optim.AdamW(fused=True)`, the trainer's on CUDA) updates the parameters in place without bumping
        their `_version`, and a swap of `param.data` (the probe scoring the previous adapter) keeps it too; a cache
        keyed on versions served the first step's operands for the whole run, so the trainer's q, k, v never saw
        their trained adapter while the engine served it."""
        with torch.no_grad():
            return sliced_lora_operands(lora_a, lora_b, self.widths, dtype)


def attach_slice_group(members: list[torch.nn.Module]) -> SliceGroup:
    """Make `members` (one fused layer's FP8 modules, in slice order) run as one call; a clear error if they cannot."""
    reason = SliceGroup.why_not(members)
    if reason is not None:
        raise ValueError(f"cannot fuse {len(members)} projections into one call: {reason}")
    group = SliceGroup(members)
    for index, module in enumerate(members):
        # plain attributes (not submodules): the group is not part of the state dict
        object.__setattr__(module, "slice_group", group)
        object.__setattr__(module, "slice_index", index)
    return group
