"""Does the matched engine compute, layer by layer, what the trainer computes under the adapter it serves?

The matched W8A16 engine's LoRA layers read fixed adapter buffers (`plugin._LayerLoRA`) that `active_adapter` fills
before every generate. `capture_lora_layers` records the first calls of every such layer while the engine runs (an
eager engine: hooks do not fire inside CUDA-graph replays); `compare_with_trainer` then checks, for each layer, that
its buffers hold the trainer's adapter (rounded to the engine's dtype) and that each captured call's output equals
the trainer's modules on the same input, bitwise. A stale or mis-filled buffer, a LoRA term computed differently on
one side, or a setting that one side reads and the other does not shows up here as the first layer that differs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from epirl.engine.vllm_compat import lora_layers


@dataclass
class CapturedLayer:
    state: object  # the layer's `plugin._LayerLoRA`
    calls: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (input, output) per call
    buffers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (A, B) per slice, as served


@dataclass
class LayerComparison:
    layers: int
    buffers_equal: int
    outputs_equal: int
    first_difference: str | None  # "<layer> M=<tokens>: max |Δ| <value>" of the first layer that differs

    @property
    def bitwise(self) -> bool:
        return self.layers > 0 and self.buffers_equal == self.outputs_equal == self.layers


@contextlib.contextmanager
def capture_lora_layers(engine, calls: int = 2) -> Iterator[dict[str, CapturedLayer]]:
    """While active: the first `calls` (input, output) of every LoRA layer of a matched (w8a16) engine, with a copy of
    the adapter buffers the layer read on its first call. Empty for other precisions."""
    captured: dict[str, CapturedLayer] = {}
    hooks = []
    lora_base = lora_layers.lora_linear_base_class()
    if engine._fused is not None:
        for name, module in engine.vllm_model().named_modules():
            state = getattr(getattr(module, "base_layer", None), "_epirl_lora", None)
            if isinstance(module, lora_base) and state is not None:
                hooks.append(module.register_forward_hook(_recorder(captured, name, state, calls)))
    try:
        yield captured
    finally:
        for hook in hooks:
            hook.remove()


def _recorder(captured, name, state, calls):
    def hook(module, args, out):  # returns None: a returned value would replace the output
        entry = captured.setdefault(name, CapturedLayer(state))
        if not entry.buffers:
            entry.buffers = [(a.clone(), b.clone()) for a, b in zip(state.lora_a, state.lora_b)]
        if len(entry.calls) < calls:
            y = out[0] if isinstance(out, tuple) else out
            entry.calls.append((args[0].detach().clone(), y.detach().clone()))
    return hook


@torch.no_grad()
def compare_with_trainer(captured: dict[str, CapturedLayer], policy) -> LayerComparison:
    """Every captured layer against the trainer's modules (see the module docstring)."""
    modules = dict(policy.model.named_modules())
    buffers_equal = outputs_equal = 0
    first = None
    for name, entry in captured.items():
        slices = entry.state.hf_slices
        members = [modules.get(hf) for hf, _ in slices]
        same = True
        for (hf, row), width, (a_buf, b_buf), member in zip(slices, entry.state.widths, entry.buffers, members):
            lora_a, lora_b = getattr(member, "lora_A", None), getattr(member, "lora_B", None)
            want_a = torch.zeros_like(a_buf) if lora_a is None else lora_a.detach().to(a_buf.dtype)
            want_b = torch.zeros_like(b_buf) if lora_b is None else lora_b.detach()[row:row + width].to(b_buf.dtype)
            same &= torch.equal(a_buf, want_a) and torch.equal(b_buf, want_b)
        buffers_equal += same
        outputs_same = all(m is not None for m in members)
        for x, y in entry.calls:
            if not outputs_same:
                break
            reference = _trainer_output(x, slices, entry.state.widths, members)
            if not torch.equal(reference, y):
                outputs_same = False
                if first is None:
                    first = f"{name} M={x.shape[0]}: max |Δ| {float((reference.float() - y.float()).abs().max()):.3g}"
        outputs_equal += outputs_same
        if not same and first is None:
            first = f"{name}: adapter buffers differ from the trainer's parameters"
    return LayerComparison(len(captured), buffers_equal, outputs_equal, first)


def _trainer_output(x, slices, widths, members) -> torch.Tensor:
    """The engine layer's output as the trainer computes it: each slice's rows of its module's output (a module may
    span several slices, e.g. Qwen3.5's in_proj_qkv inside in_proj_qkvz)."""
    x = x.clone()  # vLLM captured x in inference mode; the trainer's modules take a normal tensor
    outputs: dict[int, torch.Tensor] = {}
    parts = []
    for (_, row), width, member in zip(slices, widths, members):
        if id(member) not in outputs:
            outputs[id(member)] = member(x)
        parts.append(outputs[id(member)][..., row:row + width])
    return torch.cat(parts, dim=-1)
