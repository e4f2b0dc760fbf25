"""The matched engine's fused LoRA: `apply` of vLLM's LoRA-wrapped linear classes wrapped, for the process.

Read from vLLM 0.26 and 0.32 source: `vllm/lora/layers/base_linear.py` (`BaseLinearLayerWithLoRA`, whose
`forward` calls `self.apply(x, bias)`: the base layer's `quant_method.apply`, then punica LoRA; the wrapped
layer is `self.base_layer`), `column_parallel_linear.py`, `row_parallel_linear.py`, `replicated_linear.py`
(subclasses that override `apply`; `BaseLinearLayerWithLoRA.create_lora_weights` allocates the layer's adapter
slot buffers at model load, and `column_parallel_linear.py` overrides it). The class moved from `vllm.lora.layers`
to `vllm.lora.layers.base_linear`; both are tried.

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


def lora_linear_classes() -> list[type]:
    """BaseLinearLayerWithLoRA and every subclass of it defined so far."""
    classes, todo = [], [lora_linear_base_class()]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return classes


def wrap_lora_apply(takes_over: Callable[[object], bool], fused_apply: Callable) -> int:
    """Wrap `apply` of BaseLinearLayerWithLoRA and of each subclass that overrides it (idempotent): where
    `takes_over(base_layer)`, `fused_apply(self, x, bias)` runs instead of vLLM's. Returns the classes wrapped."""

    def first_apply(self, x, bias):
        return fused_apply(self, x, bias) if takes_over(self.base_layer) else None

    return wrap_lora_apply_first(first_apply, _WRAPPED)


def wrap_lora_apply_first(first_apply: Callable, marker: str) -> int:
    """Wrap `apply` of BaseLinearLayerWithLoRA and of each subclass that overrides it (idempotent per `marker`):
    `first_apply(self, x, bias)` runs first and vLLM's `apply` only where it returns None. Returns the classes
    wrapped."""
    wrapped = 0
    for cls in lora_linear_classes():
        original = cls.__dict__.get("apply")
        if original is None or getattr(original, marker, False):
            continue

        def apply(self, x, bias=None, _original=original):
            out = first_apply(self, x, bias)
            return _original(self, x, bias) if out is None else out

        setattr(apply, marker, True)
        cls.apply = apply
        wrapped += 1
    return wrapped


def on_lora_weights_created(callback: Callable[[object], None], marker: str) -> int:
    """Call `callback(layer)` after vLLM allocates a LoRA linear layer's adapter buffers (`create_lora_weights`,
    at model load: before torch.compile traces `apply`), on every class defining it (idempotent per `marker`)."""
    wrapped = 0
    for cls in lora_linear_classes():
        original = cls.__dict__.get("create_lora_weights")
        if original is None or getattr(original, marker, False):
            continue

        def create_lora_weights(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            callback(self)
            return result

        setattr(create_lora_weights, marker, True)
        cls.create_lora_weights = create_lora_weights
        wrapped += 1
    return wrapped


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    methods = ("apply", "create_lora_weights")
    for module in ("vllm.lora.layers.base_linear", "vllm.lora.layers"):
        if not absent([f"{module}:BaseLinearLayerWithLoRA.{name}" for name in methods]):
            return []
    return absent([f"vllm.lora.layers.base_linear:BaseLinearLayerWithLoRA.{name}" for name in methods])
