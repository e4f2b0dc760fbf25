"""Token log-probs (and the entropy metric) from hidden states, computed in token chunks of the LM head.

The LM head runs over `chunk_tokens` tokens at a time with an fp32 log-softmax, so the [tokens, vocab] logits
never exist at once; each chunk is activation-checkpointed, so the backward recomputes one chunk's logits at a
time. Its own module (torch only) so that the memory estimate can probe it without importing the policy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from epirl.kernels import invariant


def head_logits(hidden_N_H: torch.Tensor, head_weight_V_H: torch.Tensor, head_bias_V: torch.Tensor | None,
                temperature: float, exact_head: bool = False) -> torch.Tensor:
    """fp32 logits / T as vLLM's sampler sees them for processed_logprobs (contract 5): the head matmul in the model
    dtype (as vLLM's logits processor), cast to fp32, divided by the temperature (not multiplied by 1/T: the last bit
    differs) held as a 0-d tensor on the logits' device (CUDA turns division by a Python scalar into a product with its
    reciprocal; vLLM divides by its temperature tensor). exact_head (`engine.bitwise`, no bias): the batch-invariant
    fp32 logits the bitwise engine's head computes (epirl.kernels.invariant.logits)."""
    divisor = torch.full((), temperature, dtype=torch.float32, device=hidden_N_H.device)
    if exact_head:
        return invariant.logits(hidden_N_H, head_weight_V_H) / divisor
    return F.linear(hidden_N_H, head_weight_V_H, head_bias_V).float() / divisor


def head_log_softmax(logits_N_V: torch.Tensor, exact_head: bool = False) -> torch.Tensor:
    """fp32 log-probs of `head_logits`' output as the engine computes them: an fp32 log-softmax, or with exact_head the
    bitwise engine's (epirl.kernels.invariant.log_softmax, which the engine's sampler runs in place of its own)."""
    return invariant.log_softmax(logits_N_V) if exact_head else torch.log_softmax(logits_N_V, dim=-1)


def _chunk_logprobs(hidden_N_H: torch.Tensor, targets_N: torch.Tensor, head_weight_V_H: torch.Tensor,
                    head_bias_V: torch.Tensor | None, temperature: float, with_entropy: bool, exact_head: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    logits_N_V = head_logits(hidden_N_H, head_weight_V_H, head_bias_V, temperature, exact_head)
    logprobs_N_V = head_log_softmax(logits_N_V, exact_head)
    token_logprobs_N = logprobs_N_V.gather(-1, targets_N.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logprobs_N, token_logprobs_N.new_empty(0)
    # The entropy is a metric, never a loss term: no autograd graph. With grad, its exp/mul nodes kept the
    # chunk's fp32 [N, V] log-softmax alive (twice) until the next micro-batch — 17 GiB at 4 x 2304 tokens and
    # Qwen3.5's 248k vocabulary, measured on the H200 (the main recipe in benchmark mode).
    with torch.no_grad():
        entropy_N = -(logprobs_N_V.exp() * logprobs_N_V).sum(-1)
    return token_logprobs_N, entropy_N


def chunked_token_logprobs(hidden_N_H: torch.Tensor, targets_N: torch.Tensor, lm_head: nn.Linear,
                           temperature: float, chunk_tokens: int, with_entropy: bool = False, exact_head: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target | hidden) in fp32 for N tokens, computing at most `chunk_tokens` rows of logits at once.
    exact_head: the LM head as `engine.bitwise` computes it (no bias)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if chunk_tokens <= 0:
        raise ValueError(f"trainer.logprob_chunk_tokens must be > 0, got {chunk_tokens}")
    # Checkpoint only when a backward will come: otherwise there is nothing to save or recompute.
    recompute = torch.is_grad_enabled() and hidden_N_H.requires_grad
    logprobs, entropies = [], []
    for start in range(0, hidden_N_H.shape[0], chunk_tokens):
        args = (hidden_N_H[start:start + chunk_tokens], targets_N[start:start + chunk_tokens],
                lm_head.weight, lm_head.bias, float(temperature), with_entropy, exact_head)
        logprobs_n, entropy_n = (checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute
                                 else _chunk_logprobs(*args))
        logprobs.append(logprobs_n)
        entropies.append(entropy_n)
    logprobs_N = torch.cat(logprobs)
    return logprobs_N, (torch.cat(entropies) if with_entropy else None)
