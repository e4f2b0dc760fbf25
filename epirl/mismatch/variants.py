"""Trainer-side variants that change one numerical factor at a time on the same weights.

    (a) bf16 weights, bf16 activations         `trainer.base: bf16` (LoRALinear over the checkpoint weights)
    (b) FP8 weights, bf16 activations          `trainer.base: fp8` (Fp8LoRALinear = w8a16_lora: the FP8
                                               trainer and the matched engine's arithmetic)
    (c) FP8 weights, FP8 activations per token (b) with every FP8 projection switched to `w8a8_lora`
                                               (`fake_quant_activations`): vLLM's W8A8 numerics, computed
                                               by the trainer; the control that isolates δA from δK.

"bf16" means `model.dtype`: on CPU (`auto` → float32) every variant computes in fp32 and (a) is the
fp32 model. The scoring here reads the engine's top-k token ids so that the KL can be taken on the
engine's top-k support (see measure.py).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from epirl.kernels import FP8_DTYPE, w8a8_lora
from epirl.model import load_adapter, load_policy
from epirl.model.logprobs import head_log_softmax, head_logits

VARIANTS = {
    "a": "bf16 W, bf16 A",
    "b": "FP8 W, bf16 A",
    "c": "FP8 W, FP8 A",
}


def fp8_projections(policy) -> list[tuple[str, nn.Module]]:
    """Every FP8 projection of the policy: Fp8LoRALinear (LoRA targets) and Fp8Linear (the rest).

    Both hold `codes` [N, K] e4m3 and `scale` [1] buffers; Fp8LoRALinear also has lora_A / lora_B.
    """
    out = []
    for name, module in policy.model.named_modules():
        codes = getattr(module, "codes", None)
        if isinstance(codes, torch.Tensor) and codes.dtype == FP8_DTYPE and hasattr(module, "scale"):
            out.append((name, module))
    return out


def _w8a8_forward(module: nn.Module):
    lora_a = getattr(module, "lora_A", None)
    lora_b = getattr(module, "lora_B", None)
    lora_scale = float(getattr(module, "lora_scale", 1.0))

    def forward(x: torch.Tensor) -> torch.Tensor:
        # The same call the W8A8 engine makes per layer (plugin `apply`), plus the LoRA epilogue on the
        # unquantized x, which is where vLLM's punica path adds the adapter too.
        return w8a8_lora(x, module.codes, module.scale, lora_a, lora_b, lora_scale, module.bias)

    return forward


@contextmanager
def fake_quant_activations(policy) -> Iterator[int]:
    """Variant (c): inside the block every FP8 projection rounds its input to FP8 per token (vLLM's
    dynamic per-token scheme) before the FP8 GEMM. Yields the number of projections switched.

    Inference only (w8a8_lora has no backward). Instance-level `forward` overrides are removed on exit,
    so the policy returns bit-for-bit to variant (b).
    """
    modules = [m for _, m in fp8_projections(policy)]
    if not modules:
        raise ValueError("variant (c) needs an FP8 policy (trainer.base fp8 or shared); this one has no FP8 "
                         "projections")
    for module in modules:
        module.forward = _w8a8_forward(module)
    try:
        yield len(modules)
    finally:
        for module in modules:
            del module.forward


def load_variant_policy(cfg, variant: str, device: torch.device, adapter_dir: str | None = None,
                        bitwise: bool = False):
    """The policy of variant (a) (bf16 base) or (b)/(c) (FP8 base), with the adapter loaded if given; bitwise:
    with the invariant ops of `engine.bitwise` around the projections (what a bitwise engine is measured against)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown trainer variant {variant!r}; known: {sorted(VARIANTS)}")
    variant_cfg = copy.deepcopy(cfg)
    variant_cfg.trainer.base = "bf16" if variant == "a" else "fp8"
    variant_cfg.engine.bitwise = bitwise
    variant_cfg.trainer.gradient_checkpointing = False
    policy = load_policy(variant_cfg, device)
    if adapter_dir is not None:
        load_adapter(policy, adapter_dir)
    return policy.eval()


@dataclass
class ScoredSequence:
    """Trainer log-probs for one engine completion: the sampled tokens and the engine's top-k ids."""

    sampled_T: torch.Tensor  # [T] fp32 log p(sampled token)
    topk_T_K: torch.Tensor  # [T, K] fp32 log p(engine's top-k ids)


HEAD_CHUNK_TOKENS = 256  # fp32 logits of 256 positions × a 248k vocabulary (Qwen3.5) ≈ 0.25 GB


def _head_logprobs(hidden_N_H: torch.Tensor, lm_head: nn.Module, temperature: float,
                   exact_head: bool = False) -> torch.Tensor:
    # Same arithmetic as Policy.token_logprobs and vLLM's sampler (`head_logits`, `head_log_softmax`).
    logits_N_V = head_logits(hidden_N_H, lm_head.weight, lm_head.bias, temperature, exact_head)
    return head_log_softmax(logits_N_V, exact_head)


@torch.no_grad()
def score_sequences(policy, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                    topk_ids: list[torch.Tensor], temperature: float, max_batch_tokens: int = 4096
                    ) -> list[ScoredSequence]:
    """Trainer log-probs of each completion's tokens and of the engine's top-k ids at every position.

    Sequences are right-padded in batches of at most `max_batch_tokens` tokens (causal attention never
    looks right, so padding does not change real positions).
    """
    device = policy.device
    lm_head = policy.model.get_output_embeddings()
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    results: list[ScoredSequence | None] = [None] * len(prompt_ids)
    start = 0
    while start < len(prompt_ids):
        stop = start + 1
        while stop < len(prompt_ids) and max(lengths[start:stop + 1]) * (stop + 1 - start) <= max_batch_tokens:
            stop += 1
        width = max(lengths[start:stop])
        input_ids_B_L = torch.zeros(stop - start, width, dtype=torch.long)
        for row, i in enumerate(range(start, stop)):
            input_ids_B_L[row, :lengths[i]] = torch.tensor(list(prompt_ids[i]) + list(completion_ids[i]))
        hidden_B_L_H = policy.hidden_states(input_ids_B_L.to(device))
        for row, i in enumerate(range(start, stop)):
            n_prompt, n_completion = len(prompt_ids[i]), len(completion_ids[i])
            if n_completion == 0:
                results[i] = ScoredSequence(torch.zeros(0), torch.zeros(0, topk_ids[i].shape[-1]))
                continue
            # position t predicts token t + 1: the completion's tokens are predicted from n_prompt - 1 on
            hidden_T_H = hidden_B_L_H[row, n_prompt - 1:n_prompt - 1 + n_completion]
            targets_T = torch.tensor(completion_ids[i], device=device)
            topk_T_K_ids = topk_ids[i].to(device)
            sampled, topk = [], []
            for c in range(0, n_completion, HEAD_CHUNK_TOKENS):  # full-vocab fp32 rows, a chunk at a time
                logprobs_C_V = _head_logprobs(hidden_T_H[c:c + HEAD_CHUNK_TOKENS], lm_head, temperature,
                                              policy.bitwise)
                sampled.append(logprobs_C_V.gather(-1, targets_T[c:c + HEAD_CHUNK_TOKENS, None]).squeeze(-1))
                topk.append(logprobs_C_V.gather(-1, topk_T_K_ids[c:c + HEAD_CHUNK_TOKENS]))
            results[i] = ScoredSequence(torch.cat(sampled).float().cpu(), torch.cat(topk).float().cpu())
        start = stop
    return results  # type: ignore[return-value]
