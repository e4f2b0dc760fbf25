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
    """While active, prompt log-probs are `log_softmax(fp32(logits) / T)`, exactly like the sampler's
    processed log-probs (it upcasts to fp32, then divides by T, then log-softmaxes).

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

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        return (logits.to(torch.float32) / temperature).log_softmax(dim=-1)

    sampler.compute_logprobs = compute_logprobs
    try:
        yield
    finally:
        del sampler.compute_logprobs  # back to the class's staticmethod


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.v1.sample.sampler:Sampler.compute_logprobs"])
