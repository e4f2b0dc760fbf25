"""The trainer-side model: LoRA linears on a bf16 or FP8 base, chunked log-probs, PEFT adapter I/O.

    policy = load_policy(cfg, device)            # trainer.base: bf16 | fp8 | shared
    logprobs_B_T, _ = policy.token_logprobs(input_ids_B_T, targets_B_T, temperature, chunk_tokens)
    save_adapter(policy, "runs/x/adapter")       # PEFT format, readable by peft and vLLM

Never call `policy.model.to(dtype)`: FP8 codes are floating-point buffers and would be cast.
"""

from epirl.model.adapter_io import load_adapter, save_adapter
from epirl.model.loading import build_policy, load_policy, random_policy
from epirl.model.lora import LoRALinear
from epirl.model.memory import preflight_check
from epirl.model.policy import Policy

__all__ = ["Policy", "LoRALinear", "load_policy", "build_policy", "random_policy", "save_adapter",
           "load_adapter", "preflight_check"]
