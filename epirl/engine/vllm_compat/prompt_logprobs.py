"""Prompt log-probs at a temperature: the model runner's `sampler.compute_logprobs` shadowed per instance.

Read from vLLM 0.26 and 0.32 source: `vllm/v1/worker/gpu_model_runner.py` (`_get_prompt_logprobs_dict` scores
prompt tokens with `self.sampler.compute_logprobs(logits)`, i.e. `log_softmax(logits)`, and never applies the
request temperature), `vllm/v1/sample/sampler.py` (`Sampler.compute_logprobs`, a staticmethod in both).

Public API that would replace it: none in 0.26–0.33 (`SamplingParams.temperature` does not reach prompt
log-probs). Sampled-token log-probs are public and honour the temperature (`logprobs_mode=
"processed_logprobs"`), which is what generation uses; only `RolloutEngine.score` at T != 1 needs this.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from epirl.engine.vllm_compat.detect import absent, vllm_version
from epirl.engine.vllm_compat.model_access import model_runner


@contextlib.contextmanager
def prompt_temperature(llm, temperature: float) -> Iterator[None]:
    """While active, prompt log-probs are the sampler's log-softmax of `fp32(logits) / T`, like its processed
    log-probs (it upcasts to fp32, then divides by T, then log-softmaxes). T is a 0-d tensor on the logits' device:
    CUDA turns a division by a Python scalar into a product with its reciprocal, another last bit than the sampler's
    and the trainer's division. The log-softmax is the one the sampler has (the bitwise engine's, `invariant_sampler`).

    The sampled token of the scoring request (max_tokens=1, no logprobs requested) does not go through it.
    """
    if temperature == 1.0:
        yield
        return
    sampler = getattr(model_runner(llm), "sampler", None)
    if sampler is None or not hasattr(sampler, "compute_logprobs"):
        raise NotImplementedError(
            f"vLLM {vllm_version()}: no runner.sampler.compute_logprobs; cannot score at T={temperature}"
        )
    shadowed = sampler.__dict__.get("compute_logprobs")
    log_softmax = sampler.compute_logprobs

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        divisor = torch.full((), temperature, dtype=torch.float32, device=logits.device)
        return log_softmax(logits.to(torch.float32) / divisor)

    sampler.compute_logprobs = compute_logprobs
    try:
        yield
    finally:
        if shadowed is None:
            del sampler.compute_logprobs  # back to the class's staticmethod
        else:
            sampler.compute_logprobs = shadowed


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.v1.sample.sampler:Sampler.compute_logprobs"])
