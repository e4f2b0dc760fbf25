"""The bitwise pairing's invariant ops on a GPU, at SmolLM2's sizes: a row's bits do not depend on the other rows of
the call (the engine's decode batch against the trainer's whole sequences), and the sampled token's log-prob the
engine's sampler computes (fp32 logits / T, the invariant log-softmax at the token) equals the trainer's
`chunked_token_logprobs` for any batch and chunk. The CPU twins are in test_invariant.py; here CUDA's own reductions
(float64 GEMMs, softmaxes and log-sum-exps) are what is pinned."""

import pytest
import torch

from epirl.kernels import invariant

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
H, V, HEADS, KV_HEADS, D = 576, 49152, 9, 3, 64  # SmolLM2-135M
ROWS = (1, 3, 16, 61)


@pytest.fixture
def gen():
    return torch.Generator(device="cuda").manual_seed(0)


def _randn(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(BF16)


def test_norm_rotary_silu_rows_do_not_depend_on_the_batch(gen):
    x, res = _randn(61, H, gen=gen, scale=3), _randn(61, H, gen=gen)
    w = (1 + 0.1 * torch.randn(H, generator=gen, device="cuda")).to(BF16)
    full_y, full_r = invariant.rms_norm(x, w, 1e-5, res)
    q = _randn(61, HEADS, D, gen=gen)
    positions = torch.arange(61, device="cuda") * 7
    table = invariant.rotary_table(D, 10000.0, 512, "cuda")
    full_q = invariant.rotary(q, positions, table)
    g, u = _randn(61, 1536, gen=gen), _randn(61, 1536, gen=gen)
    full_act = invariant.silu_mul(g, u)
    for n in ROWS:
        y, r = invariant.rms_norm(x[-n:], w, 1e-5, res[-n:])
        assert torch.equal(y, full_y[-n:]) and torch.equal(r, full_r[-n:])
        assert torch.equal(invariant.rotary(q[-n:], positions[-n:], table), full_q[-n:])
        assert torch.equal(invariant.silu_mul(g[-n:], u[-n:]), full_act[-n:])


def test_decode_attention_rows_equal_the_whole_sequence_rows(gen):
    lengths = torch.tensor([5, 130, 77, 1, 300], device="cuda")
    L = int(lengths.max())
    k, v = _randn(len(lengths), L, KV_HEADS, D, gen=gen), _randn(len(lengths), L, KV_HEADS, D, gen=gen)
    q_last = _randn(len(lengths), HEADS, D, gen=gen)
    k[0, 5:] = float("nan")  # padding never reaches a row, whatever it holds
    batched = invariant.decode_attention(q_last, k, v, lengths, D ** -0.5)
    for r, n in enumerate(lengths.tolist()):
        q_seq = _randn(n, HEADS, D, gen=gen)
        q_seq[-1] = q_last[r]
        whole = invariant.attention(q_seq, k[r, :n], v[r, :n], D ** -0.5)
        assert torch.equal(batched[r], whole[-1]), f"request {r} ({n} keys)"


def test_sampled_logprob_equals_the_trainers_for_any_batch_and_chunk(gen):
    """The bitwise engine's sampler as `invariant_sampler` installs it in vLLM's V2 runner: fp32 logits (invariant
    head), divided by the temperature held per request, `invariant.token_logprobs` at the sampled token — against the
    trainer's chunked path, rows in other batches and chunks."""
    from epirl.engine.vllm_compat.invariant_sampler import divide_by_temperature  # imports no vLLM
    from epirl.model.logprobs import chunked_token_logprobs  # the trainer's package (its config needs pydantic)

    weight = _randn(V, H, gen=gen, scale=0.05)
    hidden = _randn(61, H, gen=gen, scale=2)
    targets = torch.randint(0, V, (61,), generator=gen, device="cuda")
    temperature = 0.7
    head = torch.nn.Linear(H, V, bias=False, device="cuda", dtype=BF16)
    head.weight.data.copy_(weight)
    with torch.no_grad():
        trainer = {chunk: chunked_token_logprobs(hidden, targets, head, temperature, chunk, exact_head=True)[0]
                   for chunk in (7, 61, 4096)}
        for chunk, lp in trainer.items():
            assert torch.equal(lp, trainer[4096]), f"chunk {chunk}"
        for n in ROWS:
            logits = invariant.logits(hidden[-n:], weight)
            requests = torch.arange(n, device="cuda")
            divide_by_temperature(logits, requests, torch.full((n,), temperature, device="cuda"))
            engine = invariant.token_logprobs(logits, targets[-n:, None]).squeeze(-1)
            assert torch.equal(engine, trainer[4096][-n:]), f"engine batch {n}"
