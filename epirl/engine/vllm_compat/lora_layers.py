"""The matched engine's fused LoRA: `apply` of vLLM's LoRA-wrapped linear classes wrapped, for the process.

Read from vLLM 0.26 and 0.32 source: `vllm/lora/layers/base_linear.py` (`BaseLinearLayerWithLoRA`, whose
`forward` calls `self.apply(x, bias)`: the base layer's `quant_method.apply`, then punica LoRA; the wrapped
layer is `self.base_layer`), `column_parallel_linear.py`, `row_parallel_linear.py`, `replicated_linear.py`
(subclasses that override `apply`). The class moved from `vllm.lora.layers` to
`vllm.lora.layers.base_linear`; both are tried.

Why class level: torch.compile and CUDA-graph capture see the method the class has when vLLM builds the
model, so the wrap is installed before any engine starts, for every subclass that defines its own `apply`,
and is a no-op for layers whose base layer carries no epirl LoRA state (every other quantization method).

Public API that would replace it: none in 0.26–0.33; a per-quantization-method hook in `LoRAConfig` (or a
quant-method `apply` that receives the LoRA slot) would.
"""

from __future__ import annotations

from typing import Callable

from epirl.engine.vllm_compat.detect import absent

_WRAPPED = "_epirl_wrapped"


def lora_linear_base_class() -> type:
    """vLLM's base class of LoRA-wrapped linear layers (module moved over the versions)."""
    try:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    except ImportError:
        from vllm.lora.layers import BaseLinearLayerWithLoRA
    return BaseLinearLayerWithLoRA


def wrap_lora_apply(takes_over: Callable[[object], bool], fused_apply: Callable) -> int:
    """Wrap `apply` of BaseLinearLayerWithLoRA and of each subclass that overrides it (idempotent): where
    `takes_over(base_layer)`, `fused_apply(self, x, bias)` runs instead of vLLM's. Returns the classes wrapped."""
    root = lora_linear_base_class()
    classes, todo = [], [root]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    patched = 0
    for cls in classes:
        original = cls.__dict__.get("apply")
        if original is None or getattr(original, _WRAPPED, False):
            continue

        def apply(self, x, bias=None, _original=original):
            if takes_over(self.base_layer):
                return fused_apply(self, x, bias)
            return _original(self, x, bias)

        setattr(apply, _WRAPPED, True)
        cls.apply = apply
        patched += 1
    return patched


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    for module in ("vllm.lora.layers.base_linear", "vllm.lora.layers"):
        if not absent([f"{module}:BaseLinearLayerWithLoRA.apply"]):
            return []
    return ["vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.apply"]
